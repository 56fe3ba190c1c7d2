"""Persistence functions, one module per aggregate: catalog, executions, history.

Every function takes a ``Session`` or ``Connection`` and never commits: the caller owns the
transaction, so a host application can include wf_persist writes in its own.
"""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

#: What the data functions accept: a host's ORM session or a Core connection.
Executor = Session | Connection


def dialect_of(conn: Executor) -> Dialect:
    """The dialect behind a session or connection."""
    if isinstance(conn, Connection):
        return conn.dialect
    return conn.get_bind().dialect
