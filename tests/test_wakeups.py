"""Fewer round trips per run, wake-ups without polling, presence locks, borrowed connections.

Counts come from :mod:`tests.dbcount` (what the database itself executed). Latencies are
asserted against poll intervals set far longer than the assertion, so only a notification
(or the in-process hand-over) can explain them; the benchmark (``bench/``) measures the real
figures.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.exc import OperationalError

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.wakeups import ANY_END, Ends

from .dbcount import counting
from .fixtures import fencing as f
from .fixtures import workflows as w
from .helpers import Processes, client_statements, history_types, wait_until


def _epoch(rt: wp.Runtime, execution_id: str) -> int:
    with rt.backend.read() as conn:
        found = conn.execute(select(ex.c.claim_epoch).where(ex.c.id == execution_id)).scalar()
    assert found is not None
    return int(found)


@wp.step
def _nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@wp.workflow(name="test_wakeups_napping", version=1)
def _napping(ctx: wp.Context, seconds: float) -> float:
    return ctx.run(_nap, seconds)


# round trips ------------------------------------------------------------------------------

#: What a 3-step run of ``echo_wf`` writes, one event at a time, however it is driven.
THREE_STEPS_HISTORY = [
    "execution.started",
    "workflow.started",
    *["step.started", "step.completed"] * 3,
    "workflow.completed",
]


def test_a_three_step_run_started_and_awaited_here_is_five_writes_at_most(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Start, claim (with ``workflow.started`` and the history read), the first two steps,
    and the last step with the outcome: five transactions; on PostgreSQL each is one
    statement, so the whole run is at most 6 round trips (``result`` claims without reading
    the run first). The history is exactly what a run writes one event at a time."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    client.result(client.start(w.echo_wf, 3).execution_id)  # warm: catalog, prepared SQL
    with counting(rt.backend.base_engine, tmp_path / "run") as counter:
        handle = client.start(w.echo_wf, 3)
        assert client.result(handle.execution_id).unwrap() == [1, 2, 3]
        counts = counter.counts()
    assert counts.transactions <= 5, counts
    assert counts.rollbacks == 0, counts
    if rt.backend.can_listen:  # PostgreSQL: one statement per transaction
        assert counts.statements <= 6, counts
    assert history_types(client, handle.execution_id) == THREE_STEPS_HISTORY


def test_a_run_started_beside_a_worker_is_driven_without_a_claim(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """With an embedded worker, a start creates the run already claimed (claim epoch 1)
    and hands it to the worker at once; ``result`` learns the outcome in this process."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    rt.start_worker(concurrency=2, poll_interval=30)
    client = rt.client()
    began = time.monotonic()
    for n in range(3, 8):
        handle = client.start(w.echo_wf, n)
        assert client.result(handle.execution_id, timeout=10).unwrap() == list(range(1, n + 1))
        assert _epoch(rt, handle.execution_id) == 1, "claimed by its start, never again"
    assert time.monotonic() - began < 5, "handed over, not found by a 30 s poll"


def test_a_start_with_a_taken_idempotency_key_claims_nothing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A start that returns an existing run (its key is taken) gives the slot it reserved
    back and records nothing: the worker keeps its full concurrency."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    worker = rt.start_worker(concurrency=1, poll_interval=30)
    client = rt.client()
    first = client.start(w.echo_wf, 3, idempotency_key="k")
    assert client.result(first.execution_id, timeout=10).unwrap() == [1, 2, 3]
    again = client.start(w.echo_wf, 3, idempotency_key="k")
    assert again.execution_id == first.execution_id and not again.created
    other = client.start(w.echo_wf, 4)
    assert client.result(other.execution_id, timeout=10).unwrap() == [1, 2, 3, 4]
    held: list[Any] = []

    def slot_back() -> bool:
        held[:] = [worker.reserve()]
        return held[0] is not None

    wait_until(slot_back, what="the slot back", timeout=10)
    worker.unreserve(held[0])


