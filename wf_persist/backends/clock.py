"""The database's clock, as SQL: lease expiry and due times never use a worker's clock.

``db_now()`` is the database's current time and ``db_later(seconds)`` that time plus a bound
number of seconds, both typed as wf_persist timestamps so they compare with the stored
columns and come back from RETURNING as aware UTC datetimes. Each backend compiles them its
own way (SQLAlchemy's ``@compiles``, the documented recipe for a portable "utcnow").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from ..errors import UnsupportedDatabaseError
from ..models import UTC_DATETIME


class db_now(FunctionElement[Any]):
    """The database's current time (UTC)."""

    type = UTC_DATETIME
    inherit_cache = True
    name = "wf_db_now"


class db_later(FunctionElement[Any]):
    """The database's current time plus ``seconds`` (a SQL expression, e.g. a bindparam)."""

    type = UTC_DATETIME
    inherit_cache = True
    name = "wf_db_later"


# Timestamps on SQLite are text in SQLAlchemy's format, 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC),
# so text comparison is time comparison. SQLite's clock has millisecond resolution.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now'{}) || '000'"
#: The SQL function an engine with a virtual clock provides: '+<seconds> seconds'.
VIRTUAL_SHIFT = "wf_clock_shift"


def _sqlite_shift(compiler: SQLCompiler) -> str:
    """The modifier moving SQLite's 'now' on an engine with a virtual clock (the test kit's:
    :func:`use_virtual_clock`); compiled once per statement and engine."""
    return f", {VIRTUAL_SHIFT}()" if getattr(compiler.dialect, "wf_virtual_clock", False) else ""


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW.format(_sqlite_shift(compiler))


@compiles(db_later, "sqlite")
def _sqlite_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return _SQLITE_NOW.format(f"{_sqlite_shift(compiler)}, '+' || ({seconds}) || ' seconds'")


def use_virtual_clock(engine: Engine, shift: Callable[[], float]) -> None:
    """Make ``db_now()`` on this SQLite engine the real time plus ``shift()`` seconds (the
    test kit skips durable waits this way). Call before the engine's first statement."""
    if engine.dialect.name != "sqlite":
        raise UnsupportedDatabaseError("a virtual clock needs a SQLite engine")
    engine.dialect.wf_virtual_clock = True  # type: ignore[attr-defined]

    def install(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.create_function(
            VIRTUAL_SHIFT, 0, lambda: f"+{shift():.6f} seconds", deterministic=False
        )

    event.listen(engine, "connect", install)
    engine.dispose()  # connections opened before the listener lack the function


# PostgreSQL: the time the statement began. Unlike now() it moves on inside a host's long
# transaction; unlike clock_timestamp() it is stable within the statement, so a claim's
# ``wake_at <= db_now()`` is an index range over due runs, not a filter over every parked
# one. A statement that waits on a lock sees a slightly earlier time: claims and leases are
# then only more conservative.
@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_later, "postgresql")
def _pg_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(statement_timestamp() + make_interval(secs => {seconds}))"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _mysql_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "UTC_TIMESTAMP(6)"


@compiles(db_later, "mysql")
@compiles(db_later, "mariadb")
def _mysql_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(UTC_TIMESTAMP(6) + INTERVAL ROUND(({seconds}) * 1000000) MICROSECOND)"
