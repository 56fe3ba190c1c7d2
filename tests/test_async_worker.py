"""The async worker: runs of ``async def`` workflows driven on one event loop, through the
same claims, leases, fencing and history as the thread worker."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.replaycheck import check_replay

from .fixtures import asyncwf as a
from .fixtures import workflows as w
from .helpers import Processes, wait_status, wait_until


@pytest.fixture(autouse=True)
def _reset() -> None:
    a.CALLS.clear()
    a.CANCELLED.clear()


def _loop_threads() -> int:
    return sum(t.name.startswith("wf-persist-event-loop") for t in threading.enumerate())


def _shape(client: wp.WorkflowClient, execution_id: str) -> list[tuple[str, str | None]]:
    return [(r.event["type"], r.event.get("activityName")) for r in client.history(execution_id)]


def test_the_loop_records_the_history_the_thread_worker_records(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """The same run on the loop and on a thread: the same events, activity names and
    result; nothing recorded runs again; the replay check finds no divergence."""
    shapes = []
    for event_loop in (True, False):
        rt = make_runtime()
        rt.register(*a.ALL)
        run = rt.client().start(a.tour_wf, 2).execution_id
        rt.start_worker(concurrency=8, poll_interval=0.05, event_loop=event_loop)
        wanted = int(event_loop)
        wait_until(lambda: _loop_threads() == wanted, what="the worker's threads")  # noqa: B023
        with wp.Client(db_url) as thin:  # never drives: the worker does
            wait_until(lambda: thin.status(run) == "suspended", what="the park")  # noqa: B023
            wait_until(lambda: bool(thin.pending_signals(run)), what="the wait")  # noqa: B023
            thin.signal(run, "go", True)
            out = thin.result(run, timeout=30).unwrap()
        assert out == {"a": 20, "b": 21, "both": ["x", "y"], "answer": 42, "go": True}
        shapes.append(Counter(_shape(rt.client(), run)))
        for report in check_replay(rt, [run]):
            assert report.divergence is None
        rt.close()
    assert shapes[0] == shapes[1]
    # Each recorded step ran once on each worker (replays after the sleep and the signal).
    assert a.CALLS["fetch"] == 2 and a.CALLS["slow:x"] == 2 and a.CALLS["slow:y"] == 2


def test_hundreds_of_runs_awaiting_io_share_one_loop_and_a_few_threads(
    make_runtime: Callable[..., wp.Runtime], db_url: str
) -> None:
    """300 runs whose steps each await 0.2 s: all in flight at once on the loop (well under
    the 180 s they take one after another) with a bounded number of threads."""
    rt = make_runtime()
    rt.register(*a.ALL)
    client = rt.client()
    runs = [client.start(a.naps_wf, 0.2).execution_id for _ in range(300)]
    peak = [threading.active_count()]
    began = time.monotonic()
    rt.start_worker(concurrency=300, poll_interval=0.05, event_loop=True)

    def done() -> bool:
        peak[0] = max(peak[0], threading.active_count())
        with rt.backend.read() as conn:
            finished = conn.execute(
                select(func.count()).where(ex.c.status == "completed")
            ).scalar_one()
        return int(finished) == len(runs)

    wait_until(done, timeout=120, what="every run", every=0.05)
    took = time.monotonic() - began
    with wp.Client(db_url) as thin:
        assert all(thin.result(r, timeout=5).unwrap() == pytest.approx(0.6) for r in runs)
    assert took < 60, f"300 runs took {took:.1f}s"
    assert peak[0] < 60, f"{peak[0]} threads"  # a thread each would be 300 and more
    rt.close()


def test_what_a_run_on_the_loop_may_call(make_runtime: Callable[..., wp.Runtime]) -> None:
    """Saga compensation, a retried synchronous step (on a thread), a limited step, a
    synchronous step past its timeout, a code block, a signal wait and a failure, each on the
    loop; async steps past their timeout are cancelled; the runs share the loop."""
    rt = make_runtime()
    rt.register(*a.ALL)
    rt.start_worker(concurrency=50, poll_interval=0.05, event_loop=True)
    client = rt.client()
    good = client.start(a.mixed_wf, "g").execution_id
    bad = client.start(a.mixed_wf, "b").execution_id
    hung = client.start(a.timeout_wf).execution_id  # an async step past its timeout
    stubborn = client.start(a.stubborn_wf).execution_id
    for run in (good, bad):
        wait_status(client, run, "suspended")
    client.signal(good, "go", "ok")
    client.signal(bad, "go", "fail")
    assert client.result(good, timeout=30).unwrap() == {
        "item": "g",
        "flaky": "g",
        "limited": [1, 2],
        "timed": "StepTimeoutError",
        "code": 7,
        "said": "ok",
    }
    failed = client.result(bad, timeout=30)
    assert isinstance(failed, wp.Failed) and failed.error["message"] == "asked to fail"
    assert client.result(hung, timeout=30).unwrap() == "failed: StepTimeoutError"
    assert a.CANCELLED == ["hangs_async", "hangs_async"]  # cancelled, retried, cancelled
    assert client.result(stubborn, timeout=30).unwrap() == "failed: StepTimeoutError"
    assert a.CALLS["undo:b"] == 1 and a.CALLS["undo:g"] == 0  # compensated once, on failure
    assert a.CALLS["reserve:g"] == 1 and a.CALLS["flaky:g"] == 3 and a.CALLS["limited"] == 4
    rt.close()


def test_a_cancelled_run_on_the_loop_is_compensated(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(*a.ALL)
    rt.start_worker(concurrency=10, poll_interval=0.05, event_loop=True)
    client = rt.client()
    run = client.start(a.mixed_wf, "c").execution_id
    wait_until(lambda: bool(client.pending_signals(run)), what="the wait")
    client.cancel(run)
    outcome = client.result(run, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error["name"] == "Cancelled"
    assert a.CALLS["undo:c"] == 1
    rt.close()


def test_children_and_plain_workflows_on_an_async_worker(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Children are runs like any other (on the loop); a plain workflow's run still gets a
    thread of its own."""
    rt = make_runtime()
    rt.register(*a.ALL, *w.ALL)
    rt.start_worker(concurrency=10, poll_interval=0.05, event_loop=True)
    client = rt.client()
    parent = client.start(a.async_parent_wf, 1).execution_id
    plain = client.start(a.sync_tour_wf, 3).execution_id
    assert client.result(parent, timeout=30).unwrap() == [10, 20]
    wait_until(lambda: bool(client.pending_signals(plain)), what="the plain run's wait")
    client.signal(plain, "go", True)
    assert client.result(plain, timeout=30).unwrap()["b"] == 31
    rt.close()


