"""Alembic environment for wf_persist's own migrations.

Used by ``wf-persist db ...``, :mod:`wf_persist.migrate` and contributors' ``alembic`` runs.
It keeps its bookkeeping in ``wf_persist_alembic_version`` (never the host's
``alembic_version``), looks only at ``wf_`` tables, and serializes concurrent upgrades:
PostgreSQL takes a transaction-scoped advisory lock before reading the current revision
(blocking, never proceeding without it); SQLite runs the whole upgrade in one
``BEGIN IMMEDIATE`` transaction. MySQL takes a named lock.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Dialect
from sqlalchemy.pool import NullPool

from alembic import context
from wf_persist import backends
from wf_persist.migrate import VERSION_TABLE, include_name, include_object_on
from wf_persist.models import metadata

config = context.config


SCHEMA: str | None = config.attributes.get("schema")


def _configure_args(backend: type[backends.Backend]) -> dict[str, Any]:
    return {
        "version_table_schema": SCHEMA,
        "target_metadata": metadata,
        "version_table": VERSION_TABLE,
        "include_name": include_name,
        "include_object": include_object_on(backend.names[0]),
        "render_as_batch": backend.batch_migrations,
        # SQLite DDL is transactional; saying so keeps the upgrade in one transaction.
        "transactional_ddl": backend.transactional_ddl,
        "compare_type": True,
    }


def _schema_statements(dialect: Dialect) -> list[str]:
    """Create the schema if need be, and search it: raw SQL in revisions (views) resolves
    names through the search path. The name is quoted as the dialect quotes (checked by
    ``wf_persist.migrate`` before this runs)."""
    assert SCHEMA is not None
    quoted = dialect.identifier_preparer.quote_identifier(SCHEMA)
    return [f"CREATE SCHEMA IF NOT EXISTS {quoted}", f"SET LOCAL search_path TO {quoted}"]


def _run(connection: Connection) -> None:
    if SCHEMA is not None:
        # Our revisions name no schema; the translate map puts every table in SCHEMA.
        connection = connection.execution_options(schema_translate_map={None: SCHEMA})
    backend = backends.backend_type(connection.dialect.name)
    context.configure(connection=connection, **_configure_args(backend))
    try:
        with context.begin_transaction():
            backend.migration_lock(connection)
            if SCHEMA is not None:
                for statement in _schema_statements(connection.dialect):
                    connection.exec_driver_sql(statement)  # as written: no % doubled
            context.run_migrations()
    finally:
        backend.migration_unlock(connection)  # where the lock is a session's, not a txn's


def run_migrations_offline() -> None:
    url = backends.resolve_url(config.get_main_option("sqlalchemy.url"))
    backend = backends.backend_type(url.get_backend_name())
    args = _configure_args(backend)
    context.configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"}, **args)
    with context.begin_transaction():
        lock = backend.offline_lock_sql()
        if lock is not None:
            context.execute(lock)
        if SCHEMA is not None:
            for statement in _schema_statements(context.get_context().dialect):
                context.execute(statement)
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = backends.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
