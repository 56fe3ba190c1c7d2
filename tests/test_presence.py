"""Presence that can be trusted: a listening connection that dies without a word.

The server frees a runtime's presence lock when its listening connection dies; the runtime
hears of that at once after a restart or a terminated backend, but not when the connection
dies silently (a failover, a dropped NAT entry): then only its heartbeats stop answering.
A drive trusts its lease without asking the database only while a heartbeat vouches for the
lock, and a reaper makes the runs due only a grace period after it finds the lock free.
"""

from __future__ import annotations

import datetime as dt
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, make_url, text

import wf_persist as wp
from wf_persist.backends.pg_presence import USER_TIMEOUT_MS
from wf_persist.wakeups import BEAT_FOR, PRESENCE_GRACE, PRESENCE_TRUST

from .fixtures import fencing as f
from .helpers import wait_until
from .tcpproxy import TCPProxy

pytestmark = pytest.mark.needs("presence")


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[TCPProxy, str]]:
    """A proxy to the test database, and the database's URL through it."""
    url = make_url(db_url)
    proxy = TCPProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    finally:
        proxy.close()  # first: a silenced listener then hears the end and stops


def _listener_port(admin: Engine, proxy: TCPProxy) -> int:
    """The server-side port of the proxied runtime's listening connection."""
    with admin.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT client_port FROM pg_stat_activity "
                "WHERE application_name = 'wf_persist listener' AND datname = current_database()"
            )
        ).scalars()
        ports = set(rows) & proxy.server_ports()
    assert len(ports) == 1, ports
    port: int = ports.pop()
    return port


def _gone(admin: Engine, port: int) -> bool:
    with admin.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE client_port = :p"), {"p": port}
        ).scalar()
    return found == 0


def _silence_listener(admin: Engine, proxy: TCPProxy) -> int:
    port = _listener_port(admin, proxy)
    proxy.silence(port)
    wait_until(lambda: _gone(admin, port), what="the server to end the session", timeout=10)
    return port


def test_a_runtime_whose_listener_died_silently_asks_before_its_next_attempt(
    proxied: tuple[TCPProxy, str],
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
) -> None:
    """A drive waits out a retry's backoff when its listening connection dies without a
    FIN reaching it: its process still believes it holds its presence lock, the server has
    freed it, and another worker reaps the run and records the retry. The first drive's
    heartbeats go unanswered, so it must ask the database before its own retry rather than
    run a step another process recorded (it ran it: ``['holder', 'other', 'holder']``)."""
    proxy, proxy_url = proxied
    f.PRESENCE_CALLS.clear()
    holder = wp.Runtime(proxy_url, lease_ttl=30)
    try:
        other = make_runtime(lease_ttl=30)
        for rt in (holder, other):
            rt.register(f.presence_backoff_wf)
        wakeups = holder.wakeups()
        other.wakeups()
        assert holder.owner.endswith("!") and wakeups.present
        execution_id = holder.client().start(f.presence_backoff_wf).execution_id
        driving = threading.Thread(target=holder.drive, args=(execution_id,), name="holder")
        driving.start()
        wait_until(lambda: len(f.PRESENCE_CALLS) == 1, what="the first attempt", timeout=10)
        admin = make_engine(db_url)
        _silence_listener(admin, proxy)
        assert wakeups.present, "nothing told the holder"
        wait_until(lambda: execution_id in other.reap(), what="the reap", timeout=10)
        f.presence_taken_over(
            driving,
            other,
            execution_id,
            lambda: wait_until(lambda: other.drive(execution_id), what="the takeover"),
        )
    finally:
        proxy.close()
        holder.close()