def test_execute_starts_the_run_claimed_and_drives_it_here_in_four_writes(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """``execute`` is start then result with the claim written by the start: four
    transactions for a 3-step run (start-and-claim, two steps, the last step with the
    outcome), one statement each on PostgreSQL; claimed once (epoch 1); the history is
    what any run of it writes."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    assert client.execute(w.echo_wf, 3).unwrap() == [1, 2, 3]  # warm: catalog, prepared SQL
    with counting(rt.backend.base_engine, tmp_path / "run") as counter:
        outcome = client.execute(w.echo_wf, 3)
        counts = counter.counts()
    assert isinstance(outcome, wp.Completed) and outcome.value == [1, 2, 3]
    assert counts.transactions == 4, counts
    assert counts.rollbacks == 0, counts
    if rt.backend.can_listen:  # PostgreSQL: one statement per transaction
        assert counts.statements == 4, counts
    assert _epoch(rt, outcome.execution_id) == 1, "claimed by its start, never again"
    assert client.status(outcome.execution_id) == "completed"
    assert history_types(client, outcome.execution_id) == THREE_STEPS_HISTORY


def test_execute_leaves_a_parked_run_to_workers_and_waits_for_it(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A run that sleeps parks: the caller's drive ends there and the embedded worker
    finishes it; ``execute`` returns its outcome. A failing run's outcome is returned, not
    raised."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.napper_wf, w.explode_wf)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    began = time.monotonic()
    outcome = client.execute(w.napper_wf, 0.3)
    assert outcome.unwrap() == "ok"
    assert time.monotonic() - began >= 0.3
    failed = client.execute(w.explode_wf, "boom")
    assert isinstance(failed, wp.Failed) and "boom" in failed.message
    assert client.status(failed.execution_id) == "failed"


def test_execute_with_a_taken_idempotency_key_returns_that_runs_outcome(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The key's run is not started again: its outcome comes back (driven here if due)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    first = client.start(w.echo_wf, 2, idempotency_key="k")
    again = client.execute(w.echo_wf, 5, idempotency_key="k")
    assert again.execution_id == first.execution_id
    assert again.unwrap() == [1, 2]  # the first start's input, driven by this call
    assert client.execute(w.echo_wf, 5, idempotency_key="k").unwrap() == [1, 2]
    with rt.backend.read() as conn:
        assert conn.execute(select(ex.c.id)).all() == [(first.execution_id,)]


@pytest.mark.parametrize(
    ("payload", "kwargs", "error"),
    [
        ("not a number", {}, wp.InvalidPayloadError),
        (2, {"idempotency_key": "bad\x00key"}, wp.InvalidArgumentError),
        (2, {"actor": "a" * 100_000}, wp.InvalidArgumentError),
        (2, {"timeout": -1}, wp.InvalidArgumentError),
        (2, {"timeout": float("nan")}, wp.InvalidArgumentError),
        (2, {"version": 99}, wp.WfPersistError),
    ],
)
def test_execute_refuses_bad_input_with_a_typed_error_and_writes_nothing(
    make_runtime: Callable[..., wp.Runtime],
    payload: object,
    kwargs: dict[str, object],
    error: type[Exception],
) -> None:
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    with pytest.raises(error):
        rt.client().execute(w.echo_wf, payload, **kwargs)  # type: ignore[arg-type]
    with rt.backend.read() as conn:
        assert conn.execute(select(ex.c.id)).all() == []
    assert rt.keeper().held() == {}


def test_a_refused_execute_writes_nothing_and_later_starts_go_to_the_worker(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Bad input raises before anything is written; the next plain ``start`` on the same
    thread is created claimed for the worker (its slot), not for this thread."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    rt.start_worker(concurrency=1, poll_interval=30)
    client = rt.client()
    with pytest.raises(wp.InvalidPayloadError):
        client.execute(w.echo_wf, "not a number")
    with rt.backend.read() as conn:
        assert conn.execute(select(ex.c.id)).all() == []
    handle = client.start(w.echo_wf, 2)
    assert client.result(handle.execution_id, timeout=10).unwrap() == [1, 2]
    assert _epoch(rt, handle.execution_id) == 1


_gate = threading.Event()


@wp.step
def _gated(path: str) -> str:
    w.mark(path, "begin")
    _gate.wait(30)
    time.sleep(0.5)
    w.mark(path, "end")
    return "done"


@wp.workflow(name="test_wakeups_gated", version=1)
def _gated_wf(ctx: wp.Context, path: str) -> str:
    return ctx.run(_gated, path)


def _lease_owner(rt: wp.Runtime, execution_id: str) -> str | None:
    with rt.backend.read() as conn:
        found = conn.execute(select(ex.c.lease_owner).where(ex.c.id == execution_id)).scalar()
    return None if found is None else str(found)


@pytest.mark.needs("presence")
def test_execute_holds_its_runs_under_the_presence_lock(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """A process that only ever calls ``execute`` (no worker, no ``result``) takes its
    presence lock before its first start: the run's owner is the locked name (ending in
    ``!``), which others take over from at once if the process dies (it was the plain
    name, taken over only after the lease)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(_gated_wf)
    client = rt.client()
    marks = str(tmp_path / "marks")
    _gate.clear()
    done: list[wp.Outcome] = []
    driver = threading.Thread(target=lambda: done.append(client.execute(_gated_wf, marks)))
    driver.start()
    try:
        wait_until(lambda: "begin" in w.marks(marks), what="the step")
        with rt.backend.read() as conn:
            (run,) = conn.execute(select(ex.c.id)).scalars().all()
        owner = _lease_owner(rt, run)
        assert owner is not None and owner.endswith("!"), owner
    finally:
        _gate.set()
        driver.join(30)
    assert done[0].unwrap() == "done"


