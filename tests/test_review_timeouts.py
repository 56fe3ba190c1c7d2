"""Review of the timeout and wake-up changes: regressions for what the review found."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

import pytest

import wf_persist as wp
from wf_persist.testing import TestRuntime
from wf_persist.wakeups import Ends

from .helpers import history_types, wait_until

GATE = threading.Event()


@pytest.fixture(autouse=True)
def _open_gate() -> object:
    GATE.clear()
    yield None
    GATE.set()


@wp.step
def gated() -> str:
    GATE.wait(60)
    return "through"


@wp.workflow(name="review_gated", version=1)
def gated_wf(ctx: wp.Context) -> str:
    return ctx.run(gated)


# Ends: several callers waiting for one run ------------------------------------------------


def test_an_end_wakes_every_waiter_of_its_run_after_one_looked_again() -> None:
    """Two callers wait for one run. Its end is heard; the first caller wakes and marks its
    next look before the second one got the lock back: the second must still wake."""
    ends = Ends()
    ready = threading.Event()
    slept: list[float] = []

    def second() -> None:
        with ends.watching("r"):
            mark = ends.mark("r")
            ready.set()
            began = time.monotonic()
            ends.wait("r", mark, 5.0)
            slept.append(time.monotonic() - began)

    with ends.watching("r"):  # the first caller
        thread = threading.Thread(target=second)
        thread.start()
        assert ready.wait(5)
        time.sleep(0.2)  # the second caller is in its wait
        with ends._cond:  # the end is heard, and the first caller looks again at once
            ends.heard("r")
            ends.mark("r")
        thread.join(10)
    assert slept and slept[0] < 2.0, f"the second waiter slept {slept}"
    assert not ends._watched and not ends._ended


@pytest.mark.needs("notify")
def test_many_thin_callers_waiting_for_one_run_all_wake_at_its_end(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """Sixteen threads of a thin client (poll interval 30 s) wait for one run driven by a
    worker elsewhere: its announced end wakes every one of them, not only the first."""
    rt = make_runtime()
    rt.register(gated_wf)
    rt.start_worker(concurrency=2)
    with wp.Client(db_url, poll_interval=30) as client:
        handle = client.start("review_gated")
        wait_until(lambda: client.status(handle.execution_id) == "running", what="claimed")
        took: list[float] = []
        lock = threading.Lock()

        def wait() -> None:
            outcome = client.result(handle.execution_id, timeout=60)
            assert outcome.unwrap() == "through"
            with lock:
                took.append(time.monotonic() - opened)

        opened = time.monotonic() + 3600.0
        waiters = [threading.Thread(target=wait) for _ in range(16)]
        for t in waiters:
            t.start()
        time.sleep(1.5)  # every waiter is in its wait
        opened = time.monotonic()
        GATE.set()
        for t in waiters:
            t.join(60)
        assert len(took) == 16
        assert max(took) < 3.0, f"slowest waiter woke {max(took):.1f}s after the end"


# @step(timeout=...) ------------------------------------------------------------------------

CALLS: list[str] = []


@wp.step(timeout=dt.timedelta(days=365 * 400), retry=wp.Retry(attempts=2))
def patient() -> str:
    CALLS.append("patient")
    return "done"


@wp.workflow(name="review_patient", version=1)
def patient_wf(ctx: wp.Context) -> str:
    return ctx.run(patient)


def test_a_step_timeout_of_centuries_is_accepted_and_waited_for(runtime: wp.Runtime) -> None:
    """Every duration up to 1000 years is accepted; one beyond what a thread join takes
    (about 292 years) must not fail each attempt with OverflowError after running it."""
    CALLS.clear()
    runtime.register(patient_wf)
    client = runtime.client()
    outcome = client.result(client.start(patient_wf).execution_id, timeout=30)
    assert outcome.unwrap() == "done"
    assert CALLS == ["patient"]


# TestRuntime time skipping and deadlines ---------------------------------------------------


@wp.workflow(name="review_sleeper", version=1)
def sleeper_wf(ctx: wp.Context) -> str:
    ctx.sleep(60)
    return "slept"


@wp.workflow(name="review_sleeper_timed", version=1, timeout=3600)
def sleeper_timed_wf(ctx: wp.Context) -> str:
    ctx.sleep(60)
    return "slept"


def test_a_test_runtime_whose_clock_was_advanced_keeps_start_timeouts() -> None:
    """After the virtual clock moved on (advance, or a skipped sleep of an earlier run), a
    run started with an hour's timeout that sleeps a minute completes: its deadline is
    counted from the virtual now, not from the wall clock a day behind."""
    with TestRuntime(sleeper_wf, sleeper_timed_wf) as rt:
        rt.advance(dt.timedelta(days=1))
        client = rt.client()
        handle = client.start(sleeper_wf, timeout=3600)
        assert client.result(handle.execution_id, timeout=30).unwrap() == "slept"
        handle = client.start(sleeper_timed_wf)
        assert client.result(handle.execution_id, timeout=30).unwrap() == "slept"


# Inline retry pauses of ctx.all branches -------------------------------------------------

FLAKY: list[int] = []


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=30.0))
def flaky_branch() -> str:
    FLAKY.append(1)
    if len(FLAKY) == 1:
        raise RuntimeError("first attempt fails")
    return "ok"


@wp.workflow(name="review_all_deadline", version=1, timeout=1.5)
def all_deadline_wf(ctx: wp.Context) -> list[str]:
    return ctx.all([wp.call(flaky_branch)])


@wp.workflow(name="review_all_plain", version=1)
def all_plain_wf(ctx: wp.Context) -> list[str]:
    return ctx.all([wp.call(flaky_branch)])


def test_a_deadline_passing_during_a_branch_retry_pause_times_the_run_out(
    runtime: wp.Runtime,
) -> None:
    """A ctx.all branch waits out its 30 s retry backoff in its thread: the run's 1.5 s
    deadline ends that wait instead of passing unnoticed for half a minute."""
    FLAKY.clear()
    runtime.register(all_deadline_wf)
    client = runtime.client()
    began = time.monotonic()
    outcome = client.result(client.start(all_deadline_wf).execution_id, timeout=60)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["name"] == "WorkflowTimeoutError"
    assert time.monotonic() - began < 10.0
    assert FLAKY == [1], "the retry never ran"


def test_a_caller_driving_a_branch_retry_pause_hands_over_at_its_timeout(
    runtime: wp.Runtime,
) -> None:
    """result(timeout=1) drives a run whose ctx.all branch waits 30 s to retry: the caller
    hands the run over about when its timeout passes, and the run is left unleased."""
    FLAKY.clear()
    runtime.register(all_plain_wf)
    client = runtime.client()
    handle = client.start(all_plain_wf)
    began = time.monotonic()
    with pytest.raises(wp.ResultTimeoutError):
        client.result(handle.execution_id, timeout=1.0)
    assert time.monotonic() - began < 5.0
    info = client.describe(handle.execution_id)
    assert info.status == "running" and info.lease_owner is None


SLOW: list[int] = []


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=30.0))
def slow_branch(i: int) -> int:
    with LOCK:
        SLOW.append(i)
        first = SLOW.count(i) == 1
    if first:
        raise RuntimeError("first attempt fails")
    return i


LOCK = threading.Lock()


@wp.workflow(name="review_all_three", version=1, timeout=1.5)
def all_three_wf(ctx: wp.Context) -> list[int]:
    return ctx.all([wp.call(slow_branch, i) for i in range(3)])


def test_branches_seeing_the_deadline_together_record_one_timeout(runtime: wp.Runtime) -> None:
    """Three ctx.all branches find the deadline passed in their retry waits: the run's
    history says it timed out once, not once per branch."""
    SLOW.clear()
    runtime.register(all_three_wf)
    client = runtime.client()
    handle = client.start(all_three_wf)
    outcome = client.result(handle.execution_id, timeout=60)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["name"] == "WorkflowTimeoutError"
    assert history_types(client, handle.execution_id).count("workflow.timed_out") == 1


# @step(timeout=...) with a concurrency limit ---------------------------------------------

RUNNING = [0, 0]  # now, most at once


@wp.step(timeout=0.3, retry=wp.Retry(attempts=2), concurrency=wp.Limit(1))
def exclusive(seconds: float) -> str:
    with LOCK:
        RUNNING[0] += 1
        RUNNING[1] = max(RUNNING[1], RUNNING[0])
        first = RUNNING[1] == 1 and seconds > 0 and not SLOW
        SLOW.append(0)
    try:
        time.sleep(seconds if first else 0.0)
        return "done"
    finally:
        with LOCK:
            RUNNING[0] -= 1


@wp.workflow(name="review_exclusive", version=1)
def exclusive_wf(ctx: wp.Context, seconds: float) -> str:
    return ctx.run(exclusive, seconds)


def test_a_timed_out_attempt_keeps_its_concurrency_slot_until_it_really_ends(
    runtime: wp.Runtime,
) -> None:
    """Limit(1): the first attempt overruns its 0.3 s timeout by a second. Its thread runs
    on, so its slot stays taken until it ends: the retry waits for it rather than run
    beside it."""
    SLOW.clear()
    RUNNING[:] = [0, 0]
    runtime.register(exclusive_wf)
    client = runtime.client()
    outcome = client.result(client.start(exclusive_wf, 1.3).execution_id, timeout=60)
    assert outcome.unwrap() == "done"
    assert len(SLOW) == 2
    assert RUNNING[1] == 1, "two attempts of a Limit(1) step ran at once"
