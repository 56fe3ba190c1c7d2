"""``async def`` workflows and steps: the same history as plain ones, replays, timeouts,
crashes, children."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import pytest

import wf_persist as wp
from wf_persist.replaycheck import check_replay

from .fixtures import asyncwf as a
from .fixtures import workflows as w
from .helpers import Processes, wait_status, wait_until


@pytest.fixture(autouse=True)
def _reset() -> None:
    a.CALLS.clear()
    a.CANCELLED.clear()


def _shape(client: wp.WorkflowClient, execution_id: str) -> list[tuple[str, str | None]]:
    return [(r.event["type"], r.event.get("activityName")) for r in client.history(execution_id)]


def _drive_to_end(runtime: wp.Runtime, execution_id: str) -> wp.Outcome:
    client = runtime.client()
    wait_status(client, execution_id, "suspended")
    wait_until(lambda: bool(client.pending_signals(execution_id)), what="the signal wait")
    client.signal(execution_id, "go", True)
    return client.result(execution_id, timeout=30)


def test_an_async_workflow_records_the_same_history_as_a_plain_one(runtime: wp.Runtime) -> None:
    runtime.register(*a.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)
    client = runtime.client()
    run = client.start(a.tour_wf, 2).execution_id
    plain = client.start(a.sync_tour_wf, 2).execution_id
    out = _drive_to_end(runtime, run).unwrap()
    assert out == {"a": 20, "b": 21, "both": ["x", "y"], "answer": 42, "go": True}
    assert _drive_to_end(runtime, plain).unwrap()["b"] == 21
    shape, expected = _shape(client, run), _shape(client, plain)
    rename = {"fetch#1": "plain_add#1", "plain_add#1": "plain_add#2", "slow_twice#1":
              "plain_add#3", "slow_twice#2": "plain_add#4"}  # fmt: skip
    renamed = [(t, rename.get(n or "", n)) for t, n in shape]
    assert Counter(renamed) == Counter(expected)  # ctx.all branches record as they finish
    branches = {"plain_add#3", "plain_add#4"}
    assert [e for e in renamed if e[1] not in branches] == [
        e for e in expected if e[1] not in branches
    ]
    # Replays (after the sleep and the signal) ran no recorded step again.
    assert a.CALLS["fetch"] == 1 and a.CALLS["slow:x"] == 1 and a.CALLS["slow:y"] == 1
    for report in check_replay(runtime, [run, plain]):
        assert report.divergence is None


def test_ctx_all_runs_async_branches_at_once(runtime: wp.Runtime) -> None:
    """Two 0.2 s async branches take about 0.2 s, not 0.4 s: they share the body's loop."""
    runtime.register(*a.ALL)
    client = runtime.client()
    run = client.start(a.tour_wf, 1).execution_id
    with pytest.raises(wp.ResultTimeoutError):
        client.result(run, timeout=3)  # drives it here, up to its signal wait
    block = [r for r in client.history(run) if r.event["type"] in ("all.started", "all.completed")]
    took = (block[1].created_at - block[0].created_at).total_seconds()
    assert took < 0.38, f"the branches took {took:.2f}s"


def test_an_async_step_from_a_plain_workflow_is_refused_and_never_run(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*a.ALL)
    client = runtime.client()
    run = client.start(a.sync_calls_async_wf).execution_id
    outcome = client.result(run, timeout=30)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["name"] == "WorkflowDefinitionError"
    assert "is async and the workflow is not" in outcome.error["message"]
    assert a.CALLS["fetch"] == 0
    assert "step.started" not in {t for t, _ in _shape(client, run)}


def test_an_async_step_past_its_timeout_is_cancelled_and_retried(runtime: wp.Runtime) -> None:
    runtime.register(*a.ALL)
    client = runtime.client()
    run = client.start(a.timeout_wf).execution_id
    assert client.result(run, timeout=30).unwrap() == "failed: StepTimeoutError"
    assert a.CALLS["hangs_async"] == 2
    assert a.CANCELLED == ["hangs_async", "hangs_async"]


def test_an_async_step_that_ignores_its_cancellation_still_times_out(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*a.ALL)
    client = runtime.client()
    run = client.start(a.stubborn_wf).execution_id
    assert client.result(run, timeout=30).unwrap() == "failed: StepTimeoutError"
    assert "step.completed" not in {t for t, _ in _shape(client, run)}


def test_a_caller_inside_an_event_loop_can_drive_an_async_run(runtime: wp.Runtime) -> None:
    """The embedded ``result()`` drives the run in the calling thread; called from code
    running on an event loop, the body gets a loop of its own (in a thread of its own)."""
    runtime.register(*a.ALL)
    client = runtime.client()

    async def app() -> int:
        run = client.start(a.async_child_wf, 4).execution_id
        return int(client.result(run, timeout=30).unwrap())

    assert asyncio.run(app()) == 40


def test_async_parents_and_children(runtime: wp.Runtime) -> None:
    runtime.register(*a.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)
    client = runtime.client()
    run = client.start(a.async_parent_wf, 1).execution_id
    assert client.result(run, timeout=30).unwrap() == [10, 20]


def test_an_async_run_survives_sigkill_of_its_worker(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    runtime.register(*a.ALL)
    client = runtime.client()
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    run = client.start(a.crash_wf, a.Job(marks=str(marks), hang=str(hang))).execution_id
    first = procs.worker(db_url, lease_ttl=1.0)
    wait_until(lambda: "b-start" in w.marks(marks), what="the second step", timeout=30)
    first.stop(signal.SIGKILL)
    hang.unlink()
    second = procs.worker(db_url, lease_ttl=1.0)
    with wp.Client(db_url) as thin:  # never drives: the second worker does
        assert thin.result(run, timeout=60).unwrap() == "ab"
    second.wait_for_stderr("serving")
    assert second.stop(signal.SIGTERM) == 0
    assert Counter(w.marks(marks)) == Counter({"a": 1, "b-start": 2, "b": 1})
    completed = Counter(
        r.event["activityName"] for r in client.history(run) if r.event["type"] == "step.completed"
    )
    assert completed == Counter({"crash_a#1": 1, "crash_b#1": 1})
