"""PostgreSQL's listening connection: LISTEN for wake-ups, and the presence lock.

The presence lock is a session-level advisory lock keyed by ``hashtextextended(owner, 0)``,
held by the listening connection of a runtime that claims runs. The server drops it the
moment that connection dies (the process was killed, the machine went away), which is what
lets another worker take the runs over at once (:data:`REAP`) rather than after the lease.
A runtime whose lock is held shows in ``lease_owner`` with :data:`PRESENT_MARK` at the end:
only such owners are ever reaped (a runtime without the lock, e.g. one that could not take
it, is recovered by lease expiry as before).

A connection can die without a word reaching its process (a failover to a standby, a NAT or
firewall entry dropped, a proxy's host gone): the server frees the lock, the process still
believes it holds it. So the process trusts its lock only as far as its last heartbeat (a
round trip on this connection, see :meth:`PGListener.wait`) vouches for it, and a reaper
makes the runs due only a grace period after it found the lock free, longer than that
trust lasts (see :mod:`wf_persist.wakeups`). The socket fails within seconds rather than
after the kernel's retransmissions, so notifications and the lock come back soon.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

from psycopg import errors, pq
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from .. import clocks
from ..wakeups import HEAR_DUE, HEAR_END, Hearing
from . import pg_wire, sockets
from .connections import dispose_pool

if TYPE_CHECKING:
    from .postgresql import PostgreSQLBackend

log = logging.getLogger("wf_persist.worker")

#: SQLSTATEs of a feature the database does not have (feature not supported, undefined
#: function): the capability is off, the guarantees stay (polling, lease expiry).
UNSUPPORTED: Final = ("0A000", "42883")
#: How the listening connection shows in ``pg_stat_activity.application_name``.
APPLICATION_NAME: Final = "wf_persist listener"
#: The end of an owner whose presence lock is held (``host:pid:id!``).
PRESENT_MARK: Final = "!"
_KEY: Final = "hashtextextended(%s, 0)"
#: Tries (and the pause between them) to take the presence lock on connecting.
LOCK_TRIES: Final = 5
LOCK_RETRY: Final = 0.01

#: How soon a silent listening connection fails on either side: TCP keepalives while it is
#: idle, and an unacknowledged write (a heartbeat) failing after this many milliseconds.
KEEPALIVE_IDLE: Final = 5
KEEPALIVE_INTERVAL: Final = 1
KEEPALIVE_COUNT: Final = 3
USER_TIMEOUT_MS: Final = 5_000
#: A heartbeat unanswered this long (seconds) fails the listening connection (and frees
#: the lock: the process's runs are then taken over, so not a hiccup's length).
BEAT_DEADLINE: Final = 10.0

#: Runs leased by owners whose presence lock is free: their process is gone, or it lost its
#: listening connection and stops trusting its leases within less than ``grace`` seconds
#: (its last heartbeat is older), so the runs are due ``grace`` seconds after the lock was
#: found free (read after the lock was tried; a later look never extends it), counted for
#: each run when its row is reached: a renewal committed while this statement waited for
#: that row keeps its full grace (the owner may trust it that long). The lock is
#: tried at transaction level, so it is released when this statement (in autocommit)
#: ends. The owners are walked in order through the partial lease-owner index, one probe
#: each (a loose index scan): the look costs the same with ten runs in flight or fifty
#: thousand. The statuses are spelled as that index's predicate (and the claim index's).
#: Their step concurrency slots (``wf_slots``) are left to lapse with their TTL: a live
#: process's lock is free too while its listener reconnects (after a database restart,
#: say), and a run taken over replays (a step in flight may run twice), where a slot taken
#: from a step still running lets a second run into a limit.
REAP: Final = """
WITH RECURSIVE owners(lease_owner) AS (
    (SELECT lease_owner FROM {table}
     WHERE lease_owner IS NOT NULL AND status IN ('compensating', 'running', 'suspended')
     ORDER BY lease_owner LIMIT 1)
    UNION ALL
    SELECT (SELECT later.lease_owner FROM {table} AS later
            WHERE later.lease_owner > owners.lease_owner AND later.lease_owner IS NOT NULL
              AND later.status IN ('compensating', 'running', 'suspended')
            ORDER BY later.lease_owner LIMIT 1)
    FROM owners WHERE owners.lease_owner IS NOT NULL
),
dead AS (
    SELECT lease_owner
    FROM owners
    WHERE lease_owner LIKE '%%!' AND lease_owner <> %(me)s
      AND pg_try_advisory_xact_lock(hashtextextended(lease_owner, 0))
)
UPDATE {table} AS run
SET (lease_expires_at, wake_at) = (
    SELECT due, LEAST(run.wake_at, due)
    FROM (SELECT clock_timestamp() + make_interval(secs => %(grace)s) AS due) AS now_due
)
FROM dead
WHERE run.lease_owner = dead.lease_owner
  AND run.status IN ('compensating', 'running', 'suspended')
  AND run.lease_expires_at > clock_timestamp() + make_interval(secs => %(grace)s)
