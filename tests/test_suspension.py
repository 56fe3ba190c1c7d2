"""Durable sleep and typed signals (seed scenarios 13-16, 19-20, 26, 31, 34-38, 61)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

import wf_persist as wp

from .fixtures import workflows as w
from .helpers import Processes, drive_until_parked


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    w.CALLS.clear()
    yield


@pytest.fixture
def rt(runtime: wp.Runtime) -> wp.Runtime:
    runtime.register(*w.ALL)
    return runtime


def _park(client: wp.WorkflowClient, execution_id: str, timeout: float = 10) -> None:
    """Drive the run until it waits for a signal."""
    deadline = time.monotonic() + timeout
    while not client.pending_signals(execution_id):
        assert time.monotonic() < deadline, "run never reached its signal wait"
        with contextlib.suppress(wp.ResultTimeoutError):
            client.result(execution_id, timeout=0.05)


def _types(client: wp.WorkflowClient, execution_id: str) -> Counter[str]:
    return Counter(r.event["type"] for r in client.history(execution_id))


def test_sleep_suspends_then_completes(rt: wp.Runtime) -> None:  # scenario 26
    client = rt.client()
    handle = client.start(w.napper_wf, 0.3)
    drive_until_parked(client, handle.execution_id)
    began = time.monotonic()
    assert client.result(handle.execution_id, timeout=5).unwrap() == "ok"
    assert time.monotonic() - began < 2
    page = client.list(w.napper_wf, status="completed", limit=1)
    assert [i.execution_id for i in page.items] == [handle.execution_id]
    events = [r.event for r in client.history(handle.execution_id)]
    started = next(e for e in events if e["type"] == "sleep.started")
    assert started["activityName"] == "sleep:0.3s#1" and started["duration"] == 0.3
    assert _types(client, handle.execution_id)["sleep.completed"] == 1


def test_sleep_survives_a_restart_of_every_process(make_runtime: object) -> None:
    first = make_runtime()  # type: ignore[operator]
    first.register(w.napper_wf)
    handle = first.client().start(w.napper_wf, 0.2)
    with pytest.raises(wp.ResultTimeoutError):
        first.client().result(handle.execution_id, timeout=0.05)
    first.close()
    second = make_runtime()  # type: ignore[operator]
    second.register(w.napper_wf)
    assert second.client().result(handle.execution_id, timeout=5).unwrap() == "ok"


def test_invalid_durations_are_rejected(rt: wp.Runtime) -> None:
    @wp.workflow(name="bad-sleep", version=1)
    def bad_sleep(ctx: wp.Context) -> None:
        ctx.sleep(-1)

    rt.register(bad_sleep)
    client = rt.client()
    outcome = client.result(client.start(bad_sleep).execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "InvalidArgumentError"


def test_signal_flow_with_actors(rt: wp.Runtime) -> None:  # scenarios 31, 19
    client = rt.client()
    handle = client.start(w.approval_wf, None, actor="tester")
    _park(client, handle.execution_id)
    assert client.status(handle.execution_id) == "suspended"
    (pending,) = client.pending_signals(handle.execution_id)
    assert (pending.name, pending.invocation, pending.activity_name) == (
        "approval",
        1,
        "approval#1",
    )
    assert pending.timeout is None
    assert pending.payload_schema is not None
    assert pending.payload_schema["type"] == "object"
    assert pending.payload_schema["required"] == ["approved"]
    assert pending.payload_schema["properties"]["approved"]["type"] == "boolean"
    client.signal(handle.execution_id, "approval", {"approved": True}, actor="manager")
    assert client.result(handle.execution_id, timeout=5).unwrap() == "approved"
    assert client.pending_signals(handle.execution_id) == []
    events = [r.event for r in client.history(handle.execution_id)]
    assert events[0]["type"] == "execution.started" and events[0]["actor"] == "tester"
    delivered = next(e for e in events if e["type"] == "signal.delivered")
    assert delivered["actor"] == "manager" and delivered["payload"] == {"approved": True}
    received = next(e for e in events if e["type"] == "signal.received")
    assert received["payload"] == {"approved": True}
    with pytest.raises(wp.SignalNotWaitingError, match="is not waiting for signal approval"):
        client.signal(handle.execution_id, "approval", {"approved": True})


def test_invalid_signal_payload_keeps_the_run_waiting(rt: wp.Runtime) -> None:  # 16, 36
    client = rt.client()
    handle = client.start(w.approval_wf, None)
    _park(client, handle.execution_id)
    before = len(client.history(handle.execution_id))
    for bad in ({"approved": "yes"}, {}, "nope", {"approved": object()}):
        with pytest.raises(wp.SignalPayloadError) as info:
            client.signal(handle.execution_id, "approval", bad)
        assert "Signal payload failed schema validation" in str(info.value)
    assert info.type is wp.SignalPayloadError
    assert len(client.history(handle.execution_id)) == before
    assert client.status(handle.execution_id) == "suspended"
    client.signal(handle.execution_id, "approval", w.Approval(approved=False))
    began = time.monotonic()
    assert client.result(handle.execution_id, timeout=5).unwrap() == "rejected"
    assert time.monotonic() - began < 5


def test_signal_validates_from_the_recorded_json_schema(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(w.untyped_wait_wf)
    _park(client, handle.execution_id)
    (pending,) = client.pending_signals(handle.execution_id)
    assert pending.payload_schema == {"additionalProperties": {"type": "integer"}, "type": "object"}
    with pytest.raises(wp.SignalPayloadError) as info:
        client.signal(handle.execution_id, "numbers", {"a": "one"})
    assert info.value.errors[0]["loc"] == ("a",)
    client.signal(handle.execution_id, "numbers", {"a": 1})
    assert client.result(handle.execution_id, timeout=5).unwrap() == {"a": 1}


def test_signal_validated_and_delivered_by_another_process(
    rt: wp.Runtime, db_url: str, procs: Processes
) -> None:
    client = rt.client()
    handle = client.start(w.approval_wf, None)
    _park(client, handle.execution_id)
    signal = ("signal", handle.execution_id, "approval")
    assert procs.run_proc(db_url, *signal, '{"approved": "yes"}') == "SignalPayloadError"
    assert client.status(handle.execution_id) == "suspended"
    assert procs.run_proc(db_url, *signal, '{"approved": true}') == "ok"
    assert client.result(handle.execution_id, timeout=5).unwrap() == "approved"


def test_signal_when_nobody_waits_raises_and_records_nothing(rt: wp.Runtime) -> None:  # 14
    client = rt.client()
    handle = client.start(w.two_approvals_wf)
    with pytest.raises(wp.SignalNotWaitingError):
        client.signal(handle.execution_id, "approval", {"approved": True})
    assert len(client.history(handle.execution_id)) == 1
    with pytest.raises(wp.UnknownExecutionError):
        client.signal("nope", "approval", {"approved": True})
    with pytest.raises(wp.UnknownExecutionError):
        client.pending_signals("nope")
    _park(client, handle.execution_id)
    with pytest.raises(wp.SignalNotWaitingError):
        client.signal(handle.execution_id, "other-name", {"approved": True})


def test_repeated_waits_count_invocations(rt: wp.Runtime) -> None:  # scenario 20
    client = rt.client()
    handle = client.start(w.two_approvals_wf)
    _park(client, handle.execution_id)
    assert [p.invocation for p in client.pending_signals(handle.execution_id)] == [1]
    client.signal(handle.execution_id, "approval", {"approved": True})
    _park(client, handle.execution_id)
    (second,) = client.pending_signals(handle.execution_id)
    assert (second.invocation, second.activity_name) == (2, "approval#2")
    client.signal(handle.execution_id, "approval", {"approved": False})
    assert client.result(handle.execution_id, timeout=5).unwrap() == [True, False]


def test_concurrent_deliveries_exactly_one_wins(rt: wp.Runtime) -> None:  # scenario 21
    """Of N concurrent deliveries to one wait, one wins and every other one is told, with
    the documented error, that the wait already got its signal (on every backend)."""
    client = rt.client()
    handle = client.start(w.approval_wf, None)
    _park(client, handle.execution_id)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def deliver() -> None:
        barrier.wait()
        try:
            client.signal(handle.execution_id, "approval", {"approved": True})
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=deliver) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["SignalAlreadyDeliveredError"] * 7 + ["ok"]
    assert client.result(handle.execution_id, timeout=5).unwrap() == "approved"
    assert _types(client, handle.execution_id)["signal.delivered"] == 1


def test_timed_wait_times_out_as_a_value(rt: wp.Runtime) -> None:  # scenarios 34, 37
    client = rt.client()
    quick = client.start(w.approval_wf, 0.001)
    assert client.result(quick.execution_id, timeout=5).unwrap() == "timeout"
    assert client.pending_signals(quick.execution_id) == []
    began = time.monotonic()
    slow = client.start(w.approval_wf, 0.3)
    assert client.result(slow.execution_id, timeout=5).unwrap() == "timeout"
    assert 0.3 <= time.monotonic() - began < 5
    timeout_event = next(
        r.event for r in client.history(slow.execution_id) if r.event["type"] == "signal.timeout"
    )
    assert timeout_event["activityName"] == "approval#1" and timeout_event["timeout"] == 0.3


def test_early_signal_beats_a_long_timeout(rt: wp.Runtime) -> None:  # scenario 61
    client = rt.client()
    handle = client.start(w.approval_wf, 30)
    _park(client, handle.execution_id)
    client.signal(handle.execution_id, "approval", {"approved": True})
    began = time.monotonic()
    assert client.result(handle.execution_id, timeout=5).unwrap() == "approved"
    assert time.monotonic() - began < 5


def test_timeout_into_a_typed_failure(rt: wp.Runtime) -> None:  # scenario 13 (saga in #4)
    client = rt.client()
    ok = client.start(w.hitl_wf, 30)
    _park(client, ok.execution_id)
    client.signal(ok.execution_id, "approval", {"approved": True})
    assert client.result(ok.execution_id, timeout=5).unwrap() == "approved"
    late = client.start(w.hitl_wf, 0.05)
    outcome = client.result(late.execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "Rejected" and outcome.error["reason"] == "no approval in time"


def test_reminder_loop_counts_invocations(rt: wp.Runtime) -> None:  # scenario 15
    client = rt.client()
    handle = client.start(w.reminders_wf, 0.05)
    deadline = time.monotonic() + 10
    while True:
        pending = client.pending_signals(handle.execution_id)
        if pending and pending[-1].invocation == 4:
            break
        assert time.monotonic() < deadline
        with contextlib.suppress(wp.ResultTimeoutError):
            client.result(handle.execution_id, timeout=0.01)
    client.signal(handle.execution_id, "approval", {"approved": True})
    assert client.result(handle.execution_id, timeout=5).unwrap() == 3
    names = [
        r.event["activityName"]
        for r in client.history(handle.execution_id)
        if r.event["type"] == "step.completed"
    ]
    assert names == ["send_reminder#1", "send_reminder#2", "send_reminder#3"]
    assert _types(client, handle.execution_id)["signal.timeout"] == 3
    assert w.CALLS["send_reminder"] == 3


def test_resume_from_a_second_runtime_records_each_event_once(make_runtime: object) -> None:
    first = make_runtime()  # type: ignore[operator]
    first.register(w.approval_wf)
    c1 = first.client()
    handle = c1.start(w.approval_wf, None)
    _park(c1, handle.execution_id)
    first.close()
    second = make_runtime()  # type: ignore[operator]  # scenarios 35, 38
    second.register(w.approval_wf)
    c2 = second.client()
    c2.signal(handle.execution_id, "approval", {"approved": True})
    assert c2.result(handle.execution_id, timeout=5).unwrap() == "approved"
    types = _types(c2, handle.execution_id)
    for kind in (
        "workflow.started",
        "step.started",
        "step.completed",
        "sleep.started",
        "sleep.completed",
        "signal.waiting",
        "signal.received",
        "workflow.completed",
    ):
        assert types[kind] == 1, kind
    assert w.CALLS["reserve_budget"] == 1
