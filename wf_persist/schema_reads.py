"""What a database holds of wf_persist's schema, read without Alembic: the revisions its
version tables record (ours, and the ``wf_`` ones of a host's merged chain), the names of
ours already taken where none is recorded, and where a host engine's map puts our tables.

:mod:`wf_persist.migrate` judges what this finds (:class:`~wf_persist.migrate.SchemaState`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, String, column, func, inspect, select, table
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from . import backends
from .models import executions_table, metadata

if TYPE_CHECKING:
    from .backends.base import Backend

#: Alembic version table wf_persist uses (never the host application's).
VERSION_TABLE: Final = "wf_persist_alembic_version"
#: The version table of a host that merged our revisions into its own chain.
HOST_VERSION_TABLE: Final = "alembic_version"
#: The tables of our first revision, with the columns it gives them (CREATE TABLE is atomic:
#: one an interrupted first revision left on MySQL has exactly these).
FIRST_TABLES: Final = {
    "wf_workflows": frozenset({"name", "version", "source_hash", "registered_at"}),
    "wf_executions": frozenset(
        {"id", "workflow_name", "workflow_version", "status", "input", "result", "error"}
        | {"idempotency_key", "actor", "next_seq", "wake_at", "lease_owner"}
        | {"lease_expires_at", "created_at", "started_at", "finished_at", "updated_at"}
    ),
    "wf_history": frozenset(
        {"execution_id", "sequence", "type", "activity_name", "dedupe_key", "created_at", "event"}
    ),
}
#: The views our revisions create (CREATE OR REPLACE on MySQL: a host's would be lost).
VIEWS: Final = ("wf_step_attempts", "wf_execution_waits", "wf_run_tree")


@dataclasses.dataclass(frozen=True)
class Found:
    """The version records read, the names of ours taken, the mapped database."""

    standalone: tuple[str, ...]
    merged: tuple[str, ...]
    taken: tuple[str, ...]
    mapped: URL | None
    #: The host's version table the merged revisions were read from.
    host_table: str = HOST_VERSION_TABLE


def read(conn: Connection, schema: str | None) -> Found:
    """Read both version tables (and, where they record nothing, the names of ours taken),
    ending any transaction the reading began."""
    backend = backends.backend_type(conn.dialect.name)
    began = not conn.in_transaction()
    try:
        standalone, merged = _recorded(conn, schema)
        names: tuple[str, ...] = ()
        if not standalone and not merged:
            with backend.catalog_reads(conn):
                names = taken(conn, backend, schema)
            if names and backend.migrating(conn):
                # Another upgrade is building them (asked after looking: the tables it
                # builds appear only while it holds the lock, its record before it frees it).
                names = ()
            if names:  # seen after a concurrent upgrade committed: so is its record
                if began and conn.in_transaction():
                    conn.rollback()  # a fresh snapshot (REPEATABLE READ would keep the old)
                standalone, merged = _recorded(conn, schema)
        host_table = HOST_VERSION_TABLE
        if names and not standalone and not merged and began:
            with backend.catalog_reads(conn):
                host_table, merged = _renamed_host_versions(conn, backend, schema)
            names = () if merged else names
        mapped = None
        if schema is not None and not backend.supports_schemas:
            mapped = backend.mapped_database(conn, schema)
    finally:
        if began and conn.in_transaction():
            conn.rollback()
    return Found(standalone, merged, names, mapped, host_table)


def _recorded(conn: Connection, schema: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Our version table's revisions and the ``wf_`` ones of the host's."""
    inspector = inspect(conn)
    standalone = _versions(conn, inspector.has_table(VERSION_TABLE, schema), VERSION_TABLE, schema)
    host = _host_versions(conn, inspector, schema)
    return standalone, tuple(r for r in host if r.startswith("wf_"))


def taken(conn: Connection, backend: type[Backend], schema: str | None) -> tuple[str, ...]:
    """The names our revisions create that a database recording none of them has already:
    the first revision would fail on them. Our tables an interrupted first revision left
    (where DDL is not transactional) are not counted."""
    inspector = inspect(conn)
    present = set(inspector.get_table_names(schema)) | set(inspector.get_view_names(schema))
    found: list[str] = [name for name in VIEWS if name in present]
    for name in metadata.tables:
        first = FIRST_TABLES.get(name, frozenset())
        if name in present and backend.foreign_table(conn, name, schema, first):
            found.append(name)
    return tuple(sorted(found))


