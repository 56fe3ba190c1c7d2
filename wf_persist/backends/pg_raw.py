"""Statements straight to psycopg on PostgreSQL, past SQLAlchemy's execution machinery
(which is most of a start's, a claim's or a thin client's read's CPU): SQL rendered once
per statement object, sent through libpq on an idle connection (``pg_wire``) or a cursor.
Errors are handled as SQLAlchemy would (a dead connection is invalidated, the error
wrapped). :class:`~.postgresql.PostgreSQLBackend` is one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Row

from .. import clocks
from .base import Backend
from .pg_json import own_loads
from .pg_sql import claims_of
from .sql import Claim, RowShape


class RawPath(Backend):
    """The raw statement path (its settings are the PostgreSQL backend's)."""

    #: Whether a statement in autocommit runs at READ COMMITTED (the sessions' default).
    autocommit_writes: bool
    #: Statements may go straight to psycopg (not through an asyncio engine).
    raw_ok: bool
    #: ``pg_wire`` where the driver is psycopg 3, else None.
    wire: ModuleType | None
    _rendered: dict[Any, tuple[str, dict[str, Any]]]
    _shapes: dict[Any, RowShape]

    def _render(self, stmt: Any) -> tuple[str, dict[str, Any]]:
        """SQL for the raw driver (rendered once per statement object) and the values of
        the statement's own literal parameters."""
        found = self._rendered.get(stmt)
        if found is None:
            translate: dict[str, Any] = (
                {"schema_translate_map": self.schema_map, "render_schema_translate": True}
                if self.schema_map
                else {}
            )
            compiled = stmt.compile(dialect=self.base_engine.dialect, **translate)
            found = self._rendered[stmt] = (str(compiled), compiled.construct_params(_check=False))
        return found

    def _raw(self, stmt: Any, params: dict[str, Any], conn: Connection | None = None) -> Any:
        """One statement straight to psycopg in autocommit (on ``conn``'s connection, or a
        pooled one): what SQLAlchemy's execution and result machinery would cost is most of
        a start's or a claim's CPU. JSON values must come serialized."""
        sql, defaults = self._render(stmt)
        return self._send_raw(sql, {**defaults, **params}, conn)

    def _checkout(self) -> Any:
        """A pooled DBAPI connection; failing to connect raises SQLAlchemy's error, as
        ``engine.connect()`` would (``raw_connection`` leaves the driver's unwrapped)."""
        self.check_process()
        dialect = self.base_engine.dialect
        try:
            return self.base_engine.raw_connection()
        except dialect.loaded_dbapi.Error as exc:
            raise self.wrapped(exc, None, dialect.is_disconnect(exc, None, None)) from exc

    def _send_raw(self, sql: str, params: dict[str, Any], conn: Connection | None = None) -> Any:
        owner: Any = conn if conn is not None else self._checkout()
        raw: Any = (
            conn.connection.driver_connection if conn is not None else owner.driver_connection
        )
        cursor = None
        try:
            if not self.autocommit_writes:
                # The sessions' default is above READ COMMITTED: a statement in autocommit
                # would run at it, and a claim meeting a concurrent update of its run would
                # fail with a serialization error instead of re-checking the run.
                from psycopg import IsolationLevel

                level = raw.isolation_level
                raw.isolation_level = IsolationLevel.READ_COMMITTED
                try:
                    with raw.transaction(), raw.cursor() as cursor:
                        own_loads(cursor)
                        cursor.execute(sql, params)
                        return cursor.fetchall()
                finally:
                    if not raw.closed:
                        raw.isolation_level = level
            if self.wire is not None and self.wire.usable(raw):
                return self.wire.execute(raw, owner.info, sql, params)
            # As the connection was (a host engine's may be in AUTOCOMMIT already).
            was = raw.autocommit
            raw.autocommit = True
            try:
                with raw.cursor() as cursor:
                    own_loads(cursor)
                    cursor.execute(sql, params)
                    return cursor.fetchall()
            finally:
                if not raw.closed:
                    raw.autocommit = was
        except Exception as exc:
            raise self.raw_failure(owner, exc, sql, cursor) from exc
        finally:
            if conn is None:
                owner.close()

    def read_one(self, stmt: Any, params: dict[str, Any]) -> Row[Any] | None:
        # SQLAlchemy's connection, execution and result machinery is two thirds of such a
        # read's time (a thin client's look at a run whose end it heard).
        if not self.raw_ok:
            return super().read_one(stmt, params)
        shape = self._shapes.get(stmt)
        if shape is None:
            shape = self._shapes[stmt] = RowShape(stmt, self.base_engine.dialect)
        return shape.one(self._raw(stmt, params))

    def _auto(self, stmt: Any, params: dict[str, Any]) -> list[Claim]:
        asked = clocks.elapsed()
        return claims_of(self._raw(stmt, params), asked)


def as_created() -> Callable[[Any, Any, Any], None]:
    """The pool's checkout listener of an engine of our own: its connections leave the pool
    as they were created (READ COMMITTED, not in autocommit, neither read-only nor
    deferrable) whatever an application that borrowed one raw
    (``runtime.engine.raw_connection()``) left on its driver connection: the pool only
    undoes changes made through SQLAlchemy. Attribute reads only at each checkout."""
    from psycopg import IsolationLevel, pq

    idle, read_committed = pq.TransactionStatus.IDLE, IsolationLevel.READ_COMMITTED

    def reset(conn: Any, _record: Any, _proxy: Any) -> None:
        if conn.pgconn.transaction_status != idle:
            return  # cannot happen after the pool's reset; a setter would refuse it
        if conn.autocommit:
            conn.autocommit = False
        if conn.isolation_level != read_committed:
            conn.isolation_level = read_committed
        if conn.read_only is not None:
            conn.read_only = None
        if conn.deferrable is not None:
            conn.deferrable = None

    return reset
