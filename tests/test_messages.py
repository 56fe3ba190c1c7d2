"""Buffered signals (sent before the wait) and events published by a run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import wf_persist as wp

from .fixtures import messaging as m


@pytest.fixture(autouse=True)
def _gates() -> Iterator[None]:
    m.GATES.clear()
    yield
    for gate in m.GATES.values():
        gate.set()
    m.GATES.clear()


@pytest.fixture
def rt(runtime: wp.Runtime) -> wp.Runtime:
    runtime.register(*m.ALL)
    return runtime


def kinds(client: wp.WorkflowClient, execution_id: str) -> list[str]:
    return [r.event["type"] for r in client.history(execution_id)]


def events_of(client: wp.WorkflowClient, execution_id: str, kind: str) -> list[dict[str, Any]]:
    return [r.event for r in client.history(execution_id) if r.event["type"] == kind]


def test_signals_sent_before_the_wait_are_taken_in_order_without_suspending(
    rt: wp.Runtime,
) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 2})
    with pytest.raises(wp.SignalNotWaitingError):  # the default stays: nobody waits yet
        client.signal(handle.execution_id, "approval", {"approved": True})
    assert kinds(client, handle.execution_id) == ["execution.started"]
    first = client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
    second = client.signal(
        handle.execution_id, "approval", {"approved": False}, buffer=True, actor="kim"
    )
    assert (first, second) == ("buffered", "buffered")
    buffered = events_of(client, handle.execution_id, "signal.buffered")
    assert [(b["name"], b["payload"], b["actor"]) for b in buffered] == [
        ("approval", {"approved": True}, None),
        ("approval", {"approved": False}, "kim"),
    ]
    assert client.result(handle.execution_id, timeout=10).unwrap() == [True, False]
    assert "signal.waiting" not in kinds(client, handle.execution_id)  # never suspended
    received = events_of(client, handle.execution_id, "signal.received")
    assert [(r["activityName"], r["signalId"]) for r in received] == [
        ("approval#1", buffered[0]["signalId"]),
        ("approval#2", buffered[1]["signalId"]),
    ]


def test_a_buffered_signal_is_taken_once_across_replays(rt: wp.Runtime, make_runtime: Any) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 2})
    client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
    assert rt.drive(handle.execution_id)  # takes the first, parks on the second
    assert client.status(handle.execution_id) == "suspended"
    [waiting] = client.pending_signals(handle.execution_id)
    assert waiting.activity_name == "approval#2"
    # Now someone waits: a buffered send is delivered to that wait.
    assert client.signal(handle.execution_id, "approval", {"approved": False}, buffer=True) == (
        "delivered"
    )
    fresh = make_runtime()  # another process's replay from history
    fresh.register(*m.ALL)
    assert fresh.client().result(handle.execution_id, timeout=10).unwrap() == [True, False]
    assert len(events_of(client, handle.execution_id, "signal.received")) == 2
    assert kinds(client, handle.execution_id).count("signal.buffered") == 1


def test_a_buffered_payload_the_wait_rejects_is_recorded_and_the_wait_goes_on(
    rt: wp.Runtime,
) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 1})
    # No wait on "approval" was ever recorded: nothing to validate against yet.
    client.signal(handle.execution_id, "approval", {"approved": "yes"}, buffer=True)
    client.signal(handle.execution_id, "approval", {"approved": 1}, buffer=True)
    assert rt.drive(handle.execution_id)
    assert client.status(handle.execution_id) == "suspended"  # both rejected: it waits
    rejected = events_of(client, handle.execution_id, "signal.rejected")
    assert [r["activityName"] for r in rejected] == ["approval#1", "approval#1"]
    assert "approved" in str(rejected[0]["errors"])
    client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
    assert client.result(handle.execution_id, timeout=10).unwrap() == [True]


def test_a_buffered_payload_is_validated_at_once_by_an_earlier_wait_of_its_name(
    rt: wp.Runtime,
) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 2, "nap": 3600})
    client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
    assert rt.drive(handle.execution_id)  # took it (no wait recorded), now napping
    assert client.status(handle.execution_id) == "suspended"
    assert client.pending_signals(handle.execution_id) == []
    client.signal(
        handle.execution_id, "approval", {"approved": True}, buffer=False
    ) if False else None
    history_before = kinds(client, handle.execution_id)
    # approval#1 received a buffered signal without recording a wait, so its schema is not
    # known yet: still buffered, judged by the next wait.
    assert client.signal(handle.execution_id, "approval", {"approved": False}, buffer=True) == (
        "buffered"
    )
    assert kinds(client, handle.execution_id) == [*history_before, "signal.buffered"]


def test_a_payload_that_misfits_a_recorded_wait_is_refused_at_delivery(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 2, "nap": 3600})
    assert rt.drive(handle.execution_id)  # parks on approval#1 (its schema recorded)
    client.signal(handle.execution_id, "approval", {"approved": True})
    assert rt.drive(handle.execution_id)  # takes it, then naps
    assert client.pending_signals(handle.execution_id) == []
    before = kinds(client, handle.execution_id)
    with pytest.raises(wp.SignalPayloadError, match="approved"):
        client.signal(handle.execution_id, "approval", {"approved": "yes"}, buffer=True)
    assert kinds(client, handle.execution_id) == before  # nothing recorded
    assert client.signal(handle.execution_id, "approval", {"approved": False}, buffer=True) == (
        "buffered"
    )


def test_buffered_signals_to_a_finished_run_are_refused(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 0})
    client.result(handle.execution_id, timeout=10)
    with pytest.raises(wp.SignalNotWaitingError) as info:
        client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
    assert info.value.status == "completed"
    assert "(it is completed)" in str(info.value)
    assert "signal.buffered" not in kinds(client, handle.execution_id)
    with pytest.raises(wp.InvalidArgumentError, match="buffer must be True or False"):
        client.signal(handle.execution_id, "approval", {}, buffer="yes")  # type: ignore[arg-type]


def test_a_signal_buffered_while_the_run_is_in_a_step_is_taken_without_parking(
    rt: wp.Runtime,
) -> None:
    """The driver read the history before the signal landed: its next write sees the news
    and the wait replays from fresh history instead of parking past the signal."""
    m.GATES["step"] = threading.Event()
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 1, "gate": "step"})
    with ThreadPoolExecutor(1) as pool:
        driving = pool.submit(rt.drive, handle.execution_id)
        while "stage" not in client.events(handle.execution_id):
            threading.Event().wait(0.01)
        client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
        m.GATES["step"].set()
        assert driving.result(timeout=30)
    assert client.result(handle.execution_id, timeout=10).unwrap() == [True]
    assert "signal.waiting" not in kinds(client, handle.execution_id)


def test_concurrent_buffered_signals_are_all_kept_and_taken_in_history_order(
    rt: wp.Runtime,
) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 8})
    with ThreadPoolExecutor(8) as pool:
        sent = list(
            pool.map(
                lambda i: client.signal(
                    handle.execution_id, "approval", {"approved": i % 2 == 0}, buffer=True
                ),
                range(8),
            )
        )
    assert sent == ["buffered"] * 8
    order = [
        b["payload"]["approved"] for b in events_of(client, handle.execution_id, "signal.buffered")
    ]
    assert client.result(handle.execution_id, timeout=20).unwrap() == order


def test_events_are_published_durably_and_read_by_any_client(rt: wp.Runtime, db_url: str) -> None:
    client = rt.client()
    handle = client.start(m.inbox_wf, {"count": 2})
    with wp.Client(db_url, poll_interval=0.02) as thin:
        with pytest.raises(wp.EventNotSetError) as early:
            thin.get_event(handle.execution_id, "stage", timeout=0)
        assert early.value.finished is False and early.value.key == "stage"
        assert rt.drive(handle.execution_id)  # publishes "stage", parks on approval#1
        assert thin.get_event(handle.execution_id, "stage") == "started"
        rt.start_worker()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(thin.get_event, handle.execution_id, "received", timeout=20)
            client.signal(handle.execution_id, "approval", {"approved": True})
            assert waiting.result(timeout=30) == 1
        client.signal(handle.execution_id, "approval", {"approved": True}, buffer=True)
        assert thin.result(handle.execution_id, timeout=20).unwrap() == [True, True]
        assert thin.events(handle.execution_id) == {"stage": "done", "received": 2}
        with pytest.raises(wp.EventNotSetError) as never:
            thin.get_event(handle.execution_id, "nothing", timeout=5)
        assert never.value.finished is True  # at once: the run ended
    # Each set_event is recorded once, though the body was replayed after each wait.
    assert kinds(client, handle.execution_id).count("event.set") == 4


def test_get_event_finds_the_latest_value_of_a_key_set_recently_or_long_ago(
    rt: wp.Runtime,
) -> None:
    """A look reads the newest published events first; a key set before them (or never) is
    found in the whole history: the same answers either way."""
    client = rt.client()
    run = client.start(m.progress_wf, 30).execution_id
    client.result(run, timeout=30).unwrap()
    assert client.get_event(run, "late") is None  # among the newest, a null value
    assert client.get_event(run, "progress") == 29
    assert client.get_event(run, "progress#1") == -29
    assert client.get_event(run, "early") == "first"  # long before the newest 16
    with pytest.raises(wp.EventNotSetError) as never:
        client.get_event(run, "progres", timeout=0)
    assert never.value.finished is True
    assert client.events(run) == {
        "early": "first",
        "progress": 29,
        "progress#1": -29,
        "late": None,
    }


def test_bad_event_values_and_keys_fail_the_run_with_a_typed_error(rt: wp.Runtime) -> None:
    client = rt.client()
    for value in ("nan", "2**64"):
        outcome = client.result(client.start(m.publisher_wf, value).execution_id, timeout=10)
        assert isinstance(outcome, wp.Failed), outcome
    for key in ("", "x" * 201, 5):
        outcome = client.result(client.start(m.bad_event_key_wf, key).execution_id, timeout=10)
        assert isinstance(outcome, wp.Failed) and "event key" in outcome.message, outcome
    with pytest.raises(wp.InvalidArgumentError):
        client.get_event(client.start(m.publisher_wf, 1).execution_id, "")
    with pytest.raises(wp.InvalidArgumentError, match="timeout"):
        client.get_event(client.start(m.publisher_wf, 1).execution_id, "value", timeout=-1)
    with pytest.raises(wp.UnknownExecutionError):
        client.get_event("00000000-0000-4000-8000-00000000dead", "value", timeout=0)


def test_a_buffered_null_payload_is_taken_once_and_the_wait_does_not_park(
    rt: wp.Runtime,
) -> None:
    """``None`` is a payload like any other: the wait that takes it must not park as if
    nothing were buffered (which recorded a wait after its signal.received)."""
    client = rt.client()
    handle = client.start(m.pings_wf, 2)
    assert client.signal(handle.execution_id, "ping", None, buffer=True) == "buffered"
    assert client.signal(handle.execution_id, "ping", 0, buffer=True) == "buffered"
    assert client.result(handle.execution_id, timeout=5).unwrap() == [None, 0]
    assert "signal.waiting" not in kinds(client, handle.execution_id)
    assert len(events_of(client, handle.execution_id, "signal.received")) == 2


def test_a_buffered_signal_the_waits_type_refuses_is_rejected_not_failing_the_run(
    rt: wp.Runtime,
) -> None:
    """A wait on a type without a class (``list[datetime]``) is judged by more than its
    JSON Schema (which does not assert ``format``): a misfit is rejected, the run waits on."""
    client = rt.client()
    handle = client.start(m.dates_wf, None)
    client.signal(handle.execution_id, "dates", ["not a date"], buffer=True)
    client.signal(handle.execution_id, "dates", ["2026-01-02T03:04:05+00:00"], buffer=True)
    outcome = client.result(handle.execution_id, timeout=5)
    assert outcome.unwrap() == ["2026-01-02T03:04:05+00:00"]
    [rejected] = events_of(client, handle.execution_id, "signal.rejected")
    assert rejected["errors"]


def test_a_payload_too_deep_to_encode_is_a_signal_payload_error(rt: wp.Runtime) -> None:
    """Nested past what JSON encoding can recurse into: a typed error, nothing recorded."""
    client = rt.client()
    handle = client.start(m.pings_wf, 1)
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    before = kinds(client, handle.execution_id)
    with pytest.raises(wp.SignalPayloadError):
        client.signal(handle.execution_id, "ping", deep, buffer=True)
    assert rt.drive(handle.execution_id)  # now waiting: the delivery path checks it too
    parked = kinds(client, handle.execution_id)
    with pytest.raises(wp.SignalPayloadError):
        client.signal(handle.execution_id, "ping", deep)
    assert kinds(client, handle.execution_id) == parked and len(parked) > len(before)


def test_a_rejection_does_not_repeat_a_large_payload(rt: wp.Runtime) -> None:
    """A JSON Schema error message quotes the whole value: a rejection keeps a bounded
    message, or a few large misfits make the write that records them too large for
    MariaDB's packet (the run could never record its wait or take)."""
    client = rt.client()
    handle = client.start(m.dates_wf, None)
    client.signal(handle.execution_id, "dates", [["x" * 200_000]], buffer=True)
    client.signal(handle.execution_id, "dates", ["2026-01-02T03:04:05+00:00"], buffer=True)
    assert client.result(handle.execution_id, timeout=5).unwrap() == ["2026-01-02T03:04:05+00:00"]
    [rejected] = events_of(client, handle.execution_id, "signal.rejected")
    assert len(json.dumps(rejected)) < 5_000
