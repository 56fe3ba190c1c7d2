"""A ``Limit`` slot is a row of ``wf_slots``, held while its holder keeps it ahead of the
database's clock: it outlives the sessions that took it (a restart, a failover, a killed
session freed a session lock while its step ran on, and ``Limit(1)`` had two holders), and
it lapses one lease TTL after its holder died or froze, on every backend."""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sqlalchemy import select

import wf_persist as wp
from tests.helpers import Processes, wait_until
from wf_persist.models import slots_table
from wf_persist.policies import key_text

IDLE = 1.0

_HOLDER = """
import sys, time
import wf_persist as wp
rt = wp.Runtime(sys.argv[1], lease_ttl=float(sys.argv[2]))
with rt.slots.slot("durable-step", "k", 1, "holder-run") as acquire:
    assert acquire()
    print("holding", flush=True)
    time.sleep(3600)
"""


@wp.step(concurrency=wp.Limit(1))
def frozen_limited(marks: str) -> str:
    with open(marks, "a", encoding="utf-8") as out:
        out.write(f"{os.getpid()}\n")
    if os.environ.get("WF_TEST_HOLD"):
        time.sleep(3600)
    return "done"


@wp.workflow(name="durable_slot", version=1)
def durable_slot_wf(ctx: wp.Context, marks: str) -> str:
    return str(ctx.run(frozen_limited, marks))


_WORKER = """
import sys, time
import wf_persist as wp
from tests.test_durable_slots import durable_slot_wf
rt = wp.Runtime(sys.argv[1], lease_ttl=float(sys.argv[2]))
rt.register(durable_slot_wf)
rt.start_worker(concurrency=1)
time.sleep(3600)
"""


def _free(runtime: wp.Runtime, key: str = "k") -> bool:
    """Whether this process can take the one slot (given back at once if so)."""
    with runtime.slots.slot("durable-step", key, 1, "probe") as acquire:
        return acquire()


def test_a_slot_is_a_row_held_with_no_session_at_all(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Every connection of the holder's pool closed (as a restart or a killed session
    closes them): the slot stays held; SQL shows what holds it; the exit frees it."""
    holder, other = make_runtime(), make_runtime()
    with holder.slots.slot("durable-step", "row", 1, "the-run") as acquire:
        assert acquire()
        holder.backend.base_engine.dispose()
        assert not _free(other, "row")
        with other.engine.connect() as conn:
            rows = conn.execute(
                select(slots_table.c.step_name, slots_table.c.execution_id, slots_table.c.slot)
            ).all()
        assert [tuple(r) for r in rows] == [("durable-step", "the-run", 0)]
    assert _free(other, "row")
    with other.engine.connect() as conn:
        assert conn.execute(select(slots_table.c.slot)).all() == []


def test_a_limit_of_n_gives_n_slots_then_none(make_runtime: Callable[..., wp.Runtime]) -> None:
    """Numbers 0 to n-1, each to one holder; a freed number is the next taker's."""
    runtimes = [make_runtime() for _ in range(2)]
    contexts = [runtimes[i % 2].slots.slot("durable-step", "n", 3, f"r{i}") for i in range(4)]
    tries = [c.__enter__() for c in contexts]
    try:
        assert [t() for t in tries] == [True, True, True, False]
        contexts[1].__exit__(None, None, None)
        assert tries[3]()
    finally:
        for i, c in enumerate(contexts):
            if i != 1:
                c.__exit__(None, None, None)


