"""The database's clock, as SQL: lease expiry and due times never use a worker's clock.

``db_now()`` is the database's current time and ``db_later(seconds)`` that time plus a bound
number of seconds, both typed as wf_persist timestamps so they compare with the stored
columns and come back from RETURNING as aware UTC datetimes. Each backend compiles them its
own way (SQLAlchemy's ``@compiles``, the documented recipe for a portable "utcnow").
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

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


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return _SQLITE_NOW.format("")


@compiles(db_later, "sqlite")
def _sqlite_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return _SQLITE_NOW.format(f", '+' || ({seconds}) || ' seconds'")


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "clock_timestamp()"


@compiles(db_later, "postgresql")
def _pg_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(clock_timestamp() + make_interval(secs => {seconds}))"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _mysql_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "UTC_TIMESTAMP(6)"


@compiles(db_later, "mysql")
@compiles(db_later, "mariadb")
def _mysql_later(element: db_later, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(UTC_TIMESTAMP(6) + INTERVAL ROUND(({seconds}) * 1000000) MICROSECOND)"
