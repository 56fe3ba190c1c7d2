"""Schema migrations: a Python API over wf_persist's shipped Alembic environment.

The Alembic environment is passed our own connection through ``config.attributes`` (never a
URL string), keeps its own version table (``wf_persist_alembic_version``) and only ever looks
at ``wf_`` tables. A host may instead merge our revisions into its own chain (merged mode:
they are recorded in its ``alembic_version``); then only the host's Alembic moves them, and
this module reads that record but refuses to run ours over it. Alembic is imported lazily: a
runtime that only checks the schema revision never pays for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import re
import shlex
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util.concurrency import await_, in_greenlet

from . import backends, refusals, schema_reads
from .errors import (
    InvalidArgumentError,
    MergedSchemaVersionError,
    SchemaNamesTakenError,
    SchemaTooNewError,
    SchemaVersionConflictError,
    SchemaVersionError,
    UnsupportedDatabaseError,
    WfPersistError,
)
from .models import ONLY_ON, metadata
from .schema_reads import FIRST_TABLES as FIRST_TABLES
from .schema_reads import HOST_VERSION_TABLE as HOST_VERSION_TABLE
from .schema_reads import VERSION_TABLE as VERSION_TABLE
from .schema_reads import VIEWS as VIEWS

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

#: What migrates a merged database: the host's own Alembic, every branch at once.
HOST_UPGRADE_COMMAND: Final = "alembic upgrade heads"
#: The revision this version of wf_persist needs. A test checks it is the script head.
SCHEMA_HEAD: Final = "wf_0012"

Bind = Engine | Connection | str | URL

# Alembic keeps its running environment in module globals: one command per process at a time.
# Across processes the environment's database lock serializes upgrades.
_alembic_lock = threading.Lock()


@contextlib.contextmanager
def _alembic_turn() -> Iterator[None]:
    """Hold :data:`_alembic_lock`. In a greenlet of SQLAlchemy's asyncio extension (an
    ``AsyncClient`` opening) the holder awaits its I/O on the same thread's event loop: a
    blocking acquire there would stop the loop the holder needs to finish, so it waits on
    the loop instead."""
    if in_greenlet():
        while not _alembic_lock.acquire(blocking=False):
            await_(asyncio.sleep(0.005))
    else:
        _alembic_lock.acquire()
    try:
        yield
    finally:
        _alembic_lock.release()


def script_location() -> Path:
    """Where the Alembic environment lives: inside the installed wheel, or the checkout."""
    packaged = Path(__file__).parent / "_alembic"
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "alembic"


def versions_directory() -> Path:
    """Our revisions, for a host's ``version_locations`` (merged mode)."""
    return script_location() / "versions"


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic ``include_name`` hook limiting comparisons to wf_persist's own tables."""
    if type_ == "table":
        return name in metadata.tables
    return True


def include_object_on(dialect: str) -> Callable[..., bool]:
    """Alembic ``include_object`` hook for ``dialect``: an index of the models that exists on
    another database only (``info[ONLY_ON]``, e.g. PostgreSQL's lease-owner index for its
    reaper) is left out of comparisons here."""

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, other: Any) -> bool:
        if type_ != "index" or reflected:
            return True
        only = obj.info.get(ONLY_ON)
        return only is None or only == dialect

    return include_object


def host_include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """``include_name`` hook for a *host's* env.py: hide wf_persist's tables from its autogenerate.

    Without it a host's ``alembic revision --autogenerate`` proposes dropping our tables,
    because Alembic only ignores its own version table.
    """
    if type_ == "table":
        return name not in metadata.tables and name != VERSION_TABLE
    return True


def _schema_of(bind: Bind, schema: str | None) -> str | None:
    """An explicit schema, else the one a Runtime's engine view renders our tables in."""
    if schema is not None or isinstance(bind, str | URL):
        return schema
    translate = bind.get_execution_options().get("schema_translate_map") or {}
    found = translate.get(None)
    return None if found is None else str(found)


def _schema_to_migrate(bind: Bind, schema: str | None) -> str | None:
    """:func:`_schema_of`, refused where migrations cannot make tables in a named schema
    (they create it and set PostgreSQL's search path): elsewhere the driver's raw syntax
    error. A host engine mapping its tables into another MySQL database or an attached
    SQLite one still runs (its schema is read through the map); migrate that database by a
    URL of its own."""
    schema = _schema_of(bind, schema)
    if schema is not None:
        name = _url_of(bind).get_backend_name()
        backend = backends.backend_type(name)
        if not backend.supports_schemas:
            raise UnsupportedDatabaseError(
                f"migrating into a named schema ({schema}) needs PostgreSQL, not {name}: "
                "migrate that database by its own URL"
            )
        problem = backend.schema_problem(schema)
        if problem is not None:  # before anything is sent
            raise InvalidArgumentError(f"schema {schema!r}: {problem}")
    return schema


