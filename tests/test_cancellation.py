"""Durable cancellation (seed scenarios 24, 25, 58-60, 62)."""

from __future__ import annotations

import threading

import pytest

import wf_persist as wp

from .fixtures import saga as s
from .fixtures.workflows import Approval
from .helpers import Processes, drive_until_parked, wait_until

pytestmark = pytest.mark.usefixtures("saga_reset")


def _types(client: wp.WorkflowClient, execution_id: str) -> list[str]:
    return [r.event["type"] for r in client.history(execution_id)]


def _parked(client: wp.WorkflowClient) -> str:
    handle = client.start(s.reserve_then_wait_wf)
    drive_until_parked(client, handle.execution_id)
    return handle.execution_id


def test_cancel_a_suspended_run_compensates(rt: wp.Runtime) -> None:  # 24, 58
    client = rt.client()
    execution_id = _parked(client)
    client.cancel(execution_id, actor="ops")
    assert client.status(execution_id) == "compensating"
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.Cancelled)
    assert outcome.error["compensate"] is True and outcome.error["actor"] == "ops"
    assert s.CALLS["undo_first"] == 1
    assert s.LOG[0] == ("undo_first", ("reserved-1", 1, "Cancelled"))
    events = [r.event for r in client.history(execution_id)]
    cancelled = [e for e in events if e["type"] == "execution.cancelled"]
    assert cancelled == [
        {
            "type": "execution.cancelled",
            "executionId": execution_id,
            "compensate": True,
            "actor": "ops",
        }
    ]
    types = [e["type"] for e in events]
    assert types.count("cancellation.received") == 1
    assert "compensation.started" in types and "compensation.completed" in types
    info = client.describe(execution_id)
    assert info.status == "failed" and info.finished_at is not None


def test_cancel_without_compensation(rt: wp.Runtime) -> None:  # 24, 59
    client = rt.client()
    execution_id = _parked(client)
    client.cancel(execution_id, compensate=False)
    outcome = client.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert outcome.error["compensate"] is False
    info = client.describe(execution_id)
    assert info.status == "failed" and info.finished_at is not None
    types = _types(client, execution_id)
    assert "compensation.started" not in types and "cancellation.received" not in types
    assert s.CALLS["undo_first"] == 0


def test_two_concurrent_cancels_record_one(rt: wp.Runtime) -> None:  # 60
    client = rt.client()
    execution_id = _parked(client)
    barrier = threading.Barrier(2)
    results: list[str] = []

    def cancel(actor: str) -> None:
        barrier.wait()
        try:
            client.cancel(execution_id, actor=actor)
            results.append(f"ok:{actor}")
        except wp.CannotCancelError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=cancel, args=(a,)) for a in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.startswith("ok:") for r in results) == 1
    (loser,) = [r for r in results if not r.startswith("ok:")]
    assert loser == (
        f"Cannot cancel compensating execution {execution_id} (cancel it with "
        "compensate=False to end it at once)"
    )
    assert _types(client, execution_id).count("execution.cancelled") == 1


def test_a_compensating_run_no_worker_unwinds_is_ended_by_a_cancel_without_compensation(
    rt: wp.Runtime, db_url: str
) -> None:
    """A run whose version no worker serves any more (a release rolled back for good) and
    that was cancelled with compensation stayed ``compensating`` for good: nothing could
    unwind it, and every later cancel was refused. A cancel without compensation ends it
    at once, from any client, its compensations never run."""
    client = rt.client()
    execution_id = _parked(client)
    client.cancel(execution_id, actor="ops")  # nobody drives it here: it stays compensating
    assert client.status(execution_id) == "compensating"
    with wp.Client(db_url) as thin:  # a process without the workflow's code
        thin.cancel(execution_id, compensate=False, actor="ops-2")
        outcome = thin.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert outcome.error["compensate"] is False and outcome.error["actor"] == "ops-2"
    info = client.describe(execution_id)
    assert info.status == "failed" and info.finished_at is not None
    assert info.lease_owner is None and info.wake_at is None
    cancels = [
        (r.event["compensate"], r.event["actor"])
        for r in client.history(execution_id)
        if r.event["type"] == "execution.cancelled"
    ]
    assert cancels == [(True, "ops"), (False, "ops-2")]
    again = client.result(execution_id, timeout=5)  # the embedded client drives nothing now
    assert isinstance(again, wp.Failed) and again.error["compensate"] is False
    assert s.CALLS["undo_first"] == 0
    assert "compensation.started" not in _types(client, execution_id)
    for compensate in (True, False):
        with pytest.raises(wp.CannotCancelError, match=r"^Cannot cancel failed execution [^(]*$"):
            client.cancel(execution_id, compensate=compensate)


