"""An opened database: the engine (ours or a host's), its backend, and a schema check.

Shared by the :class:`~wf_persist.runtime.Runtime` (which drives runs) and the thin
:class:`~wf_persist.client.Client` (which never does), so both open a database the same way.
"""

from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from . import backends, gate, migrate, refusals
from .errors import InvalidArgumentError, UnsupportedDatabaseError

#: Why a read-only engine cannot be written through.
READ_ONLY = (
    "this engine's connections are read-only (a read-only default for transactions, a "
    "standby, SQLite's query_only): a runtime writes its catalog, claims and steps, and a "
    "client its starts, signals and cancellations; use a writable engine (a wp.Client on a "
    "read-only one only reads)"
)


class Database:
    """The binding of one process to one wf_persist database.

    Args:
        bind: a database URL, or an existing SQLAlchemy ``Engine`` (used as is, never
            reconfigured, never disposed). Default: ``$WF_PERSIST_DATABASE_URL``, else
            ``wf_persist.sqlite3`` in the working directory.
        auto_migrate: upgrade the schema on open. Default: only for an embedded SQLite
            database whose engine this object created; any other database must be at head
            (:class:`~wf_persist.errors.SchemaVersionError` otherwise).
        schema: a PostgreSQL schema holding the wf_ tables.
        writes: whether its owner writes (a runtime): a read-only engine is then refused.
    """

    def __init__(
        self,
        bind: str | URL | Engine | None = None,
        *,
        auto_migrate: bool | None = None,
        schema: str | None = None,
        writes: bool = True,
    ) -> None:
        if bind is not None and not isinstance(bind, str | URL | Engine):
            raise InvalidArgumentError(f"bind must be a URL or an Engine, got {bind!r:.80}")
        if isinstance(bind, Engine):
            engine, self.owns_engine = bind, False
        else:
            if auto_migrate is False:
                _refuse_missing(bind, schema)
            engine, self.owns_engine = backends.create_engine(bind), True
        try:
            self.backend = backends.open_backend(engine, owned=self.owns_engine, schema=schema)
            self.backend.check()
            #: Whether the engine's connections may not write (a client then only reads).
            self.read_only = self.backend.read_only()
            if self.read_only and (writes or auto_migrate):
                raise UnsupportedDatabaseError(READ_ONLY)
            if auto_migrate is None:
                # Not a read-only one (a mode=ro SQLite URI, say): a client there only reads.
                auto_migrate = self.owns_engine and self.backend.embedded and not self.read_only
            if auto_migrate and (
                # A deploy gate's: a fleet's database is never upgraded under it.
                not gate.gating() or migrate.current(self.backend.engine) is None
            ):
                migrate.upgrade(self.backend.engine)
            else:
                migrate.assert_at_head(self.backend.engine)
            if not self.read_only:
                self.backend.settle()
        except BaseException as exc:
            if self.owns_engine:
                backends.dispose_engine(engine)
            if isinstance(exc, DBAPIError):
                refusals.translate(backends.backend_type(engine.dialect.name), exc)
            raise
        self.base_engine = engine
        self.schema = schema
        #: The engine wf_persist works through (same pool as ``bind``, our options).
        self.engine = self.backend.engine

    def dispose(self) -> None:
        """Dispose of the engine if this object created it (a host's engine is left alone)."""
        if self.owns_engine:
            backends.dispose_engine(self.base_engine)


def _refuse_missing(bind: str | URL | None, schema: str | None) -> None:
    """A database that must not be migrated here and is an embedded file not there: the
    error that says what to run, before connecting would create the file."""
    url = backends.resolve_url(bind)
    if backends.backend_type(url.get_backend_name()).database_missing(url):
        problem = migrate.state(url, schema=schema).error()
        if problem is not None:
            raise problem
