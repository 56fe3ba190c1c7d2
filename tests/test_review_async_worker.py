"""Review of the async worker (bridge / async_worker): regression tests for problems found.

Each test drives real runs on a real worker (``event_loop=True``) against every listed
backend; no mocks."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from sqlalchemy import func, select

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .helpers import wait_until

CALLS: Counter[str] = Counter()
N_RUNS = 90


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()


def _count(rt: wp.Runtime, status: str) -> int:
    with rt.backend.read() as conn:
        return int(conn.execute(select(func.count()).where(ex.c.status == status)).scalar_one())


# 1. Waiting for a concurrency slot holds a "user" thread per waiting run ----------------


@wp.step(concurrency=wp.Limit(1))
async def review_one_at_a_time(n: int) -> int:
    CALLS["limited"] += 1
    await asyncio.sleep(0.005)
    return n


@wp.workflow(name="review_limited", version=1)
async def review_limited_wf(ctx: wp.AsyncContext, n: int) -> int:
    return await ctx.run(review_one_at_a_time, n)


def test_many_runs_queueing_for_a_limited_step_do_not_wedge_the_loop(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """More runs queue for a ``Limit(1)`` step than the async worker has user threads (64):
    each queued run's slot wait (``bridge.threaded``) occupies a user thread, polling, so
    the holder's ``__exit__`` (also ``in_thread``) never gets one: the slot is never given
    back and every run on the worker waits forever."""
    rt = make_runtime()
    rt.register(review_limited_wf)
    client = rt.client()
    runs = [client.start(review_limited_wf, i).execution_id for i in range(N_RUNS)]
    rt.start_worker(concurrency=100, poll_interval=0.05, event_loop=True)
    wait_until(
        lambda: _count(rt, "completed") == len(runs), timeout=60, what="every run", every=0.1
    )
    assert CALLS["limited"] == len(runs)


# 2. The loop thread blocks on a lock a thread holds through a database write ------------

STEP_RUNNING = threading.Event()
TICKS: list[float] = []


@wp.step
async def review_slow_step(seconds: float) -> float:
    STEP_RUNNING.set()
    await asyncio.sleep(seconds)
    return seconds


@wp.workflow(name="review_slow", version=1)
async def review_slow_wf(ctx: wp.AsyncContext, seconds: float) -> float:
    return await ctx.run(review_slow_step, seconds)


@wp.step
async def review_ticker_step(ticks: int) -> int:
    for _ in range(ticks):
        TICKS.append(time.monotonic())
        await asyncio.sleep(0.05)
    return ticks


@wp.workflow(name="review_ticker", version=1)
async def review_ticker_wf(ctx: wp.AsyncContext, ticks: int) -> int:
    return await ctx.run(review_ticker_step, ticks)


@pytest.mark.needs("server")
def test_a_run_whose_row_is_locked_does_not_freeze_every_run_on_the_loop(
    make_runtime: Callable[..., wp.Runtime], db_engine: object
) -> None:
    """A step runs past ``record_start_after``: the timer thread records its start, holding
    the attempt's ``_StartWatch._state`` and the drive's ``conn_lock`` through that write.
    If the write waits (a row lock held by another transaction, a pool with no connection
    left), the step's end calls ``watch.finish()`` and ``driver.defer()`` ON THE LOOP THREAD,
    which block on those locks: every other run on the loop stops until the write is done
    (here, 3 s of a ticker that ticks every 50 ms stalls)."""
    from sqlalchemy import Engine, text

    assert isinstance(db_engine, Engine)
    STEP_RUNNING.clear()
    TICKS.clear()
    rt = make_runtime(record_start_after=0.3)
    rt.register(review_slow_wf, review_ticker_wf)
    client = rt.client()
    ticker = client.start(review_ticker_wf, 120).execution_id  # about 6 s of ticks
    rt.start_worker(concurrency=10, poll_interval=0.05, event_loop=True)
    wait_until(lambda: len(TICKS) > 5, timeout=30, what="the ticker")
    victim = client.start(review_slow_wf, 0.8).execution_id
    assert STEP_RUNNING.wait(30)
    with db_engine.connect() as conn, conn.begin():
        # Another transaction holds the victim's row (a host's, a client's): the start
        # record of its step (at 0.3 s) waits for it; the step ends at 0.8 s.
        conn.execute(text("SELECT id FROM wf_executions WHERE id = :id FOR UPDATE"), {"id": victim})
        held_from = time.monotonic()
        time.sleep(3.0)
        held_to = time.monotonic()
        conn.rollback()
    assert client.result(victim, timeout=30).unwrap() == 0.8
    assert client.result(ticker, timeout=30).unwrap() == 120
    during = [t for t in TICKS if held_from - 0.2 <= t <= held_to + 0.5]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert gaps and max(gaps) < 1.0, f"the loop stalled {max(gaps):.2f}s"


BROKEN = threading.Event()


@wp.step
async def review_wait_for_break() -> None:
    BROKEN.wait(10)  # the test breaks the worker's user pool meanwhile


@wp.step
def review_sync_after(seconds: float) -> float:
    CALLS["sync_after"] += 1
    return seconds


@wp.workflow(name="review_breaks", version=1)
async def review_breaks_wf(ctx: wp.AsyncContext, seconds: float) -> float:
    await ctx.run(review_wait_for_break)
    return await ctx.run(review_sync_after, seconds)  # a synchronous step: on a user thread


def test_a_runtime_that_cannot_hand_work_to_a_thread_never_fails_the_run(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A pool that cannot take work any more (shut down at exit, no thread to be had)
    stops the drive like a database outage: the run is not failed with the pool's
    RuntimeError (nor is its step); another runtime finishes it."""
    BROKEN.clear()
    first = make_runtime(lease_ttl=1.0)
    first.register(review_breaks_wf)
    run = first.client().start(review_breaks_wf, 0.05).execution_id
    worker = first.start_worker(concurrency=4, poll_interval=0.05, event_loop=True)
    wait_until(lambda: worker._loop is not None, what="the worker's loop")
    loop = worker._loop
    assert loop is not None and loop.pools.user is not None
    loop.pools.user.shutdown(wait=False)  # fault injection: the user threads are gone
    BROKEN.set()
    time.sleep(1.0)
    assert first.client().status(run) != "failed"
    assert CALLS["sync_after"] == 0
    failures = [r for r in first.client().history(run) if r.event["type"] == "step.failed"]
    assert failures == []  # the runtime's failure is not the step's
    first.close()
    second = make_runtime(lease_ttl=1.0)
    second.register(review_breaks_wf)
    assert second.client().result(run, timeout=30).unwrap() == 0.05
    assert CALLS["sync_after"] == 1


