"""Step concurrency slots: ``Limit(n, key=...)`` on a step.

Where the database has session locks (PostgreSQL advisory locks, MySQL/MariaDB named locks) a
slot is such a lock, held on a connection of its own while the step runs: the limit holds
across every worker sharing the database, and a worker that dies releases its slots with its
connection. A held slot's session is ended by the server once it idles past
:attr:`SessionLockSlots.idle_limit`, and a heartbeat of its process keeps it from idling: a
worker frozen (SIGSTOP) or cut off frees its slots as it loses its leases, instead of
keeping the runs that took them over waiting for as long as it stays so. Elsewhere (SQLite)
a slot is a semaphore of this process.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Engine, func, select, text

from .. import clocks
from . import sockets

log = logging.getLogger("wf_persist.worker")

#: ``acquire()`` tries once, without blocking; True once a slot is held.
Acquire = Callable[[], bool]


def lock_key(namespace: str, step_name: str, key: str) -> int:
    """A stable signed 32-bit key for (step, key) in the schema or database ``namespace``
    whose wf_ tables the limit is for: a server's locks are shared by all its databases
    (MySQL's named locks) or all schemas of one (PostgreSQL's advisory locks), and two
    deployments must not hold each other's slots."""
    # surrogatepass: a key with a lone surrogate (any str) is a key like another.
    text = f"wf_persist\0{namespace}\0{step_name}\0{key}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


class Slots:
    """Per-process slots (semaphores); the database-wide kinds override :meth:`slot`."""

    #: Whether a limit holds across processes sharing the database.
    shared = False

    def __init__(self, engine: Engine, namespace: str = "") -> None:
        self.engine = engine
        #: Where the wf_ tables are (a schema, a database): limits hold within it.
        self.namespace = namespace
        self._lock = threading.Lock()
        self._semaphores: dict[tuple[str, str, int], threading.Semaphore] = {}

    def follow_lease(self, ttl: float) -> None:
        """Bound what a held slot outlives its worker by this lease TTL (where it can)."""

    @contextmanager
    def slot(self, step_name: str, key: str, limit: int) -> Iterator[Acquire]:
        """Yields ``acquire()``; the slot (if taken) is released on exit."""
        with self._lock:
            semaphore = self._semaphores.setdefault(
                (step_name, key, limit), threading.Semaphore(limit)
            )
        held = False
        ending = _Exit()

        def hold() -> None:
            nonlocal held
            held = True

        def acquire() -> bool:
            if not held and semaphore.acquire(blocking=False) and not ending.keep(hold):
                semaphore.release()
                return False
            return held

        try:
            yield acquire
        finally:
            ending.exit()
            if held:
                semaphore.release()