@pytest.mark.parametrize("taker", ["--async", "--concurrency=30"])
def test_an_async_worker_killed_mid_step_loses_nothing(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes, taker: str
) -> None:
    """SIGKILL ``wf-persist worker --async`` inside the second step of a run (among 20 runs
    on its loop); another worker (async, or a thread worker) takes every run over: the
    recorded first steps never run again, the interrupted one runs again (at least once),
    every run completes."""
    runtime.register(*a.ALL)
    client = runtime.client()
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    run = client.start(a.crash_wf, a.Job(marks=str(marks), hang=str(hang))).execution_id
    others = [client.start(a.naps_wf, 0.05).execution_id for _ in range(20)]
    first = procs.worker(db_url, "--async", lease_ttl=1.0)
    first.wait_for_stderr("serving")
    assert "on an event loop" in " ".join(first.stderr().split())
    wait_until(lambda: "b-start" in w.marks(marks), what="the second step", timeout=30)
    first.stop(signal.SIGKILL)
    hang.unlink()
    second = procs.worker(db_url, taker, lease_ttl=1.0)
    with wp.Client(db_url) as thin:
        assert thin.result(run, timeout=60).unwrap() == "ab"
        for other in others:
            assert thin.result(other, timeout=60).unwrap() == pytest.approx(0.15)
    assert second.stop(signal.SIGTERM) == 0
    assert Counter(w.marks(marks)) == Counter({"a": 1, "b-start": 2, "b": 1})
    completed = Counter(
        r.event["activityName"] for r in client.history(run) if r.event["type"] == "step.completed"
    )
    assert completed == Counter({"crash_a#1": 1, "crash_b#1": 1})
    for other in others:
        steps = [r for r in client.history(other) if r.event["type"] == "step.completed"]
        assert [r.event["activityName"] for r in steps] == ["nap#1", "nap#2", "nap#3"]


def test_the_event_loop_worker_needs_a_positive_concurrency(runtime: wp.Runtime) -> None:
    with pytest.raises(wp.InvalidArgumentError):
        wp.Worker(runtime, concurrency=0, event_loop=True)
