"""The one place that tells SQLite, PostgreSQL and MySQL apart.

Everything else asks this module for an insert construct that can ignore conflicts, whether
a data-modifying CTE is available, or how to begin a write transaction.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Final

from sqlalchemy import Connection, Engine, event, make_url
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import URL, Dialect
from sqlalchemy.pool import ConnectionPoolEntry

from .errors import WfPersistError

#: Environment variable that names the database when no URL is passed.
DATABASE_URL_ENV: Final = "WF_PERSIST_DATABASE_URL"
#: The embedded default: a SQLite file in the working directory.
DEFAULT_URL: Final = "sqlite:///wf_persist.sqlite3"
#: How long a SQLite writer waits for the lock before failing (milliseconds).
SQLITE_BUSY_TIMEOUT_MS: Final = 30_000


def is_sqlite(dialect: Dialect) -> bool:
    return dialect.name == "sqlite"


def is_postgresql(dialect: Dialect) -> bool:
    return dialect.name == "postgresql"


def is_mysql(dialect: Dialect) -> bool:
    return dialect.name in ("mysql", "mariadb")


def insert_ignoring(
    dialect: Dialect, table: Any, conflict_columns: list[str], where: Any = None
) -> Any:
    """An INSERT into ``table`` that silently drops rows conflicting on ``conflict_columns``.

    Built once per (dialect, table, columns); pass the row as execution parameters.

    PostgreSQL and SQLite name the constraint (``ON CONFLICT (...) DO NOTHING``), so a
    conflict on any *other* unique constraint still raises; ``where`` repeats the predicate of
    a partial unique index. MySQL has no conflict target; a
    no-op ``ON DUPLICATE KEY UPDATE`` is the closest equivalent.
    """
    return _insert_ignoring(dialect.name, table, tuple(conflict_columns), where)


@functools.lru_cache(maxsize=64)
def _insert_ignoring(
    dialect_name: str, table: Any, conflict_columns: tuple[str, ...], where: Any
) -> Any:
    # rowcount tells the caller whether the row went in; SQLAlchemy only keeps it for
    # INSERTs when asked to.
    factories: dict[str, Any] = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
    factory = factories.get(dialect_name, mysql.insert)
    ins = factory(table).execution_options(preserve_rowcount=True)
    if dialect_name in ("mysql", "mariadb"):
        # No conflict target in MySQL. ``INSERT IGNORE`` reports 0 rows for a duplicate (an
        # ON DUPLICATE KEY no-op can report 1 with the driver's FOUND_ROWS flag); callers
        # insert only rows whose other constraints they have checked under a lock.
        return ins.prefix_with("IGNORE")
    return ins.on_conflict_do_nothing(index_elements=list(conflict_columns), index_where=where)


def supports_dml_cte(dialect: Dialect) -> bool:
    """PostgreSQL can run UPDATE ... RETURNING inside a WITH feeding an INSERT: one round trip."""
    return is_postgresql(dialect)


def normalize_url(url: str | URL) -> URL:
    """Pick psycopg 3 for ``postgresql://`` URLs (SQLAlchemy's default driver is psycopg2)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername in ("mysql", "mariadb"):
        parsed = parsed.set(drivername=f"{parsed.drivername}+pymysql")
    return parsed


def resolve_url(url: str | URL | None) -> URL:
    """The URL to use: the argument, else ``$WF_PERSIST_DATABASE_URL``, else embedded SQLite."""
    if url is None:
        url = os.environ.get(DATABASE_URL_ENV) or DEFAULT_URL
    return normalize_url(url)


def create_engine(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """Create an engine configured the way wf_persist wants its own engines.

    SQLite gets WAL, ``synchronous=FULL`` (a commit survives power loss), foreign keys, a busy
    timeout and ``BEGIN IMMEDIATE`` for write transactions, so two writers queue on the lock
    instead of failing on a read-to-write upgrade. Read-only transactions can opt into a
    deferred BEGIN with the execution option ``wf_persist_readonly=True``.

    Engines handed to wf_persist by a host application are never changed; this function is
    only for engines wf_persist owns.
    """
    resolved = resolve_url(url)
    # A driven run holds one connection and briefly borrows a second; the lease keeper and
    # concurrency slots need theirs too. Room for that keeps leases renewed under load.
    if kwargs.get("poolclass") is None:
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 40)
    if resolved.get_backend_name() == "sqlite":
        engine = sa_create_engine(resolved, **kwargs)
        _configure_sqlite(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", False)
    if resolved.get_backend_name() in ("mysql", "mariadb"):
        # What PostgreSQL does by default: each statement sees what committed before it.
        kwargs.setdefault("isolation_level", "READ COMMITTED")
    return sa_create_engine(resolved, **kwargs)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN is ours to send.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("wf_persist_readonly"):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def with_schema(engine: Engine, schema: str | None) -> Engine:
    """``engine`` rendering wf_persist's tables in ``schema`` (PostgreSQL only).

    Returns a copy with a ``schema_translate_map`` execution option; it shares the pool and
    leaves the original engine untouched.
    """
    if schema is None:
        return engine
    if not is_postgresql(engine.dialect):
        raise WfPersistError(f"a named schema needs PostgreSQL, not {engine.dialect.name}")
    return engine.execution_options(schema_translate_map={None: schema})


class UnsupportedDatabaseError(WfPersistError):
    """The database (or its version) lacks something wf_persist needs; the message says what."""


def requirement_problem(name: str, version: tuple[int, ...] | None, mariadb: bool) -> str | None:
    """Why a backend of this kind and version cannot run wf_persist, or ``None`` if it can."""
    if name == "sqlite":
        if version is not None and version < (3, 35):
            return "SQLite >= 3.35 is needed (UPDATE ... RETURNING); found " + _v(version)
        return None
    if name == "postgresql":
        if version is not None and version < (12,):
            return "PostgreSQL >= 12 is needed; found " + _v(version)
        return None
    if name in ("mysql", "mariadb"):
        if mariadb and version is not None and version < (10, 6):
            return "MariaDB >= 10.6 is needed (FOR UPDATE SKIP LOCKED); found " + _v(version)
        if not mariadb and version is not None and version < (8, 0, 1):
            return "MySQL >= 8.0.1 is needed (FOR UPDATE SKIP LOCKED); found " + _v(version)
        return None
    return f"the {name} dialect is not supported (SQLite, PostgreSQL, MySQL/MariaDB are)"


def _v(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


def check_engine(engine: Engine) -> None:
    """Fail early, and say why, if ``engine``'s database cannot run wf_persist.

    Reads the server version over one connection; changes nothing on the engine.
    """
    dialect = engine.dialect
    if dialect.name == "sqlite":
        import sqlite3

        version: tuple[int, ...] | None = sqlite3.sqlite_version_info
    else:
        with engine.connect() as conn:
            found = conn.dialect.server_version_info or ()
        version = tuple(p for p in found if isinstance(p, int)) or None
    problem = requirement_problem(
        dialect.name, version, bool(getattr(dialect, "is_mariadb", False))
    )
    if problem is not None:
        raise UnsupportedDatabaseError(problem)


def describe_url(url: URL) -> str:
    """The URL as it may appear in messages: password hidden."""
    return url.render_as_string(hide_password=True)