def test_heartbeats_stop_vouching_for_a_silently_dead_listener(
    proxied: tuple[TCPProxy, str],
    db_url: str,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While its heartbeats answer, a runtime's presence is vouched for since the lock was
    taken; once the listening connection dies silently, within :data:`PRESENCE_TRUST` of
    the last answer it is not (the listener itself still believes it holds the lock). The
    socket fails a silent peer within seconds (keepalives, a user timeout); a heartbeat
    unanswered for :data:`BEAT_DEADLINE` ends it even where a hop keeps its TCP alive."""
    from wf_persist.backends import pg_presence

    deadline = 2.0  # shorter than the default, for the test's sake
    monkeypatch.setattr(pg_presence, "BEAT_DEADLINE", deadline)
    proxy, proxy_url = proxied
    with wp.Runtime(proxy_url, lease_ttl=30) as rt:
        wakeups = rt.wakeups()
        since = rt.presence_since()
        assert since is not None and since < math.inf
        listener = wakeups._listener
        assert listener is not None
        raw = listener._raw  # type: ignore[attr-defined]
        with socket.socket(fileno=raw.pgconn.socket) as sock:
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
                assert timeout == USER_TIMEOUT_MS
            finally:
                sock.detach()  # the connection's own descriptor
        first = wakeups.heard
        wait_until(lambda: wakeups.heard > first, what="a heartbeat", timeout=2)
        assert rt.presence_since() == since, "a heartbeat vouches for the same lock"
        admin = make_engine(db_url)
        _silence_listener(admin, proxy)
        wait_until(lambda: rt.presence_since() == math.inf, what="distrust", timeout=2)
        assert wakeups.present, "the listener itself heard nothing"
        # The proxy keeps the client's TCP alive (as a pooler or a sidecar would): the
        # unanswered heartbeat itself ends the connection, and the listener connects anew.
        silenced = time.monotonic()
        wait_until(lambda: wakeups.connections >= 2, what="a new connection", timeout=10)
        assert time.monotonic() - silenced < deadline + 3
        wait_until(lambda: (rt.presence_since() or math.inf) < math.inf, what="trust again")


def test_a_reaped_run_is_due_only_after_the_grace(
    proxied: tuple[TCPProxy, str],
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
) -> None:
    """A reaper that finds a presence lock free makes the run due :data:`PRESENCE_GRACE`
    from then, longer than the owner's trust in its last heartbeat lasts (the owner may not
    know yet); a second look neither pushes that time out nor reports the run again, and
    once it has passed another worker takes the run over."""
    assert PRESENCE_GRACE > PRESENCE_TRUST
    proxy, proxy_url = proxied
    holder = wp.Runtime(proxy_url, lease_ttl=30)
    try:
        other = make_runtime(lease_ttl=30)
        for rt in (holder, other):
            rt.register(*f.ALL)
        holder.wakeups()
        other.wakeups()
        handle = holder.client().start(f.nap_wf, 3600)
        with holder.backend.begin() as conn:
            assert holder.backend.claim(conn, handle.execution_id, holder.owner, 30) is not None
        admin = make_engine(db_url)

        def now() -> dt.datetime:
            with admin.connect() as conn:
                found: dt.datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
                return found

        def expiry() -> tuple[dt.datetime, dt.datetime]:
            with admin.connect() as conn:
                row = conn.execute(
                    text("SELECT lease_expires_at, wake_at FROM wf_executions WHERE id = :i"),
                    {"i": handle.execution_id},
                ).one()
            return row[0], row[1]

        _silence_listener(admin, proxy)
        grace = dt.timedelta(seconds=PRESENCE_GRACE)
        before = now()
        while handle.execution_id not in other.reap():
            before = now()
        after = now()
        lease, wake = expiry()
        assert before + grace <= lease <= after + grace
        assert wake == lease
        assert other.reap() == []  # looked at again: not pushed out, not reported again
        assert expiry() == (lease, wake)
        assert other.drive(handle.execution_id) is False or now() >= lease
        wait_until(lambda: now() > lease, what="the grace", timeout=5)
        assert other.drive(handle.execution_id) is True
        assert other.client().describe(handle.execution_id).status == "suspended"
    finally:
        proxy.close()
        holder.close()


def test_heartbeats_pause_while_nothing_is_driven_and_resume_when_asked(
    db_url: str, make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that drives nothing sends no heartbeats once :data:`BEAT_FOR` has passed
    (an idle worker stays idle); the first drive to ask for its presence then is not
    vouched for (it asks the database) and wakes the listener, which beats at once rather
    than at the end of its tick."""
    from wf_persist import wakeups as wu

    monkeypatch.setattr(wu, "BEAT_FOR", 0.3)
    monkeypatch.setattr(wu, "LISTEN_TICK", 5.0)
    rt = make_runtime(lease_ttl=30)
    wakeups = rt.wakeups()
    assert rt.presence_since() is not None
    time.sleep(0.7)  # past BEAT_FOR and PRESENCE_TRUST, into a 5 s tick
    quiet = wakeups.heard
    time.sleep(0.3)
    assert wakeups.heard == quiet, "no heartbeat while nothing asks"
    asked = time.monotonic()
    assert rt.presence_since() == math.inf
    wait_until(lambda: wakeups.heard > asked, what="a heartbeat", timeout=2.5)
    assert (rt.presence_since() or math.inf) < math.inf