def _config(
    connection: Connection | None,
    url: URL | None,
    output: io.StringIO | None,
    schema: str | None = None,
) -> Config:
    from alembic.config import Config

    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        # Offline mode renders SQL for a dialect without connecting; Alembic needs the URL.
        cfg.set_main_option(
            "sqlalchemy.url", url.render_as_string(hide_password=False).replace("%", "%%")
        )
    cfg.attributes["connection"] = connection
    cfg.attributes["schema"] = schema
    return cfg


@contextlib.contextmanager
def _connection(bind: Bind) -> Iterator[Connection]:
    if isinstance(bind, Connection):
        _check_session(bind)
        yield bind
        return
    engine = bind if isinstance(bind, Engine) else backends.create_engine(bind)
    try:
        with (
            backends.connect(engine) as conn,
            backends.backend_type(conn.dialect.name).patient(conn),
        ):
            _check_session(conn)
            yield conn
            conn.commit()
    finally:
        if not isinstance(bind, Engine):
            backends.dispose_engine(engine)


def _check_session(conn: Connection) -> None:
    """Refuse a session wf_persist's tables cannot be reached through, leaving the
    connection as it was (a transaction the check began is ended: Alembic's own
    transactions must not be nested in it)."""
    began = not conn.in_transaction()
    try:
        problem = backends.backend_type(conn.dialect.name).session_problem(conn)
    finally:
        if began and conn.in_transaction():
            conn.rollback()
    if problem is not None:
        raise UnsupportedDatabaseError(problem)


def _url_of(bind: Bind) -> URL:
    if isinstance(bind, Connection):
        return bind.engine.url
    if isinstance(bind, Engine):
        return bind.url
    return backends.resolve_url(bind)


@contextlib.contextmanager
def _revision_errors(bind: Bind) -> Iterator[None]:
    """Alembic's refusal of a revision (unknown, ambiguous, not reachable) as the typed
    :class:`InvalidArgumentError`, and the database's refusal of the engine (a privilege
    it lacks, a read-only server), the database out of reach or a statement it cancelled
    as their typed errors (:func:`wf_persist.refusals.translate`), any other statement the
    database failed as :class:`UnsupportedDatabaseError`, that callers (the CLI) report in
    one line."""
    from alembic.util import CommandError

    try:
        yield
    except CommandError as exc:
        raise InvalidArgumentError(f"revision: {exc}") from exc
    except AssertionError as exc:  # Alembic's, for a relative revision (head+5) past the end
        raise InvalidArgumentError(
            "revision: a relative revision reaches past the last one"
        ) from exc
    except DBAPIError as exc:
        if isinstance(exc, WfPersistError):  # typed already (a connection refused, say)
            raise
        backend = backends.backend_type(_url_of(bind).get_backend_name())
        if not backend.missing_schema(exc):  # a migration's own: the tables changed by hand
            refusals.translate(backend, exc)
        raise UnsupportedDatabaseError(_failed(exc)) from exc


def _failed(exc: DBAPIError) -> str:
    """What to tell of a statement the database failed during a migration: most often
    the schema is not what the recorded revision says (a table or column changed by
    hand)."""
    cause = (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0][:300]
    statement = " ".join(str(exc.statement or "").split())
    if not statement:
        return f"the database failed the migration: {cause}"
    if len(statement) > 200:
        statement = statement[:200] + "..."
    return (
        f"a statement of the migration failed: {cause} (in: {statement}). If the wf_ "
        "tables were changed by hand, they are not as the revision recorded in the "
        "database says. The revision was rolled back where DDL is transactional "
        "(PostgreSQL, SQLite); MySQL/MariaDB revisions may be run again once the cause is "
        "removed"
    )


