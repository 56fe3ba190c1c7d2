"""The replay engine: memoized steps, recorded values, determinism, typed boundaries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, func, select

import wf_persist as wp
from wf_persist.models import executions_table, history_table

from .fixtures import workflows as w


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    w.CALLS.clear()
    w.CONTROL.update(crash_after_first=False, diverge=False)
    yield
    w.CONTROL.update(crash_after_first=False, diverge=False)


def _types(client: wp.WorkflowClient, execution_id: str) -> list[str]:
    return [r.event["type"] for r in client.history(execution_id)]


def _count_rows(url: str, table: object) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]
    finally:
        engine.dispose()


def test_steps_are_named_per_invocation_and_results_returned(runtime: wp.Runtime) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    handle = client.start(w.echo_wf, 5)
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Completed)
    assert outcome.value == [1, 2, 3, 4, 5]
    completed = [
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.completed"
    ]
    assert [e["activityName"] for e in completed] == [f"echo#{i}" for i in range(1, 6)]
    assert [e["invocation"] for e in completed] == [1, 2, 3, 4, 5]
    assert completed[0]["stepName"] == "echo" and completed[0]["attempt"] == 1
    assert completed[0]["executionId"] == handle.execution_id
    started = [
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.started"
    ]
    assert started[2]["input"] == {"value": 3}
    assert _types(client, handle.execution_id)[:2] == ["execution.started", "workflow.started"]
    assert _types(client, handle.execution_id)[-1] == "workflow.completed"
    assert client.status(handle.execution_id) == "completed"
    seqs = [r.sequence for r in client.history(handle.execution_id)]
    assert seqs == list(range(1, len(seqs) + 1))


def test_typed_input_and_output_roundtrip(runtime: wp.Runtime) -> None:
    runtime.register(w.order_wf)
    client = runtime.client()
    handle = client.start(w.order_wf, w.Order(order_id="o-1", amount=7), actor="tester")
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Completed)
    assert isinstance(outcome.value, w.Receipt)
    assert outcome.value.payment_id == "pay-o-1-7"
    assert outcome.value.charged_at.tzinfo is not None
    first = client.history(handle.execution_id)[0].event
    assert first == {
        "type": "execution.started",
        "executionId": handle.execution_id,
        "workflowName": "order",
        "version": 1,
        "payload": {"order_id": "o-1", "amount": 7},
        "actor": "tester",
    }
    # A dict payload validates into the same model.
    again = client.start(w.order_wf, {"order_id": "o-2", "amount": "3"})
    assert client.result(again.execution_id).unwrap().payment_id == "pay-o-2-3"


def test_invalid_payload_raises_and_writes_nothing(runtime: wp.Runtime, db_url: str) -> None:
    runtime.register(w.order_wf)
    client = runtime.client()
    with pytest.raises(wp.InvalidPayloadError) as info:
        client.start(w.order_wf, {"order_id": "", "amount": -1})
    assert {tuple(e["loc"]) for e in info.value.errors} == {("order_id",), ("amount",)}
    assert "order_id" in str(info.value) and "amount" in str(info.value)
    with pytest.raises(wp.InvalidPayloadError):
        client.start(w.order_wf, "not an order")
    assert _count_rows(db_url, executions_table) == 0
    assert _count_rows(db_url, history_table) == 0
    assert client.list(w.order_wf).items == []


def test_recorded_values_replay_identically_after_a_crash(runtime: wp.Runtime) -> None:
    runtime.register(w.determinism_wf)
    client = runtime.client()
    handle = client.start(w.determinism_wf)
    w.CONTROL["crash_after_first"] = True
    with pytest.raises(w.SimulatedCrash):
        client.result(handle.execution_id)
    recorded = {
        r.event["type"]: r.event["value"]
        for r in client.history(handle.execution_id)
        if r.event["type"].endswith(".recorded")
    }
    assert set(recorded) == {"now.recorded", "random.recorded", "uuid.recorded"}
    w.CONTROL["crash_after_first"] = False
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Completed)
    assert outcome.value["roll"] == recorded["random.recorded"]
    assert outcome.value["id"] == recorded["uuid.recorded"]
    assert outcome.value["when"] == recorded["now.recorded"]
    assert w.CALLS["first"] == 1, "a completed step must not run again on replay"
    types = _types(client, handle.execution_id)
    assert types.count("workflow.started") == 1
    assert types.count("step.completed") == 1
    assert types.count("now.recorded") == 1


def test_divergent_replay_fails_and_never_runs_the_mismatched_step(runtime: wp.Runtime) -> None:
    runtime.register(w.determinism_wf)
    client = runtime.client()
    handle = client.start(w.determinism_wf)
    w.CONTROL["crash_after_first"] = True
    with pytest.raises(w.SimulatedCrash):
        client.result(handle.execution_id)
    w.CONTROL.update(crash_after_first=False, diverge=True)
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "NonDeterminismError"
    assert outcome.error["expected"] == "step:first#1"
    assert outcome.error["actual"] == "step:second#1"
    assert "expected step:first#1 but saw step:second#1" in outcome.message
    assert w.CALLS["second"] == 0
    assert w.CALLS["first"] == 1
    assert client.status(handle.execution_id) == "failed"
    with pytest.raises(wp.WorkflowFailedError):
        outcome.unwrap()


def test_step_failure_fails_the_run_with_a_typed_error(runtime: wp.Runtime) -> None:
    runtime.register(w.explode_wf)
    client = runtime.client()
    handle = client.start(w.explode_wf, "boom")
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "StepExecutionError"
    assert outcome.error["step_name"] == "explode"
    assert outcome.error["cause"]["name"] == "RuntimeError"
    assert outcome.error["cause"]["message"] == "boom"
    events = [r.event for r in client.history(handle.execution_id)]
    failed = [e for e in events if e["type"] == "step.failed"]
    assert (
        len(failed) == 1 and failed[0]["attempt"] == 1 and failed[0]["error"]["message"] == "boom"
    )
    assert events[-1]["type"] == "workflow.failed"
    info = client.describe(handle.execution_id)
    assert info.status == "failed" and info.finished_at is not None


def test_non_serializable_step_result_is_a_clear_error(runtime: wp.Runtime) -> None:
    runtime.register(w.bad_result_wf)
    client = runtime.client()
    outcome = client.result(client.start(w.bad_result_wf).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["cause"]["name"] == "NotSerializableError"
    assert "result of step bad_result is not JSON-serializable" in outcome.error["cause"]["message"]


def test_invalid_workflow_output_fails_the_run(runtime: wp.Runtime) -> None:
    runtime.register(w.bad_output_wf)
    client = runtime.client()
    outcome = client.result(client.start(w.bad_output_wf).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "InvalidPayloadError"
    assert "output of workflow bad-output" in outcome.message


def test_invalid_step_arguments_fail_the_run_before_the_step_runs(runtime: wp.Runtime) -> None:
    @wp.workflow(name="bad-args", version=1)
    def bad_args(ctx: wp.Context) -> int:
        return ctx.run(w.echo, "not-an-int")

    runtime.register(bad_args)
    client = runtime.client()
    outcome = client.result(client.start(bad_args).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "InvalidPayloadError"
    assert w.CALLS["echo"] == 0
    assert "step.started" not in _types(client, outcome.execution_id)