_BLOCKING = threading.Event()
_BUSY = threading.Semaphore(0)
_VICTIM_CALLS: list[str] = []


@wp.step
def _occupy(i: int) -> int:
    _BUSY.release()
    _BLOCKING.wait(60)
    return i


@wp.step
def _charge() -> str:
    _VICTIM_CALLS.append(threading.current_thread().name)
    return "charged"


@wp.workflow(name="t_presence_occupier", version=1)
async def _occupier_wf(ctx: wp.AsyncContext, i: int) -> int:
    return await ctx.run(_occupy, i)


@wp.workflow(name="t_presence_charge", version=1)
async def _charge_wf(ctx: wp.AsyncContext) -> str:
    return await ctx.run(_charge)


def _charge_in_code() -> str:
    _VICTIM_CALLS.append(threading.current_thread().name)
    return "charged"


@wp.workflow(name="t_presence_charge_code", version=1)
async def _charge_code_wf(ctx: wp.AsyncContext) -> str:
    charged: str = await ctx.code("charge", _charge_in_code, output=str)
    return charged


def _undo_charge(result: str, reason: dict[str, Any]) -> None:
    _VICTIM_CALLS.append(threading.current_thread().name)


@wp.step(compensate=_undo_charge)
async def _book() -> str:  # on the loop: only its compensation needs a user thread
    return "booked"


@wp.workflow(name="t_presence_charge_undo", version=1)
async def _charge_undo_wf(ctx: wp.AsyncContext) -> str:
    await ctx.run(_book)
    ctx.fail(ValueError("undo the booking"))


VICTIMS: dict[str, Any] = {
    "step": _charge_wf,
    "code block": _charge_code_wf,
    "compensation": _charge_undo_wf,
}


@pytest.mark.parametrize("kind", list(VICTIMS))
def test_user_code_queued_for_a_thread_checks_its_lease_on_that_thread(
    kind: str,
    proxied: tuple[TCPProxy, str],
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
) -> None:
    """The async worker checks a drive's lease on its loop, then hands a synchronous step
    (or ``ctx.code`` block) to its pool of user threads; with every thread busy it waits in
    the queue. Meanwhile the listening connection dies silently, another worker takes the
    run over and records it. When a thread frees up it must not run again: the lease is
    checked on that thread, right before the call (it ran twice, after the record)."""
    from wf_persist.async_worker import USER_THREADS

    proxy, proxy_url = proxied
    _BLOCKING.clear()
    _VICTIM_CALLS.clear()
    victim = VICTIMS[kind]
    holder = wp.Runtime(proxy_url, lease_ttl=30)
    try:
        other = make_runtime(lease_ttl=30)
        for rt in (holder, other):
            rt.register(_occupier_wf, victim)
        other.wakeups()
        holder.start_worker(concurrency=USER_THREADS + 8, event_loop=True, poll_interval=0.05)
        client = holder.client()
        for i in range(USER_THREADS):
            client.start(_occupier_wf, i)
        for _ in range(USER_THREADS):
            assert _BUSY.acquire(timeout=60), "every user thread busy"
        execution_id = client.start(victim).execution_id

        def queued() -> bool:
            row = other.client().describe(execution_id)
            return row.lease_owner == holder.owner

        wait_until(queued, what="the holder's claim", timeout=10)
        time.sleep(0.2)  # its lease checked on the loop, its step in the queue
        assert _VICTIM_CALLS == []
        _silence_listener(make_engine(db_url), proxy)
        wait_until(lambda: execution_id in other.reap(), what="the reap", timeout=10)
        wait_until(lambda: other.drive(execution_id), what="the takeover", timeout=10)
        outcome = other.client().result(execution_id, timeout=10)
        if kind == "compensation":
            assert isinstance(outcome, wp.Failed), outcome
        else:
            assert outcome.unwrap() == "charged"
        _BLOCKING.set()  # the holder's user threads free up
        time.sleep(1.0)
        assert len(_VICTIM_CALLS) == 1, _VICTIM_CALLS
    finally:
        _BLOCKING.set()
        proxy.close()
        holder.close()


