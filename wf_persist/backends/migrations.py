"""What migrations ask of a backend, apart from its connections: the classmethods the
schema's upgrade and the reading of its state call, each answered here for a database whose
DDL is transactional, and overridden where a backend differs."""

from __future__ import annotations

import contextlib

from sqlalchemy import Connection
from sqlalchemy.engine import URL


class Migrations:
    """The migration half of every backend (a mixin of :class:`~.connections.Connections`)."""

    @classmethod
    def database_missing(cls, url: URL) -> bool:
        """Whether connecting to ``url`` would create a database (an embedded file that is
        not there): read-only commands must not."""
        return False

    @classmethod
    def session_problem(cls, conn: Connection) -> str | None:
        """Why wf_persist's tables cannot be reached through ``conn`` (asked where a
        migration connects: an opened backend checks the same in :meth:`check`)."""
        return None

    @classmethod
    def catalog_reads(cls, conn: Connection) -> contextlib.AbstractContextManager[None]:
        """Around reads of the server's catalog (its table and column lists) that a
        session's limits would refuse: allowed for their duration, put back after."""
        return contextlib.nullcontext()

    @classmethod
    def mapped_database(cls, conn: Connection, schema: str) -> URL | None:
        """Where a server without schemas keeps the tables a host engine's
        ``schema_translate_map`` renders in ``schema`` (another database, migrated by a URL
        of its own); ``None`` where unknown, or where schemas are PostgreSQL's own."""
        return None

    @classmethod
    def migrating(cls, conn: Connection) -> bool:
        """Whether another session holds the migration lock now, building tables that are
        not recorded yet (only where DDL is not transactional: elsewhere none is seen)."""
        return False

    @classmethod
    def foreign_table(
        cls, conn: Connection, name: str, schema: str | None, columns: frozenset[str]
    ) -> bool:
        """Whether the table ``name``, found where no revision of ours is recorded, is not
        one an interrupted first revision left (with exactly the ``columns`` it gives it;
        none: not one of its tables). Where DDL is transactional an interrupted revision
        leaves nothing: any such table is not."""
        return True

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        """Serialize concurrent upgrades (taken inside the migration transaction)."""

    @classmethod
    def migration_unlock(cls, conn: Connection) -> None:
        """Release what :meth:`migration_lock` took, if it outlives the transaction."""

    @classmethod
    def offline_lock_sql(cls) -> str | None:
        """The lock statement a rendered (``--sql``) upgrade script starts with."""
        return None