def _host_versions(conn: Connection, inspector: Any, schema: str | None) -> tuple[str, ...]:
    """The host's Alembic revisions; none where the database refuses this engine's user
    their table (a user granted wf_persist's tables only: MySQL refuses even to describe
    it). Such a user sees the database as wf_persist's own version table records it."""
    try:
        exists = inspector.has_table(HOST_VERSION_TABLE, schema)
        return _versions(conn, exists, HOST_VERSION_TABLE, schema)
    except DBAPIError as exc:
        if not backends.backend_type(conn.dialect.name).refused(exc):
            raise
        return ()


def _renamed_host_versions(
    conn: Connection, backend: type[Backend], schema: str | None
) -> tuple[str, tuple[str, ...]]:
    """A host's Alembic environment may name its version table otherwise (``env.py``'s
    ``version_table``), or keep it in another schema (``version_table_schema``, where a
    database has schemas): the one table of a single text column ``version_num`` holding
    ``wf_`` revisions is the one that merged ours. Read only where our names are taken and
    nothing is recorded (the database was refused as holding another application's
    tables), on a transaction of this read's own. Two such tables (a copy kept by hand),
    or one this user may not read, leave the record unknown: refused as before."""
    inspector = inspect(conn)
    quote = conn.dialect.identifier_preparer.quote
    candidates: list[tuple[str | None, str]] = [
        (schema, name)
        for (_, name), columns in sorted(inspector.get_multi_columns(schema).items())
        if name != VERSION_TABLE
        and [c["name"] for c in columns] == ["version_num"]
        and isinstance(columns[0]["type"], String)
    ]
    if backend.supports_schemas:
        try:
            candidates += _elsewhere(conn, schema or str(inspector.default_schema_name))
        except DBAPIError as exc:
            if not backend.refused(exc):
                raise
            return HOST_VERSION_TABLE, ()  # (the transaction has failed: stop)
    found: list[tuple[str, tuple[str, ...]]] = []
    for where, name in candidates:
        try:
            rows = _versions(conn, True, name, where)
        except DBAPIError as exc:
            if not backend.refused(exc):
                raise
            return HOST_VERSION_TABLE, ()  # (PostgreSQL's transaction has failed: stop)
        ours = tuple(sorted(r for r in rows if isinstance(r, str) and r.startswith("wf_")))
        if ours:
            shown = name if where == schema else f"{quote(where or '')}.{quote(name)}"
            found.append((shown, ours))
    return found[0] if len(found) == 1 else (HOST_VERSION_TABLE, ())


def _elsewhere(conn: Connection, ours: str) -> list[tuple[str | None, str]]:
    """One-column text ``version_num`` tables in the other schemas (one catalog query,
    however many schemas a database has), but the server's own and those holding tables of
    ours: a version table there records those. The catalog lists only tables this user has
    a privilege on: one it may not touch is not a candidate."""
    cols = table(
        "columns",
        column("table_schema"),
        column("table_name"),
        column("column_name"),
        column("data_type"),
        schema="information_schema",
    )
    tables = table(
        "tables", column("table_schema"), column("table_name"), schema="information_schema"
    )
    holding_ours = select(tables.c.table_schema).where(tables.c.table_name == executions_table.name)
    found = conn.execute(
        select(cols.c.table_schema, cols.c.table_name)
        .where(
            cols.c.table_schema != ours,
            cols.c.table_schema != "information_schema",
            ~cols.c.table_schema.startswith("pg_", autoescape=True),
            cols.c.table_schema.not_in(holding_ours),
        )
        .group_by(cols.c.table_schema, cols.c.table_name)
        .having(func.count() == 1)
        .having(func.max(cols.c.column_name) == "version_num")
        .having(func.max(cols.c.data_type).in_(("character varying", "text", "character")))
        .order_by(cols.c.table_schema, cols.c.table_name)
    ).all()
    return [(str(where), str(name)) for where, name in found]


def _versions(conn: Connection, exists: bool, name: str, schema: str | None) -> tuple[str, ...]:
    if not exists:
        return ()
    version = table(name, column("version_num"), schema=schema)
    return tuple(sorted(conn.execute(select(version.c.version_num)).scalars()))