def test_heartbeats_are_never_prepared_statements(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement prepared through ``pg_wire`` is prepared again every thousand runs, and
    the protocol's Close that forgets it holds the interpreter's lock for a round trip:
    forty heartbeats a second would freeze the whole process every half a minute (for
    seconds, on a connection that just died). Heartbeats and lock tries are sent as they
    are, never through it."""
    from wf_persist.backends import pg_wire

    sent_by: list[str] = []
    execute = pg_wire.execute

    def recording(*args: object, **kwargs: object) -> object:
        sent_by.append(threading.current_thread().name)
        return execute(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pg_wire, "execute", recording)
    rt = make_runtime(lease_ttl=30)
    wakeups = rt.wakeups()
    assert rt.presence_since() is not None
    first = wakeups.heard
    wait_until(lambda: wakeups.heard > first + 0.1, what="heartbeats", timeout=5)
    assert "wf-persist-wakeups" not in sent_by


_OWNERS: dict[str, str | None] = {}


@wp.step
def _read_owner(execution_id: str) -> str:
    with _OWNER_ENGINE["engine"].connect() as conn:
        owner = conn.execute(
            text("SELECT lease_owner FROM wf_executions WHERE id = :i"), {"i": execution_id}
        ).scalar_one()
    _OWNERS[execution_id] = owner
    return str(owner)


_OWNER_ENGINE: dict[str, Engine] = {}


@wp.workflow(name="t_presence_owner_after_quiet", version=1)
def _owner_after_quiet_wf(ctx: wp.Context) -> str:
    return ctx.run(_read_owner, ctx.execution_id)


def test_a_lease_keeps_its_presence_name_after_a_quiet_spell(
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
) -> None:
    """Heartbeats pause after a quiet spell (``BEAT_FOR``), so the first lease check after
    one finds no recent heartbeat; asking sends one, and the check waits a moment for it
    rather than take the lock as lost. Had it renamed the lease to the plain name (as a
    lock in doubt does), a crash of this process would free the run only when its lease
    lapsed (30 s), not 0.2 s after the lock is found free."""
    _OWNER_ENGINE["engine"] = make_engine(db_url)
    _OWNERS.clear()
    rt = make_runtime(lease_ttl=30)
    rt.register(_owner_after_quiet_wf)
    rt.wakeups()
    assert rt.owner.endswith("!")
    time.sleep(BEAT_FOR + 1.0)  # the heartbeats pause
    execution_id = rt.client().start(_owner_after_quiet_wf).execution_id
    assert rt.drive(execution_id)
    assert _OWNERS[execution_id] == rt.owner, "the lease lost its presence name"


def test_capability_probes_at_the_same_time_all_find_advisory_locks_working(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Each process probes once whether advisory locks exclude each other. Probes shared
    one key: a probe that met another process's concluded they lock nothing here, and that
    process ran its whole life without a presence lock (its runs taken over only after
    their lease). Each probe now has a key of its own."""
    import psycopg

    from wf_persist.backends.pg_presence import advisory_locks_work

    engine = make_engine(db_url, pool_size=4)
    libpq = make_url(db_url).set(drivername="postgresql").render_as_string(False)
    raws = [psycopg.connect(libpq, autocommit=True) for _ in range(4)]
    together = threading.Barrier(len(raws))
    found: list[bool] = []

    def probe(raw: Any) -> None:
        for _ in range(20):
            together.wait(timeout=30)
            found.append(advisory_locks_work(engine, raw))

    threads = [threading.Thread(target=probe, args=(raw,)) for raw in raws]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        for raw in raws:
            raw.close()
    assert len(found) == 80
    assert all(found), f"{found.count(False)} of 80 probes found the locks not working"
