"""Mutant killers for the backends (``backends/base.py``, ``backends/sqlite.py``), the lease
keeper and the worker: claims, renewals, pools, the lease keeper's engine, SQLite's write
path and URLs, and the value limits.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no other test
asserted, and its docstring names the mutants it kills. Some of these mutants only change
what happens on PostgreSQL or MySQL/MariaDB, which the mutation run (SQLite only) cannot
see: every test runs on each backend that has what it needs, and each kill was checked on
all three.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.pool import NullPool

import wf_persist as wp
from wf_persist import migrate
from wf_persist.backends.mysql import MySQLBackend
from wf_persist.backends.sql import Claim, held_at
from wf_persist.backends.sqlite import SQLiteBackend
from wf_persist.events import NewEvent
from wf_persist.models import DEDUPE_KEY
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist
from wf_persist.store import executions
from wf_persist.worker import Worker

from .fixtures import workflows as w
from .helpers import history_types, wait_status, wait_until
from .test_mutation_killers import _row, _started

MIB = 1024 * 1024
KIB = 1024


def _claim(runtime: wp.Runtime, execution_id: str, ttl: float = 3600) -> Claim:
    with runtime.transaction() as conn:
        claim = runtime.backend.claim(conn, execution_id, runtime.owner, ttl)
    assert claim is not None, f"{execution_id} could not be claimed"
    return claim


def _set(runtime: wp.Runtime, execution_id: str, **values: Any) -> None:
    with runtime.transaction() as conn:
        conn.execute(update(ex).where(ex.c.id == execution_id).values(**values))


def _event(execution_id: str, name: str, at: dt.datetime) -> NewEvent:
    doc = {"type": "step.completed", "executionId": execution_id, "activityName": name}
    return NewEvent(doc, at)


# claims: Backend.claim_due -------------------------------------------------------------


def test_claim_due_takes_the_oldest_due_runs_first_past_runs_that_are_not_due(
    runtime: wp.Runtime,
) -> None:
    """``claim_due`` claims "up to ``limit`` due runs ..., oldest wake time first" (its
    docstring): a run waiting for a signal (``wake_at`` NULL, which SQLite sorts first) or
    one whose timer lies ahead never takes the place of a due one, and of two due runs the
    one whose timer passed first is claimed first, whatever their statuses or the order
    they were created in. Kills ``Backend.claim_due`` mutants 4 (the candidates are not
    filtered on being due: a limit of 1 picks the waiting run, which the UPDATE then
    refuses, and claims nothing) and 14 (no ORDER BY: claimed in index or table order)."""
    backend = runtime.backend
    workflows = [(w.echo_wf.name, 1)]
    waiting, later, newer, older = (_started(runtime) for _ in range(4))
    now = runtime.clock()
    epoch = _claim(runtime, waiting).epoch
    with runtime.transaction() as conn:
        executions.park(conn, waiting, epoch, None)  # waits for a signal
    _set(runtime, later, wake_at=now + dt.timedelta(hours=1))
    _set(runtime, newer, status="running", wake_at=now - dt.timedelta(minutes=1))
    _set(runtime, older, status="suspended", wake_at=now - dt.timedelta(hours=1))
    with runtime.transaction() as conn:
        first = backend.claim_due(conn, runtime.owner, 30, 1, workflows, ())
    assert [c.execution_id for c in first] == [older], "the longest due run, whatever its status"
    with runtime.transaction() as conn:
        rest = backend.claim_due(conn, runtime.owner, 30, 5, workflows, ())
    assert [c.execution_id for c in rest] == [newer], "never a waiting or not yet due run"


@pytest.mark.needs("skip_locked")
def test_claims_skip_runs_another_transaction_has_locked(runtime: wp.Runtime) -> None:
    """Claims use ``FOR UPDATE SKIP LOCKED`` where the database has it (README; the worker
    module: workers "share one database without queueing behind each other"): a due run
    whose row another transaction holds locked (a driver appending to it, another claim)
    is skipped at once and the other due run is claimed. Kills ``Backend.claim_due``
    mutants 15 (no candidates at all on a SKIP LOCKED backend), 16 and 17 (``FOR UPDATE``
    without SKIP LOCKED: the claim waits for the lock)."""
    backend = runtime.backend
    locked, free = _started(runtime), _started(runtime)
    timeout = (
        "SET LOCAL lock_timeout = '3s'"
        if runtime.backend.names == ("postgresql",)
        else "SET SESSION innodb_lock_wait_timeout = 3"
    )
    with backend.connection() as holder, backend.begin(holder):
        assert backend.lock_run(holder, locked) is not None
        started = time.monotonic()
        with backend.connection() as conn:
            with backend.begin(conn):
                conn.execute(text(timeout))
                claims = backend.claim_due(conn, runtime.owner, 30, 2, [(w.echo_wf.name, 1)], ())
            conn.invalidate()  # the session setting never goes back to the pool
        waited = time.monotonic() - started
    assert [c.execution_id for c in claims] == [free]
    assert waited < 2, f"the claim waited {waited:.1f}s for a locked row"


# leases: held_at, the keeper ----------------------------------------------------------


def test_a_parked_run_is_never_renewed_or_released(runtime: wp.Runtime) -> None:
    """ "A parked run is never renewed" (``held_at``): once its driver parked the run (lease
    columns cleared, its timer set), a renewal or release at the same epoch, such as one
    of the lease keeper's racing the park, returns nothing and leaves the timer alone.
    Kills ``backends.base.held_at`` mutant 4 (runs matched on id and epoch alone: the
    keeper would overwrite a parked run's timer, or wake a run waiting for a signal)."""
    backend = runtime.backend
    sleeping, waiting = _started(runtime), _started(runtime)
    epochs = {i: _claim(runtime, i).epoch for i in (sleeping, waiting)}
    later = runtime.clock() + dt.timedelta(hours=2)
    with runtime.transaction() as conn:
        executions.park(conn, sleeping, epochs[sleeping], later)
        executions.park(conn, waiting, epochs[waiting], None)
    before = {i: _row(runtime, i) for i in epochs}
    with runtime.transaction() as conn:
        assert backend.renew(conn, epochs, 30) == set()
        assert backend.release(conn, epochs) == 0
        assert conn.execute(select(ex.c.id).where(held_at(epochs))).all() == []
    assert {i: _row(runtime, i) for i in epochs} == before


def test_the_keeper_reports_a_run_cancelled_mid_drive_and_keeps_renewing_the_others(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """ "A run it finds taken (another worker claimed it after a pause, or a cancellation
    revoked it) is reported to its driver" (``wf_persist.leases``): the Lease of a run
    cancelled while it is held is marked ``lost`` at the keeper's next renewal, and the
    keeper goes on renewing this runtime's other leases. Kills ``LeaseKeeper.run`` mutants
    48 (the keeper thread dies on the first lease it does not find: no run of this
    runtime is renewed any more) and 49 (the lost lease is not marked)."""
    runtime = make_runtime(lease_ttl=0.6)
    cancelled, other = _started(runtime), _started(runtime)
    keeper = runtime.keeper()
    leases = {}
    for execution_id in (cancelled, other):
        asked = time.monotonic()
        leases[execution_id] = keeper.hold(
            execution_id, _claim(runtime, execution_id, 0.6).epoch, asked
        )
    runtime.client().cancel(cancelled, compensate=False)
    wait_until(lambda: leases[cancelled].lost is True, 5, "the cancelled run's lease marked lost")
    assert leases[other].lost is False
    renewed = _row(runtime, other)["lease_expires_at"]
    wait_until(
        lambda: _row(runtime, other)["lease_expires_at"] != renewed,
        5,
        "the other lease renewed after the cancellation",
    )
    assert keeper.is_alive() and not leases[other].lost


def test_finished_and_parked_runs_leave_the_keeper_and_it_never_keeps_a_process_alive(
    runtime: wp.Runtime,
) -> None:
    """A drive's lease is held while it drives and forgotten when the run finishes or
    parks (suspended runs cost the worker nothing: tests/test_workers.py, a slow test the
    mutation run leaves out); the keeper is a daemon thread, so a program that never
    closes its runtime still exits. Kills ``LeaseKeeper.forget`` mutants 1 and 2 (a lease
    never forgotten) and ``LeaseKeeper.__init__`` mutant 4 (not a daemon)."""
    runtime.register(w.echo_wf, short_sleep_wf)
    client = runtime.client()
    done = client.start(w.echo_wf, 2).execution_id
    asleep = client.start(short_sleep_wf, 3600.0).execution_id
    assert runtime.drive(done) and runtime.drive(asleep)
    assert client.status(done) == "completed" and client.status(asleep) == "suspended"
    keeper = runtime.keeper()
    assert keeper.held() == {}
    assert keeper.daemon


# the lease keeper's engine: Backend.side_engine ---------------------------------------


def test_the_keepers_engine_connects_as_the_hosts_engine_does(
    db_url: str, make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """The lease keeper's engine "connects as the host's engine does (same creator)"
    (``Backend.side_engine``): with a host engine whose connections come from a
    ``creator`` (its URL names a database that is not the one), leases are renewed in
    the host's database (on SQLite, the URL names another migrated database). Kills
    ``Backend.side_engine`` mutants 1, 5 and 8 (an engine made from the URL alone, with a
    default pool of its own)."""
    probe = make_engine(db_url)
    args, kwargs = probe.dialect.create_connect_args(make_url(db_url))
    dbapi = probe.dialect.loaded_dbapi
    elsewhere = {
        "sqlite": f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}",
        "postgresql": "postgresql+psycopg://nobody@127.0.0.1:9/elsewhere",
        "mysql": "mysql+pymysql://nobody@127.0.0.1:9/elsewhere",
    }[probe.dialect.name]
    if probe.dialect.name == "sqlite":
        migrate.upgrade(elsewhere)  # a database of wf_persist's, but not the one
    engine = make_engine(elsewhere, creator=lambda: dbapi.connect(*args, **kwargs))
    with wp.Runtime(engine) as runtime:
        execution_id = _started(runtime)
        claim = _claim(runtime, execution_id)
        backend = runtime.backend
        with runtime.keeper().engine().connect() as conn, backend.begin(conn):
            assert backend.renew(conn, {execution_id: claim.epoch}, 60) == {execution_id}


@pytest.mark.needs("schemas")
def test_the_keepers_engine_renews_leases_in_the_runtimes_schema(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``Runtime(engine, schema="wf")`` keeps every table in schema ``wf`` (README): the
    driver's one-statement write renders it ("SQL a fast path renders itself must render
    it too", ``Backend.schema_map``), and the lease keeper's engine "runs statements as
    [the host's engine] does (its execution options, a schema translation among them)",
    renewing and releasing leases of runs in ``wf``. Kills ``Backend.side_engine``
    mutants 2, 6 and 9 (no execution options: the keeper looks in the default schema),
    ``Backend.__init__`` mutants 10-13 (no schema translation at all), 16-21 and 23 (the
    fast path's translation lost) and ``Backend.make_view`` mutant 2."""
    migrate.upgrade(blank_db_url, schema="wf")
    engine = make_engine(blank_db_url)
    with wp.Runtime(engine, schema="wf") as runtime:
        execution_id = _started(runtime)
        claim = _claim(runtime, execution_id)
        backend = runtime.backend
        now = runtime.clock()
        with backend.connection() as conn:
            done = backend.write(
                conn, execution_id, claim.epoch, [_event(execution_id, "a#1", now)], now=now
            )
        assert done.sequences == [2]
        with runtime.keeper().engine().connect() as conn, backend.begin(conn):
            held = {execution_id: claim.epoch}
            assert backend.renew(conn, held, 60) == {execution_id}
            assert backend.release(conn, held) == 1
    with engine.connect() as conn:
        found = conn.execute(text("SELECT count(*) FROM wf.wf_history")).scalar_one()
    assert found == 2, "execution.started and the step, in schema wf"


# pools: Backend.capacity --------------------------------------------------------------


def test_pool_capacity_is_its_size_and_overflow_and_unbounded_pools_are_not_limited(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``Backend.capacity``: the connections the runs' pool can hand out at once,
    ``pool_size + max_overflow``, or None for an unbounded pool (``max_overflow=-1``) and
    one without a size (``NullPool``), which limit no worker; a pool of one connection is
    too small for any worker (``PoolTooSmallError`` with the numbers, README). Kills
    ``Backend.capacity`` mutants 7 and 15 (attributes a ``NullPool`` lacks are required),
    18 (``max_overflow=-1`` counted as one connection fewer than the pool's size) and 23,
    24 (a pool without overflow counted as unbounded)."""

    def runtime_on(**kwargs: Any) -> wp.Runtime:
        return wp.Runtime(make_engine(db_url, **kwargs))

    for unbounded in ({"poolclass": NullPool}, {"pool_size": 2, "max_overflow": -1}):
        with runtime_on(**unbounded) as runtime:
            assert runtime.backend.capacity() is None, unbounded
            Worker(runtime, concurrency=64)  # no limit to refuse it by
    with runtime_on(pool_size=2, max_overflow=3) as runtime:
        assert runtime.backend.capacity() == 5
    with runtime_on(pool_size=1, max_overflow=0) as runtime:
        assert runtime.backend.capacity() == 1
        with pytest.raises(wp.PoolTooSmallError) as refused:
            Worker(runtime, concurrency=1)
        assert refused.value.capacity == 1


# version checks --------------------------------------------------------------------


@pytest.mark.needs("embedded")
def test_sqlite_older_than_3_35_is_refused_when_a_runtime_opens(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite 3.35 (``UPDATE ... RETURNING``) is the oldest that qualifies, 3.35.0
    included, and a runtime on an older SQLite library fails at once saying so
    (``Backend.check``: "Fail early, and say why"). The library's version is what the
    ``sqlite3`` module reports, set here to an older one. Kills
    ``SQLiteBackend.requirement_problem`` mutant 5 (3.35 itself refused) and
    ``Backend.check`` mutant 2 (the version never checked)."""
    with wp.Runtime(db_url) as runtime:
        problem = runtime.backend.requirement_problem
    assert problem((3, 35, 0)) is None and problem((3, 35, 5)) is None
    assert problem((3, 34, 9)) == ("SQLite >= 3.35 is needed (UPDATE ... RETURNING); found 3.34.9")
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 34, 1))
    with pytest.raises(
        wp.UnsupportedDatabaseError, match=r"SQLite >= 3\.35 is needed .*found 3\.34\.1"
    ):
        wp.Runtime(db_url)


# value limits ----------------------------------------------------------------------


def test_the_value_limit_leaves_room_for_the_event_under_the_databases_own_limit(
    runtime: wp.Runtime,
) -> None:
    """``runtime.backend.max_value_bytes`` (README; ``ValueTooLargeError.limit``) is the
    database's limit on one stored value less 64 KiB for the event around it: half of
    SQLite's ``SQLITE_LIMIT_LENGTH`` less that (read from the library; a run's row holds
    input and result), 16 MiB on PostgreSQL (its JSONB parser fails on arrays of small
    numbers past 32 MiB of text), and MySQL/MariaDB half of ``max_allowed_packet`` (values
    go as escaped literals). Kills ``Backend.__init__`` mutants 26-35 and
    ``SQLiteBackend.__init__`` mutants 9-12 (another figure or a float)."""
    backend = runtime.backend
    limit = backend.max_value_bytes
    assert isinstance(limit, int)
    kind = backend.names[0]
    if kind == "sqlite":
        probe = sqlite3.connect(":memory:")
        try:
            assert limit == (probe.getlimit(sqlite3.SQLITE_LIMIT_LENGTH) - 64 * KIB) // 2
        finally:
            probe.close()
    elif kind == "postgresql":
        assert limit == 16 * MIB - 64 * KIB
    else:
        assert isinstance(backend, MySQLBackend)
        assert limit == (backend.packet_bytes - 64 * KIB) // 2
    runtime.register(w.echo_wf)
    handle = runtime.client().start(w.echo_wf, 2)  # an ordinary value is within it
    assert runtime.drive(handle.execution_id)
    assert runtime.client().result(handle.execution_id).unwrap() == [1, 2]


# dedupe: Backend.insert_once -----------------------------------------------------------


def test_insert_once_ignores_its_own_key_only(runtime: wp.Runtime) -> None:
    """``insert_once`` inserts a row unless it conflicts on the given key, returning
    whether it went in; "any other error (another unique key, ...) raises". Here: a
    history row with a dedupe key goes in once; one with a new dedupe key on a sequence
    already taken (the history's primary key) raises ``IntegrityError``. Kills
    ``Backend.insert_once`` mutants 2 (no ``preserve_rowcount``: psycopg's rowcount of the
    INSERT is lost, so nothing "went in" on PostgreSQL) and 3 (``ON CONFLICT DO NOTHING``
    without the key: every conflict ignored)."""
    execution_id = _started(runtime)
    backend = runtime.backend
    now = runtime.clock()

    def row(sequence: int, key: str) -> dict[str, Any]:
        return {
            "execution_id": execution_id,
            "sequence": sequence,
            "type": "signal.delivered",
            "activity_name": None,
            "dedupe_key": key,
            "created_at": now,
            "event": {"type": "signal.delivered", "executionId": execution_id},
        }

    with runtime.transaction() as conn:
        assert backend.insert_once(conn, hist, row(100, "k-1"), DEDUPE_KEY) is True
        assert backend.insert_once(conn, hist, row(101, "k-1"), DEDUPE_KEY) is False
    with pytest.raises(IntegrityError), runtime.transaction() as conn:
        backend.insert_once(conn, hist, row(100, "k-2"), DEDUPE_KEY)
    with runtime.transaction() as conn:
        stored = conn.execute(
            select(hist.c.sequence, hist.c.dedupe_key).where(
                hist.c.execution_id == execution_id, hist.c.dedupe_key.is_not(None)
            )
        ).all()
    assert [tuple(r) for r in stored] == [(100, "k-1")]


# timers: Runtime.seconds_to_next_wake, Worker._idle_wait --------------------------------


@wp.workflow(name="killers-backends-nap", version=1)
def short_sleep_wf(ctx: wp.Context, seconds: float) -> str:
    ctx.sleep(seconds)
    return "woke"


def test_the_next_wake_is_of_a_run_this_runtime_can_drive(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``Runtime.seconds_to_next_wake``: "seconds until the earliest wake time of a run
    this runtime can drive" (``None`` when nothing is scheduled): a due run of a workflow
    it has no code for does not count (the test kit's clock, which jumps to the next
    wake, relies on it). Kills ``Backend.next_wake`` mutant 8 (every workflow's runs
    count)."""
    mine, theirs = make_runtime(), make_runtime()
    mine.register(short_sleep_wf)
    theirs.register(w.echo_wf)
    theirs.client().start(w.echo_wf, 2)  # due now, echo: not runnable by ``mine``
    assert mine.seconds_to_next_wake() is None
    mine.client().start(short_sleep_wf, 1.0)
    until = mine.seconds_to_next_wake()
    assert until is not None and until <= 0.5


def test_a_worker_fires_a_timer_it_knows_about_on_time(runtime: wp.Runtime) -> None:
    """ "Timers known to this worker fire on time" (``Worker``): with a 5 s poll interval a
    run that parked here on a 0.3 s sleep is driven again about 0.3 s later, not at the
    next poll nor a second later. Kills ``Worker._idle_wait`` mutant 7 (the shortest idle
    wait becomes 1 s)."""
    runtime.register(short_sleep_wf)
    client = runtime.client()
    runtime.start_worker(concurrency=1, poll_interval=5)
    execution_id = client.start(short_sleep_wf, 0.3).execution_id
    wait_status(client, execution_id, "suspended", 5)
    parked = time.monotonic()
    wait_status(client, execution_id, "completed", 5)
    elapsed = time.monotonic() - parked
    assert elapsed < 0.8, f"a 0.3 s timer fired {elapsed:.2f}s after the run parked"


# workers: Worker.run ----------------------------------------------------------------------

#: Filled in by the test: the barrier every run's step meets at.
MEETING: dict[str, threading.Barrier] = {}


@wp.step
def meet() -> int:
    return MEETING["barrier"].wait()


@wp.workflow(name="killers-backends-meet", version=1)
def meet_wf(ctx: wp.Context) -> int:
    return ctx.run(meet)


def test_a_worker_drives_as_many_runs_at_once_as_its_concurrency(runtime: wp.Runtime) -> None:
    """``concurrency``: "runs driven at once (threads)" (``Worker``): a worker with a
    concurrency above the default size of a thread pool (``min(32, cpus + 4)``) has every
    one of its runs in a step at the same time (each step waits for all the others).
    Kills ``Worker.run`` mutants 2 and 4 (a thread pool of the default size: the runs
    past it are claimed but wait for a thread)."""
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    barrier = MEETING["barrier"] = threading.Barrier(n, timeout=10)
    runtime.register(meet_wf)
    client = runtime.client()
    ids = [client.start(meet_wf).execution_id for _ in range(n)]
    runtime.start_worker(concurrency=n, poll_interval=0.05)
    for execution_id in ids:
        wait_status(client, execution_id, "completed", 20)
    assert not barrier.broken
    results = {client.result(i).unwrap() for i in ids}
    assert results == set(range(n)), "every run met all the others at one barrier"


# SQLite: the write path, locking, URLs -----------------------------------------------------


@pytest.mark.needs("embedded")
def test_writes_on_a_host_engine_with_a_schema_translation_are_fenced_and_guarded(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host's SQLite engine may carry a schema translation (``schema_translate_map``);
    wf_persist's statements then get it too, and ``Backend.write`` goes through the
    generic fenced write (SQLite's direct path renders its SQL without one): events on
    the next sequences, the values written, the status guard and the epoch honoured.
    Kills ``SQLiteBackend.write`` mutants 2, 5, 8, 13, 14 and 15 (the hand-over to the
    generic write loses the connection, the events, the time, the values or the
    guard)."""
    engine = make_engine(db_url).execution_options(schema_translate_map={None: "main"})
    with wp.Runtime(engine) as runtime:
        backend = runtime.backend
        assert backend.schema_map == {None: "main"}
        execution_id = _started(runtime)
        claim = _claim(runtime, execution_id)
        now = runtime.clock()
        finished = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
        with backend.connection() as conn:
            done = backend.write(
                conn, execution_id, claim.epoch, [_event(execution_id, "a#1", now)], now=now
            )
            assert (done.sequences, done.status) == ([2], "running")
            with pytest.raises(wp.LeaseLostError):
                backend.write(
                    conn,
                    execution_id,
                    claim.epoch,
                    [_event(execution_id, "b#1", now)],
                    now=now,
                    values={"status": "completed"},
                    guard=("suspended",),
                )
            with pytest.raises(wp.LeaseLostError):
                backend.write(conn, execution_id, claim.epoch + 1, [], now=now)
            done = backend.write(
                conn,
                execution_id,
                claim.epoch,
                [_event(execution_id, "b#1", now)],
                now=now,
                values={"status": "completed", "finished_at": finished},
                guard=("running",),
            )
        assert (done.sequences, done.status) == ([3], "completed")
        row = _row(runtime, execution_id)
        assert (row["status"], row["finished_at"], row["updated_at"]) == (
            "completed",
            finished,
            now,
        )
        assert history_types(runtime.client(), execution_id).count("step.completed") == 2


@pytest.mark.needs("embedded")
def test_a_write_that_finds_the_database_locked_is_contention_and_the_connection_lives_on(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Errors of SQLite's direct write path "are handled as SQLAlchemy would"
    (``SQLiteBackend.write``): a write that finds another writer holding the database
    (past the engine's busy timeout) raises SQLAlchemy's ``OperationalError``, which the
    backend reads as contention (nothing happened, try again later); nothing is written
    (the next write takes the next sequence) and the same connection writes once the lock
    is gone. Kills ``SQLiteBackend.write``
    mutants 97, 98 and 103 (the driver error handed on wrongly: another exception
    entirely)."""
    path = make_url(db_url).database
    assert path is not None
    engine = make_engine(db_url, connect_args={"timeout": 0.05})
    with wp.Runtime(engine) as runtime:
        backend = runtime.backend
        execution_id = _started(runtime)
        claim = _claim(runtime, execution_id)
        now = runtime.clock()
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with backend.connection() as conn:
                with pytest.raises(OperationalError) as locked:
                    backend.write(
                        conn, execution_id, claim.epoch, [_event(execution_id, "a#1", now)], now=now
                    )
                assert backend.contention(locked.value)
                assert isinstance(locked.value.orig, sqlite3.OperationalError)
                other.execute("ROLLBACK")
                done = backend.write(
                    conn, execution_id, claim.epoch, [_event(execution_id, "a#1", now)], now=now
                )
                assert not conn.invalidated
        finally:
            other.close()
    assert done.sequences == [2]


def test_sqlite_uri_filenames_are_read_as_sqlite_reads_them(tmp_path: Path) -> None:
    """Read-only commands never create a database (README): a URI filename whose own
    query says ``mode=memory`` (``file:PATH%3Fmode%3Dmemory``) is an in-memory database,
    never missing; a plain path given with ``uri=true`` is a file of that name, which
    SQLite would create (``mode=memory`` in the URL does not make it one): missing, and
    not created. Kills ``SQLiteBackend.database_missing`` mutants 17, 21, 22, 23 (the
    filename's own mode ignored) and 4 (a plain path read as a URI)."""
    missing = tmp_path / "missing.sqlite3"
    in_memory = f"sqlite:///file:{missing}%3Fmode%3Dmemory?uri=true"
    assert not SQLiteBackend.database_missing(make_url(in_memory))
    state = migrate.state(in_memory)
    assert not state.missing and state.revision is None
    plain = f"sqlite:///{missing}?uri=true&mode=memory"
    assert SQLiteBackend.database_missing(make_url(plain))
    assert migrate.state(plain).missing
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_plain_filename_starting_with_file_is_not_created_by_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``migrate.state`` "never creates anything" and commands that only read never create
    a database file (README). Without ``uri=true`` SQLAlchemy hands SQLite the absolute
    path of a filename like ``file:x.sqlite3`` (SQLite then creates ``./file:x.sqlite3``),
    so ``SQLiteBackend.database_missing`` reads such a name as a path, not as a URI."""
    monkeypatch.chdir(tmp_path)
    state = migrate.state("sqlite:///file:x.sqlite3")
    assert state.missing
    assert list(tmp_path.iterdir()) == []
