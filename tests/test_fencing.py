"""Fencing: a claim is a token, leases and timers run on the database's clock, a paused
driver records nothing after someone else claimed its run, close() hands runs over at once."""

from __future__ import annotations

import datetime as dt
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .fixtures import fencing as f
from .helpers import Processes, is_due, wait_for_mark, wait_until


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    f.reset()
    yield
    f.reset()


def _completions(rt: wp.Runtime, execution_id: str) -> Counter[str]:
    return Counter(
        str(r.event.get("activityName"))
        for r in rt.client().history(execution_id)
        if r.event["type"] == "step.completed"
    )


def _db_now(rt: wp.Runtime) -> dt.datetime:
    from wf_persist.backends.clock import db_now

    with rt.backend.read() as conn:
        value: dt.datetime = conn.execute(select(db_now())).scalar_one()
    return value


def test_a_paused_driver_records_nothing_after_a_takeover(
    make_runtime: Callable[..., wp.Runtime], db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """SIGSTOP a worker inside a step past its lease; another runtime takes the run over and
    records the next steps, then dies; the paused worker resumes: its stale thread's write
    is refused (its claim epoch is stale), its own worker loop never claims the run while
    that thread still drives it, and no recorded step runs again."""
    rt = make_runtime(lease_ttl=1.0)
    rt.register(*f.ALL)
    marks, release = tmp_path / "marks", tmp_path / "release"
    handle = rt.client().start(f.fenced_wf, {"marks": str(marks), "release": str(release)})
    paused = procs.worker(db_url, "--concurrency", "2", lease_ttl=1.0)
    try:
        wait_for_mark(marks, "hold-start")
        paused.send(signal.SIGSTOP)
        # The lease runs out by the database's clock; then anyone may claim the run.
        wait_until(
            lambda: rt.client().describe(handle.execution_id) and is_due(rt, handle.execution_id),
            10,
            "lease expiry",
        )
        release.touch()
        f.CONTROL["crash_at"] = "two"  # the taker records hold and one, then dies in two
        with pytest.raises(f.SimulatedCrash):
            rt.drive(handle.execution_id)
        f.CONTROL.clear()
        assert _completions(rt, handle.execution_id) == {"hold#1": 1, "after#1": 1}
        paused.send(signal.SIGCONT)
        outcome = rt.client().result(handle.execution_id, timeout=30)
    finally:
        paused.send(signal.SIGCONT)
        paused.stop()
    assert outcome.unwrap() == ["held", "one", "two"]
    assert _completions(rt, handle.execution_id) == {"hold#1": 1, "after#1": 1, "after#2": 1}
    labels = Counter(label for label, _ in f.marks_of(marks))
    # hold ran in the paused worker and in the taker (at-least-once under a pause); "one"
    # was recorded by the taker and never ran again; "two" ran where the taker died and
    # once more to finish.
    assert labels["hold-start"] == 2 and labels["one"] == 1 and labels["two"] == 2
    sequences = [r.sequence for r in rt.client().history(handle.execution_id)]
    assert sequences == list(range(1, len(sequences) + 1))


def _holding(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> tuple[wp.Runtime, wp.ExecutionHandle, Path, Path]:
    """A runtime whose worker is inside the ``hold`` step of a fenced run (until
    ``release`` exists)."""
    first = make_runtime(lease_ttl=30)
    first.register(*f.ALL)
    marks, release = tmp_path / "marks", tmp_path / "release"
    handle = first.client().start(f.fenced_wf, {"marks": str(marks), "release": str(release)})
    first.start_worker(concurrency=1, poll_interval=0.02)
    wait_for_mark(marks, "hold-start")
    return first, handle, marks, release


def test_claims_are_compare_and_set_on_plain_host_engines(db_url: str) -> None:
    """Two runtimes on plain ``create_engine`` engines (the driver's default transaction
    handling, SQLite's legacy mode included) race for 60 runs: each run is claimed once,
    with epoch 1, and a claim never hands out more runs than asked."""
    engines = [create_engine(db_url), create_engine(db_url)]
    runtimes = [wp.Runtime(e) for e in engines]
    try:
        for rt in runtimes:
            rt.register(*f.ALL)
        ids = {runtimes[0].client().start(f.slow_wf, 0.0).execution_id for _ in range(60)}
        claimed: dict[int, list[wp.backends.Claim]] = {0: [], 1: []}
        barrier = threading.Barrier(2)

        def claim(i: int) -> None:
            barrier.wait()
            for _ in range(40):
                got = runtimes[i].claim_due(4)
                assert len(got) <= 4
                claimed[i] += got

        threads = [threading.Thread(target=claim, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        a = {c.execution_id for c in claimed[0]}
        b = {c.execution_id for c in claimed[1]}
        assert not a & b
        assert a | b == ids
        assert {c.epoch for c in claimed[0] + claimed[1]} == {1}
    finally:
        for rt in runtimes:
            rt.close()
        for e in engines:
            e.dispose()


def test_a_worker_clock_far_ahead_takes_over_no_live_lease(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    holder = make_runtime(lease_ttl=5)
    holder.register(*f.ALL)
    handle = holder.client().start(f.slow_wf, 0.0)
    with holder.transaction() as conn:
        assert holder.backend.claim(conn, handle.execution_id, holder.owner, 5)
    ahead = make_runtime(clock=lambda: dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10))
    ahead.register(*f.ALL)
    assert ahead.drive(handle.execution_id) is False
    assert ahead.claim_due(10) == []


@pytest.mark.parametrize("skew", [dt.timedelta(seconds=30), -dt.timedelta(seconds=30)])
def test_timers_run_on_the_database_clock(
    make_runtime: Callable[..., wp.Runtime], skew: dt.timedelta
) -> None:
    skewed = make_runtime(clock=lambda: dt.datetime.now(dt.UTC) + skew, poll_interval=0.05)
    skewed.register(*f.ALL)
    client = skewed.client()
    handle = client.start(f.nap_wf, 1.0)
    began = time.monotonic()
    assert skewed.drive(handle.execution_id)
    row = client.describe(handle.execution_id)
    assert row.status == "suspended"
    with skewed.backend.read() as conn:
        wake_at = conn.execute(
            select(ex.c.wake_at).where(ex.c.id == handle.execution_id)
        ).scalar_one()
    assert abs((wake_at - _db_now(skewed)).total_seconds() - 1.0) < 0.5
    assert client.result(handle.execution_id, timeout=10).unwrap() == "rested"
    assert 0.8 <= time.monotonic() - began < 5, "woken by the database's clock"


def test_close_releases_leases_so_another_runtime_takes_over_at_once(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    first, handle, marks, release = _holding(make_runtime, tmp_path)
    first.close(timeout=0.2)  # the step is still running in its thread
    second = make_runtime(lease_ttl=30)
    second.register(*f.ALL)
    assert is_due(second, handle.execution_id), "released: due at once, not after 30 s"

    def starts() -> Counter[str]:
        return Counter(label for label, _ in f.marks_of(marks))

    outcome: list[wp.Outcome] = []
    taker = threading.Thread(
        target=lambda: outcome.append(second.client().result(handle.execution_id, timeout=30))
    )
    taker.start()
    wait_until(lambda: starts()["hold-start"] == 2, what="the takeover")
    release.touch()
    taker.join(timeout=30)
    assert outcome[0].unwrap() == ["held", "one", "two"]
    wait_until(lambda: starts()["hold-end"] == 2, what="the closed runtime's step to end")
    assert _completions(second, handle.execution_id)["hold#1"] == 1, "its late write refused"


def test_leases_are_renewed_on_a_connection_of_their_own(db_url: str) -> None:
    """A worker whose runs hold every pooled connection still renews its leases."""
    engine = create_engine(db_url, pool_size=2, max_overflow=0, pool_timeout=30)
    rt = wp.Runtime(engine, lease_ttl=1.5)
    other = wp.Runtime(db_url, lease_ttl=1.5)
    try:
        rt.register(*f.ALL)
        other.register(*f.ALL)
        handle = rt.client().start(f.slow_wf, 3.5)
        rt.start_worker(concurrency=1, poll_interval=0.02)
        with engine.connect():  # the test holds the pool's second connection
            wait_until(
                lambda: (
                    other.client().describe(handle.execution_id).started_at is not None
                    and not is_due(other, handle.execution_id)
                ),
                what="the claim",
            )
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                assert other.drive(handle.execution_id) is False, "a live lease was taken over"
                time.sleep(0.05)
        assert other.client().result(handle.execution_id, timeout=20).unwrap() == 3.5
        assert f.CONTROL["slow_runs"] == 1
    finally:
        rt.close()
        other.close()
        engine.dispose()


def test_a_pool_too_small_for_the_worker_is_refused(db_url: str) -> None:
    """Runs borrow a connection per write: two connections serve any concurrency (the claim
    loop and one write at a time); one cannot."""
    for size, works in ((1, False), (2, True)):
        engine = create_engine(db_url, pool_size=size, max_overflow=0)
        rt = wp.Runtime(engine)
        try:
            if works:
                rt.start_worker(concurrency=50).stop()
                continue
            with pytest.raises(wp.PoolTooSmallError) as caught:
                rt.start_worker(concurrency=3)
            assert (caught.value.capacity, caught.value.needed) == (1, 2)
            assert "concurrency 3" in str(caught.value)
        finally:
            rt.close()
            engine.dispose()


def test_a_pause_between_a_claim_and_its_lease_record_is_not_trusted(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """A worker is paused right after its claim commits, longer than the lease; another
    runtime takes the run over and is inside its second step. When the first resumes, its
    driver must not count the lease as confirmed when it resumed: it asks the database
    before its first step, learns the run was taken, and runs nothing."""
    from .fixtures import workflows as w

    first = make_runtime(lease_ttl=1.0)
    first.register(w.three_steps_wf)
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    handle = first.client().start(w.three_steps_wf, {"marks": str(marks), "hang_file": str(hang)})
    keeper = first.keeper()
    hold = keeper.hold
    resume = threading.Event()

    def paused_hold(execution_id: str, epoch: int, asked: float | None = None) -> Any:
        resume.wait(30)  # paused right after the claim committed
        return hold(execution_id, epoch, asked)

    keeper.hold = paused_hold  # type: ignore[method-assign]
    claims: list[Any] = []
    claimer = threading.Thread(target=lambda: claims.extend(first.claim_due(1)))
    claimer.start()

    def leased_by_first() -> bool:
        with first.backend.read() as conn:
            owner = conn.execute(
                select(ex.c.lease_owner).where(ex.c.id == handle.execution_id)
            ).scalar_one()
        return bool(owner == first.owner)

    wait_until(leased_by_first, what="the first runtime's claim")
    second = make_runtime(lease_ttl=5)
    second.register(w.three_steps_wf)
    outcome: list[wp.Outcome] = []
    taker = threading.Thread(
        target=lambda: outcome.append(second.client().result(handle.execution_id, timeout=30))
    )
    taker.start()
    wait_for_mark(marks, "b-start")  # the takeover, once the first lease expired
    resume.set()
    claimer.join(timeout=30)
    assert [c.execution_id for c in claims] == [handle.execution_id]
    stale: list[Any] = []
    resumed = threading.Thread(target=lambda: stale.append(first.drive_claim(claims[0])))
    resumed.start()
    resumed.join(timeout=15)
    alive = resumed.is_alive()
    hang.unlink()
    resumed.join(timeout=30)
    assert not alive, "the resumed driver started step b (it hangs) on a lease it lost"
    assert stale == [None], "the stale driver finished nothing"
    taker.join(timeout=30)
    assert outcome and outcome[0].unwrap() == "abc"
    assert w.marks(marks) == ["a", "b-start", "b", "c"], "no step ran a second time"


def test_close_releases_the_lease_of_a_run_that_stopped_at_its_next_step(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """close() waits for a step in flight; its run stops before the next step. That run is
    handed over at once too, not left leased until its lease runs out."""
    first, handle, _, release = _holding(make_runtime, tmp_path)
    closing = threading.Thread(target=first.close, kwargs={"timeout": 30})
    closing.start()
    wait_until(lambda: first.closing, what="close() to begin")
    release.touch()  # the step ends; the drive stops before the next one
    closing.join(timeout=30)
    assert not closing.is_alive()
    second = make_runtime(lease_ttl=30)
    second.register(*f.ALL)
    assert is_due(second, handle.execution_id), "released: due at once, not after 30 s"
    assert second.client().result(handle.execution_id, timeout=30).unwrap() == [
        "held",
        "one",
        "two",
    ]
    assert _completions(second, handle.execution_id)["hold#1"] == 1


def test_a_compensation_is_not_started_without_the_lease(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Compensations are new work like steps: a driver checks its lease before each one.
    A runtime closed during the unwind records the compensation in flight but starts no
    other; the runtime that takes the run over runs that one, once."""
    first = make_runtime(lease_ttl=30)
    first.register(*f.ALL)
    marks, release = tmp_path / "marks", tmp_path / "release"
    handle = first.client().start(f.unwound_wf, {"marks": str(marks), "release": str(release)})
    first.start_worker(concurrency=1, poll_interval=0.02)
    wait_for_mark(marks, "undo-second", timeout=20)
    first.close(timeout=0.2)  # the undo is still running in its thread; the lease is released
    second = make_runtime(lease_ttl=30)
    second.register(*f.ALL)
    client = second.client()
    Path(f"{release}.second").touch()

    def undone() -> list[str]:
        return [
            str(r.event.get("activityName"))
            for r in client.history(handle.execution_id)
            if r.event["type"] == "compensation.completed"
        ]

    wait_until(lambda: undone() == ["book#2"], what="the closed runtime's undo to be recorded")
    time.sleep(0.3)  # long enough for that driver to start the next undo, if it would
    outcome: list[wp.Outcome] = []
    taker = threading.Thread(
        target=lambda: outcome.append(client.result(handle.execution_id, timeout=30))
    )
    taker.start()
    wait_for_mark(marks, "undo-first", timeout=20)
    time.sleep(0.2)
    Path(f"{release}.first").touch()
    taker.join(timeout=30)
    assert isinstance(outcome[0], wp.Failed)
    labels = Counter(label for label, _ in f.marks_of(marks))
    assert labels == {"undo-second": 1, "undo-first": 1}, labels
    assert undone() == ["book#2", "book#1"]


_RENEWER = """
import sys, wf_persist as wp
rt = wp.Runtime(sys.argv[1])
held = {sys.argv[2]: int(sys.argv[3])}
print("renewing", flush=True)
while True:
    with rt.backend.engine.connect() as conn:
        assert rt.backend.renew_alone(conn, held, 3600) == set(held)
"""


@pytest.mark.needs("server")
def test_a_process_paused_while_renewing_a_lease_holds_no_lock_on_the_run(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes
) -> None:
    """A worker renews its leases all the time; SIGSTOP may land anywhere in a renewal. A
    renewal left open between its UPDATE and its COMMIT would hold the run's row lock for
    as long as the process stays paused, and every claim of the run would wait for it (the
    run stuck, though its lease lapses). Paused at many moments of back-to-back renewals,
    the process never holds the row."""
    rt = make_runtime()
    rt.register(*f.ALL)
    handle = rt.client().start(f.fenced_wf, {"marks": "-", "release": "-"})
    info = rt.client().describe(handle.execution_id)
    assert info is not None
    claim = rt.backend.claim_to_drive(
        handle.execution_id, "paused-test", 3600, [(info.workflow_name, info.version)]
    )
    assert claim is not None
    renewer = procs.python(
        "-c", _RENEWER, db_url, handle.execution_id, str(claim.epoch), stdout=True
    )
    assert renewer.popen.stdout is not None
    assert renewer.popen.stdout.readline().strip() == "renewing"
    nowait = select(ex.c.id).where(ex.c.id == handle.execution_id).with_for_update(nowait=True)
    try:
        for _ in range(60):
            time.sleep(0.002 + (_ % 7) * 0.0013)
            renewer.send(signal.SIGSTOP)
            time.sleep(0.05)  # a statement the server was running when the stop came ends
            with rt.backend.engine.connect() as conn, conn.begin():
                assert conn.execute(nowait).scalar_one() == handle.execution_id
            renewer.send(signal.SIGCONT)
        assert renewer.popen.poll() is None, renewer.tail()  # still renewing, all along
    finally:
        renewer.send(signal.SIGCONT)
        renewer.stop()


_PAUSED_MID_WRITE = """
import os, signal, sys
import wf_persist as wp
from sqlalchemy import text
from wf_persist.backends.postgresql import PostgreSQLBackend
PostgreSQLBackend.idle_timeout = 1.0
rt = wp.Runtime(sys.argv[1])
with rt.backend.begin() as conn:
    conn.execute(text("SELECT id FROM wf_executions WHERE id = :i FOR UPDATE"), {"i": sys.argv[2]})
    print("holding", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.needs("idle_limit")
def test_a_process_paused_inside_a_write_transaction_holds_the_run_only_so_long(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes
) -> None:
    """Every write transaction of ours on PostgreSQL is bounded: the server ends one whose
    process is paused in it (SIGSTOP) after ``idle_timeout``, and the run's row lock goes
    with it, so another worker drives the run once its lease lapses."""
    rt = make_runtime(lease_ttl=1.0)
    rt.register(*f.ALL)
    handle = rt.client().start(f.slow_wf, 0.0)
    holder = procs.python("-c", _PAUSED_MID_WRITE, db_url, handle.execution_id, stdout=True)
    try:
        assert holder.popen.stdout is not None
        assert holder.popen.stdout.readline().strip() == "holding"
        started = time.monotonic()
        assert rt.drive(handle.execution_id) is True
        assert time.monotonic() - started < 10
        assert rt.client().result(handle.execution_id, timeout=5).unwrap() == 0.0
    finally:
        holder.send(signal.SIGCONT)
        holder.stop()
