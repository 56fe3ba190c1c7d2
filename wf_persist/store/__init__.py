"""Persistence functions, one module per aggregate: catalog, executions, history.

Every function takes a ``Session`` or ``Connection`` and never commits: the caller owns the
transaction, so a host application can include wf_persist writes in its own.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Result
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

#: What the data functions accept: a host's ORM session or a Core connection.
Executor = Session | Connection


def dialect_of(conn: Executor) -> Dialect:
    """The dialect behind a session or connection."""
    if isinstance(conn, Connection):
        return conn.dialect
    return conn.get_bind().dialect


def rowcount(result: Result[Any]) -> int:
    """Rows matched by a DML statement (sessions type their results more loosely)."""
    return int(cast(CursorResult[Any], result).rowcount)
