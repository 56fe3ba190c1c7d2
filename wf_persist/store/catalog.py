"""The workflow version catalog: first registration of (name, version) wins."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from sqlalchemy import Row, func, select, update

from ..models import CATALOG_KEY
from ..models import workflows_table as wf
from . import Executor, connection_of

if TYPE_CHECKING:
    from ..backends import Backend


def catalog_version(
    conn: Executor,
    backend: Backend,
    name: str,
    version: int,
    source_hash: str,
    now: dt.datetime,
    schemas: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
) -> str:
    """Record (name, version, hash, input and output schema) unless present; return the hash
    the catalog holds.

    The insert ignores a conflict on the primary key, so two processes registering at once
    never fail; the loser reads the winner's hash and the caller compares. A version
    cataloged without schemas (before they were recorded) gets them from a registration of
    the same source.
    """
    core = connection_of(conn)
    options = backend.statement_options
    row = {
        "name": name,
        "version": version,
        "source_hash": source_hash,
        "registered_at": now,
        "input_schema": schemas[0],
        "output_schema": schemas[1],
    }
    backend.insert_once(core, wf, row, CATALOG_KEY)
    # Where a host's snapshot predates another process's registration, the insert met a
    # committed row a plain read does not see (see entry_seen).
    found = entry_seen(core, backend, name, version)
    if found is None:
        raise LookupError(f"workflow {name}@v{version}: cataloged, yet no read finds it")
    if found.source_hash == source_hash:
        # Only what is missing (versions cataloged before schemas were recorded): a process
        # that could not make a schema never erases the one another process recorded.
        for column, schema in ((wf.c.input_schema, schemas[0]), (wf.c.output_schema, schemas[1])):
            if schema is not None and found._mapping[column.name] is None:
                core.execute(
                    update(wf)
                    .where(wf.c.name == name, wf.c.version == version, column.is_(None))
                    .values({column.name: schema}),
                    execution_options=options,
                )
    return str(found.source_hash)


def entries(conn: Executor, backend: Backend, name: str | None = None) -> list[Row[Any]]:
    """Cataloged versions (of one workflow, or all), by name then version."""
    query = select(wf).order_by(wf.c.name, wf.c.version)
    if name is not None:
        query = query.where(wf.c.name == name)
    return list(
        connection_of(conn).execute(query, execution_options=backend.statement_options).all()
    )


def entry(
    conn: Executor, backend: Backend, name: str, version: int | None, *, locking: bool = False
) -> Row[Any] | None:
    """One cataloged version: ``version``, or the highest when ``None``; with ``locking``
    read by a locking read (without a subquery: MySQL reads one from the snapshot)."""
    query = select(wf).where(wf.c.name == name)
    if version is not None:
        query = query.where(wf.c.version == version)
    elif locking:
        query = query.order_by(wf.c.version.desc()).limit(1)
    else:
        highest = select(func.max(wf.c.version)).where(wf.c.name == name).scalar_subquery()
        query = query.where(wf.c.version == highest)
    if locking:
        query = query.with_for_update(read=True)
    return (
        connection_of(conn)
        .execute(query, execution_options=backend.statement_options)
        .one_or_none()
    )


def entry_seen(conn: Executor, backend: Backend, name: str, version: int | None) -> Row[Any] | None:
    """:func:`entry` in a host's transaction, whose snapshot may predate the version's
    cataloging (MySQL/MariaDB at REPEATABLE READ): a row a plain read misses is looked for
    again with a locking read, where that reads what is committed. (PostgreSQL's locking
    read keeps the snapshot's rows: a version cataloged since stays unseen there, as the
    run's row, written in that snapshot, could not refer to it.)"""
    found = entry(conn, backend, name, version)
    if found is not None or not backend.locking_reads_see_committed:
        return found
    return entry(conn, backend, name, version, locking=True)
