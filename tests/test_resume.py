"""Resume across processes: a run whose process was killed is finished elsewhere by replay."""

from __future__ import annotations

import datetime as dt
import json
import signal
from collections import Counter
from pathlib import Path

import wf_persist as wp

from .fixtures import workflows as w
from .helpers import Processes, wait_for_mark


def test_killed_process_run_is_finished_by_another_process(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    starter = procs.proc(db_url, "start-three", str(marks), str(hang), stdout=True)
    assert starter.popen.stdout is not None
    execution_id = starter.popen.stdout.readline().strip()
    wait_for_mark(marks, "b-start")
    starter.stop(signal.SIGKILL)
    hang.unlink()

    client = runtime.client()
    assert client.status(execution_id) == "running"
    resumed = procs.run_proc(db_url, "result", execution_id)
    assert json.loads(resumed) == {"status": "completed", "value": "abc"}

    assert Counter(w.marks(marks)) == Counter({"a": 1, "b-start": 2, "b": 1, "c": 1})
    events = [r.event for r in client.history(execution_id)]
    completed = Counter(e["activityName"] for e in events if e["type"] == "step.completed")
    assert completed == Counter({"step_a#1": 1, "step_b#1": 1, "step_c#1": 1})
    types = Counter(e["type"] for e in events)
    assert types["workflow.started"] == 1
    assert types["workflow.completed"] == 1
    assert types["execution.started"] == 1
    info = client.describe(execution_id)
    assert info.status == "completed" and info.finished_at is not None


def test_expired_lease_of_a_dead_driver_is_taken_over(make_runtime: object, tmp_path: Path) -> None:
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    dead = make_runtime(lease_ttl=0.5)  # type: ignore[operator]
    dead.register(w.three_steps_wf)
    handle = dead.client().start(w.three_steps_wf, {"marks": str(marks), "hang_file": str(hang)})
    with dead.transaction() as conn:  # it claimed the run, then died without a word
        claim = dead.backend.claim(conn, handle.execution_id, dead.owner, 0.5)
    assert claim is not None
    expiry = claim.db_now + dt.timedelta(seconds=0.5)

    second = make_runtime(lease_ttl=5)  # type: ignore[operator]
    second.register(w.three_steps_wf)
    outcome = second.client().result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Completed) and outcome.value == "abc"
    assert w.marks(marks) == ["a", "b-start", "b", "c"]
    # The lease was honoured until it expired, by the database's clock (which event times
    # follow): the second driver recorded nothing before then, however slowly it started.
    first = next(r for r in second.client().history(handle.execution_id) if r.sequence > 2)
    assert first.created_at >= expiry, (first, expiry)
