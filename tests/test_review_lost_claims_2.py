"""The lost-claim give-back of ``result()``, further: a signal's exception
that lands while the claim waits for a pooled connection, and a start mark that leaks."""

from __future__ import annotations

import datetime as dt
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, select, update

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .fixtures import workflows as w
from .helpers import pause_calls, wait_until


def _lease(rt: wp.Runtime, run: str) -> tuple[Any, int, bool]:
    with rt.backend.read() as conn:
        row = conn.execute(
            select(ex.c.lease_owner, ex.c.claim_epoch, ex.c.lease_expires_at).where(ex.c.id == run)
        ).one()
    return row[0], int(row[1]), row[2] is not None


def test_a_signal_while_the_claim_waits_for_the_pool_does_not_wait_the_pool_again(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A request's deadline (a SIGALRM handler raising TimeoutError) fires while
    ``result()``'s claim waits for a pooled connection (the pool is exhausted: exactly when
    requests time out). Nothing was sent; but the exception is not the pool's own
    TimeoutError, so the give-back by owner name runs and its read waits a whole
    ``pool_timeout`` more on the same exhausted pool before the request's TimeoutError
    reaches the caller (the start's own path tracks ``sent`` and does not do this)."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=4)
    with wp.Runtime(engine, lease_ttl=300) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        run = client.start(w.echo_wf, 2).execution_id
        rt.wakeups()

        def deadline(signum: int, frame: Any) -> None:
            raise TimeoutError("the request timed out")

        previous = signal.signal(signal.SIGALRM, deadline)
        try:
            with engine.connect():  # the pool's one connection, taken by another request
                began = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with pytest.raises(TimeoutError, match="the request timed out"):
                    client.result(run, timeout=30)
                took = time.monotonic() - began
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert took < 2.0, (
            f"{took:.2f}s: the interrupted result() waited the pool timeout again "
            "(its claim was never sent)"
        )
        assert client.result(run, timeout=30).unwrap() == [1, 2]


# A step that runs another workflow to its end with execute(), on the drive's own thread.
_CLIENT: list[wp.WorkflowClient] = []


@wp.step
def run_inner() -> list[int]:
    got: list[int] = _CLIENT[0].execute(w.echo_wf, 2).unwrap()
    return got


@wp.workflow(name="review-outer", version=1)
def outer_wf(ctx: wp.Context) -> list[int]:
    got = ctx.run(run_inner)
    ctx.sleep(6)  # parks: the run outlives execute()'s drive
    return got


def test_a_nested_execute_does_not_leak_the_outer_start_mark(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``execute()`` drives its run in this thread; a step of that run (run inline, in this
    very thread) calls ``execute()`` on the same client. The inner call resets the
    thread-local ``here.claim`` to None and leaves it None, so the outer ``execute()``'s
    finally never unmarked its run (``_unheld``): ``claimed_here`` says True for that run
    for the life of the runtime. A later ``result()`` of that run whose claim's answer is
    lost (a signal's TimeoutError as the claim returns) then spares its own claim: the run
    stays leased by this runtime's name, driven by nobody, until the lease lapses."""
    rt = make_runtime(lease_ttl=300, poll_interval=60)
    rt.register(w.echo_wf)
    rt.register(outer_wf)
    client = rt.client()
    _CLIENT[:] = [client]
    rt.wakeups()
    errors: list[BaseException] = []
    gate = threading.Event()
    real_result = client.result

    def result_later(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(60)  # execute()'s own wait stays out of the way until the end
        return real_result(*args, **kwargs)

    monkeypatch.setattr(client, "result", result_later)

    def outer() -> None:
        try:
            client.execute(outer_wf)
        except BaseException as exc:
            errors.append(exc)

    first = threading.Thread(target=outer, daemon=True)
    first.start()
    # the outer run parks in its 6 s sleep; execute() then waits for it (polls: 60 s)
    wait_until(lambda: _parked_outer(rt), what="the outer run parked", timeout=30)
    run = _parked_outer(rt)
    assert run is not None
    time.sleep(0.3)  # execute()'s finally has run (it is waiting in result() now)
    leaked = run in rt._unheld
    client = rt.client()  # another request
    _make_due(rt, run)
    real = rt.backend.claim_to_drive
    claims: list[Any] = []

    def claimed_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        claims.append(real(*args, **kwargs))
        raise TimeoutError("the request timed out")  # the claim's answer is lost

    monkeypatch.setattr(rt.backend, "claim_to_drive", claimed_then_interrupted)
    try:
        with pytest.raises(TimeoutError, match="the request timed out"):
            client.result(run, timeout=30)
    finally:
        monkeypatch.setattr(rt.backend, "claim_to_drive", real)
    owner, epoch, leased = _lease(rt, run)
    # clean up: give the run back, make it due, and drive it to its end (execute() too)
    if leased:
        from wf_persist import drives

        drives._release(rt, run, epoch, "review-outer")
    _make_due(rt, run)
    assert client.result(run, timeout=30).unwrap() == [1, 2]
    gate.set()
    first.join(30)
    assert not errors, errors
    assert claims and claims[0] is not None, "the test's claim was not made"
    assert not leased, (
        f"result()'s lost claim was left leased by {owner} (spared by a leaked start mark)"
    )
    assert not leaked, "execute() left its start mark behind (a nested execute() reset it)"


def _make_due(rt: wp.Runtime, run: str) -> None:
    with rt.engine.begin() as conn:
        conn.execute(
            update(ex).where(ex.c.id == run).values(wake_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
        )


def _parked_outer(rt: wp.Runtime) -> str | None:
    with rt.backend.read() as conn:
        row = conn.execute(
            select(ex.c.id, ex.c.lease_expires_at, ex.c.wake_at).where(
                ex.c.workflow_name == "review-outer"
            )
        ).one_or_none()
    if row is None or row[1] is not None or row[2] is None:
        return None
    return str(row[0])


def test_a_worker_claim_batch_under_way_spares_only_its_own_runs(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``claimed_here`` answers True for *every* run while any claim batch of the worker is
    under way (``_claiming`` is one counter for the runtime). A ``result()`` of run B whose
    claim's answer is lost while the worker's batch claims run A (it has committed, the
    keeper has not got A yet) spares its own lost claim of B: B stays leased by this
    runtime's name, driven by nobody, until the lease lapses. While the batch's statement
    is in flight the ids it claims are unknown and sparing every run is unavoidable; once
    it has returned (as here) they are known, and only they need sparing."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run_a = client.start(w.echo_wf, 2).execution_id
    rt.wakeups()
    committed, go_on = pause_calls(monkeypatch, rt.keeper(), "hold")
    claimed: list[Any] = []
    worker = threading.Thread(target=lambda: claimed.extend(rt.claim_due(1)))
    worker.start()
    try:
        assert committed.wait(20)
        run_b = client.start(w.echo_wf, 3).execution_id  # due; the batch claimed A only
        real = rt.backend.claim_to_drive

        def claimed_then_interrupted(*args: Any, **kwargs: Any) -> Any:
            assert real(*args, **kwargs) is not None
            raise TimeoutError("the request timed out")

        monkeypatch.setattr(rt.backend, "claim_to_drive", claimed_then_interrupted)
        with pytest.raises(TimeoutError):
            client.result(run_b, timeout=30)
        monkeypatch.setattr(rt.backend, "claim_to_drive", real)
        lease_b = _lease(rt, run_b)
    finally:
        go_on.set()
        worker.join(20)
        monkeypatch.undo()
    assert [c.execution_id for c in claimed] == [run_a]
    rt.keeper().forget_run(run_a, claimed[0].epoch)
    rt.give_back(claimed[0])
    assert not lease_b[2], (
        f"result()'s lost claim of B was left leased by {lease_b[0]}: spared because the "
        "worker was claiming A"
    )


def test_an_interrupt_inside_started_claimed_leaves_no_mark_behind(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """An interrupt landing in ``started_claimed`` between the decrement and the ``del``
    (simulated with a trace function raising at that line, as a signal handler's exception
    lands at a bytecode boundary) left a zero count in the Counter; ``claimed_here`` asked
    ``execution_id in self._unheld`` (key presence, not a positive count), so the run is
    spared by every later lost-claim give-back. No negative count or KeyError is possible:
    a missing key counts 0 and a count at or below 0 is deleted."""
    import inspect
    import sys

    from wf_persist import worker_side

    rt = make_runtime(lease_ttl=300)
    lines, first = inspect.getsourcelines(worker_side.WorkerSide.started_claimed)
    target = first + next(i for i, text in enumerate(lines) if "<= 0" in text)
    code = worker_side.WorkerSide.started_claimed.__code__

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is code:

            def local(frame: Any, event: str, arg: Any) -> Any:
                if event == "line" and frame.f_lineno == target:
                    raise KeyboardInterrupt
                return local

            return local
        return None

    rt.starting_claimed("run-x")
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            rt.started_claimed("run-x")
    finally:
        sys.settrace(None)
    rt.started_claimed("run-y")  # unmatched: no KeyError, nothing negative left
    assert "run-y" not in rt._unheld
    assert not rt.claimed_here("run-x"), f"a zero count is still a mark: {dict(rt._unheld)}"


@pytest.mark.needs("libpq")
def test_a_claim_interrupted_while_it_waits_on_a_row_lock_is_given_back(
    make_runtime: Callable[..., wp.Runtime], make_engine: Callable[..., Engine], db_url: str
) -> None:
    """``result()``'s claim waits on the run's row lock (another
    transaction holds it for 1.5 s). The request's deadline (a SIGALRM handler raising
    TimeoutError) fires at 0.5 s. On PostgreSQL the claim goes through libpq's blocking
    call, which retries on EINTR: the handler's exception lands only once the claim's
    answer is back (committed), and the give-back by owner name then finds and releases it.
    Where the wait is interruptible (psycopg's own cursor path), the claim could still be
    queued on the server when the give-back reads ."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    rt.wakeups()
    blocker = make_engine(db_url)
    locked = threading.Event()

    def hold_the_row() -> None:
        with blocker.connect() as conn, conn.begin():
            conn.execute(select(ex.c.id).where(ex.c.id == run).with_for_update()).one()
            locked.set()
            time.sleep(1.5)

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    assert locked.wait(10)

    def deadline(signum: int, frame: Any) -> None:
        raise TimeoutError("the request timed out")

    previous = signal.signal(signal.SIGALRM, deadline)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(TimeoutError, match="the request timed out"):
            client.result(run, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        holder.join(10)
    time.sleep(0.5)
    owner, epoch, leased = _lease(rt, run)
    assert not leased, (
        f"the interrupted claim committed after the give-back looked: leased by {owner} "
        f"at epoch {epoch}, driven by nobody"
    )
