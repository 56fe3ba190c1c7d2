"""Persistence functions, one module per aggregate: catalog, executions, history, signals.

Every function takes a ``Session`` or ``Connection`` and never commits: the caller owns the
transaction, so a host application can include wf_persist writes in its own. What differs
between databases is asked of the :class:`~wf_persist.backends.Backend` passed in.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Result
from sqlalchemy.orm import Session, scoped_session

#: What the data functions accept: a host's ORM session (or a ``scoped_session`` of one,
#: Flask-SQLAlchemy's ``db.session``) or a Core connection.
Executor = Session | Connection | scoped_session[Session]


def rowcount(result: Result[Any]) -> int:
    """Rows matched by a DML statement (sessions type their results more loosely)."""
    return int(cast(CursorResult[Any], result).rowcount)


def connection_of(conn: Executor) -> Connection:
    """The Core connection behind a session (in its current transaction) or a connection."""
    return conn if isinstance(conn, Connection) else conn.connection()