def upgrade(
    bind: Bind, revision: str = "heads", *, sql: bool = False, schema: str | None = None
) -> str | None:
    """Upgrade the schema to ``revision`` (default: the newest).

    Our Alembic never runs where it would fork or undo the bookkeeping: a merged database
    raises :class:`MergedSchemaVersionError` naming the host's command (at head, an upgrade to
    head does nothing), one a newer wf_persist migrated :class:`SchemaTooNewError`, one with
    records in both version tables :class:`SchemaVersionConflictError`.

    Args:
        bind: an engine, connection or URL.
        revision: target revision.
        sql: render the SQL instead of running it (offline mode, for review by a DBA).
        schema: a PostgreSQL schema for the wf_ tables and the version table (created if
            missing).

    Returns:
        The SQL script when ``sql`` is true, else ``None``.
    """
    from alembic import command

    schema = _schema_to_migrate(bind, schema)
    with _alembic_turn(), _revision_errors(bind):
        if sql:
            buf = io.StringIO()
            command.upgrade(_config(None, _url_of(bind), buf, schema), revision, sql=True)
            return buf.getvalue()
        _known(revision)
        with _connection(bind) as conn:
            found = _read_state(conn, schema)
            to_head = revision in ("head", "heads", "wf_persist@head", SCHEMA_HEAD)
            if found.mode == "merged" and found.revision == SCHEMA_HEAD and to_head:
                return None
            _refuse_foreign(found, HOST_UPGRADE_COMMAND)
            taken = found.error()
            if isinstance(taken, SchemaNamesTakenError):
                raise taken
            command.upgrade(_config(conn, None, None, schema), revision)
    return None


def downgrade(
    bind: Bind, revision: str, *, sql: bool = False, schema: str | None = None
) -> str | None:
    """Downgrade the schema to ``revision`` (``base`` removes every wf_persist table).

    Refuses the databases :func:`upgrade` refuses (a merged one always).
    """
    from alembic import command

    schema = _schema_to_migrate(bind, schema)
    with _alembic_turn(), _revision_errors(bind):
        if sql:
            buf = io.StringIO()
            rng = revision if ":" in revision else f"{SCHEMA_HEAD}:{revision}"
            command.downgrade(_config(None, _url_of(bind), buf, schema), rng, sql=True)
            return buf.getvalue()
        _known(revision)
        with _connection(bind) as conn:
            # As the README says: by our branch, whatever the host's heads are.
            target = revision if "@" in revision else f"wf_persist@{revision}"
            _refuse_foreign(_read_state(conn, schema), f"alembic downgrade {target}")
            command.downgrade(_config(conn, None, None, schema), revision)
    return None


def _known(revision: str) -> None:
    """Refuse a revision no script names before the database is touched: connecting made
    a SQLite file, and Alembic an empty version table, before it looked the revision up.
    (A relative one, ``head-1`` or ``+2``, is Alembic's to judge against the database.)"""
    if ":" in revision or re.search(r"[+-]\d", revision):
        return
    _script().get_revisions(revision)


def _script() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config(None, None, None))


def heads() -> Sequence[str]:
    """The head revisions of the shipped migration scripts."""
    return _script().get_heads()


Mode = Literal["standalone", "merged", "both", "none"]


@dataclasses.dataclass(frozen=True)
class SchemaState:
    """Where a database records wf_persist's revisions, and which.

    Attributes:
        standalone: the rows of our own version table (standalone mode).
        merged: the ``wf_`` rows of the host's ``alembic_version`` (merged mode).
        host_table: the host's version table they were read from: ``alembic_version``, or
            the one its Alembic environment names instead (``version_table``).
        url: the database, for the command an error names.
        schema: the PostgreSQL schema looked in.
        missing: the SQLite file does not exist (and was not created to look).
        taken: where no revision is recorded, the tables and views there already that
            bear our names (and are not what an interrupted first revision left).
        mapped: on a server without schemas, the database ``schema`` names there.
    """

    standalone: tuple[str, ...]
    merged: tuple[str, ...]
    url: URL
    schema: str | None = None
    missing: bool = False
    taken: tuple[str, ...] = ()
    mapped: URL | None = None
    host_table: str = HOST_VERSION_TABLE

    @property
    def mode(self) -> Mode:
        """``standalone``, ``merged``, ``both`` (a forked record) or ``none``.

        An empty version table counts as no record: MySQL keeps the table a failed upgrade
        created (its DDL is not transactional), and it must not hide the merged rows.
        """
        if self.standalone and self.merged:
            return "both"
        if self.standalone:
            return "standalone"
        return "merged" if self.merged else "none"

    @property
    def revision(self) -> str | None:
        """The recorded revision (heads joined by commas); ``None`` if none, or if ``both``."""
        if self.mode == "both":
            return None
        return ",".join(self.standalone or self.merged) or None

    def error(self, host_command: str = HOST_UPGRADE_COMMAND) -> SchemaVersionError | None:
        """What a runtime needing :data:`SCHEMA_HEAD` raises here (``None`` at head).

        Each names what fixes it: ``wf-persist db upgrade``, the host's ``host_command``
        (merged mode), upgrading wf_persist (too new), or dropping one record (both).
        """
        if self.mode == "both":
            return SchemaVersionConflictError(
                ",".join(self.standalone), ",".join(self.merged), SCHEMA_HEAD, self._keep_one()
            )
        found = self.revision
        if found == SCHEMA_HEAD:
            return None
        if found is not None and _is_newer(found):
            return SchemaTooNewError(found, SCHEMA_HEAD)
        if found is not None and self.mode == "merged":
            return MergedSchemaVersionError(found, SCHEMA_HEAD, host_command, self.host_table)
        if found is None and self.taken:
            return SchemaNamesTakenError(self.taken, SCHEMA_HEAD, self._upgrade())
        return SchemaVersionError(found, SCHEMA_HEAD, self._upgrade())

    def _upgrade(self) -> str:
        """The command that migrates this database: where a host engine's map names
        another database (MySQL, an attached SQLite file), that database by its own URL."""
        if (
            self.schema is None
            or backends.backend_type(self.url.get_backend_name()).supports_schemas
        ):
            return upgrade_command(self.url, self.schema)
        if self.mapped is not None:
            return upgrade_command(self.mapped)
        return f"wf-persist db upgrade --url <the URL of the database mapped as {self.schema}>"

    def _keep_one(self) -> str:
        prefix = "" if self.schema is None else f"{self.schema}."
        rows = ", ".join(f"'{r}'" for r in self.merged)
        return (
            f"DROP TABLE {prefix}{VERSION_TABLE} to stay merged, or DELETE FROM "
            f"{prefix}{self.host_table} WHERE version_num IN ({rows}) to stay standalone"
        )


