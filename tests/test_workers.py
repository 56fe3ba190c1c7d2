"""Workers: leases, claims, timers, crash recovery with real processes."""

from __future__ import annotations

import signal
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist

from .fixtures import workflows as w
from .helpers import Child, Processes, wait_for_mark, wait_status, wait_until


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    w.CALLS.clear()
    yield


def test_embedded_worker_runs_timers_and_signals(runtime: wp.Runtime) -> None:
    runtime.register(*w.ALL)
    worker = runtime.start_worker(concurrency=2, poll_interval=0.05)
    client = runtime.client()
    nap = client.start(w.napper_wf, 0.3)
    began = time.monotonic()
    wait = client.start(w.approval_wf, None)
    wait_status(client, nap.execution_id, "completed")
    # Never early; late only by the poll and the machine's load (2 cores shared by many).
    assert 0.3 <= time.monotonic() - began < 3.0, "a timer fires within a poll interval"
    wait_until(lambda: client.pending_signals(wait.execution_id), what="the signal wait")
    client.signal(wait.execution_id, "approval", {"approved": True})
    wait_status(client, wait.execution_id, "completed")
    assert client.result(wait.execution_id).unwrap() == "approved"
    worker.stop()


def test_invalid_worker_settings(runtime: wp.Runtime) -> None:
    with pytest.raises(wp.InvalidArgumentError):
        wp.Worker(runtime, concurrency=0)
    with pytest.raises(wp.InvalidArgumentError):
        wp.Worker(runtime, poll_interval=0)