RETURNING run.id
"""


class PGListener:
    """One connection of the process's own, in autocommit: LISTEN, and the presence lock."""

    def __init__(
        self, backend: PostgreSQLBackend, owner: str | None, hear: frozenset[Hearing]
    ) -> None:
        self._nudge_lock = threading.RLock()  # close() in a signal handler nudges too
        self._nudge_r = self._nudge_w = -1
        self._engine: Engine = backend.side_engine()
        try:
            fairy = self._engine.raw_connection()
            raw: Any = fairy.driver_connection
            fairy.detach()  # this process's for good: not a pool connection any more
            self._raw = raw
            raw.autocommit = True
            raw.execute(f"SET application_name = '{APPLICATION_NAME}'")  # for operators
            _fail_fast(raw)
            self._channels = {HEAR_DUE: backend.channel(), HEAR_END: backend.end_channel()}
            # Whether this database can LISTEN at all is found here, whatever is heard yet
            # (a database without it raises "feature not supported": workers then poll).
            for kind in sorted(hear) or [HEAR_DUE]:
                raw.execute(f'LISTEN "{self._quoted(kind)}"')
            if not hear:
                raw.execute(f'UNLISTEN "{self._quoted(HEAR_DUE)}"')
            #: The owner whose presence lock this connection should hold (None: no lock).
            self._owner = (
                owner if owner is not None and backend.presence_ok(self._engine, raw) else None
            )
            self.present = False
            #: When (monotonic) the last round trip that found the lock held was sent.
            self.heard = -math.inf
            # From here on libpq is used directly (psycopg's notifies() costs a millisecond
            # of CPU per call, at every tick): notifications stay in libpq's queue.
            self._beat_sent: float | None = None
            self._encoding = raw.info.encoding
            self._poll = select.poll()
            self._poll.register(raw.pgconn.socket, select.POLLIN)
            # interrupt() ends a wait early: a byte down a pipe the wait polls too.
            self._nudge_r, self._nudge_w = os.pipe()
            os.set_blocking(self._nudge_w, False)
            self._poll.register(self._nudge_r, select.POLLIN)
            self._relock()
        except BaseException:
            self.close()
            raise

    def _relock(self) -> None:
        """Take the presence lock if it is not held. Another process's reaper holds it for
        the instant of its statement: a few tries get past that. Until the lock is held
        again (after a reconnection), this owner's runs may be taken over; fencing keeps
        that harmless, and each tick of :meth:`wait` tries again."""
        if self._owner is None or self.present:
            return
        for attempt in range(LOCK_TRIES):
            sent = clocks.elapsed()
            if self._locked():
                self.present = True
                self.heard = sent
                return
            if attempt + 1 < LOCK_TRIES:
                time.sleep(LOCK_RETRY)

    def wait(self, timeout: float, beat: bool = False) -> list[str]:
        """``beat``: while the lock is held, a heartbeat is sent (unless one is on its way).
        A session that answers still holds its session locks, so the lock was held when
        the server read it, at the earliest when it was sent (:attr:`heard` is then that
        time). A heartbeat unanswered for :data:`BEAT_DEADLINE` fails the connection: a
        hop in between (a pooler, a proxy) may keep its TCP alive for minutes after its
        own upstream died."""
        if not self.present:
            self._relock()
        elif beat and self._beat_sent is None:
            with self._raw.lock:
                self._beat_sent = clocks.elapsed()
                self._raw.pgconn.send_query(b"SELECT true")
                pg_wire.flushed(self._raw.pgconn, BEAT_DEADLINE)
        payloads = self._received()
        if payloads:
            return payloads
        if self._beat_sent is not None:
            timeout = min(timeout, self._beat_sent + BEAT_DEADLINE - clocks.elapsed())
        ready = dict(self._poll.poll(max(0.0, timeout) * 1000))
        if self._nudge_r in ready:
            os.read(self._nudge_r, 512)
        if len(ready) > (self._nudge_r in ready):
            payloads = self._received(consume=True)
        if self._beat_sent is not None and clocks.elapsed() - self._beat_sent > BEAT_DEADLINE:
            raise errors.OperationalError(
                f"the listening connection did not answer a heartbeat within {BEAT_DEADLINE} s"
            )
        return payloads

    def hear(self, kinds: frozenset[Hearing]) -> bool:
        """``LISTEN`` on the channels of ``kinds`` (not while a heartbeat's answer is due:
        libpq sends one command at a time)."""
        if self._beat_sent is not None:
            return False
        pgconn = self._raw.pgconn
        for kind in sorted(kinds):
            with self._raw.lock:
                result = pgconn.exec_(f'LISTEN "{self._quoted(kind)}"'.encode(self._encoding))
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise pg_wire.failure(self._raw, result)
        return True

    def _quoted(self, kind: Hearing) -> str:
        return self._channels[kind].replace('"', '""')

    def interrupt(self) -> None:
        with self._nudge_lock:  # never a write to a descriptor closed (and reused) meanwhile
            if self._nudge_w >= 0:
                with contextlib.suppress(BlockingIOError):  # nudged already
                    os.write(self._nudge_w, b".")

    def _locked(self) -> bool:
        """Try the presence lock (unprepared: nothing to plan, nothing to re-prepare)."""
        pgconn = self._raw.pgconn
        with self._raw.lock:
            result = pgconn.exec_params(
                f"SELECT pg_try_advisory_lock({_KEY})".replace("%s", "$1").encode(),
                [str(self._owner).encode(self._encoding)],
            )
        if result.status != pq.ExecStatus.TUPLES_OK:
            raise pg_wire.failure(self._raw, result)
        return bool(result.get_value(0, 0) == b"t")

    def _received(self, consume: bool = False) -> list[str]:
        """The notifications libpq has read (after reading what the socket holds), and the
        heartbeat's answer if it came."""
        pgconn = self._raw.pgconn
        with self._raw.lock:
            if consume:
                pgconn.consume_input()  # raises if the connection is lost
                if pgconn.status != pq.ConnStatus.OK:
                    raise errors.OperationalError("the listening connection was lost")
            while self._beat_sent is not None and not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:  # the heartbeat's answer is complete
                    self.heard, self._beat_sent = self._beat_sent, None
                elif result.status != pq.ExecStatus.TUPLES_OK:
                    raise pg_wire.failure(self._raw, result)
            found = []
            while (notify := pgconn.notifies()) is not None:
                found.append(notify.extra.decode(self._encoding, "replace"))
        return found

    def close(self) -> None:
        with self._nudge_lock:
            for fd in (self._nudge_r, self._nudge_w):
                if fd >= 0:
                    os.close(fd)
            self._nudge_r = self._nudge_w = -1
        raw = getattr(self, "_raw", None)
        if raw is not None and not raw.closed:
            try:
                raw.close()
            except Exception as exc:  # closing a broken connection
                log.debug("closing the listening connection: %s", exc)
        dispose_pool(self._engine)