class _Exit:
    """A slot's exit and a late ``acquire()`` take turns: on the async worker a try runs
    on an io thread, and a cancel of the step's call runs the exit meanwhile; a slot that
    try takes afterwards must be given back at once, never kept (and, for a session lock,
    beaten for) for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exited = False

    def keep(self, hold: Callable[[], None]) -> bool:
        """``hold()`` (recording the slot taken) unless the exit came first; whether it
        did not."""
        with self._lock:
            if self._exited:
                return False
            hold()
            return True

    def exit(self) -> None:
        with self._lock:
            self._exited = True


@dataclass(eq=False)
class _Held:
    """A held slot's connection. Its heartbeat and its release take turns (``lock``);
    ``busy_since``: when the round trip on it now began (monotonic), to cut one that
    never ends."""

    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)
    busy_since: float | None = None
    #: Set (under ``guard``, never held across a round trip) once the release is through,
    #: before the connection goes back to the pool: no cut may reach it after that.
    done: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)


class SessionLockSlots(Slots):
    """Slots as session-level database locks ``(step, key, slot number)``."""

    shared = True
    #: The least :attr:`idle_limit` a runtime's lease sets: a heartbeat's turn a little
    #: late on a busy machine must not end a slot mid-step.
    min_idle: ClassVar[float] = 10.0

    def __init__(
        self, engine: Engine, namespace: str = "", cut: Callable[[Any], None] | None = None
    ) -> None:
        super().__init__(engine, namespace)
        #: Seconds a held slot's session may idle before the server ends it (and frees
        #: the slot): twice the runtime's lease TTL (see :meth:`follow_lease`), so a
        #: frozen worker's slots are free a lease after its runs can be taken over, and a
        #: step that keeps the GIL for long stretches (each round trip of the heartbeat
        #: needs a few turns of it) loses its lease before its slot. The heartbeat speaks
        #: every eighth of it.
        self.idle_limit = 60.0
        self._cut = cut
        self._held: set[_Held] = set()
        self._beat_thread: threading.Thread | None = None

    def follow_lease(self, ttl: float) -> None:
        self.idle_limit = min(max(2 * ttl, self.min_idle), _MOST_IDLE)

    def try_lock(self, conn: Connection, k1: int, slot: int) -> bool:
        raise NotImplementedError

    def unlock(self, conn: Connection, k1: int, slot: int) -> None:
        raise NotImplementedError

    def stay(self, conn: Connection) -> object:
        """Have the server end the held slot's session if it idles past
        :attr:`idle_limit` (and no sooner, whatever the session had: a host's timeout
        would end it mid-step); what :meth:`unstay` puts back."""
        return None

    def unstay(self, conn: Connection, saved: object) -> None:
        """Put back what :meth:`stay` changed, before the connection returns to the pool."""

    @contextmanager
    def slot(self, step_name: str, key: str, limit: int) -> Iterator[Acquire]:
        # A connection only while a slot is held: each try takes one and gives it back
        # if every slot is taken. Runs queueing for a slot (hundreds, on the async worker)
        # would otherwise each hold a pooled connection for nothing, and the pool would
        # have none left for the writes of the runs that hold the slots.
        k1 = lock_key(self.namespace, step_name, key)
        held: tuple[_Held, int, object] | None = None
        ending = _Exit()

        def acquire() -> bool:
            nonlocal held
            if held is None:
                conn = self.engine.connect()
                try:
                    conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                    got = next((s for s in range(limit) if self.try_lock(conn, k1, s)), None)
                    saved = None if got is None else self.stay(conn)
                except BaseException:
                    conn.invalidate()  # a lock it may have taken goes with its session
                    conn.close()
                    raise
                if got is None:
                    conn.close()
                    return False

                def hold() -> None:
                    nonlocal held
                    held = (self._keep(conn), got, saved)

                if not ending.keep(hold):
                    try:
                        self._release(conn, k1, got, saved)
                    finally:
                        conn.close()
                    return False
            return held is not None

        try:
            yield acquire
        finally:
            ending.exit()
            if held is not None:
                kept, got, saved = held
                try:
                    with kept.lock:
                        kept.busy_since = clocks.elapsed()  # cut if it never ends
                        try:
                            self._release(kept.conn, k1, got, saved)
                        finally:
                            with kept.guard:
                                kept.done = True
                            kept.conn.close()
                finally:
                    with self._lock:
                        self._held.discard(kept)

    def _keep(self, conn: Connection) -> _Held:
        """Beat for ``conn`` from now on (a heartbeat runs while any slot is held)."""
        kept = _Held(conn)
        with self._lock:
            self._held.add(kept)
            if self._beat_thread is None or not self._beat_thread.is_alive():  # or forked
                self._beat_thread = threading.Thread(
                    target=self._beat, name="wf-persist-slot-heartbeat", daemon=True
                )
                self._beat_thread.start()
        return kept

    def _beat(self) -> None:
        """Every eighth of :attr:`idle_limit`, a round trip on each held slot's session
        (each in a thread of its own: one that never comes back holds up no other), until
        none is held. A round trip, or a release, still waiting after the idle limit is on
        a connection cut without a word (or its process kept from running that long, when
        the server has ended the session anyway): it is ended, and the driver reports a
        lost connection. A session the server ended has lost its slot: said, and left to
        the release (the step runs on; its run's lease decides the rest)."""
        while True:
            time.sleep(self.idle_limit / 8)
            with self._lock:
                if not self._held:
                    self._beat_thread = None
                    return
                held = list(self._held)
            for kept in held:
                since = kept.busy_since
                try:
                    if since is None:
                        threading.Thread(
                            target=self._ping,
                            args=(kept,),
                            name="wf-persist-slot-ping",
                            daemon=True,
                        ).start()
                    elif clocks.elapsed() - since > self.idle_limit:
                        self._end(kept)
                except Exception as exc:  # no thread to be had, say: the next turn tries again
                    log.warning("a held concurrency slot's heartbeat failed: %s", exc)

    def _ping(self, kept: _Held) -> None:
        if not kept.lock.acquire(blocking=False):
            return  # being released
        try:
            if kept.conn.closed or kept.conn.invalidated:
                return
            kept.busy_since = clocks.elapsed()
            kept.conn.exec_driver_sql("SELECT 1")
        except Exception as exc:
            log.warning("a held concurrency slot's session ended: %s", exc)
        finally:
            kept.busy_since = None
            kept.lock.release()

    def _end(self, kept: _Held) -> None:
        """Cut the held slot's connection under a call that does not come back."""
        with kept.guard:
            if kept.done:
                return  # released meanwhile: the connection may serve another by now
            log.warning("a held concurrency slot's connection does not answer; it is cut")
            try:
                raw = kept.conn.connection.dbapi_connection
                if self._cut is not None and raw is not None:
                    self._cut(raw)
            except Exception as exc:  # invalidated meanwhile
                log.debug("cutting a held slot's connection: %s", exc)

    def _release(self, conn: Connection, k1: int, slot: int, saved: object) -> None:
        """Unlock the slot; if that fails, close the connection instead (the server then
        drops its session locks): a pooled connection must never keep a slot held. The
        step's outcome stands either way."""
        try:
            self.unlock(conn, k1, slot)
            self.unstay(conn, saved)
        except BaseException as exc:
            conn.invalidate()
            if not isinstance(exc, Exception):
                raise
            log.warning(
                "releasing a step's concurrency slot failed; its connection was closed: %s", exc
            )


class AdvisorySlots(SessionLockSlots):
    """PostgreSQL: a slot is a session-level advisory lock ``(k1, slot)``."""

    def try_lock(self, conn: Connection, k1: int, slot: int) -> bool:
        return bool(conn.execute(select(func.pg_try_advisory_lock(k1, slot))).scalar())

    def unlock(self, conn: Connection, k1: int, slot: int) -> None:
        conn.execute(select(func.pg_advisory_unlock(k1, slot)))

    def stay(self, conn: Connection) -> object:
        # idle_session_timeout: PostgreSQL 14+ (NULL before: such a server keeps a frozen
        # worker's slot until it thaws). The server's keepalives: a worker whose host
        # vanished without a word frees its slots in seconds (with the server's defaults,
        # hours). What the session had comes back.
        wanted = {**_HELD_SETTINGS, "idle_session_timeout": str(math.ceil(self.idle_limit * 1000))}
        names = list(wanted)
        found = conn.execute(select(*(func.current_setting(n, True) for n in names))).one()
        saved = {
            name: was
            for name, was in zip(names, found, strict=True)
            if was is not None and was != wanted[name]
        }
        if saved:
            conn.execute(select(*(func.set_config(n, wanted[n], False) for n in saved)))
        return saved

    def unstay(self, conn: Connection, saved: object) -> None:
        if isinstance(saved, dict) and saved:
            conn.execute(select(*(func.set_config(n, str(v), False) for n, v in saved.items())))


#: The most :attr:`SessionLockSlots.idle_limit` every server takes (PostgreSQL's
#: ``idle_session_timeout`` is an int of milliseconds: 24 days and some).
_MOST_IDLE: Final = 2_147_483.0


#: The keepalive settings of a held slot's session (those a server lacks are left alone).
_HELD_SETTINGS: Final = {
    "tcp_keepalives_idle": str(sockets.IDLE),
    "tcp_keepalives_interval": str(sockets.INTERVAL),
    "tcp_keepalives_count": str(sockets.COUNT),
    "tcp_user_timeout": str(sockets.USER_TIMEOUT_MS),
}


class NamedLockSlots(SessionLockSlots):
    """MySQL/MariaDB: a slot is a named lock (the server's, shared by its databases: the
    key carries the namespace)."""

    def _name(self, k1: int, slot: int) -> str:
        return f"wf_persist:{k1}:{slot}"

    def try_lock(self, conn: Connection, k1: int, slot: int) -> bool:
        got = conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": self._name(k1, slot)}).scalar()
        return got == 1

    def unlock(self, conn: Connection, k1: int, slot: int) -> None:
        conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": self._name(k1, slot)})

    def stay(self, conn: Connection) -> object:
        was = conn.execute(text("SELECT @@SESSION.wait_timeout")).scalar()
        conn.execute(text(f"SET SESSION wait_timeout = {max(1, math.ceil(self.idle_limit))}"))
        return was

    def unstay(self, conn: Connection, saved: object) -> None:
        conn.execute(text("SET SESSION wait_timeout = :s"), {"s": int(str(saved))})
