"""Timeouts: a step attempt's ``timeout``, and its definition checks."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import wf_persist as wp
from wf_persist.replaycheck import check_replay

from .helpers import history_types, wait_until

#: Attempts begun per step, and attempts whose function returned (late or not).
BEGUN: dict[str, int] = {}
RETURNED: dict[str, int] = {}
LOCK = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    BEGUN.clear()
    RETURNED.clear()


def _begin(name: str) -> int:
    with LOCK:
        BEGUN[name] = BEGUN.get(name, 0) + 1
        return BEGUN[name]


def _returned(name: str) -> None:
    with LOCK:
        RETURNED[name] = RETURNED.get(name, 0) + 1


@wp.step(timeout=0.3, retry=wp.Retry(attempts=2))
def hangs(seconds: float) -> str:
    _begin("hangs")
    time.sleep(seconds)
    _returned("hangs")
    return "late"


@wp.workflow(name="timeouts_hangs", version=1)
def hangs_wf(ctx: wp.Context, seconds: float) -> str:
    return ctx.run(hangs, seconds)


@wp.step(timeout=dt.timedelta(milliseconds=300), retry=wp.Retry(attempts=3))
def slow_then_fast() -> int:
    attempt = _begin("slow_then_fast")
    if attempt == 1:
        time.sleep(1.0)
    _returned("slow_then_fast")
    return attempt


@wp.workflow(name="timeouts_slow_then_fast", version=1)
def slow_then_fast_wf(ctx: wp.Context) -> int:
    return ctx.run(slow_then_fast)


@wp.step(timeout=0.2, retry=wp.Retry(attempts=5), errors=(wp.StepTimeoutError,))
def terminal_timeout() -> str:
    _begin("terminal_timeout")
    time.sleep(0.6)
    return "late"


@wp.workflow(name="timeouts_terminal", version=1)
def terminal_timeout_wf(ctx: wp.Context) -> str:
    try:
        return ctx.run(terminal_timeout)
    except wp.StepTimeoutError as exc:
        ctx.sleep(0.05)  # parks: the next drive replays the recorded timeout
        return f"caught {exc.step_name} after {exc.timeout:g}s"


class Boom(Exception):
    pass


@wp.step(timeout=5)
def raises_fast() -> None:
    raise Boom("raised within the timeout")


@wp.workflow(name="timeouts_raises", version=1)
def raises_wf(ctx: wp.Context) -> None:
    ctx.run(raises_fast)


ALL: tuple[wp.Workflow[Any, Any], ...] = (
    hangs_wf,
    slow_then_fast_wf,
    terminal_timeout_wf,
    raises_wf,
)


def test_an_attempt_past_its_timeout_fails_and_its_late_result_is_never_recorded(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*ALL)
    client = runtime.client()
    began = time.monotonic()
    handle = client.start(hangs_wf, 1.5)
    outcome = client.result(handle.execution_id, timeout=30)
    took = time.monotonic() - began
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["name"] == "StepExecutionError"
    assert "did not finish within its timeout of 0.3s" in outcome.error["message"]
    assert took < 1.4, f"two attempts of 0.3 s took {took:.2f}s"
    assert BEGUN["hangs"] == 2
    # The abandoned attempts end later; nothing they return is written.
    wait_until(lambda: RETURNED.get("hangs") == 2, what="the abandoned attempts", timeout=10)
    types = history_types(client, handle.execution_id)
    assert types.count("step.failed") == 2 and "step.completed" not in types
    failures = [
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.failed"
    ]
    assert [f["error"]["name"] for f in failures] == ["StepTimeoutError"] * 2
    assert [f.get("final", True) for f in failures] == [False, True]


def test_a_timed_out_attempt_is_retried_and_a_later_one_can_succeed(runtime: wp.Runtime) -> None:
    runtime.register(*ALL)
    client = runtime.client()
    handle = client.start(slow_then_fast_wf)
    assert client.result(handle.execution_id, timeout=30).unwrap() == 2
    wait_until(lambda: RETURNED.get("slow_then_fast") == 2, what="the first attempt's end")
    completed = [
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.completed"
    ]
    assert len(completed) == 1 and completed[0]["result"] == 2


def test_a_declared_timeout_is_terminal_and_raised_as_itself_also_on_replay(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*ALL)
    client = runtime.client()
    handle = client.start(terminal_timeout_wf)
    outcome = client.result(handle.execution_id, timeout=30).unwrap()
    assert outcome == "caught terminal_timeout after 0.2s"
    assert BEGUN["terminal_timeout"] == 1


def test_an_error_raised_within_the_timeout_is_the_steps_own(runtime: wp.Runtime) -> None:
    runtime.register(*ALL)
    client = runtime.client()
    outcome = client.result(client.start(raises_wf).execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed)
    assert "raised within the timeout" in outcome.error["message"]


@pytest.mark.parametrize(
    "bad", [0, -1, float("nan"), float("inf"), True, "1", dt.timedelta(seconds=-1), 1e12]
)
def test_a_step_timeout_that_is_not_a_positive_duration_is_refused(bad: Any) -> None:
    # One wording for every kind of bad value (NaN and -1 said "non-negative", 0 "positive").
    wanted = "timeout of step never must be a positive duration, got "
    if bad in (1e12, float("inf")):
        wanted = "timeout of step never must be finite and at most "
    with pytest.raises(wp.WorkflowDefinitionError, match=f"^{wanted}"):

        @wp.step(timeout=bad)
        def never() -> None:
            return None


# a run's deadline ---------------------------------------------------------------------------

UNDONE: list[str] = []


def _undo(result: str, label: str) -> None:
    UNDONE.append(label)


@wp.step(compensate=_undo)
def book(label: str) -> str:
    return f"booked {label}"


@wp.workflow(name="timeouts_sleepy", version=1, timeout=0.6)
def sleepy_wf(ctx: wp.Context, label: str) -> str:
    ctx.run(book, label)
    ctx.sleep(60)
    return "woke"


@wp.workflow(name="timeouts_waits", version=1)
def waits_wf(ctx: wp.Context, label: str) -> str:
    ctx.run(book, label)
    got = ctx.wait_for_signal("go", bool)
    return f"signalled {got}"


@wp.workflow(name="timeouts_quick", version=1, timeout=30)
def quick_wf(ctx: wp.Context, label: str) -> str:
    return ctx.run(book, label)


DEADLINED: tuple[wp.Workflow[Any, Any], ...] = (sleepy_wf, waits_wf, quick_wf)


def _timed_out(client: wp.WorkflowClient | wp.Client, execution_id: str) -> None:
    outcome = client.result(execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed), outcome
    assert outcome.error["name"] == "WorkflowTimeoutError"
    assert "timed out: its deadline" in outcome.error["message"]
    types = [r.event["type"] for r in client.history(execution_id)]
    assert types.count("workflow.timed_out") == 1
    assert types.index("workflow.timed_out") < types.index("compensation.started")
    assert types[-1] == "workflow.failed"


@pytest.fixture
def _undone() -> None:
    UNDONE.clear()


@pytest.mark.usefixtures("_undone")
def test_a_parked_run_is_woken_at_its_workflows_deadline_and_fails_compensated(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*DEADLINED)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    client = runtime.client()
    began = time.monotonic()
    handle = client.start(sleepy_wf, "room")
    info = client.describe(handle.execution_id)
    assert info.deadline_at is not None
    assert info.deadline_at - info.created_at == dt.timedelta(seconds=0.6)
    _timed_out(client, handle.execution_id)
    assert 0.55 <= time.monotonic() - began < 5, "woken at the deadline, not the 60 s timer"
    assert UNDONE == ["room"]
    (report,) = check_replay(runtime, [handle.execution_id])
    assert report.divergence is None, "the recorded timeout replays as it happened"


@pytest.mark.usefixtures("_undone")
def test_a_start_timeout_bounds_a_signal_wait_of_a_workflow_without_one(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*DEADLINED)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    with wp.Client(db_url) as thin:
        handle = thin.start("timeouts_waits", "car", timeout=dt.timedelta(milliseconds=500))
        assert thin.describe(handle.execution_id).deadline_at is not None
        _timed_out(thin, handle.execution_id)
    assert UNDONE == ["car"]


@pytest.mark.usefixtures("_undone")
def test_a_thin_start_gets_its_workflows_timeout_from_the_code_that_drives_it(
    runtime: wp.Runtime, db_url: str
) -> None:
    """A thin client does not know ``@workflow(timeout=...)``: the run's first drive applies
    it from the run's creation, and stores the deadline for SQL readers."""
    runtime.register(*DEADLINED)
    with wp.Client(db_url) as thin:
        handle = thin.start("timeouts_sleepy", "tent")
        info = thin.describe(handle.execution_id)
        assert info.deadline_at is None
        runtime.start_worker(concurrency=1, poll_interval=0.05)
        _timed_out(thin, handle.execution_id)
        after = thin.describe(handle.execution_id)
        assert after.deadline_at == info.created_at + dt.timedelta(seconds=0.6)
    assert UNDONE == ["tent"]