def test_two_runtimes_never_claim_the_same_run(make_runtime: Callable[..., wp.Runtime]) -> None:
    a, b = make_runtime(), make_runtime()
    for rt in (a, b):
        rt.register(w.echo_wf)
    client = a.client()
    ids = {client.start(w.echo_wf, 2).execution_id for _ in range(40)}
    claimed: dict[str, list[str]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def claim(name: str, rt: wp.Runtime) -> None:
        barrier.wait()
        # SKIP LOCKED may hand out fewer than asked while the other claims: go on until
        # every run was handed out (or long past it, on a loaded machine).
        deadline = time.monotonic() + 30
        rounds = 0
        while rounds < 30 or (
            len(claimed["a"]) + len(claimed["b"]) < len(ids) and time.monotonic() < deadline
        ):
            claimed[name] += [c.execution_id for c in rt.claim_due(3)]
            rounds += 1

    threads = [threading.Thread(target=claim, args=(n, r)) for n, r in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(claimed["a"]) & set(claimed["b"])
    assert set(claimed["a"]) | set(claimed["b"]) == ids


def test_worker_process_serves_the_cli_app(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    runtime.register(*w.ALL)
    client = runtime.client()
    handles = [client.start(w.echo_wf, 3) for _ in range(5)]
    worker = procs.worker(db_url)
    for handle in handles:
        wait_status(client, handle.execution_id, "completed")
    assert worker.stop(signal.SIGTERM) == 0
    assert "stopping (SIGTERM)" in worker.stderr()
    assert {client.result(h.execution_id).unwrap() == [1, 2, 3] for h in handles} == {True}
    assert w.CALLS["echo"] == 0, "the steps ran in the worker process"


def test_killed_worker_is_recovered_by_another(
    runtime: wp.Runtime, db_url: str, db_engine: Engine, tmp_path: Path, procs: Processes
) -> None:
    runtime.register(*w.ALL)
    client = runtime.client()
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    handle = client.start(w.three_steps_wf, {"marks": str(marks), "hang_file": str(hang)})
    first = procs.worker(db_url, lease_ttl=1.0)
    wait_for_mark(marks, "b-start")
    first.stop(signal.SIGKILL)
    hang.unlink()
    assert client.status(handle.execution_id) == "running"
    second = procs.worker(db_url, lease_ttl=1.0)
    wait_status(client, handle.execution_id, "completed")
    assert second.stop(signal.SIGTERM) == 0
    assert client.result(handle.execution_id).unwrap() == "abc"
    assert Counter(w.marks(marks)) == Counter({"a": 1, "b-start": 2, "b": 1, "c": 1})
    events = [r.event for r in client.history(handle.execution_id)]
    completed = Counter(e["activityName"] for e in events if e["type"] == "step.completed")
    assert completed == Counter({"step_a#1": 1, "step_b#1": 1, "step_c#1": 1})
    with db_engine.connect() as conn:
        dupes = conn.execute(
            select(hist.c.dedupe_key, func.count())
            .where(hist.c.execution_id == handle.execution_id, hist.c.dedupe_key.is_not(None))
            .group_by(hist.c.dedupe_key)
            .having(func.count() > 1)
        ).all()
    assert dupes == []


def test_signal_across_three_processes(runtime: wp.Runtime, db_url: str, procs: Processes) -> None:
    """Suspended by one process, signalled by a second, resumed by a worker process."""
    runtime.register(*w.ALL)
    execution_id = procs.run_proc(db_url, "start-approval")
    client = runtime.client()
    assert client.status(execution_id) == "suspended"
    sent = procs.run_proc(db_url, "signal", execution_id, "approval", '{"approved": true}')
    assert sent == "ok"
    worker = procs.worker(db_url)
    wait_status(client, execution_id, "completed")
    assert worker.stop(signal.SIGTERM) == 0
    assert client.result(execution_id).unwrap() == "approved"
    delivered = next(
        r.event for r in client.history(execution_id) if r.event["type"] == "signal.delivered"
    )
    assert delivered["actor"] == "other-process"
    assert w.CALLS["reserve_budget"] == 0


@pytest.mark.needs("skip_locked")
def test_four_workers_drain_120_runs_exactly_once(
    runtime: wp.Runtime, db_url: str, db_engine: Engine, tmp_path: Path, procs: Processes
) -> None:
    runtime.register(*w.ALL)
    client = runtime.client()
    marks = tmp_path / "marks"
    ids = [client.start(w.drain_wf, str(marks)).execution_id for _ in range(120)]
    workers = [procs.worker(db_url, "--concurrency", "4") for _ in range(4)]
    for proc in workers:
        proc.wait_for_stderr("serving")

    def completed() -> int:
        with db_engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(ex).where(ex.c.status == "completed")
                ).scalar_one()
            )

    wait_until(lambda: completed() == 120, 240, "120 completed runs", every=0.2)
    for proc in workers:
        proc.send(signal.SIGTERM)
    assert [proc.wait() for proc in workers] == [0, 0, 0, 0]
    with db_engine.connect() as conn:
        per_step = conn.execute(
            select(hist.c.execution_id, hist.c.activity_name, func.count())
            .where(hist.c.type == "step.completed")
            .group_by(hist.c.execution_id, hist.c.activity_name)
        ).all()
        finished = conn.execute(
            select(hist.c.execution_id, func.count())
            .where(hist.c.type == "workflow.completed")
            .group_by(hist.c.execution_id)
        ).all()
    assert len(per_step) == 360 and {row[2] for row in per_step} == {1}
    assert {row[0] for row in finished} == set(ids) and {row[1] for row in finished} == {1}
    lines = (marks).read_text().splitlines()
    labels = Counter(line.split()[0] for line in lines)
    assert len(labels) == 360 and set(labels.values()) == {1}, "no step ran twice"
    assert len({line.split()[1] for line in lines}) >= 2, "the work was shared"


def test_suspended_runs_cost_the_worker_no_memory(runtime: wp.Runtime) -> None:
    runtime.register(w.two_approvals_wf)
    client = runtime.client()

    def idle_allocations() -> int:
        worker = wp.Worker(runtime, concurrency=4, poll_interval=0.02)
        tracemalloc.start()
        thread = threading.Thread(target=worker.run)
        thread.start()
        time.sleep(0.5)  # the idle time itself is what is measured (~25 looks)
        snapshot = tracemalloc.take_snapshot()
        worker.stop()
        thread.join()
        tracemalloc.stop()
        return sum(stat.size for stat in snapshot.statistics("filename"))

    baseline = idle_allocations()
    for _ in range(300):
        handle = client.start(w.two_approvals_wf)
        runtime.drive(handle.execution_id)
    assert client.list(w.two_approvals_wf, status="suspended").items.__len__() == 300
    loaded = idle_allocations()
    assert loaded - baseline < 256 * 1024, (baseline, loaded)
    assert runtime._driving == set()


def test_sigterm_stops_a_worker_process_at_the_next_step_and_hands_the_run_over(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """SIGTERM: the step in flight ends, nothing new starts, and the run is due at once for
    other workers (not after the lease TTL), as with close()."""
    from .fixtures import fencing as f

    runtime.register(*f.ALL)
    client = runtime.client()
    marks, release = tmp_path / "marks", tmp_path / "release"
    handle = client.start(f.fenced_wf, {"marks": str(marks), "release": str(release)})
    worker = procs.worker(db_url, lease_ttl=30.0)
    wait_for_mark(marks, "hold-start")
    worker.send(signal.SIGTERM)
    worker.wait_for_stderr("stopping (SIGTERM)")
    release.touch()
    assert worker.wait(30) == 0
    assert w.marks(marks) == ["hold-start", "hold-end"], "nothing new started after SIGTERM"
    with runtime.backend.read() as conn:
        row = conn.execute(
            select(ex.c.status, ex.c.lease_owner).where(ex.c.id == handle.execution_id)
        ).one()
    assert (row.status, row.lease_owner) == ("running", None), "handed over at once"
    assert client.result(handle.execution_id, timeout=30).unwrap() == ["held", "one", "two"]
    completed = Counter(
        r.event["activityName"]
        for r in client.history(handle.execution_id)
        if r.event["type"] == "step.completed"
    )
    assert completed == Counter({"hold#1": 1, "after#1": 1, "after#2": 1})


def _stop_inside_a_hanging_step(worker: Child, marks: Path) -> None:
    """SIGTERM once the run is inside its hanging step: the process exits within close()'s
    wait (30 s), saying a run is still inside a step."""
    wait_for_mark(marks, "b-start")
    began = time.monotonic()
    worker.send(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert time.monotonic() - began < 45, "bounded by close()'s wait"
    assert "still inside a step" in worker.stderr()


def test_sigterm_stops_a_worker_process_whose_step_never_ends(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """A step that does not end (it hangs): the worker process waited for it however long
    it took, forever here, after SIGTERM. It waits as close() does (30 s), releases the
    lease and exits; another worker takes the run over at once (the step runs again there:
    it was in flight)."""
    runtime.register(w.three_steps_wf)
    client = runtime.client()
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    inp = w.CrashInput(marks=str(marks), hang_file=str(hang))
    handle = client.start(w.three_steps_wf, inp)
    worker = procs.worker(db_url, lease_ttl=300.0)
    _stop_inside_a_hanging_step(worker, marks)
    with runtime.backend.read() as conn:
        owner = conn.execute(
            select(ex.c.lease_owner).where(ex.c.id == handle.execution_id)
        ).scalar_one()
    assert owner is None, "its lease released: not waited out (300 s)"
    hang.unlink()
    assert client.result(handle.execution_id, timeout=30).unwrap() == "abc"


def test_sigterm_stops_an_async_worker_process_whose_step_never_ends(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """The same on the async worker: its event loop, where the run's step hangs, is left
    running for the step (closing it would have waited for, or cut, the step)."""
    from .fixtures import asyncwf as a

    runtime.register(a.crash_wf)
    client = runtime.client()
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    handle = client.start(a.crash_wf, a.Job(marks=str(marks), hang=str(hang)))
    worker = procs.worker(db_url, "--async", lease_ttl=300.0)
    _stop_inside_a_hanging_step(worker, marks)
    hang.unlink()
    assert client.result(handle.execution_id, timeout=30).unwrap() == "ab"
