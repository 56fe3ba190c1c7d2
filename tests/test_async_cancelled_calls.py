"""An ``async def`` body that cancels one of its own durable calls (``asyncio.wait_for``,
``asyncio.timeout``, ``task.cancel``) or ends while one is under way: a call that began
runs to its end and records in order; one cancelled before it began never runs. Either way
every later durable call is refused and the run fails with ``CancelledCallError`` at once,
so no replay can differ, unless the body raises an error of its own (a ``TaskGroup``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import wf_persist as wp
from wf_persist import async_context
from wf_persist.replaycheck import check_replay

CALLS: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    STARTED.clear()


@wp.step(name="cc_slow")
def slow() -> str:
    CALLS["slow"] += 1
    time.sleep(0.5)
    return "slow"


@wp.step(name="cc_slow_async")
async def slow_async() -> str:
    CALLS["slow_async"] += 1
    await asyncio.sleep(0.5)
    return "slow_async"


@wp.step(name="cc_quick")
def quick() -> str:
    CALLS["quick"] += 1
    return "quick"


@wp.workflow(name="cc_wait_for", version=1)
async def wait_for_wf(ctx: wp.AsyncContext, kind: str) -> str:
    step = slow_async if kind == "async" else slow
    try:
        return await asyncio.wait_for(ctx.run(step), 0.1)
    except TimeoutError:
        return await ctx.run(quick)  # refused: the run already failed


@wp.workflow(name="cc_timeout", version=1)
async def timeout_wf(ctx: wp.AsyncContext) -> str:
    try:
        async with asyncio.timeout(0.1):
            return await ctx.run(slow)
    except TimeoutError:
        return "gave up"


class TookTooLong(Exception):
    pass


@wp.workflow(name="cc_uncaught", version=1)
async def uncaught_wf(ctx: wp.AsyncContext) -> str:
    return await asyncio.wait_for(ctx.run(slow), 0.1)  # its TimeoutError is the cancel's


@wp.workflow(name="cc_own_error", version=1)
async def own_error_wf(ctx: wp.AsyncContext) -> str:
    try:
        return await asyncio.wait_for(ctx.run(slow), 0.1)
    except TimeoutError:
        raise TookTooLong from None  # made by the cancel: not a call's failure


@wp.workflow(name="cc_self_cancel", version=1)
async def self_cancel_wf(ctx: wp.AsyncContext, during_call: bool) -> str:
    me = asyncio.current_task()
    assert me is not None
    asyncio.get_running_loop().call_later(0.1, me.cancel)
    if during_call:
        return await ctx.run(slow)
    await asyncio.sleep(5)
    return "slept"


@wp.workflow(name="cc_task_cancel", version=1)
async def task_cancel_wf(ctx: wp.AsyncContext) -> str:
    task = asyncio.ensure_future(ctx.run(slow))
    await asyncio.sleep(0.1)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


@wp.workflow(name="cc_left_behind", version=1)
async def left_behind_wf(ctx: wp.AsyncContext) -> str:
    asyncio.ensure_future(ctx.run(slow))  # noqa: RUF006 (never awaited)
    await asyncio.sleep(0.1)
    return "early"


class Declined(Exception):
    pass


@wp.step(name="cc_declines", errors=(Declined,))
def declines() -> str:
    CALLS["declines"] += 1
    time.sleep(0.1)
    raise Declined("no")


@wp.workflow(name="cc_child", version=1)
async def child_wf(ctx: wp.AsyncContext) -> str:
    return await ctx.run(quick)


@wp.workflow(name="cc_parent", version=1)
async def parent_wf(ctx: wp.AsyncContext) -> str:
    handle = await ctx.start_child(child_wf)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ctx.run(slow), 0.1)
    return await ctx.child_result(handle)  # refused: no durable call after a cancel


STARTED = threading.Event()


@wp.step(name="cc_slow_flagged")
def slow_flagged() -> str:
    CALLS["slow_flagged"] += 1
    STARTED.set()
    time.sleep(0.6)
    return "slow"


@wp.workflow(name="cc_cancelled_meanwhile", version=1)
async def cancelled_meanwhile_wf(ctx: wp.AsyncContext) -> str:
    try:
        return await asyncio.wait_for(ctx.run(slow_flagged), 0.1)
    except TimeoutError:
        return "gave up"


async def _queue_behind_slow(
    ctx: wp.AsyncContext,
) -> tuple[asyncio.Future[str], asyncio.Future[str]]:
    first = asyncio.ensure_future(ctx.run(slow))
    await asyncio.sleep(0.05)  # ``first`` holds the turn
    second = asyncio.ensure_future(ctx.run(quick))
    await asyncio.sleep(0.05)
    second.cancel()  # still waiting for its turn: it never begins
    return first, second


@wp.workflow(name="cc_before_turn", version=1)
async def before_turn_wf(ctx: wp.AsyncContext) -> str:
    first, second = await _queue_behind_slow(ctx)
    with contextlib.suppress(asyncio.CancelledError):
        await second
    return await first  # goes on after the cancel: under replay ``second`` might begin


@wp.workflow(name="cc_before_turn_then_call", version=1)
async def before_turn_then_call_wf(ctx: wp.AsyncContext) -> str:
    first, second = await _queue_behind_slow(ctx)
    with contextlib.suppress(asyncio.CancelledError):
        await second
    await first
    return await ctx.run(quick)  # refused


@wp.workflow(name="cc_task_group", version=1)
async def task_group_wf(ctx: wp.AsyncContext) -> str:
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(ctx.run(declines))
            group.create_task(ctx.run(quick))  # waits for its turn, cancelled when declines fails
    except* Declined as failed:
        raise failed.exceptions[0] from None
    return "unreachable"


@wp.workflow(name="cc_left_queued", version=1)
async def left_queued_wf(ctx: wp.AsyncContext) -> str:
    first = asyncio.ensure_future(ctx.run(slow))
    await asyncio.sleep(0.05)
    asyncio.ensure_future(ctx.run(quick))  # noqa: RUF006 (never awaited, waits its turn)
    await asyncio.sleep(0)
    return await first


ALL = (
    wait_for_wf,
    timeout_wf,
    task_cancel_wf,
    left_behind_wf,
    before_turn_wf,
    before_turn_then_call_wf,
    task_group_wf,
    left_queued_wf,
    child_wf,
    parent_wf,
    cancelled_meanwhile_wf,
    uncaught_wf,
    own_error_wf,
    self_cancel_wf,
)


def _outcome(
    runtime: wp.Runtime, how: str, wf: wp.Workflow[Any, str], payload: object = None
) -> wp.Outcome:
    runtime.register(*ALL)
    if how == "loop":
        runtime.start_worker(concurrency=4, poll_interval=0.05, event_loop=True)
    client = runtime.client()
    run = client.start(wf, payload).execution_id
    return client.result(run, timeout=30)


def _events(client: wp.WorkflowClient, execution_id: str) -> list[tuple[str, str | None]]:
    return [(r.event["type"], r.event.get("activityName")) for r in client.history(execution_id)]


def _failed_with_cancelled_call(
    runtime: wp.Runtime, out: wp.Outcome, call: str, how: str, steps: list[str]
) -> None:
    """The run failed with CancelledCallError naming ``call``; ``steps`` ran and recorded
    (in order, each before the failure), and nothing else."""
    assert isinstance(out, wp.Failed), out
    assert out.error["name"] == "CancelledCallError", out.error
    assert out.error["call"] == f"ctx.run({call!r})"
    assert f"the workflow body {how}" in out.error["message"]
    client = runtime.client()
    recorded = [
        e
        for step in steps
        for e in [("step.started", f"{step}#1"), ("step.completed", f"{step}#1")]
    ]
    assert _events(client, out.execution_id)[2:] == [*recorded, ("workflow.failed", None)]
    (report,) = check_replay(runtime, [out.execution_id])
    assert report.divergence is not None and "CancelledCallError" in report.divergence


@pytest.mark.parametrize("how", ["caller", "loop"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_body_that_cancels_its_durable_call_fails_the_run_at_once(
    runtime: wp.Runtime, how: str, kind: str
) -> None:
    out = _outcome(runtime, how, wait_for_wf, kind)
    step = "cc_slow_async" if kind == "async" else "cc_slow"
    _failed_with_cancelled_call(runtime, out, step, "cancelled it while it ran", [step])
    assert Counter({"slow_async" if kind == "async" else "slow": 1}) == CALLS  # never quick


#: Workflow, the call it cancels, how, and the one step that ran.
CANCELS = {
    "timeout": (timeout_wf, "cc_slow", "cancelled it while it ran"),
    "task_cancel": (task_cancel_wf, "cc_slow", "cancelled it while it ran"),
    # An error the cancel made, or led the body to raise, hides nothing.
    "uncaught_timeout": (uncaught_wf, "cc_slow", "cancelled it while it ran"),
    "own_error_after": (own_error_wf, "cc_slow", "cancelled it while it ran"),
    # A call cancelled while waiting for its turn never ran, nor did a later one; the run
    # fails anyway once the body goes on, since under replay the call might begin.
    "before_turn_then_end": (before_turn_wf, "cc_quick", "cancelled it before it began"),
    "before_turn_then_call": (before_turn_then_call_wf, "cc_quick", "cancelled it before it began"),
}


@pytest.mark.parametrize("how", ["caller", "loop"])
@pytest.mark.parametrize("case", list(CANCELS))
def test_every_way_of_cancelling_a_call_fails_the_run(
    runtime: wp.Runtime, how: str, case: str
) -> None:
    wf, call, said = CANCELS[case]
    _failed_with_cancelled_call(runtime, _outcome(runtime, how, wf), call, said, ["cc_slow"])
    assert Counter({"slow": 1}) == CALLS


@pytest.mark.parametrize("how", ["caller", "loop"])
def test_a_body_that_ends_with_a_call_under_way_fails_the_run(
    runtime: wp.Runtime, how: str
) -> None:
    out = _outcome(runtime, how, left_behind_wf)
    _failed_with_cancelled_call(runtime, out, "cc_slow", "ended while it still ran", ["cc_slow"])
    assert Counter({"slow": 1}) == CALLS
    out = _outcome(runtime, how, left_queued_wf)
    assert out.unwrap() == "slow"  # the call it left waiting for its turn never began
    assert Counter({"slow": 2}) == CALLS
    (report,) = check_replay(runtime, [out.execution_id])
    assert report.divergence is None


@pytest.mark.parametrize("how", ["caller", "loop"])
def test_a_task_group_whose_call_fails_fails_the_run_with_that_error(
    runtime: wp.Runtime, how: str
) -> None:
    """The failing task cancels its sibling, waiting for its turn: the sibling never runs
    (the cancel lands before it begins), and the run fails with the step's error, which
    a replay check accepts."""
    for _ in range(3):  # the cancel used to land after the sibling had begun, mostly
        CALLS.clear()
        out = _outcome(runtime, how, task_group_wf)
        assert isinstance(out, wp.Failed) and out.error["name"] == "Declined", out
        assert Counter({"declines": 1}) == CALLS
        client = runtime.client()
        assert _events(client, out.execution_id)[2:] == [
            ("step.started", "cc_declines#1"),
            ("step.failed", "cc_declines#1"),
            ("workflow.failed", None),
        ]
        (report,) = check_replay(runtime, [out.execution_id])
        assert report.divergence is None


@pytest.mark.parametrize("how", ["caller", "loop"])
def test_no_durable_call_after_a_cancel_not_even_a_child_result(
    runtime: wp.Runtime, how: str
) -> None:
    """``child_result`` makes no new entry in the replay order: it parked the run, the
    failure was lost, and the next drive completed it on a path the first never took."""
    out = _outcome(runtime, how, parent_wf)
    assert isinstance(out, wp.Failed) and out.error["name"] == "CancelledCallError", out
    assert out.error["call"] == "ctx.run('cc_slow')"


@pytest.mark.parametrize("how", ["caller", "loop"])
@pytest.mark.parametrize("compensate", [True, False], ids=["compensate", "no_compensation"])
def test_a_cancellation_landing_while_the_cancelled_call_runs_wins(
    runtime: wp.Runtime, how: str, compensate: bool
) -> None:
    """``client.cancel`` lands while the body's cancelled call runs on: the run ends
    cancelled, not failed with CancelledCallError (with compensation the drive unwinds
    it: the call met the cancellation, and the body gets that, not a CancelledError)."""
    runtime.register(*ALL)
    if how == "loop":
        runtime.start_worker(concurrency=4, poll_interval=0.05, event_loop=True)
    client = runtime.client()
    run = client.start(cancelled_meanwhile_wf).execution_id
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.result, run, 30)
        assert STARTED.wait(20)
        client.cancel(run, compensate=compensate)
        out = waiting.result(timeout=40)
    assert isinstance(out, wp.Failed) and out.error["name"] == "Cancelled", out
    assert out.error["compensate"] is compensate
    assert Counter({"slow_flagged": 1}) == CALLS


@pytest.mark.parametrize("how", ["caller", "loop"])
def test_a_body_that_cancels_itself_fails_its_run_with_a_typed_error(
    runtime: wp.Runtime, how: str
) -> None:
    """Its own task cancelled (a CancelledError out of the body, in the main thread too):
    the run fails, CancelledCallError if a call was under way; nothing escapes raw from
    ``result()``."""
    out = _outcome(runtime, how, self_cancel_wf, True)
    _failed_with_cancelled_call(runtime, out, "cc_slow", "cancelled it while it ran", ["cc_slow"])
    out = _outcome(runtime, how, self_cancel_wf, False)
    assert isinstance(out, wp.Failed) and out.error["name"] == "CancelledError", out


def test_a_body_waiting_on_a_cancelled_call_says_so_in_the_log(
    runtime: wp.Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that waits for the body in turn would never end: the wait is logged."""
    monkeypatch.setattr(async_context, "SETTLE_NOTICE", 0.1)
    out = _outcome(runtime, "caller", timeout_wf)
    assert isinstance(out, wp.Failed) and out.error["name"] == "CancelledCallError"
    said = [r.getMessage() for r in caplog.records if "has not ended yet" in r.getMessage()]
    assert said and "ctx.run('cc_slow'): the workflow body cancelled it while it ran;" in said[0], (
        said
    )