@pytest.mark.usefixtures("_undone")
def test_a_run_finishing_before_its_deadline_is_untouched(runtime: wp.Runtime) -> None:
    runtime.register(*DEADLINED)
    client = runtime.client()
    handle = client.start(quick_wf, "desk")
    assert client.result(handle.execution_id, timeout=30).unwrap() == "booked desk"
    assert "workflow.timed_out" not in history_types(client, handle.execution_id)


@pytest.mark.usefixtures("_undone")
def test_a_deadline_that_passed_while_no_process_was_alive_is_enforced_by_the_next_worker(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """The run parks on a signal wait; its runtime closes; the deadline passes with no
    process alive; a worker started later finds the run due and times it out."""
    first = make_runtime()
    first.register(*DEADLINED)
    handle = first.client().start(waits_wf, "boat", timeout=0.8)
    first.drive(handle.execution_id)
    info = first.client().describe(handle.execution_id)
    assert info.status == "suspended" and info.wake_at == info.deadline_at
    first.close()
    time.sleep(1.0)
    later = make_runtime()
    later.register(*DEADLINED)
    later.start_worker(concurrency=1, poll_interval=0.05)
    _timed_out(later.client(), handle.execution_id)
    assert UNDONE == ["boat"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), True, "5", 1e12])
def test_a_start_timeout_that_is_not_a_positive_duration_writes_nothing(
    runtime: wp.Runtime, bad: Any
) -> None:
    runtime.register(*DEADLINED)
    client = runtime.client()
    with pytest.raises(wp.InvalidArgumentError, match="timeout"):
        client.start(quick_wf, "x", timeout=bad)
    assert client.list().items == []


@pytest.mark.parametrize("bad", [0, -2.5, float("inf"), False])
def test_a_workflow_timeout_that_is_not_a_positive_duration_is_refused(bad: Any) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="workflow timeout"):

        @wp.workflow(name="never", timeout=bad)
        def never(ctx: wp.Context) -> None:
            return None