# A synchronous step's last lease check (on its thread) is not the step's time ------------


@wp.step(timeout=0.5, retry=wp.Retry(attempts=1))
def review_quick_with_timeout() -> str:
    return "quick"


@wp.workflow(name="review_quick_timeout", version=1)
async def review_quick_timeout_wf(ctx: wp.AsyncContext) -> str:
    return await ctx.run(review_quick_with_timeout)


def test_a_slow_lease_check_on_the_steps_thread_is_not_its_timeout(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async worker checks a synchronous step's lease again on the thread that runs it
    (the step may have waited there for a free thread). That check may ask the database and
    wait (a row lock, a pooled connection): it must happen before the step's timeout
    starts, or a step that never began fails with ``StepTimeoutError`` (and its abandoned
    thread then runs it anyway)."""
    from wf_persist.driver import RunDriver

    check = RunDriver.check_lease

    def slow_off_the_loop(self: RunDriver) -> None:
        if threading.current_thread().name.startswith(("wf-persist-user", "wf-persist-step")):
            time.sleep(1.0)  # a database round trip waiting for a row lock
        check(self)

    monkeypatch.setattr(RunDriver, "check_lease", slow_off_the_loop)
    rt = make_runtime()
    rt.register(review_quick_timeout_wf)
    rt.start_worker(concurrency=4, poll_interval=0.05, event_loop=True)
    client = rt.client()
    execution_id = client.start(review_quick_timeout_wf).execution_id
    assert client.result(execution_id, timeout=20).unwrap() == "quick"