def test_a_frozen_holder_frees_its_slot_a_live_one_keeps_it(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    holder = procs.python("-c", _HOLDER, db_url, str(IDLE), stdout=True)
    assert holder.popen.stdout is not None
    assert holder.popen.stdout.readline().strip() == "holding"
    try:
        for _ in range(4):  # several TTLs: the renewals keep it
            assert not _free(runtime)
            time.sleep(IDLE)
        holder.send(signal.SIGSTOP)
        began = time.monotonic()
        wait_until(lambda: _free(runtime), what="the frozen holder's slot", timeout=20)
        assert time.monotonic() - began < IDLE + 3  # one TTL after its last renewal
    finally:
        holder.send(signal.SIGCONT)
        holder.stop()


def test_the_renewal_ends_with_the_last_slot(make_runtime: Callable[..., wp.Runtime]) -> None:
    """The renewing thread runs while a slot is held, and not after."""
    runtime = make_runtime(lease_ttl=0.4)
    slots = runtime.slots
    with slots.slot("durable-step", "k", 1, "run") as acquire:
        assert acquire()
        renewer = slots._renewer
        assert renewer is not None and renewer.is_alive()
        time.sleep(1.0)  # a few renewals, past the TTL: still held
        assert not _free(runtime)
    renewer.join(timeout=5)
    assert not renewer.is_alive() and slots._renewer is None


def test_a_run_taken_over_from_a_frozen_worker_gets_its_slot(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes, tmp_path: Path
) -> None:
    """End to end: the step holding the only slot is frozen with its worker; another
    worker takes the run over once the lease lapses and gets the slot to run the step (at
    least once: the step in flight runs again)."""
    marks = tmp_path / "marks"
    starter = make_runtime(lease_ttl=10)  # its own drive must not lapse on a busy machine
    starter.register(durable_slot_wf)
    worker = procs.python("-c", _WORKER, db_url, str(IDLE), env={"WF_TEST_HOLD": "1"})
    run = starter.client().start(durable_slot_wf, str(marks)).execution_id
    try:
        wait_until(marks.exists, what="the step in the worker", timeout=30)
        worker.send(signal.SIGSTOP)
        starter.start_worker(concurrency=1)
        assert starter.client().result(run, timeout=30).unwrap() == "done"
        ran = marks.read_text(encoding="utf-8").split()
        assert ran[-1] == str(os.getpid()) and len(ran) == 2
    finally:
        worker.send(signal.SIGCONT)
        worker.stop()


def test_a_dead_workers_slot_lapses_a_lease_ttl_later(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes, tmp_path: Path
) -> None:
    """A worker killed inside the step: its slot lapses one lease TTL after its last
    renewal (not with its presence lock on PostgreSQL: a live worker's is free too while
    it reconnects), and the run taken over gets it."""
    marks = tmp_path / "marks"
    starter = make_runtime(lease_ttl=10)
    starter.register(durable_slot_wf)
    worker = procs.python("-c", _WORKER, db_url, "2", env={"WF_TEST_HOLD": "1"})
    run = starter.client().start(durable_slot_wf, str(marks)).execution_id
    wait_until(marks.exists, what="the step in the worker", timeout=30)
    worker.stop(signal.SIGKILL)
    began = time.monotonic()
    starter.start_worker(concurrency=1)
    assert starter.client().result(run, timeout=30).unwrap() == "done"
    assert time.monotonic() - began < 2 + 8


def _hog_the_gil(seconds: float) -> None:
    """Keep the GIL for about ``seconds`` in one C call (no other thread runs)."""
    began = time.perf_counter()
    sum(range(1_000_000))
    n = int(1_000_000 * seconds / max(time.perf_counter() - began, 1e-6))
    sum(range(n))


def test_a_step_that_keeps_the_gil_for_stretches_keeps_its_slot(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The renewal needs a few turns of the GIL every quarter of the TTL; a step keeping it
    for stretches (one long C call after another) must not lose its slot while its run's
    lease holds."""
    runtime = make_runtime(lease_ttl=2.0)  # a renewal every 0.5 s
    other = make_runtime()
    with runtime.slots.slot("durable-step", "k", 1, "run") as acquire:
        assert acquire()
        until = time.monotonic() + 6
        while time.monotonic() < until:
            _hog_the_gil(0.3)
        assert not _free(other)


def test_racing_takers_of_one_lapsed_slot_get_it_once(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A lapsed slot is taken by a compare-and-set: of many threads trying at once, one
    gets it."""
    stale = make_runtime(lease_ttl=0.2)
    context = stale.slots.slot("durable-step", "race", 1, "stale")
    assert context.__enter__()()
    with stale.slots._lock:
        stale.slots._held.clear()  # no renewal: it lapses
    time.sleep(0.5)
    takers = [make_runtime() for _ in range(3)]
    got: list[bool] = []
    barrier = threading.Barrier(6)
    exits: list[AbstractContextManager[Any]] = []

    def take(rt: wp.Runtime) -> None:
        slot = rt.slots.slot("durable-step", "race", 1, "taker")
        acquire = slot.__enter__()
        exits.append(slot)
        barrier.wait()
        got.append(acquire())

    threads = [threading.Thread(target=take, args=(takers[i % 3],)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == [False] * 5 + [True]
    for done in exits:
        done.__exit__(None, None, None)
    context.__exit__(None, None, None)


_KEYS = """
import sys
from wf_persist.policies import key_text
print(key_text(frozenset({"alpha", "beta", "gamma", "delta"})))
print(key_text({"b": {2, 1, 3}, "a": ("x", frozenset({"p", "q"}))}))
"""


def test_a_limits_key_is_the_same_text_in_every_process(procs: Processes) -> None:
    """A key was compared by its ``str()``: a set's depends on the process's string
    hashing, so two workers held one key's ``Limit(1)`` slots apart and ran it twice at
    once. Other values are compared by their JSON: ``1``, ``1.0``, ``True`` and ``"1"``
    are four keys."""
    seen = set()
    for seed in ("1", "2", "3"):
        child = procs.python("-c", _KEYS, env={"PYTHONHASHSEED": seed}, stdout=True)
        assert child.popen.stdout is not None
        seen.add(child.popen.stdout.read())
        assert child.popen.wait(timeout=60) == 0
    assert len(seen) == 1, seen
    texts = [key_text(k) for k in (1, 1.0, True, "1", None, "None", (1, 2), [1, 2])]
    assert len(set(texts[:6])) == 6 and texts[6] == texts[7]
    assert key_text(object) == key_text(object)  # not JSON: by its str()


def test_a_held_slot_is_renewed_while_the_runs_pool_is_exhausted(
    db_url: str, make_engine: Callable[..., Any], make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Renewals went through the runs' pool: with every connection of it out (busy runs),
    a renewal waited for one past the slot's TTL, and another worker took the slot while
    its step ran. They go through the lease keeper's own pool."""
    engine = make_engine(db_url, pool_size=2, max_overflow=0, pool_timeout=30)
    holder = wp.Runtime(engine, lease_ttl=0.4)
    other = make_runtime()
    try:
        with holder.slots.slot("durable-step", "starved", 1, "run") as acquire:
            assert acquire()
            busy = [engine.connect() for _ in range(2)]  # the runs' pool, all out
            try:
                time.sleep(1.5)  # several renewals, past the TTL
                assert not _free(other, "starved"), "the slot lapsed: its renewals starved"
            finally:
                for conn in busy:
                    conn.close()
        assert _free(other, "starved")
    finally:
        holder.close()


def _slot_keys(runtime: wp.Runtime) -> set[str]:
    with runtime.engine.connect() as conn:
        return set(conn.execute(select(slots_table.c.execution_id)).scalars())


def test_purge_sweeps_the_slots_of_dead_holders_that_lapsed_before_its_cutoff(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes
) -> None:
    """A holder killed inside its step leaves its row (a step that ends deletes its own);
    with many keys and many crashes the table would only grow. A purge deletes the rows
    that lapsed before its cutoff, never a held one, nor one that lapsed after it."""
    live = make_runtime()
    holder = procs.python("-c", _HOLDER, db_url, "0.5", stdout=True)
    assert holder.popen.stdout is not None
    assert holder.popen.stdout.readline().strip() == "holding"
    holder.stop(signal.SIGKILL)
    with live.slots.slot("durable-step", "live", 1, "live-run") as acquire:
        assert acquire()
        time.sleep(1.5)  # the dead holder's row lapses (TTL 0.5 s)
        client = live.client()
        assert client.purge(older_than=dt.timedelta(hours=1)) == 0
        assert _slot_keys(live) == {"holder-run", "live-run"}, "lapsed after the cutoff"
        assert client.purge(older_than=dt.timedelta(0), batch_size=1) == 0
        assert _slot_keys(live) == {"live-run"}, "the dead holder's row only"
        # A client whose clock runs ahead of the database's: still never a held slot.
        with wp.Client(
            db_url, clock=lambda: dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        ) as ahead:
            assert ahead.purge(older_than=dt.timedelta(0)) == 0
        assert _slot_keys(live) == {"live-run"}, "a held slot swept"
        assert not _free(make_runtime(), "live")
    assert _slot_keys(live) == set()


@wp.step(concurrency=wp.Limit(1))
def queued_charge(marks: str) -> str:
    with open(marks, "a", encoding="utf-8") as out:
        out.write("charged\n")
    return "charged"


@wp.workflow(name="slot_deadline", version=1)
def slot_deadline_wf(ctx: wp.Context, marks: str) -> str:
    return str(ctx.run(queued_charge, marks))


def test_a_step_queued_for_a_slot_past_its_runs_deadline_never_starts(
    runtime: wp.Runtime, tmp_path: Path
) -> None:
    """The queue checked the lease and a cancel, not the run's deadline: the step's
    function ran (its side effect done) seconds after the run's deadline, then the run
    timed out and compensated."""
    marks = tmp_path / "marks"
    runtime.register(slot_deadline_wf)
    client = runtime.client()
    name = queued_charge.name
    with runtime.slots.slot(name, name, 1, "another-run") as acquire:
        assert acquire()
        handle = client.start(slot_deadline_wf, str(marks), timeout=1.0)
        runtime.start_worker(concurrency=2, poll_interval=0.05)
        outcome = client.result(handle.execution_id, timeout=30)
        assert isinstance(outcome, wp.Failed) and outcome.error_type == "WorkflowTimeoutError"
    assert not marks.exists()
    kinds = [r.event["type"] for r in client.history(handle.execution_id)]
    assert "step.completed" not in kinds and "workflow.timed_out" in kinds, kinds


MARKS: list[tuple[str, float]] = []


@wp.step(concurrency=wp.Limit(1))
def limited_mark(label: str) -> str:
    MARKS.append((label, time.monotonic()))
    return label


@wp.workflow(name="slot_lapsed_before_call", version=1)
def slot_lapsed_wf(ctx: wp.Context) -> str:
    return str(ctx.run(limited_mark, "ours"))


def test_a_step_whose_slot_lapsed_before_its_call_queues_again(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: Any
) -> None:
    """A process kept from running past its lease TTL (its renewals late, a thread long
    to be had) between taking a slot and calling the step found the slot lapsed and taken by
    another run, and called the step all the same: ``Limit(1)`` had two holders at once. The
    slot is now vouched for right before the call; a lost one is queued for again."""
    from wf_persist.slots import Slots
    from wf_persist.steps import StepRunner

    MARKS.clear()
    ours, other = make_runtime(lease_ttl=1.0), make_runtime(lease_ttl=1.0)
    ours.register(slot_lapsed_wf)
    monkeypatch.setattr(Slots, "_keep_renewing", lambda self: None)  # renewals never come
    name = limited_mark.name
    released: list[float] = []
    original = StepRunner._call
    stalled = [False]

    def stall_then_call(self: StepRunner, step: Any, *args: Any, **kwargs: Any) -> Any:
        if step.name == name and not stalled[0]:
            stalled[0] = True
            time.sleep(1.3)  # past the TTL: the slot lapsed
            intruder = other.slots.slot(name, name, 1, "another-run")
            assert intruder.__enter__()(), "the lapsed slot is free to take"

            def release() -> None:
                time.sleep(1.0)
                released.append(time.monotonic())
                intruder.__exit__(None, None, None)

            threading.Thread(target=release, daemon=True).start()
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "_call", stall_then_call)
    outcome = ours.client().execute(slot_lapsed_wf)
    assert outcome.unwrap() == "ours"
    assert len(MARKS) == 1 and released, (MARKS, released)
    assert MARKS[0][1] >= released[0], "the step ran while another run held the only slot"
