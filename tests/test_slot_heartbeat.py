"""A worker frozen (SIGSTOP) or cut off while it holds a ``Limit`` slot frees the slot as it
loses its leases, instead of for as long as it stays so.

A slot is a session lock on a connection that sits idle while its step runs. A frozen
process's kernel still answers for its connections, so neither keepalives nor the lease
freed the slot: the runs that took over the frozen worker's runs queued for it until the
process was thawed. A held slot's session is now ended by the server once it idles past
``SessionLockSlots.idle_limit``, and a heartbeat keeps it from idling while its process
lives.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from tests.helpers import Processes, wait_until
from tests.tcpproxy import TCPProxy
from wf_persist.backends.slots import SessionLockSlots

pytestmark = pytest.mark.needs("shared_slots")  # session locks: PostgreSQL, MySQL/MariaDB

IDLE = 1.0

_HOLDER = """
import sys, time
import wf_persist as wp
from wf_persist.backends.slots import SessionLockSlots
SessionLockSlots.min_idle = float(sys.argv[2])
rt = wp.Runtime(sys.argv[1], lease_ttl=float(sys.argv[2]))
with rt.backend.slots.slot("heartbeat-step", "k", 1) as acquire:
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


@wp.workflow(name="slot_heartbeat", version=1)
def slot_heartbeat_wf(ctx: wp.Context, marks: str) -> str:
    return str(ctx.run(frozen_limited, marks))


_WORKER = """
import sys, time
import wf_persist as wp
from wf_persist.backends.slots import SessionLockSlots
from tests.test_slot_heartbeat import slot_heartbeat_wf
SessionLockSlots.min_idle = float(sys.argv[2])
rt = wp.Runtime(sys.argv[1], lease_ttl=float(sys.argv[2]))
rt.register(slot_heartbeat_wf)
rt.start_worker(concurrency=1)
time.sleep(3600)
"""


def _free(runtime: wp.Runtime) -> bool:
    """Whether this process can take the one slot (given back at once if so)."""
    with runtime.backend.slots.slot("heartbeat-step", "k", 1) as acquire:
        return acquire()


