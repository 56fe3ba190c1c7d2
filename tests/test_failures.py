"""Failure semantics: retries, typed errors, saga compensation, ctx.code, ctx.all
(seed scenarios 1, 5-7, 8-12, 39, 63-65)."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, select, update

import wf_persist as wp
from wf_persist.models import history_table as hist

from .fixtures import saga as s
from .fixtures.workflows import SimulatedCrash

pytestmark = pytest.mark.usefixtures("saga_reset")


def _events(
    client: wp.WorkflowClient, execution_id: str, kind: str | None = None
) -> list[dict[str, Any]]:
    events = [r.event for r in client.history(execution_id)]
    return [e for e in events if kind is None or e["type"] == kind]


def test_retry_policy_is_validated_at_definition() -> None:  # scenario 1
    with pytest.raises(wp.WorkflowDefinitionError):
        wp.Retry(attempts=0)
    with pytest.raises(wp.WorkflowDefinitionError):
        wp.Retry(backoff="linear")  # type: ignore[arg-type]
    with pytest.raises(wp.WorkflowDefinitionError):
        wp.Limit(0)
    policy = wp.Retry(attempts=5, backoff="exponential", base=0.1, factor=3, max_delay=0.5)
    assert [policy.delay(k, lambda: 0.0) for k in (1, 2, 3, 4)] == [
        0.0,
        0.1,
        0.30000000000000004,
        0.5,
    ]
    jittered = wp.Retry(attempts=3, backoff="exponential", base=1.0, jitter=True)
    assert 0.5 <= jittered.delay(2, lambda: 0.2) < 1.0


@pytest.mark.parametrize(
    "policy",
    [
        {"base": math.nan},
        {"base": math.inf},
        {"base": 1e30},
        {"base": True},
        {"base": "1"},
        {"base": None},
        {"base": 1j},
        {"base": -1},
        {"factor": math.inf},
        {"factor": math.nan},
        {"factor": 0.5},
        {"factor": 1e7},
        {"factor": "2"},
        {"max_delay": math.nan},
        {"max_delay": math.inf},
        {"max_delay": dt.timedelta(days=-1)},
        {"attempts": True},
        {"attempts": 2.0},
        {"jitter": "yes"},
        {"backoff": ["none"]},
    ],
    ids=repr,
)
def test_a_retry_policy_that_could_not_compute_its_delays_is_refused_at_definition(
    policy: dict[str, Any],
) -> None:
    """NaN, infinite or huge delays and factors, and values that are no numbers, were
    accepted: the first failure of the step then failed its run with a raw ValueError or
    OverflowError (its step.failed never recorded), or the run retried for ever."""
    kwargs: dict[str, Any] = {"attempts": 3, "backoff": "exponential", **policy}
    with pytest.raises(wp.WorkflowDefinitionError, match=r"retry|backoff"):
        wp.Retry(**kwargs)


def test_retry_delays_stay_within_their_cap_however_many_attempts() -> None:
    """A factor raised to a long run of failures overflowed the float (OverflowError)."""
    policy = wp.Retry(attempts=10**30, backoff="exponential", base=1)
    assert policy.base == 1.0 and policy.max_delay is None
    assert policy.delay(5000, lambda: 0.0) == 1000 * 365.25 * 86400  # 1000 years at most
    capped = wp.Retry(attempts=10**6, backoff="exponential", factor=1e6, max_delay=60)
    assert capped.delay(10**6 - 1, lambda: 0.0) == 60.0
    for limit in (0, 2**31, True, 2.0, "3"):
        with pytest.raises(wp.WorkflowDefinitionError, match="concurrency limit"):
            wp.Limit(limit)  # type: ignore[arg-type]
    with pytest.raises(wp.WorkflowDefinitionError, match="key"):
        wp.Limit(2, key="tenant")  # type: ignore[arg-type]
    policies: list[dict[str, Any]] = [
        {"retry": 3},
        {"concurrency": 5},
        {"errors": ValueError},
        {"errors": (ValueError, "KeyError")},
    ]
    for options in policies:
        with pytest.raises(wp.WorkflowDefinitionError, match=r"retry|concurrency|errors"):
            wp.step(**options)(_double)


def _double(n: int) -> int:
    return 2 * n


def test_exhausted_retries_fail_with_a_typed_error(rt: wp.Runtime) -> None:  # scenario 5
    client = rt.client()
    outcome = client.result(client.start(s.always_transient_wf).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "StepExecutionError"
    assert outcome.message == "Step transient failed: temporary"
    assert outcome.error["step_name"] == "transient"
    assert s.CALLS["transient"] == 3
    failed = _events(client, outcome.execution_id, "step.failed")
    assert [e["attempt"] for e in failed] == [1, 2, 3]
    assert [e["final"] for e in failed] == [False, False, True]
    assert len(_events(client, outcome.execution_id, "step.started")) == 3


def test_exponential_retry_succeeds_on_the_third_attempt(rt: wp.Runtime) -> None:  # 39
    client = rt.client()
    began = time.monotonic()
    handle = client.start(s.flaky_wf)
    assert client.result(handle.execution_id).unwrap() == 3
    assert time.monotonic() - began >= 0.03  # 10 ms then 20 ms of backoff
    failed = _events(client, handle.execution_id, "step.failed")
    assert len(failed) == 2 and [e["attempt"] for e in failed] == [1, 2]
    assert all("retryAt" in e for e in failed)
    completed = _events(client, handle.execution_id, "step.completed")
    assert completed[0]["attempt"] == 3


def test_long_backoff_parks_the_run_durably(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.slow_flaky_wf)
    deadline = time.monotonic() + 10
    while not s.CALLS["slow_flaky"] and time.monotonic() < deadline:  # a loaded machine
        with pytest.raises(wp.ResultTimeoutError):  # the first attempt fails, the retry waits
            client.result(handle.execution_id, timeout=0.3)
    info = client.describe(handle.execution_id)
    assert info.status == "running" and s.CALLS["slow_flaky"] == 1
    assert client.result(handle.execution_id, timeout=10).unwrap() == "second"
    assert s.CALLS["slow_flaky"] == 2


def test_terminal_error_is_not_retried_and_keeps_its_type(rt: wp.Runtime) -> None:  # 6
    client = rt.client()
    outcome = client.result(client.start(s.boom_wf, False).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert s.CALLS["boom"] == 1
    assert outcome.error_type == "Boom" and outcome.error["code"] == "x1"
    assert outcome.matches(s.Boom) and not outcome.matches(s.Rejected)
    failed = _events(client, outcome.execution_id, "step.failed")
    assert len(failed) == 1 and failed[0]["terminal"] is True


def test_recorded_terminal_error_is_raised_again_on_replay(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.boom_wf, True)
    s.CONTROL["crash_after_boom"] = True
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["crash_after_boom"] = False
    assert client.result(handle.execution_id).unwrap() == "caught Boom x2"
    assert s.CALLS["boom"] == 1


def test_typed_failure_unwinds_compensations_newest_first(rt: wp.Runtime) -> None:  # 7
    client = rt.client()
    outcome = client.result(client.start(s.saga_wf, 10).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.matches(s.Rejected) and outcome.error["reason"] == "not today"
    assert s.LOG == [
        ("undo_second", ("second-11", 11, "Rejected")),
        ("undo_first", ("first-10", 10, "Rejected")),
    ]
    types = [e["type"] for e in _events(client, outcome.execution_id)]
    assert types[-5:] == [
        "compensation.started",
        "compensation.completed",
        "compensation.started",
        "compensation.completed",
        "workflow.failed",
    ]
    started = _events(client, outcome.execution_id, "compensation.started")
    assert [e["stepName"] for e in started] == ["second_step", "first_step"]
    assert started[0]["result"] == "second-11" and started[0]["input"] == {"value": 11}
    assert started[0]["reason"]["name"] == "Rejected"
    assert outcome.compensation_errors == []


def test_failing_compensation_is_recorded_and_the_unwind_continues(rt: wp.Runtime) -> None:
    s.CONTROL["fail_second_comp"] = True
    client = rt.client()
    outcome = client.result(client.start(s.saga_wf, 1).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "Rejected", "the run's error stays the original failure"
    (comp_error,) = outcome.compensation_errors
    assert comp_error["stepName"] == "second_step"
    assert comp_error["error"]["message"] == "refund service down"
    assert s.CALLS["undo_first"] == 1, "the unwind continued"
    assert len(_events(client, outcome.execution_id, "compensation.failed")) == 1


def test_unwind_resumes_after_a_crash_without_repeating(rt: wp.Runtime) -> None:
    s.CONTROL["crash_in_compensation"] = True
    client = rt.client()
    handle = client.start(s.saga_wf, 5)
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    assert s.CALLS["undo_second"] == 1 and s.CALLS["undo_first"] == 1
    s.CONTROL["crash_in_compensation"] = False
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Rejected"
    assert s.CALLS["undo_second"] == 1, "a finished compensation never runs twice"
    assert s.CALLS["undo_first"] == 2, "the interrupted one runs again"
    assert s.CALLS["first_step"] == 1 and s.CALLS["second_step"] == 1
    completed = Counter(
        e["stepName"] for e in _events(client, handle.execution_id, "compensation.completed")
    )
    assert completed == Counter({"second_step": 1, "first_step": 1})


def test_code_blocks_run_once_and_fail_typed(rt: wp.Runtime) -> None:  # 10, 11, 12
    client = rt.client()
    handle = client.start(s.code_wf, False)
    s.CONTROL["crash_after_code"] = True
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["crash_after_code"] = False
    assert client.result(handle.execution_id).unwrap() == 42
    assert s.CALLS["compute"] == 1
    types = [e["type"] for e in _events(client, handle.execution_id)]
    assert types.count("code.started") == 1 and types.count("code.completed") == 1
    failing = client.result(client.start(s.code_wf, True).execution_id)
    assert isinstance(failing, wp.Failed)
    assert failing.error_type == "CodeExecutionError"
    assert failing.message == "Code block build-value failed: callback failed"


def test_code_replaced_by_a_step_is_non_deterministic(rt: wp.Runtime) -> None:  # 10
    client = rt.client()
    handle = client.start(s.code_then_step_wf)
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["mismatch"] = True
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert "expected code:build-value#1 but saw step:plain_step#1" in outcome.message
    assert s.CALLS["plain_step"] == 0


def test_all_returns_results_in_order_and_records_the_block(rt: wp.Runtime) -> None:  # 63
    client = rt.client()
    handle = client.start(s.parallel_wf, 4)
    assert client.result(handle.execution_id).unwrap() == [40, 5]
    events = _events(client, handle.execution_id)
    started = next(e for e in events if e["type"] == "all.started")
    assert (started["activityName"], started["branches"]) == ("parallel#1", 2)
    assert started["branchActivities"] == ["left#1", "right#1"]
    assert sorted(e["activityName"] for e in events if e["type"] == "step.completed") == [
        "left#1",
        "right#1",
    ]
    assert next(e for e in events if e["type"] == "all.completed")["branches"] == 2


def test_all_runs_branches_concurrently(rt: wp.Runtime) -> None:
    client = rt.client()
    assert client.result(client.start(s.meeting_wf).execution_id, timeout=30).unwrap() == ["a", "b"]


def test_all_replays_recorded_branches_and_checks_the_count(rt: wp.Runtime) -> None:  # 64
    client = rt.client()
    handle = client.start(s.parallel_wf, 2)
    s.CONTROL["crash_after_all"] = True
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["crash_after_all"] = False
    assert client.result(handle.execution_id).unwrap() == [20, 3]
    assert (s.CALLS["left"], s.CALLS["right"]) == (1, 1)
    diverging = client.start(s.parallel_wf, 2)
    s.CONTROL["crash_after_all"] = True
    with pytest.raises(SimulatedCrash):
        client.result(diverging.execution_id)
    s.CONTROL.update(crash_after_all=False, branches=1)
    outcome = client.result(diverging.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert (
        "expected all:parallel#1 branches=['left#1', 'right#1'] "
        "but saw all:parallel#1 branches=['left#1']"
    ) in outcome.message


def test_failing_branch_fails_the_block_and_compensates(rt: wp.Runtime) -> None:  # 65
    client = rt.client()
    outcome = client.result(client.start(s.parallel_fails_wf).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "StepExecutionError"
    assert outcome.error["step_name"] == "branch_fails"
    assert s.CALLS["undo_first"] == 1 and s.LOG[0][1][0] == "reserved-3"
    types = [e["type"] for e in _events(client, outcome.execution_id)]
    assert "all.failed" in types and "compensation.completed" in types


def test_non_determinism_unwinds_the_saga(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.diverging_saga_wf)
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["diverge"] = True
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert s.CALLS["plain_step"] == 0
    assert [name for name, _ in s.LOG] == ["undo_first"], "only registered steps are undone"


def test_corrupted_recorded_value_fails_decoding(rt: wp.Runtime, db_engine: Engine) -> None:  # 11
    client = rt.client()
    handle = client.start(s.code_wf, False)
    s.CONTROL["crash_after_code"] = True
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["crash_after_code"] = False
    with db_engine.begin() as conn:
        row = conn.execute(
            select(hist.c.sequence, hist.c.event).where(
                hist.c.execution_id == handle.execution_id, hist.c.type == "code.completed"
            )
        ).one()
        conn.execute(
            update(hist)
            .where(hist.c.execution_id == handle.execution_id, hist.c.sequence == row.sequence)
            .values(event={**row.event, "result": "not-a-number"})
        )
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "InvalidPayloadError"
    assert "recorded result of code block build-value" in outcome.message
    assert s.CALLS["compute"] == 1


class _GoBefore(BaseModel):
    ok: bool


class _GoAfter(BaseModel):
    ok: bool
    who: str  # a field the deployed code now requires


#: The type the deployed code waits with: the body's text (its source hash) stays the same.
_GO_TYPE: dict[str, type[BaseModel]] = {"type": _GoBefore}


@wp.workflow(name="go_typed", version=1)
def _go_typed_wf(ctx: wp.Context) -> bool:
    got = ctx.wait_for_signal("go", _GO_TYPE["type"])
    assert isinstance(got, wp.Received)
    return bool(getattr(got.value, "ok", False))


def test_a_delivered_value_that_no_longer_fits_is_refused_and_the_wait_goes_on(
    rt: wp.Runtime,
) -> None:
    """A run parked on a signal is resumed by code whose payload type gained a required
    field: the payload, delivered as the recorded wait allowed, failed the run with
    pydantic's raw ValidationError (later with ``InvalidPayloadError``). The wait now
    refuses it (``signal.rejected``, the errors with it) and waits on. (A sender judging by
    the type the wait recorded stores what that type reads: change a wait's type under a
    new version.)"""
    rt.register(_go_typed_wf)
    client = rt.client()
    run = client.start(_go_typed_wf).execution_id
    assert rt.drive(run)  # parked on the wait
    try:
        _GO_TYPE["type"] = _GoAfter
        assert client.signal(run, "go", {"ok": True}) == "delivered"
        assert rt.drive(run)
        assert client.status(run) == "suspended"
        [rejected] = [r.event for r in client.history(run) if r.event["type"] == "signal.rejected"]
        assert rejected["delivery"] is True and rejected["errors"][0]["loc"] == ["who"]
        assert [p.activity_name for p in client.pending_signals(run)] == ["go#1"]
    finally:
        _GO_TYPE["type"] = _GoBefore


BIG_ERROR_CALLS: list[int] = []


@wp.step
def _boom_big() -> str:
    BIG_ERROR_CALLS.append(1)
    raise RuntimeError("x" * 4_500_000)


@wp.workflow(name="big_error", version=1)
def big_error_wf(ctx: wp.Context) -> str:
    return ctx.run(_boom_big)


def test_a_step_error_with_a_huge_message_is_recorded_once(runtime: wp.Runtime) -> None:
    """Its document (message and args, nested again in the run's error) made the failure's
    write larger than MariaDB takes: the step ran again at every drive and the run failed
    with DriveFailedError. The document keeps the message's beginning."""
    from wf_persist.error_documents import MAX_MESSAGE

    BIG_ERROR_CALLS.clear()
    runtime.register(big_error_wf)
    outcome = runtime.client().execute(big_error_wf, None)
    assert outcome.status == "failed" and outcome.error_type == "StepExecutionError"
    assert BIG_ERROR_CALLS == [1]
    cause = outcome.error["cause"]
    assert cause["name"] == "RuntimeError"
    assert cause["message"].startswith("x" * MAX_MESSAGE + "... (4492000 more characters)")
    assert len(cause["message"]) < MAX_MESSAGE + 100


class _LongRejected(Exception):
    pass


SEEN_LENGTHS: list[int] = []


@wp.step(errors=(_LongRejected,))
def _reject_long() -> int:
    raise _LongRejected("x" * 9_000)


@wp.step
def _note_length(n: int) -> int:
    SEEN_LENGTHS.append(n)
    return n


@wp.workflow(name="long_rejection", version=1)
def long_rejection_wf(ctx: wp.Context) -> int:
    try:
        ctx.run(_reject_long)
    except _LongRejected as e:
        n = len(e.args[0])
    ctx.run(_note_length, n)
    ctx.sleep(0.2)  # parks: what follows runs in a replay
    return ctx.run(_note_length, n)


def test_a_declared_error_is_seen_as_a_replay_sees_it(runtime: wp.Runtime) -> None:
    """The first drive raised the step's own exception into the body, a replay one rebuilt
    from the record, whose long texts are cut: the body saw 9,000 characters, then 8,026,
    and its replay disagreed with what the first drive recorded."""
    SEEN_LENGTHS.clear()
    runtime.register(long_rejection_wf)
    runtime.start_worker(concurrency=1)
    run = runtime.client().start(long_rejection_wf).execution_id
    value = runtime.client().result(run, timeout=30).unwrap()
    assert [value, value] == SEEN_LENGTHS and value < 9_000