def _fail_fast(raw: Any) -> None:
    """Make a dead TCP connection fail within seconds on both ends, whatever connected it
    (a host's creator may not pass libpq's keepalive options): the client's socket gets
    keepalives and a user timeout, the server's session the same settings (for operators
    whose clients vanish: the lock is then freed without waiting for a lease)."""
    try:
        sock = socket.socket(fileno=os.dup(raw.pgconn.socket))
    except OSError as exc:
        log.debug("the listening connection's socket: %s", exc)
        return
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return  # a Unix socket: the server's end cannot vanish silently
        sockets.keep_alive(
            sock, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT, USER_TIMEOUT_MS
        )
    settings = {
        "tcp_keepalives_idle": KEEPALIVE_IDLE,
        "tcp_keepalives_interval": KEEPALIVE_INTERVAL,
        "tcp_keepalives_count": KEEPALIVE_COUNT,
        "tcp_user_timeout": USER_TIMEOUT_MS,
        # A database's or role's idle_session_timeout (PostgreSQL 14+) would end this
        # session whenever the process has nothing to hear for that long.
        "idle_session_timeout": 0,
    }
    for name, value in settings.items():
        try:
            raw.execute("SELECT set_config(%s, %s, false)", [name, str(value)])
        except Exception as exc:  # a PostgreSQL-compatible database without the setting
            if getattr(exc, "sqlstate", None) is None:
                raise
            log.debug("the listening session keeps its %s: %s", name, exc)


def advisory_locks_work(engine: Engine, raw: Any) -> bool:
    """Whether session advisory locks really exclude each other here (some
    PostgreSQL-compatible databases refuse the functions, others accept them but lock
    nothing): tried on ``raw`` (the listener's own connection, in autocommit) and on one
    connection of ``engine`` (a pool of one connection is enough)."""
    try:
        return _exclusive(engine, raw)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) in UNSUPPORTED:
            return False
        raise
    except Exception as exc:  # the listener's own connection: a driver error
        if getattr(exc, "sqlstate", None) in UNSUPPORTED:
            return False
        raise


def _exclusive(engine: Engine, raw: Any) -> bool:
    # A key of its own: another process probing at the same time holds the same fixed key,
    # and this probe would conclude the locks lock nothing (no presence for its life).
    key = f"wf_persist capability probe {uuid.uuid4()}"
    first = raw.execute(f"SELECT pg_try_advisory_lock({_KEY})", [key]).fetchone()[0]
    try:
        with engine.connect() as two:
            second = two.exec_driver_sql(f"SELECT pg_try_advisory_lock({_KEY})", (key,)).scalar()
            if second:
                two.exec_driver_sql(f"SELECT pg_advisory_unlock({_KEY})", (key,))
            two.rollback()
    finally:
        if first:
            raw.execute(f"SELECT pg_advisory_unlock({_KEY})", [key])
    return bool(first) and not second
