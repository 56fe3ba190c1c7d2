"""Pooled connections a server may have ended while they sat idle.

A server that ends idle sessions (PostgreSQL's ``idle_session_timeout``, often set by
managed services; MySQL's ``wait_timeout``), or a proxy or firewall dropping idle TCP,
leaves dead connections in the pool, and the first statement on one fails. For a drive
that is the outcome write after a long step: the drive fails and the step runs again, at
every drive. So a connection that sat in the pool for :data:`PING_AFTER` seconds or more is
pinged when it is handed out, and replaced if the server ended it. A busy pool hands out
connections idle for less than that: its hot paths pay nothing.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Engine, event
from sqlalchemy.exc import DisconnectionError

from .. import clocks

#: Seconds in the pool after which a connection is pinged before it is handed out.
PING_AFTER: Final = 0.5
#: Key of ``ConnectionPoolEntry.info``: when the connection went back to the pool.
_IDLE_SINCE: Final = "wf_persist_idle_since"


def watch(engine: Engine) -> None:
    """Ping, at checkout, a connection of ``engine``'s pool that sat idle long enough (a
    pool of wf_persist's own: a host's engine is used as is, its ``pool_pre_ping`` its
    choice)."""
    dialect = engine.dialect

    def checkin(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = clocks.elapsed()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or clocks.elapsed() - since < PING_AFTER:
            return
        try:
            dialect.do_ping(dbapi_connection)
            dbapi_connection.rollback()  # the ping's implicit transaction, if it began one
        except dialect.loaded_dbapi.Error as exc:
            if dialect.is_disconnect(exc, dbapi_connection, None):
                # The pool discards this connection and hands out another (or a new one).
                raise DisconnectionError(f"an idle pooled connection was ended: {exc}") from exc
            raise

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)
