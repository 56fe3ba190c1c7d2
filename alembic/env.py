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

from sqlalchemy import Connection, text
from sqlalchemy.pool import NullPool

from alembic import context
from wf_persist import _dialect
from wf_persist.migrate import MIGRATION_LOCK_KEY, VERSION_TABLE, include_name
from wf_persist.models import metadata

config = context.config


SCHEMA: str | None = config.attributes.get("schema")


def _configure_args(dialect_name: str) -> dict[str, Any]:
    return {
        "version_table_schema": SCHEMA,
        "target_metadata": metadata,
        "version_table": VERSION_TABLE,
        "include_name": include_name,
        "render_as_batch": dialect_name == "sqlite",
        # SQLite DDL is transactional; saying so keeps the upgrade in one transaction.
        "transactional_ddl": dialect_name != "mysql" and dialect_name != "mariadb",
        "compare_type": True,
    }


def _lock(connection: Connection) -> None:
    name = connection.dialect.name
    if name == "postgresql":
        # Wait for a concurrent upgrade, but not forever: fail closed, never go on unlocked.
        connection.execute(text("SET LOCAL lock_timeout = '300s'"))
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
    elif name in ("mysql", "mariadb"):
        got = connection.execute(text("SELECT GET_LOCK('wf_persist_migrate', 600)")).scalar_one()
        if got != 1:
            raise RuntimeError("could not take the wf_persist migration lock")


def _run(connection: Connection) -> None:
    if SCHEMA is not None:
        # Our revisions name no schema; the translate map puts every table in SCHEMA.
        connection = connection.execution_options(schema_translate_map={None: SCHEMA})
    context.configure(connection=connection, **_configure_args(connection.dialect.name))
    try:
        with context.begin_transaction():
            _lock(connection)
            if SCHEMA is not None:
                connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"'))
                # Raw SQL in revisions (views) resolves names through the search path.
                connection.execute(text(f'SET LOCAL search_path TO "{SCHEMA}"'))
            context.run_migrations()
    finally:
        if connection.dialect.name in ("mysql", "mariadb"):  # a session lock, not a txn one
            connection.execute(text("SELECT RELEASE_LOCK('wf_persist_migrate')"))


def run_migrations_offline() -> None:
    url = _dialect.resolve_url(config.get_main_option("sqlalchemy.url"))
    args = _configure_args(url.get_backend_name())
    context.configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"}, **args)
    with context.begin_transaction():
        if url.get_backend_name() == "postgresql":
            context.execute(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
            if SCHEMA is not None:
                context.execute(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"')
                context.execute(f'SET LOCAL search_path TO "{SCHEMA}"')
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = _dialect.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=NullPool)
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