def test_close_waits_for_a_run_a_caller_drives_beside_a_worker(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """``close()`` with a worker running also lets a run driven in a caller's thread
    (``execute``) finish its step before releasing the leases: another runtime must not
    take the run while its step still runs (``close`` returned at once and released it)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(_gated_wf)
    rt.start_worker(concurrency=2, poll_interval=30)
    client = rt.client()
    marks = str(tmp_path / "marks")
    _gate.clear()
    outcomes: list[object] = []

    def drive() -> None:
        try:
            outcomes.append(client.execute(_gated_wf, marks))
        except wp.WfPersistError as exc:  # closed under it: handed over
            outcomes.append(exc)

    driver = threading.Thread(target=drive)
    driver.start()
    wait_until(lambda: "begin" in w.marks(marks), what="the step")
    _gate.set()
    rt.close()
    assert "end" in w.marks(marks), "close() returned while the step still ran"
    driver.join(30)
    assert outcomes


def test_execute_on_a_closed_runtime_starts_nothing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    with rt.backend.read() as conn:  # the tables, before the engine goes
        assert conn.execute(select(ex.c.id)).all() == []
    other = make_runtime(lease_ttl=300)
    rt.close()
    with pytest.raises(wp.WfPersistError, match="closed"):
        rt.client().execute(w.echo_wf, 2)
    with other.backend.read() as conn:
        assert conn.execute(select(ex.c.id)).all() == []


def test_a_start_failing_after_its_claimed_run_was_written_leaves_the_run_due(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start created claimed that fails after its statement (committed on PostgreSQL,
    rolled back elsewhere) leaves no run claimed by nobody: any run it made is due at once,
    for ``execute`` and for a start handed to the worker alike."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    backend = rt.backend
    real = backend.insert_run

    def insert_then_fail(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # type: ignore[arg-type]
        raise RuntimeError("lost after the insert")

    monkeypatch.setattr(backend, "insert_run", insert_then_fail)
    client = rt.client()
    with pytest.raises(RuntimeError, match="lost after"):
        client.execute(w.echo_wf, 2)
    rt.start_worker(concurrency=1, poll_interval=30)
    with pytest.raises(RuntimeError, match="lost after"):
        client.start(w.echo_wf, 3)
    with backend.read() as conn:
        rows = conn.execute(select(ex.c.lease_owner, ex.c.claim_epoch)).all()
    assert all(owner is None for owner, _ in rows), rows


@pytest.mark.needs("presence")
def test_threads_executing_at_once_first_all_claim_under_the_presence_lock(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Eight threads' first ``execute`` calls at once: the ones that find the listener
    being started wait for the presence lock, so every run carries the locked name (seven
    carried the plain one, freed only by a lapsed lease)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(_gated_wf)
    client = rt.client()
    _gate.clear()
    files = [str(tmp_path / f"marks-{i}") for i in range(8)]
    threads = [threading.Thread(target=client.execute, args=(_gated_wf, f)) for f in files]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: all("begin" in w.marks(f) for f in files), what="every step")
        with rt.backend.read() as conn:
            owners = conn.execute(select(ex.c.lease_owner)).scalars().all()
        assert len(owners) == 8 and all(o is not None and o.endswith("!") for o in owners)
    finally:
        _gate.set()
        for thread in threads:
            thread.join(30)


_closing: list[wp.Runtime] = []


def _close_and_look(path: str) -> float:
    """Close the first runtime from inside a step; mark the run's lease owner just after."""
    began = time.monotonic()
    _closing[0].close(timeout=4)
    with _closing[1].backend.read() as conn:
        owners = conn.execute(select(ex.c.lease_owner)).scalars().all()
    w.mark(path, f"owner:{owners[0]}")
    return time.monotonic() - began


@wp.step(name="test_wakeups_close_plain")
def _close_plain(path: str) -> float:
    return _close_and_look(path)


@wp.step(name="test_wakeups_close_timed", timeout=60)  # runs on a thread of its own
def _close_timed(path: str) -> float:
    return _close_and_look(path)


@wp.step
def _after_close(path: str) -> str:
    w.mark(path, "second")
    return "second"


@wp.workflow(name="test_wakeups_closes", version=1)
def _closes_wf(ctx: wp.Context, args: dict[str, str]) -> str:
    path, how = args["path"], args["how"]
    if how == "branch":  # a ctx.all branch runs on a thread of the block's
        ctx.all([wp.call(_close_plain, path)])
    else:
        ctx.run(_close_timed if how == "timed" else _close_plain, path)
    return ctx.run(_after_close, path)


@pytest.mark.parametrize("how", ["caller", "worker", "timed", "branch"])
def test_close_from_inside_a_run_neither_waits_for_nor_releases_that_run(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path, how: str
) -> None:
    """``close()`` called from inside a run (its step, on the driving thread or on a step's
    or branch's own thread; or a signal handler interrupting it) cannot see that run stop
    before it returns: it does not wait its timeout for it (it did, beside a worker: the
    worker's loop waited for that very run), and it does not release the run's lease while
    the step still runs (it did from a step's or a branch's thread: another runtime then
    ran the same step at once); the drive hands the run over at its next step, where
    another runtime finishes it."""
    rt = make_runtime(lease_ttl=300)
    rt.register(_closes_wf)
    rt.start_worker(concurrency=1, poll_interval=30)
    other = make_runtime(lease_ttl=300)
    other.register(_closes_wf)
    marks = str(tmp_path / "marks")
    _closing[:] = [rt, other]
    client = rt.client()
    try:
        if how == "worker":  # handed to the worker: driven on its thread
            run = client.start(_closes_wf, {"path": marks, "how": how}).execution_id
            wait_until(lambda: any(m.startswith("owner:") for m in w.marks(marks)), 30)
        else:
            with pytest.raises(wp.WfPersistError, match="closed"):  # handed over, not awaited
                client.execute(_closes_wf, {"path": marks, "how": how})
            with other.backend.read() as conn:
                (run,) = conn.execute(select(ex.c.id)).scalars().all()
        assert other.client().result(run, timeout=30).unwrap() == "second"
    finally:
        _closing.clear()
    owner = next(m for m in w.marks(marks) if m.startswith("owner:"))
    assert owner != "owner:None", "released while its step still ran"
    (closing_took,) = [
        r.event["result"]
        for r in other.client().history(run)
        if r.event["type"] == "step.completed"
        and r.event["stepName"].startswith("test_wakeups_close_")
    ]
    assert closing_took < 2, f"close() waited {closing_took:.1f}s for the run inside it"
    assert w.marks(marks).count("second") == 1
    steps_begun = [r for r in other.client().history(run) if r.event["type"] == "step.started"]
    assert len(steps_begun) == 2, "each step began once"


def test_an_interrupt_just_after_a_claimed_start_committed_gives_the_run_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt that lands after a start created claimed committed (while the driver
    waits for the commit's answer, say): the run is released, not left leased by nobody's
    drive (it waited out the lease on SQLite and MySQL)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    backend = rt.backend
    real = backend.atomic

    @contextlib.contextmanager
    def atomic_then_interrupt() -> Iterator[object]:
        with real() as conn:
            yield conn
        raise _Interrupt

    monkeypatch.setattr(backend, "atomic", atomic_then_interrupt)
    with pytest.raises(_Interrupt):
        rt.client().execute(w.echo_wf, 2)
    monkeypatch.undo()
    with backend.read() as conn:
        rows = conn.execute(select(ex.c.id, ex.c.lease_owner)).all()
    assert [owner for _, owner in rows] == [None], rows
    assert rt.client().result(rows[0][0], timeout=30).unwrap() == [1, 2]


@pytest.mark.needs("embedded")
def test_a_claimed_start_refused_by_a_locked_database_is_not_written_twice(
    tmp_path: Path,
) -> None:
    """SQLite rolls a failed start back: nothing can have committed, so there is no lease
    to give back (a second write waited out the busy timeout again)."""
    path = tmp_path / "locked.sqlite3"
    host = create_engine(f"sqlite:///{path}", connect_args={"timeout": 1.0})
    rt = wp.Runtime(host, auto_migrate=True)
    try:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.execute(w.echo_wf, 1).unwrap() == [1, 2]
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            began = time.monotonic()
            with pytest.raises(OperationalError, match="locked"):
                client.execute(w.echo_wf, 2)
            took = time.monotonic() - began
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert took < 1.8, f"{took:.2f}s: the busy timeout was waited twice"
    finally:
        rt.close()
        host.dispose()


class _Interrupt(BaseException):
    """Stands for KeyboardInterrupt (which pytest would take as its own)."""


def test_an_interrupt_while_a_drive_opens_gives_the_run_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted after its claim but before its body runs, a drive forgets its lease
    (it was renewed for ever by nobody's drive) and releases the run: due at once."""
    from wf_persist import drives

    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)

    def interrupted(*args: object, **kwargs: object) -> object:
        raise _Interrupt

    monkeypatch.setattr(drives, "start_drive", interrupted)
    with pytest.raises(_Interrupt):
        rt.client().execute(w.echo_wf, 2)
    assert rt.keeper().held() == {}
    with rt.backend.read() as conn:
        assert conn.execute(select(ex.c.lease_owner)).scalars().all() == [None]


def _interrupt_before(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, error: BaseException
) -> None:
    """``owner.name`` raises ``error`` as it is entered (where a signal handler runs)."""

    def interrupted(*args: object, **kwargs: object) -> object:
        raise error

    monkeypatch.setattr(owner, name, interrupted)


def _given_back(rt: wp.Runtime, other: wp.Runtime) -> None:
    """The one run is leased by nobody, held by no lease keeper, and another runtime
    finishes it at once (not after the lease)."""
    assert rt.keeper().held() == {}
    with rt.backend.read() as conn:
        rows = conn.execute(select(ex.c.id, ex.c.lease_owner)).all()
    assert [owner for _, owner in rows] == [None], rows
    assert other.client().result(rows[0][0], timeout=20).unwrap() == [1, 2]


@pytest.mark.parametrize("where", ["started", "drive_started", "trace"])
def test_an_interrupt_between_a_claimed_start_and_its_drive_gives_the_run_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An interrupt landing after ``execute``'s start committed, before the drive's own
    handling begins (as the start hands the claim on, as the drive is entered, as its trace
    opens): the run is given back, not left leased by nobody (until the lease lapsed) or
    renewed for ever by this runtime's lease keeper."""
    from wf_persist import drive_telemetry

    rt = make_runtime(lease_ttl=300)
    other = make_runtime(lease_ttl=300)
    for r in (rt, other):
        r.register(w.echo_wf)
    client = rt.client()
    owner, name = {
        "started": (client, "_started"),
        "drive_started": (rt, "drive_started"),
        "trace": (drive_telemetry, "drive"),
    }[where]
    _interrupt_before(monkeypatch, owner, name, _Interrupt())
    with pytest.raises(_Interrupt):
        client.execute(w.echo_wf, 2)
    monkeypatch.undo()
    _given_back(rt, other)


def test_an_exception_raised_just_after_a_claimed_start_committed_gives_the_run_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler's exception (a request's timeout) landing right after the commit of
    ``execute``'s start: the run may have committed, so it is given back (on SQLite and
    MySQL it waited out the lease)."""
    rt = make_runtime(lease_ttl=300)
    other = make_runtime(lease_ttl=300)
    for r in (rt, other):
        r.register(w.echo_wf)
    real = rt.backend.atomic

    @contextlib.contextmanager
    def atomic_then_timeout() -> Iterator[object]:
        with real() as conn:
            yield conn
        raise TimeoutError("the request timed out")

    monkeypatch.setattr(rt.backend, "atomic", atomic_then_timeout)
    with pytest.raises(TimeoutError):
        rt.client().execute(w.echo_wf, 2)
    monkeypatch.undo()
    _given_back(rt, other)


@pytest.mark.parametrize("where", ["answer", "drive", "timeout"])
def test_an_interrupt_as_result_claims_the_run_gives_it_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """``result()`` claims a due run to drive it here. An interrupt landing once that claim
    committed (as its answer comes back, which is where a signal handler's exception lands
    while the claim waits on the database; or as the drive is entered) gives the run back:
    it was left leased by nobody's drive until the lease lapsed."""
    rt = make_runtime(lease_ttl=300)
    other = make_runtime(lease_ttl=300)
    for r in (rt, other):
        r.register(w.echo_wf)
    run = rt.client().start(w.echo_wf, 2).execution_id
    error = TimeoutError("the request timed out") if where == "timeout" else _Interrupt()
    if where == "drive":
        _interrupt_before(monkeypatch, rt, "_drive", error)
    else:
        real = rt.backend.claim_to_drive

        def claimed_then_interrupted(*args: Any, **kwargs: Any) -> Any:
            assert real(*args, **kwargs) is not None
            raise error

        monkeypatch.setattr(rt.backend, "claim_to_drive", claimed_then_interrupted)
    with pytest.raises(type(error)):
        rt.client().result(run, timeout=30)
    monkeypatch.undo()
    _given_back(rt, other)