def test_a_frozen_holder_frees_its_slot_a_live_one_keeps_it(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    holder = procs.python("-c", _HOLDER, db_url, str(IDLE), stdout=True)
    assert holder.popen.stdout is not None
    assert holder.popen.stdout.readline().strip() == "holding"
    try:
        for _ in range(4):  # several idle limits: the heartbeat keeps the session
            assert not _free(runtime)
            time.sleep(IDLE)
        holder.send(signal.SIGSTOP)
        began = time.monotonic()
        wait_until(lambda: _free(runtime), what="the frozen holder's slot", timeout=20)
        assert time.monotonic() - began < 2 * IDLE + 5  # the idle limit: two leases
    finally:
        holder.send(signal.SIGCONT)
        holder.stop()


def test_the_heartbeat_ends_with_the_last_slot(runtime: wp.Runtime) -> None:
    """The heartbeat thread runs while a slot is held, and not after."""
    slots = runtime.backend.slots
    assert isinstance(slots, SessionLockSlots)
    assert slots.idle_limit == 60.0  # two of the runtime's leases
    slots.idle_limit = 0.2
    with slots.slot("heartbeat-step", "k", 1) as acquire:
        assert acquire()
        beat = slots._beat_thread
        assert beat is not None and beat.is_alive()
        time.sleep(0.5)  # a few beats
    beat.join(timeout=5)
    assert not beat.is_alive() and slots._beat_thread is None


def test_a_slot_whose_connection_never_answers_holds_up_no_other(
    runtime: wp.Runtime, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One held slot's connection cut without a word (a proxy's upstream gone): its round
    trip never came back, and the heartbeat, one thread for every slot, stopped for all
    of them: their sessions idled out mid-step and other workers took their slots. Now
    each round trip has a thread of its own, and one still waiting a turn later is cut
    (so is a release waiting on it)."""
    monkeypatch.setattr(SessionLockSlots, "min_idle", IDLE)
    url = make_url(db_url)
    default = 5432 if url.get_backend_name() == "postgresql" else 3306
    proxy = TCPProxy((url.host or "127.0.0.1", url.port or default))
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    held = wp.Runtime(proxied, lease_ttl=IDLE)
    try:
        slots = held.backend.slots
        assert isinstance(slots, SessionLockSlots)
        with slots.slot("heartbeat-step", "cut", 1) as cut:
            assert cut()
            (kept,) = slots._held
            port = _server_port(runtime, kept.conn)
            with slots.slot("heartbeat-step", "k", 1) as other:
                assert other()
                proxy.silence(port)
                for _ in range(4):  # several idle limits: the other slot stays held
                    time.sleep(IDLE)
                    assert not _free(runtime)
            began = time.monotonic()
        assert time.monotonic() - began < 5  # the release on the cut connection ended
    finally:
        held.close()
        proxy.close()


def _server_port(runtime: wp.Runtime, conn: Connection) -> int:
    """The server-side client port of ``conn``'s session."""
    raw = conn.connection.dbapi_connection
    pgconn = getattr(raw, "pgconn", None)
    with runtime.backend.engine.connect() as reader:
        if pgconn is not None:
            query, i = "SELECT client_port FROM pg_stat_activity WHERE pid = :i", pgconn.backend_pid
        else:
            query = (
                "SELECT CAST(SUBSTRING_INDEX(host, ':', -1) AS UNSIGNED) "
                "FROM information_schema.processlist WHERE id = :i"
            )
            i = raw.thread_id()  # type: ignore[union-attr]
        return int(reader.execute(text(query), {"i": i}).scalar_one())


def test_a_run_taken_over_from_a_frozen_worker_gets_its_slot(
    make_runtime: Callable[..., wp.Runtime], db_url: str, procs: Processes, tmp_path: Path
) -> None:
    """End to end: the step holding the only slot is frozen with its worker; another
    worker takes the run over once the lease lapses and gets the slot to run the step (at
    least once: the step in flight runs again)."""
    marks = tmp_path / "marks"
    starter = make_runtime(lease_ttl=10)  # its own drive must not lapse on a busy machine
    starter.register(slot_heartbeat_wf)
    worker = procs.python("-c", _WORKER, db_url, str(IDLE), env={"WF_TEST_HOLD": "1"})
    run = starter.client().start(slot_heartbeat_wf, str(marks)).execution_id
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


def test_a_lease_longer_than_any_server_idle_limit(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A lease of years: the slot's idle limit is the most every server takes, not a
    value PostgreSQL refuses (its ``idle_session_timeout`` is an int of milliseconds)."""
    runtime = make_runtime(lease_ttl=1e8)
    slots = runtime.backend.slots
    assert isinstance(slots, SessionLockSlots)
    assert slots.idle_limit == 2_147_483.0
    with slots.slot("heartbeat-step", "long", 1) as acquire:
        assert acquire()
    assert _free(runtime)


def _hog_the_gil(seconds: float) -> None:
    """Keep the GIL for about ``seconds`` in one C call (no other thread runs)."""
    began = time.perf_counter()
    sum(range(1_000_000))
    n = int(1_000_000 * seconds / max(time.perf_counter() - began, 1e-6))
    sum(range(n))


def test_a_step_that_keeps_the_gil_for_stretches_keeps_its_slot(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each heartbeat round trip needs a few turns of the GIL; a step keeping it for
    stretches (one long C call after another) held them back, and the heartbeat cut the
    healthy connection a quarter of the idle limit later: the slot was lost while the
    run's lease held, and another worker ran the limited step alongside."""
    monkeypatch.setattr(SessionLockSlots, "min_idle", 1.0)
    runtime = make_runtime(lease_ttl=2.0)  # a slot's idle limit: 4 s, a beat every 0.5 s
    other = make_runtime()
    slots = runtime.backend.slots
    assert isinstance(slots, SessionLockSlots) and slots.idle_limit == 4.0
    with slots.slot("heartbeat-step", "k", 1) as acquire:
        assert acquire()
        (kept,) = slots._held
        until = time.monotonic() + 6
        while time.monotonic() < until:
            _hog_the_gil(0.3)
        assert not kept.conn.invalidated
        assert not _free(other)


class _NoThreadOnce(threading.Thread):
    """A thread whose first ping cannot start (no thread to be had)."""

    failed = False

    def start(self) -> None:
        if self.name == "wf-persist-slot-ping" and not _NoThreadOnce.failed:
            _NoThreadOnce.failed = True
            raise RuntimeError("can't start new thread")
        super().start()


def test_the_heartbeat_outlives_a_ping_it_could_not_start(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread start that failed ended the heartbeat thread: every held slot idled out
    mid-step, and another worker took it."""
    monkeypatch.setattr(SessionLockSlots, "min_idle", 1.0)
    fake = types.SimpleNamespace(**{**vars(threading), "Thread": _NoThreadOnce})
    monkeypatch.setattr("wf_persist.backends.slots.threading", fake)
    _NoThreadOnce.failed = False
    runtime = make_runtime(lease_ttl=0.5)  # a slot's idle limit: 1 s
    other = make_runtime()
    slots = runtime.backend.slots
    assert isinstance(slots, SessionLockSlots)
    with slots.slot("heartbeat-step", "k", 1) as acquire:
        assert acquire()
        time.sleep(2.5)
        assert _NoThreadOnce.failed
        assert slots._beat_thread is not None and slots._beat_thread.is_alive()
        assert not _free(other)
