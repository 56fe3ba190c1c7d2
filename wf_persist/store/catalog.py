"""The workflow version catalog: first registration of (name, version) wins."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from sqlalchemy import select

from ..models import CATALOG_KEY
from ..models import workflows_table as wf
from . import Executor, connection_of

if TYPE_CHECKING:
    from ..backends import Backend


def catalog_version(
    conn: Executor, backend: Backend, name: str, version: int, source_hash: str, now: dt.datetime
) -> str:
    """Record (name, version, hash) unless present; return the hash the catalog holds.

    The insert ignores a conflict on the primary key, so two processes registering at once
    never fail; the loser reads the winner's hash and the caller compares.
    """
    core = connection_of(conn)
    row = {"name": name, "version": version, "source_hash": source_hash, "registered_at": now}
    backend.insert_once(core, wf, row, CATALOG_KEY)
    cataloged = core.execute(
        select(wf.c.source_hash).where(wf.c.name == name, wf.c.version == version),
        execution_options=backend.statement_options,
    ).scalar_one()
    return str(cataloged)
