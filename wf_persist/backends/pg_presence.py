"""PostgreSQL's listening connection: LISTEN for wake-ups, and the presence lock.

The presence lock is a session-level advisory lock keyed by ``hashtextextended(owner, 0)``,
held by the listening connection of a runtime that claims runs. The server drops it the
moment that connection dies (the process was killed, the machine went away), which is what
lets another worker take the runs over at once (:data:`REAP`) rather than after the lease.
A runtime whose lock is held shows in ``lease_owner`` with :data:`PRESENT_MARK` at the end:
only such owners are ever reaped (a runtime without the lock, e.g. one that could not take
it, is recovered by lease expiry as before).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

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

#: Runs leased by owners whose presence lock is free: their process is gone. The lock is
#: tried at transaction level, so it is released when this statement (in autocommit) ends.
#: The statuses are spelled as the partial claim index's predicate: both lookups read that
#: index's unfinished runs, never the finished ones.
REAP: Final = """
WITH owners AS (
    SELECT DISTINCT lease_owner FROM {table}
    WHERE lease_owner IS NOT NULL AND status IN ('compensating', 'running', 'suspended')
),
dead AS (
    SELECT lease_owner FROM owners
    WHERE lease_owner LIKE '%%!' AND lease_owner <> %(me)s
      AND pg_try_advisory_xact_lock(hashtextextended(lease_owner, 0))
)
UPDATE {table}
SET wake_at = clock_timestamp(), lease_expires_at = clock_timestamp()
WHERE lease_owner IN (SELECT lease_owner FROM dead)
  AND status IN ('compensating', 'running', 'suspended')
  AND lease_expires_at > clock_timestamp()
RETURNING id
"""


class PGListener:
    """One connection of the process's own, in autocommit: LISTEN, and the presence lock."""

    def __init__(self, backend: PostgreSQLBackend, owner: str | None) -> None:
        self._engine: Engine = backend.side_engine()
        try:
            fairy = self._engine.raw_connection()
            raw: Any = fairy.driver_connection
            fairy.detach()  # this process's for good: not a pool connection any more
            self._raw = raw
            raw.autocommit = True
            raw.execute(f"SET application_name = '{APPLICATION_NAME}'")  # for operators
            quoted = backend.channel().replace('"', '""')
            raw.execute(f'LISTEN "{quoted}"')
            #: The owner whose presence lock this connection should hold (None: no lock).
            self._owner = (
                owner if owner is not None and backend.presence_ok(self._engine, raw) else None
            )
            self.present = False
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
            cursor = self._raw.execute(f"SELECT pg_try_advisory_lock({_KEY})", [self._owner])
            if cursor.fetchone()[0]:
                self.present = True
                return
            if attempt + 1 < LOCK_TRIES:
                time.sleep(LOCK_RETRY)

    def wait(self, timeout: float) -> list[str]:
        self._relock()
        return [n.payload for n in self._raw.notifies(timeout=timeout, stop_after=1)]

    def close(self) -> None:
        raw = getattr(self, "_raw", None)
        if raw is not None and not raw.closed:
            try:
                raw.close()
            except Exception as exc:  # closing a broken connection
                log.debug("closing the listening connection: %s", exc)
        self._engine.dispose()


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
    key = "wf_persist capability probe"
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