def test_a_cancel_without_compensation_stops_an_unwind_in_flight(rt: wp.Runtime) -> None:
    """A compensation stuck in flight (a remote system that never answers): the operator
    ends the run at once; the stuck compensation's late record is refused, and the older
    compensations never run."""
    client = rt.client()
    handle = client.start(s.stuck_undo_wf)
    drive_until_parked(client, handle.execution_id)
    client.cancel(handle.execution_id)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    wait_until(lambda: s.CALLS["stuck_undo"] == 1, what="the compensation is stuck")
    assert client.status(handle.execution_id) == "compensating"
    client.cancel(handle.execution_id, compensate=False)
    outcome = client.result(handle.execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error["compensate"] is False
    s.GATE.set()
    wait_until(lambda: handle.execution_id not in rt._driving, what="the stuck drive ends")
    types = _types(client, handle.execution_id)
    assert "compensation.completed" not in types and "workflow.failed" not in types
    assert s.CALLS["undo_first"] == 0, "the older compensation never runs"
    assert client.status(handle.execution_id) == "failed"


@wp.workflow(name="cancel-tree-child", version=1)
def _tree_child(ctx: wp.Context) -> str:
    ctx.run(s.reserve, 5)
    ctx.wait_for_signal("approval", Approval)
    return "child"


@wp.workflow(name="cancel-tree-parent", version=1)
def _tree_parent(ctx: wp.Context) -> str:
    return ctx.run_child(_tree_child, None)


def test_a_trees_cancel_without_compensation_leaves_a_childs_own_unwind_to_run(
    rt: wp.Runtime,
) -> None:
    """An operator cancelled a child with compensation (its refunds wanted); its parent's
    cancel without compensation then reaches the tree: the child's unwind runs its course
    (ending it at once needs a cancel of the child itself)."""
    rt.register(_tree_parent, _tree_child)
    client = rt.client()
    parent = client.start(_tree_parent).execution_id
    drive_until_parked(client, parent)
    (child,) = [
        r.event["childExecutionId"]
        for r in client.history(parent)
        if r.event["type"] == "child.started"
    ]
    drive_until_parked(client, child)
    client.cancel(child, actor="ops-child")
    client.cancel(parent, compensate=False, actor="ops-parent")
    assert client.status(parent) == "failed" and client.status(child) == "compensating"
    rt.start_worker(concurrency=2, poll_interval=0.05)
    outcome = client.result(child, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error["compensate"] is True
    assert outcome.error["actor"] == "ops-child"
    assert s.CALLS["undo_first"] == 1


def test_cancelling_a_finished_run_raises(rt: wp.Runtime) -> None:  # 62
    client = rt.client()
    handle = client.start(s.flaky_wf)
    assert client.result(handle.execution_id).unwrap() == 3
    with pytest.raises(wp.CannotCancelError, match="Cannot cancel completed execution"):
        client.cancel(handle.execution_id)
    assert client.result(handle.execution_id).unwrap() == 3
    assert "execution.cancelled" not in _types(client, handle.execution_id)
    with pytest.raises(wp.UnknownExecutionError):
        client.cancel("no-such-run")


def test_cancel_a_running_run_at_its_next_step_boundary(rt: wp.Runtime) -> None:
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    handle = client.start(s.gated_wf)
    wait_until(lambda: s.CALLS["gated:g"] == 1)
    client.cancel(handle.execution_id, actor="ops")
    s.GATE.set()
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert s.CALLS["after_gate"] == 0, "no step starts after the boundary"
    completed = [
        r.event["activityName"]
        for r in client.history(handle.execution_id)
        if r.event["type"] == "step.completed"
    ]
    assert completed == ["reserve#1", "gated#1"], "the step in flight finished and was recorded"
    assert s.CALLS["undo_first"] == 1


def test_hard_cancel_of_a_stuck_step(rt: wp.Runtime) -> None:  # 25
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    handle = client.start(s.gated_wf)
    wait_until(lambda: s.CALLS["gated:g"] == 1)
    client.cancel(handle.execution_id, compensate=False)
    outcome = client.result(handle.execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "Cancelled" and outcome.error["compensate"] is False
    s.GATE.set()
    # The stuck step returns, its write is refused and its drive ends.
    wait_until(lambda: ("gated-end", "g") in s.LOG, what="the stuck step returns")
    wait_until(lambda: handle.execution_id not in rt._driving, what="the stuck drive ends")
    assert s.CALLS["after_gate"] == 0
    types = _types(client, handle.execution_id)
    assert types.count("step.completed") == 1, "the stuck step's late result is refused"
    assert "compensation.started" not in types
    assert client.status(handle.execution_id) == "failed"


def test_cancel_from_another_process(rt: wp.Runtime, db_url: str, procs: Processes) -> None:
    client = rt.client()
    execution_id = _parked(client)
    assert procs.run_proc(db_url, "cancel", execution_id, "compensate") == "ok"
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error["actor"] == "remote-ops"
    assert s.CALLS["undo_first"] == 1
    assert procs.run_proc(db_url, "cancel", execution_id, "compensate") == "CannotCancelError"
