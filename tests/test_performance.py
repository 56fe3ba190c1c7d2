"""The README's performance promises, counted at the database (see :mod:`tests.dbcount` for
how and why): one write per completed step, one history read per resume, no busy polling."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

import wf_persist as wp
from wf_persist import events
from wf_persist.backends import Backend
from wf_persist.wakeups import NOTIFIED_POLL_INTERVAL
from wf_persist.worker import CHANGE_PROBE, REAP_INTERVAL

from .dbcount import Counts, counting
from .fixtures import workflows as w
from .helpers import is_due, wait_until


@wp.step
def bump(i: int) -> int:
    return i + 1


@wp.workflow(name="n-steps", version=1)
def n_steps_wf(ctx: wp.Context, n: int) -> int:
    total = 0
    for i in range(n):
        total = ctx.run(bump, i)
    return total


#: What the database runs for one more completed step on the hot path: always one
#: transaction; the statements are each backend's (README, "Performance").
STEP_STATEMENTS = {
    # one INSERT ... SELECT FROM (WITH bump AS (UPDATE ... RETURNING)), autocommitted
    "postgresql": {"INSERT": 1},
    # BEGIN IMMEDIATE, UPDATE ... RETURNING, the INSERT run for each of its 2 rows, COMMIT
    "sqlite": {"BEGIN": 1, "UPDATE": 1, "INSERT": 2, "COMMIT": 1},
    # SELECT ... FOR UPDATE (the fence), UPDATE, one INSERT of 2 rows, COMMIT
    "mysql": {"SELECT": 1, "UPDATE": 1, "INSERT": 1, "COMMIT": 1},
}


def test_each_completed_step_is_one_write(
    backend: str, make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Two runs that differ only in their number of steps (2 and 12): the difference in what
    the database ran is ten times one step's cost, which cancels the claim, the history read
    and the outcome every run has."""
    rt = make_runtime(lease_ttl=300)  # no lease renewal inside the measurement
    rt.register(n_steps_wf)
    client = rt.client()
    client.result(client.start(n_steps_wf, 1).execution_id)  # warm: catalog, prepared SQL

    def cost(n: int) -> Counts:
        handle = client.start(n_steps_wf, n)
        with counting(rt.backend.base_engine, tmp_path / f"steps-{n}") as counter:
            assert client.result(handle.execution_id).unwrap() == n
            return counter.counts()

    few, many = cost(2), cost(12)
    per_ten = many - few
    assert per_ten.transactions == 10, f"one transaction per step: {per_ten}"
    assert per_ten.rollbacks == 0
    expected = {verb: 10 * n for verb, n in STEP_STATEMENTS[backend].items()}
    assert {verb: n for verb, n in per_ten.verbs.items() if n} == expected, per_ten
    assert per_ten.statements == sum(expected.values())


def test_a_resume_reads_the_history_with_one_query(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """A run resumed after its sleep loads its history once. (The other statement on
    wf_history that reads anything is the check, under the run's lock, that no signal or
    cancellation arrived since that read: one row at most, no events.)"""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.napper_wf)
    client = rt.client()
    handle = client.start(w.napper_wf, 0.05)
    assert rt.drive(handle.execution_id)
    assert client.status(handle.execution_id) == "suspended"
    wait_until(lambda: is_due(rt, handle.execution_id), what="the timer")
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(" ".join(statement.split()))

    engine = rt.backend.base_engine
    event.listen(engine, "before_cursor_execute", seen)
    try:
        with counting(engine, tmp_path / "resume") as counter:
            assert rt.drive(handle.execution_id)
            if rt.backend.can_listen:  # PostgreSQL's claims go straight to the driver
                statements += [" ".join(s.split()) for s in counter.sent()]
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert client.status(handle.execution_id) == "completed"
    reads = [s for s in statements if s.startswith("SELECT") and "FROM wf_history" in s]
    # PostgreSQL reads the history inside its claim statement (a json_agg of the events).
    loads = [
        s
        for s in statements
        if "FROM wf_history" in s and ("wf_history.event" in s or "json_agg" in s)
    ]
    assert len(loads) == 1, loads
    assert all("LIMIT" in s for s in reads if s not in loads), reads
    assert len(reads) <= 2, reads


