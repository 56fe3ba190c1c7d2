"""Timeouts: a step attempt's ``timeout``, and its definition checks."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest

import wf_persist as wp

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
    with pytest.raises(wp.WorkflowDefinitionError, match="timeout of step"):

        @wp.step(timeout=bad)
        def never() -> None:
            return None