def test_an_interrupted_result_leaves_a_claim_of_its_worker_alone(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Giving back a claim whose answer was lost goes by the lease's owner name, which this
    runtime's worker shares: a run the worker claimed (held by the lease keeper, not yet
    driven) stays the worker's."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    run = rt.client().start(w.echo_wf, 2).execution_id
    rt.wakeups()  # the owner name settled (PostgreSQL adds its presence mark)
    claim = rt.backend.claim_to_drive(run, rt.owner, 300, rt.runnable_workflows())
    assert claim is not None
    rt.keeper().hold(run, claim.epoch)
    _interrupt_before(monkeypatch, rt.backend, "claim_to_drive", TimeoutError("timed out"))
    with pytest.raises(TimeoutError):
        rt.client().result(run, timeout=30)
    monkeypatch.undo()
    with rt.backend.read() as conn:
        held = conn.execute(select(ex.c.lease_owner, ex.c.claim_epoch)).one()
    assert tuple(held) == (rt.owner, claim.epoch)
    rt.give_back(claim)
    rt.keeper().forget_run(run, claim.epoch)


def test_an_interrupt_before_a_started_run_reaches_the_worker_frees_its_slot(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start made claimed for this runtime's worker, interrupted after its commit before
    the run was handed over: the run is due again and the slot promised to it is free (a
    worker of concurrency 1 would otherwise never claim again)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    rt.start_worker(concurrency=1, poll_interval=0.05)
    client = rt.client()
    warm = client.start(w.echo_wf, 1).execution_id  # the worker serving: starts go claimed
    assert client.result(warm, timeout=20).unwrap() == [1, 2]
    worker = rt.start_worker()
    wait_until(
        lambda: worker._pool is not None and not worker._inflight,
        what="the worker serving, the warm run's slot free again",
    )
    _interrupt_before(monkeypatch, rt, "dispatch", _Interrupt())
    with pytest.raises(_Interrupt):
        client.start(w.echo_wf, 2)
    monkeypatch.undo()
    with rt.backend.read() as conn:
        (run,) = conn.execute(select(ex.c.id).where(ex.c.id != warm)).scalars().all()
    assert client.result(run, timeout=20).unwrap() == [1, 2]
    assert client.result(client.start(w.echo_wf, 2).execution_id, timeout=20).unwrap() == [1, 2]


def _serving_worker(rt: wp.Runtime) -> Any:
    """A worker of concurrency 1, serving (its first run done, its slot free again)."""
    worker = rt.start_worker(concurrency=1, poll_interval=0.05)
    client = rt.client()
    warm = client.start(w.echo_wf, 1).execution_id
    assert client.result(warm, timeout=20).unwrap() == [1, 2]
    wait_until(lambda: worker._pool is not None and not worker._inflight, what="serving")
    return worker


@pytest.mark.parametrize("where", ["submit", "after_dispatch", "expect"])
def test_an_interrupted_start_for_the_worker_neither_strands_its_run_nor_miscounts_its_slot(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Interrupted as the worker is given the run (the run was stuck, renewed for ever and
    its slot held), just after it was given it (its slot was freed twice: the worker then
    promised more runs than it has threads), or before the start was sent (the slot
    promised to it leaked): the run completes, the slot count ends at zero, and a worker
    of concurrency 1 takes the next start."""
    from wf_persist.embedded import WorkflowClient

    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    worker = _serving_worker(rt)
    client = rt.client()
    before = set(_ids(rt))
    if where == "submit":
        _interrupt_before(monkeypatch, worker, "submit", _Interrupt())
    elif where == "expect":
        _interrupt_before(monkeypatch, client, "_expect", _Interrupt())
    else:
        real = WorkflowClient._started

        def started_then_interrupted(self: Any, created: Any, *args: Any) -> None:
            real(self, created, *args)
            # The worker drove it to its end before the interrupt came (a handler's close()
            # waits for it, say).
            wait_until(lambda: not rt.busy_here(created.execution_id), what="driven")
            raise _Interrupt

        monkeypatch.setattr(WorkflowClient, "_started", started_then_interrupted)
    with pytest.raises(_Interrupt):
        client.start(w.echo_wf, 2)
    monkeypatch.undo()
    for run in set(_ids(rt)) - before:
        assert client.result(run, timeout=20).unwrap() == [1, 2]
    wait_until(lambda: not worker._inflight, what="the worker idle")
    assert worker._reserved == 0
    assert client.result(client.start(w.echo_wf, 2).execution_id, timeout=20).unwrap() == [1, 2]


def _ids(rt: wp.Runtime) -> list[str]:
    with rt.backend.read() as conn:
        return [str(i) for i in conn.execute(select(ex.c.id)).scalars()]


def test_an_interrupt_as_a_drive_is_marked_leaves_the_run_drivable_here(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt just after a drive marked its run as driven here: the mark goes too
    (this process never drove that run again: its worker skipped it and ``result()`` took
    it for busy here)."""
    from wf_persist import runtime as runtime_module

    class Interrupting:
        def set(self, value: object) -> object:
            raise _Interrupt

    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    monkeypatch.setattr(runtime_module, "DRIVING_RUN", Interrupting())
    with pytest.raises(_Interrupt):
        rt.client().execute(w.echo_wf, 2)
    monkeypatch.undo()
    (run,) = _ids(rt)
    assert rt.client().result(run, timeout=10).unwrap() == [1, 2]


def test_a_claimed_start_that_got_no_connection_gives_nothing_back(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A start that timed out waiting for the pool sent nothing: it fails after one pool
    timeout (a give-back for it waited on the same exhausted pool a second time)."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=1)
    with wp.Runtime(engine, lease_ttl=300) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.execute(w.echo_wf, 1).unwrap() == [1, 2]
        with engine.connect():  # the pool's one connection, taken
            began = time.monotonic()
            with pytest.raises(Exception, match="QueuePool limit"):
                client.execute(w.echo_wf, 2)
            took = time.monotonic() - began
        assert took < 1.8, f"{took:.2f}s: the pool timeout was waited twice"


_CLOSE_IN_HANDLER = """
import os, signal, sys
import wf_persist as wp

rt = wp.Runtime(sys.argv[1], auto_migrate=True)
keeper = rt.keeper()

def handler(*_):
    rt.close(timeout=2)
    print("closed", flush=True)

signal.signal(signal.SIGTERM, handler)
with rt._lock, keeper._lock:  # as a drive that takes its lease keeper, say
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(10))  # the handler runs here
print("done", flush=True)
"""


def test_close_from_a_signal_handler_landing_in_a_locked_section_does_not_hang(
    tmp_path: Path,
) -> None:
    """The README allows ``close()`` from a signal handler; landing while the interrupted
    thread held the runtime's or the lease keeper's lock, it waited for that lock for ever."""
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'handler.sqlite3'}"
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_IN_HANDLER, url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed", "done"], done.stdout


def test_a_closed_runtime_starts_no_new_lease_keeper(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    assert rt.client().execute(w.echo_wf, 1).unwrap() == [1, 2]
    rt.close()
    rt.keeper()  # as a drive still finishing would
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    assert "wf-persist-lease-keeper" not in names, names


# borrowed connections -------------------------------------------------------------------


def test_runs_share_a_pool_smaller_than_their_number(db_url: str) -> None:
    """Forty runs whose step takes half a second, driven at once on a pool of three: a run
    holds no connection while its step runs, so they all run together."""
    engine = create_engine(db_url, pool_size=3, max_overflow=0, pool_timeout=10)
    rt = wp.Runtime(engine, lease_ttl=30)
    try:
        rt.register(f.slow_wf)
        rt.start_worker(concurrency=40, poll_interval=0.05)
        client = rt.client()
        began = time.monotonic()
        handles = [client.start(f.slow_wf, 0.5) for _ in range(40)]
        for handle in handles:
            assert client.result(handle.execution_id, timeout=30).unwrap() == 0.5
        elapsed = time.monotonic() - began
        # Holding a connection per run, three at a time: 40 / 3 * 0.5 s = 6.7 s at least.
        assert elapsed < 5, f"{elapsed:.1f}s: runs waited for connections"
    finally:
        rt.close()
        engine.dispose()


def _started_runs_reach_a_worker_process_at_once(db_url: str, procs: Processes) -> None:
    """A worker process polling every 30 s picks up three runs started here at once."""
    procs.worker(db_url, app_poll_interval=30).wait_for_stderr("serving")
    with wp.Client(db_url, poll_interval=30) as client:
        for _ in range(3):
            began = time.time()
            handle = client.start("stamped")
            stamp = client.result(handle.execution_id, timeout=20).unwrap()
            assert stamp - began < 2.0, f"picked up after {stamp - began:.2f}s"


@pytest.mark.needs("embedded")
def test_a_commit_elsewhere_wakes_a_sqlite_worker_within_milliseconds(
    db_url: str, procs: Processes
) -> None:
    """SQLite announces nothing, but a waiting worker process reads the database's change
    counter: a start from this process (another connection's commit) reaches it at once."""
    _started_runs_reach_a_worker_process_at_once(db_url, procs)


# notifications ----------------------------------------------------------------------------


@pytest.mark.needs("notify")
def test_a_start_wakes_a_worker_in_another_process_at_once(db_url: str, procs: Processes) -> None:
    """The worker process polls every 30 s; a start from this process notifies it."""
    _started_runs_reach_a_worker_process_at_once(db_url, procs)


@pytest.mark.needs("notify")
def test_a_run_ending_elsewhere_wakes_its_waiting_client(
    db_url: str, procs: Processes, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A thin client waiting for a run has backed off to long pauses (its poll interval is
    30 s); the run's end in a worker process wakes it at once."""
    procs.worker(db_url, app_poll_interval=30).wait_for_stderr("serving")
    signaller = make_runtime()
    with wp.Client(db_url, poll_interval=30) as client:
        handle = client.start("approval", None)
        wait_until(
            lambda: bool(client.pending_signals(handle.execution_id)), what="the wait", timeout=20
        )
        outcome: list[wp.Outcome] = []
        waiter = threading.Thread(
            target=lambda: outcome.append(client.result(handle.execution_id, timeout=60))
        )
        waiter.start()
        time.sleep(5)  # the client's pauses between looks have grown to seconds
        sent = time.monotonic()
        signaller.client().signal(handle.execution_id, "approval", {"approved": True})
        waiter.join(20)
        assert outcome and outcome[0].status == "completed"
        assert time.monotonic() - sent < 1.5, "woken by the run's end, not by its next look"


@pytest.mark.needs("notify")
def test_a_waiting_client_looks_at_its_run_again_only_when_its_end_is_heard(
    db_url: str, procs: Processes, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """While ends are announced, a thin client waiting for a run reads it once before the
    wait and once after the end is heard: no backed-off polling meanwhile."""
    procs.worker(db_url, app_poll_interval=30).wait_for_stderr("serving")
    signaller = make_runtime()
    with wp.Client(db_url, poll_interval=30) as client:
        handle = client.start("approval", None)
        wait_until(
            lambda: bool(client.pending_signals(handle.execution_id)), what="the wait", timeout=20
        )
        outcome: list[wp.Outcome] = []
        with client_statements(client) as reads:
            waiter = threading.Thread(
                target=lambda: outcome.append(client.result(handle.execution_id, timeout=60))
            )
            waiter.start()
            time.sleep(1.5)  # backed-off polling would have looked about ten times by now
            during = len(reads)
            signaller.client().signal(handle.execution_id, "approval", {"approved": True})
            waiter.join(20)
        assert outcome and outcome[0].status == "completed"
        assert during == 1, reads
        assert len(reads) == 2, reads


@pytest.mark.needs("notify")
def test_a_waiting_client_still_sees_an_end_nobody_announced_within_its_poll_interval(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """A run a runtime starts and drives itself announces no end; a thin client elsewhere
    waiting for it looks every poll interval and sees it finish."""
    rt = make_runtime()
    rt.register(_napping)
    rt.start_worker(concurrency=2)
    with wp.Client(db_url, poll_interval=0.2) as client:
        client.result(client.start(_napping, 0.0).execution_id, timeout=20)  # listening
        handle = rt.client().start(_napping, 0.8)
        assert rt.busy_here(handle.execution_id), "driven by the runtime that started it"
        began = time.monotonic()
        assert client.result(handle.execution_id, timeout=20).unwrap() == 0.8
        # The end, one poll interval and a loaded machine's slack (it failed once at 1.76 s).
        assert time.monotonic() - began < 0.8 + 0.2 + 2.0


@pytest.mark.needs("notify")
def test_the_listener_reconnects_after_its_connection_is_killed(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """The listening connection is terminated by the server: the runtime connects again,
    takes its presence lock again, and a start from elsewhere still wakes its worker."""
    rt = make_runtime(lease_ttl=30)
    rt.register(*f.ALL)
    rt.start_worker(concurrency=2, poll_interval=30)
    wait_until(rt.listening, what="listening")
    assert rt._wakeups is not None and rt._wakeups.connections == 1
    admin = create_engine(db_url)
    try:
        with admin.begin() as conn:
            killed = conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'wf_persist listener' "
                    "AND datname = current_database()"
                )
            ).all()
        assert killed, "found the listening connection"
        wakeups = rt._wakeups
        assert wakeups is not None
        wait_until(lambda: wakeups.connections >= 2, what="a new connection", timeout=20)
        wait_until(rt.listening, what="listening again", timeout=20)
        with wp.Client(db_url, poll_interval=30) as client:
            began = time.time()
            stamp = client.result(client.start("stamped").execution_id, timeout=20).unwrap()
            assert stamp - began < 2.0
    finally:
        admin.dispose()


# presence ---------------------------------------------------------------------------------


@pytest.mark.needs("presence")
def test_a_reconnected_listener_takes_its_presence_lock_again_once_it_is_free(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """After its connection died, the listener could not take its presence lock back (held
    elsewhere for a moment, as another process's reaper does): it keeps trying, and holds it
    again as soon as it is free, so this live runtime's runs stop being reapable."""
    rt = make_runtime(lease_ttl=30)
    rt.register(*f.ALL)
    rt.start_worker(concurrency=2, poll_interval=30)
    # The owner name is settled by the thread that started the listener, just after the
    # listener connected (a moment later on a loaded machine).
    wait_until(lambda: rt.listening() and rt.owner.endswith("!"), what="listening, present")
    wakeups = rt._wakeups
    assert wakeups is not None and wakeups.present
    key = "SELECT pg_advisory_lock(hashtextextended(:o, 0))"
    admin = create_engine(db_url)
    holder = admin.connect()
    taken = threading.Event()

    def take() -> None:  # queued behind the listener's lock: granted the moment it dies
        holder.execute(text(key), {"o": rt.owner})
        taken.set()

    grabber = threading.Thread(target=take)
    try:
        grabber.start()
        time.sleep(0.2)
        assert not taken.is_set(), "the listener holds its lock"
        with admin.begin() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'wf_persist listener' "
                    "AND datname = current_database()"
                )
            )
        assert taken.wait(10), "the lock went with the listener's connection"
        wait_until(lambda: wakeups.connections >= 2 and rt.listening(), what="reconnected")
        time.sleep(0.5)
        assert not wakeups.present, "the lock is held elsewhere"
        holder.execute(text("SELECT pg_advisory_unlock(hashtextextended(:o, 0))"), {"o": rt.owner})
        wait_until(lambda: wakeups.present, what="the lock taken again", timeout=3)
        with admin.connect() as probe:
            free = probe.execute(
                text("SELECT pg_try_advisory_lock(hashtextextended(:o, 0))"), {"o": rt.owner}
            ).scalar()
            assert free is False, "the listener holds it again"
    finally:
        grabber.join(10)
        holder.close()
        admin.dispose()


@pytest.mark.needs("presence")
def test_a_killed_workers_runs_are_taken_over_before_their_lease_ends(
    db_url: str, procs: Processes, make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """A worker process holding a run inside its first step is SIGKILLed with 30 s left on
    its lease; a worker here takes the run over at once (its presence lock went with its
    connection), and the run completes with its step run twice (at-least-once: it was in
    flight) and the later steps once."""
    marks, release = tmp_path / "marks", tmp_path / "release"
    victim = procs.worker(db_url, lease_ttl=30, app_poll_interval=0.05)
    victim.wait_for_stderr("serving")
    rt = make_runtime(lease_ttl=30)
    rt.register(*f.ALL)
    client = rt.client()
    handle = client.start(f.fenced_wf, {"marks": str(marks), "release": str(release)})
    wait_until(lambda: w.marks(marks).count("hold-start") == 1, what="the first attempt")
    row = client.describe(handle.execution_id)
    assert row.lease_owner is not None and row.lease_owner.endswith("!"), "a present owner"
    victim.send(signal.SIGKILL)
    victim.wait(10)
    killed = time.monotonic()
    release.touch()
    rt.start_worker(concurrency=2, poll_interval=30)
    wait_until(lambda: w.marks(marks).count("hold-start") == 2, what="the takeover", timeout=20)
    assert time.monotonic() - killed < 3.0, "taken over long before the 30 s lease"
    assert client.result(handle.execution_id, timeout=20).unwrap() == ["held", "one", "two"]
    assert w.marks(marks).count("one") == 1


@pytest.mark.needs("presence")
def test_a_live_runtime_is_never_reaped(make_runtime: Callable[..., wp.Runtime]) -> None:
    """Reaping takes over only owners whose presence lock is free: a run held by a live
    runtime (another one in this process, with its own listening connection) stays held."""
    holder, other = make_runtime(lease_ttl=30), make_runtime(lease_ttl=30)
    holder.register(*f.ALL)
    other.register(*f.ALL)
    holder.wakeups()
    other.wakeups()
    assert holder.owner.endswith("!") and other.owner.endswith("!")
    handle = holder.client().start(f.nap_wf, 3600)
    with holder.backend.begin() as conn:
        claim = holder.backend.claim(conn, handle.execution_id, holder.owner, 30)
    assert claim is not None
    assert other.reap() == [] and holder.reap() == []
    assert other.drive(handle.execution_id) is False


# cheap polling ---------------------------------------------------------------------------


@pytest.mark.needs("embedded")
def test_an_idle_sqlite_worker_looks_only_when_something_was_committed(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """A worker polling every 20 ms runs no query while nothing is committed (its look is
    a ``PRAGMA data_version`` on a connection of its own), and finds a run another runtime
    (another connection, as another process would) starts within a poll or two."""
    rt, other = make_runtime(lease_ttl=30), make_runtime(lease_ttl=30)
    rt.register(f.nap_wf, f.stamped_wf)
    other.register(f.stamped_wf)
    parked = rt.client().start(f.nap_wf, 3600).execution_id
    assert rt.drive(parked)
    worker = wp.Worker(rt, concurrency=2, poll_interval=0.02)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        time.sleep(0.3)  # its first looks
        with counting(rt.backend.base_engine, tmp_path / "idle") as counter:
            time.sleep(1.0)
            counts = counter.counts()
        assert counts.transactions <= 1, counts
        began = time.time()
        handle = other.client().start(f.stamped_wf)
        stamp = wp.Client(other.engine).result(handle.execution_id, timeout=10).unwrap()
        assert stamp - began < 1.0
    finally:
        worker.stop()
        thread.join(10)


def test_an_end_heard_wakes_only_its_waiter_and_a_reconnection_wakes_every_waiter() -> None:
    """:class:`Ends`: an end heard before a look is forgotten by that look; an end of an
    unwatched run is not kept; a (re)connection (ends may have gone unheard) wakes all."""
    ends = Ends()
    ends.heard("nobody-waits")
    with ends.watching("a"), ends.watching("b"):
        ends.heard("a")
        mark = ends.mark("a")  # the look sees that end itself
        began = time.monotonic()
        ends.wait("a", mark, 0.2)
        assert time.monotonic() - began >= 0.19, "an end heard before the look is forgotten"
        threading.Timer(0.05, ends.heard, ("b",)).start()
        began = time.monotonic()
        ends.wait("a", mark, 2.0)
        assert time.monotonic() - began >= 1.9, "another run's end does not wake this waiter"
        mark_b = ends.mark("b")
        threading.Timer(0.05, ends.heard, (ANY_END,)).start()
        began = time.monotonic()
        ends.wait("b", mark_b, 5.0)
        assert time.monotonic() - began < 2.0, "a reconnection wakes every waiter"
        threading.Timer(0.05, ends.heard, ("a",)).start()
        began = time.monotonic()
        ends.wait("a", ends.mark("a"), 5.0)
        assert time.monotonic() - began < 2.0
    assert not ends._watched and not ends._ended


@pytest.mark.needs("embedded")
def test_a_look_at_sqlite_while_a_writer_commits_under_a_rollback_journal(
    tmp_path: Path,
) -> None:
    """A host engine in a rollback journal with a busy timeout of 0: the worker's look
    (``PRAGMA data_version``) failed at once with "database is locked" while another
    connection committed, and the worker logged an outage and backed off, every time. A
    look that finds the file locked says something changes."""
    path = tmp_path / "journal.sqlite3"
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _host_settings(dbapi: Any, record: Any) -> None:
        cursor = dbapi.cursor()
        cursor.execute("PRAGMA journal_mode=DELETE")
        cursor.execute("PRAGMA busy_timeout=0")
        cursor.close()

    wp.migrate.upgrade(engine)
    with wp.Runtime(engine) as rt:
        changes = rt.backend.changes()
        assert changes is not None
        changes.changed()
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("BEGIN EXCLUSIVE")  # as a commit holds it, readers shut out
            assert changes.changed() is True
            writer.execute("COMMIT")
            changes.changed()
            assert changes.changed() is False
        finally:
            writer.close()
            changes.close()
    engine.dispose()
