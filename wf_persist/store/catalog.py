"""The workflow version catalog: first registration of (name, version) wins."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select

from .. import _dialect
from ..models import workflows_table as wf
from . import Executor, dialect_of


def catalog_version(
    conn: Executor, name: str, version: int, source_hash: str, now: dt.datetime
) -> str:
    """Record (name, version, hash) unless present; return the hash the catalog holds.

    The insert ignores a conflict on the primary key, so two processes registering at once
    never fail; the loser reads the winner's hash and the caller compares.
    """
    conn.execute(
        _dialect.insert_ignoring(dialect_of(conn), wf, ["name", "version"]).values(
            name=name, version=version, source_hash=source_hash, registered_at=now
        )
    )
    cataloged = conn.execute(
        select(wf.c.source_hash).where(wf.c.name == name, wf.c.version == version)
    ).scalar_one()
    return str(cataloged)