def _is_newer(revisions: str) -> bool:
    """A recorded revision this wf_persist does not ship, or one after its head."""
    script = _script()
    known = {s.revision for s in script.walk_revisions()}
    for rev in revisions.split(","):
        if rev not in known:
            return True
        below = {s.revision for s in script.iterate_revisions(rev, "base")}
        if rev != SCHEMA_HEAD and SCHEMA_HEAD in below:
            return True
    return False


def state(bind: Bind, *, schema: str | None = None) -> SchemaState:
    """Read where and at which revision wf_persist's revisions are recorded.

    Never creates anything: a missing SQLite file reads as never migrated (``missing``).
    """
    schema = _schema_of(bind, schema)
    url = _url_of(bind)
    if not isinstance(bind, Connection) and _missing_sqlite_file(url):
        return SchemaState((), (), url, schema, missing=True)
    with _revision_errors(bind), _connection(bind) as conn:
        return _read_state(conn, schema)


def current(bind: Bind, *, schema: str | None = None) -> str | None:
    """The revision the database is at, or ``None`` if wf_persist was never migrated there.

    Reads our version table or, in merged mode, the ``wf_`` rows of the host's; a missing
    SQLite file is ``None`` and is not created. Raises :class:`SchemaVersionConflictError`
    when both tables record revisions.
    """
    found = state(bind, schema=schema)
    problem = found.error()
    if isinstance(problem, SchemaVersionConflictError):
        raise problem
    return found.revision


def _missing_sqlite_file(url: URL) -> bool:
    return backends.backend_type(url.get_backend_name()).database_missing(url)


def _read_state(conn: Connection, schema: str | None) -> SchemaState:
    """What the database records, as a :class:`SchemaState` (see :func:`schema_reads.read`)."""
    found = schema_reads.read(conn, schema)
    return SchemaState(
        found.standalone,
        found.merged,
        conn.engine.url,
        schema,
        taken=found.taken,
        mapped=found.mapped,
        host_table=found.host_table,
    )


def _refuse_foreign(found: SchemaState, host_command: str) -> None:
    """Stop before our Alembic runs where it would fork the record or meet a newer revision.

    A merged database is refused even at head: only the host's ``host_command`` may move it.
    """
    problem = found.error(host_command)
    if problem is None and found.mode == "merged":
        merged = ",".join(found.merged)
        problem = MergedSchemaVersionError(merged, SCHEMA_HEAD, host_command, found.host_table)
    if isinstance(
        problem, SchemaTooNewError | MergedSchemaVersionError | SchemaVersionConflictError
    ):
        raise problem


def upgrade_command(url: URL, schema: str | None = None) -> str:
    """The command a person runs to bring the database at ``url`` to head."""
    # The schema quoted as a shell needs it ('a;b'), so the command pastes as it reads.
    extra = "" if schema is None else f" --schema {shlex.quote(schema)}"
    return f"wf-persist db upgrade --url '{backends.describe_url(url)}'{extra}"


def assert_at_head(bind: Bind, *, schema: str | None = None) -> None:
    """Raise the :class:`SchemaVersionError` that says what to run, unless at head.

    Merged databases name the host's ``alembic upgrade heads``; a database migrated by a newer
    wf_persist raises :class:`SchemaTooNewError`. Nothing is created to look.
    """
    problem = state(bind, schema=schema).error()
    if problem is not None:
        raise problem