def test_an_idle_worker_never_busy_polls(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """With runs parked on a signal and on a timer an hour away, a worker looks for work
    once per poll interval: two short transactions (claim, next wake time) per look. Where
    notifications reach it (PostgreSQL) polling is only a safety net, once per
    NOTIFIED_POLL_INTERVAL; where presence locks exist it also runs one statement per
    REAP_INTERVAL looking for runs whose worker is gone; on SQLite a look when nothing was
    committed since the last one is a ``PRAGMA data_version`` on a connection of its own,
    and between looks the same probe runs every CHANGE_PROBE (nothing else)."""
    poll_interval = 0.25
    rt = make_runtime(lease_ttl=300)
    rt.register(w.approval_wf, w.napper_wf)
    client = rt.client()
    waiting = client.start(w.approval_wf, None).execution_id
    sleeping = client.start(w.napper_wf, 3600).execution_id

    def parked() -> bool:
        for execution_id in (waiting, sleeping):
            rt.drive(execution_id)
        return bool(client.pending_signals(waiting)) and client.status(sleeping) == "suspended"

    wait_until(parked, what="both runs parked")
    worker = wp.Worker(rt, concurrency=2, poll_interval=poll_interval)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        with counting(rt.backend.base_engine, tmp_path / "idle") as counter:
            began = time.monotonic()
            time.sleep(2.0)  # the time itself is what is measured
            worker.stop()
            thread.join(10)
            elapsed = time.monotonic() - began
            counts = counter.counts()
    finally:
        worker.stop()
        thread.join(10)
    interval = max(poll_interval, NOTIFIED_POLL_INTERVAL) if rt.hears_due() else poll_interval
    looks = elapsed / interval + 1
    mark = rt.backend.owner_mark()
    reaps = elapsed / REAP_INTERVAL + 1 if mark and rt.owner.endswith(mark) else 0
    probes = counts.verbs["PRAGMA"]
    if type(rt.backend).changes is Backend.changes:
        assert probes == 0, f"{counts} in {elapsed:.2f}s"
    else:  # each ends a wait of CHANGE_PROBE, or is a look's own
        assert probes <= elapsed / CHANGE_PROBE + looks, f"{counts} in {elapsed:.2f}s"
    assert counts.transactions - probes <= 2 * looks + reaps, f"{counts} in {elapsed:.2f}s"
    assert counts.statements - probes <= 7 * looks + reaps, f"{counts} in {elapsed:.2f}s"
    if type(rt.backend).changes is Backend.changes:  # no cheap probe (SQLite's): it polls
        assert counts.transactions >= 2, "the worker looked for work at all"


#: How long the first writer below keeps its transaction open: just past one of SQLite's
#: busy-handler retries (at 228 and 328 ms of waiting; the next is at 428 ms), so a writer
#: left to that handler would commit about 90 ms after the first one did.
_HOLD = 0.335


@pytest.mark.needs("embedded")
@pytest.mark.parametrize("path", ["transaction", "step write"])
def test_sqlite_writers_of_one_process_take_turns_without_sleeping(
    path: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A write waiting for another of this process starts as soon as that one commits, not
    at the busy handler's next retry (up to 100 ms later): the pool workload's 500 runs
    finishing at once spent most of their time in those sleeps."""
    rt = make_runtime()
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 1).execution_id
    begun, committed = threading.Event(), []

    def hold() -> None:
        with rt.backend.begin():
            begun.set()
            time.sleep(_HOLD)
        committed.append(time.perf_counter())

    holder = threading.Thread(target=hold)
    holder.start()
    assert begun.wait(5)
    if path == "transaction":
        client.start(w.echo_wf, 2)
    else:
        who = events.Activity(run, "s", 1, "s#1", step=True)
        done = events.step_completed(who, 1, 1, rt.clock())
        with rt.engine.connect() as conn:
            rt.backend.write(conn, run, 0, [done], now=rt.clock())
    finished = time.perf_counter()
    holder.join()
    assert finished - committed[0] < 0.05


def test_an_embedded_worker_claims_nothing_for_sequential_runs(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs started one after another, each awaited, with an embedded worker of one slot:
    each is started claimed by that slot (its drive's end frees the slot before the waiter
    hears of it, so the next start finds it free), and the look a freed slot makes asks
    what is due (a read) before it claims (a write transaction): the worker never claims."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    rt.start_worker(concurrency=1, poll_interval=30)
    client = rt.client()
    for _ in range(3):  # warm: catalog, statements, the worker's first looks
        assert client.result(client.start(w.echo_wf, 3).execution_id).unwrap() == [1, 2, 3]
    time.sleep(0.3)
    claims: list[int] = []
    claim_batch = rt.backend.claim_batch

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = claim_batch(*args, **kwargs)
        claims.append(len(found))
        return found

    monkeypatch.setattr(rt.backend, "claim_batch", counted)
    for _ in range(20):
        assert client.result(client.start(w.echo_wf, 3).execution_id).unwrap() == [1, 2, 3]
    time.sleep(0.3)  # the worker's looks after the last run
    assert claims == []


@pytest.mark.needs("embedded")
def test_sqlite_writers_waiting_their_turn_keep_the_busy_timeout(
    db_url: str, make_engine: Callable[..., Any]
) -> None:
    """Another process holds the database's write lock longer than a host engine's busy
    timeout (1 s here): each of several threads starting runs fails once that timeout has
    passed for it, not after its turn's wait plus the timeout again."""
    engine = make_engine(db_url, connect_args={"timeout": 1.0})
    with wp.Runtime(engine, auto_migrate=True) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        client.start(w.echo_wf, 1)  # warm: catalog, a connection per thread below
        database = engine.url.database
        assert database is not None
        other = sqlite3.connect(database, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        took: list[float] = []

        def start() -> None:
            began = time.perf_counter()
            with contextlib.suppress(Exception):  # "database is locked"
                client.start(w.echo_wf, 2)
            took.append(time.perf_counter() - began)

        threads = [threading.Thread(target=start) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        other.execute("ROLLBACK")
        other.close()
    assert len(took) == 3
    assert max(took) < 1.6, took


@wp.workflow(name="perf-busy-steps", version=1)
def busy_steps(ctx: wp.Context, n: int) -> int:
    return sum(int(ctx.run(w.echo, i)) for i in range(n))


@pytest.mark.needs("embedded")
def test_a_sqlite_worker_does_not_look_at_every_commit_of_its_own_process(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A worker with free slots reads SQLite's change counter every CHANGE_PROBE while it
    waits, but commits that bring it nothing to claim (here its own process's run, writing
    its steps) slow the probe down to the poll interval: a few looks a second, not one
    per probe."""
    rt = make_runtime()
    rt.register(busy_steps)
    looks: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any, **_kwargs: Any) -> None:
        if "min(wf_executions.wake_at)" in statement:
            looks.append(statement)

    worker = wp.Worker(rt, concurrency=4, poll_interval=0.25)
    thread = threading.Thread(target=worker.run)
    thread.start()
    engine = rt.backend.base_engine
    event.listen(engine, "after_cursor_execute", count)
    try:
        began = time.monotonic()
        run = rt.client().start(busy_steps, 3000).execution_id
        assert rt.client().result(run, timeout=120).unwrap() == sum(range(3000))
        elapsed = time.monotonic() - began
    finally:
        event.remove(engine, "after_cursor_execute", count)
        worker.stop()
        thread.join(10)
    # A probe every 10 ms would look 100 times a second; the bound below allows 16 a second
    # plus 8, so any run longer than 0.1 s tells the two apart.
    assert elapsed > 0.25, "long enough to tell"
    assert len(looks) <= 4 * (elapsed / 0.25 + 2), f"{len(looks)} looks in {elapsed:.2f}s"
