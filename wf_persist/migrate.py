"""Schema migrations: a Python API over wf_persist's shipped Alembic environment.

The Alembic environment is passed our own connection through ``config.attributes`` (never a
URL string), keeps its own version table (``wf_persist_alembic_version``) and only ever looks
at ``wf_`` tables. Alembic is imported lazily: a runtime that only checks the schema revision
never pays for it.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, Engine, column, inspect, select, table
from sqlalchemy.engine import URL

from . import backends
from .errors import SchemaVersionError
from .models import metadata

if TYPE_CHECKING:
    from alembic.config import Config

#: Alembic version table wf_persist uses (never the host application's).
VERSION_TABLE: Final = "wf_persist_alembic_version"
#: The version table of a host that merged our revisions into its own chain.
HOST_VERSION_TABLE: Final = "alembic_version"
#: The revision this version of wf_persist needs. A test checks it is the script head.
SCHEMA_HEAD: Final = "wf_0003"
#: Key of the PostgreSQL advisory lock that serializes concurrent upgrades.
MIGRATION_LOCK_KEY: Final = 0x77665F70657273  # "wf_pers"

Bind = Engine | Connection | str | URL

# Alembic keeps its running environment in module globals: one command per process at a time.
# Across processes the environment's database lock serializes upgrades.
_alembic_lock = threading.Lock()


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
        yield bind
        return
    engine = bind if isinstance(bind, Engine) else backends.create_engine(bind)
    try:
        with engine.connect() as conn:
            yield conn
            conn.commit()
    finally:
        if not isinstance(bind, Engine):
            backends.dispose_engine(engine)


def _url_of(bind: Bind) -> URL:
    if isinstance(bind, Connection):
        return bind.engine.url
    if isinstance(bind, Engine):
        return bind.url
    return backends.resolve_url(bind)


def upgrade(
    bind: Bind, revision: str = "heads", *, sql: bool = False, schema: str | None = None
) -> str | None:
    """Upgrade the schema to ``revision`` (default: the newest).

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

    schema = _schema_of(bind, schema)
    with _alembic_lock:
        if sql:
            buf = io.StringIO()
            command.upgrade(_config(None, _url_of(bind), buf, schema), revision, sql=True)
            return buf.getvalue()
        with _connection(bind) as conn:
            command.upgrade(_config(conn, None, None, schema), revision)
    return None


def downgrade(
    bind: Bind, revision: str, *, sql: bool = False, schema: str | None = None
) -> str | None:
    """Downgrade the schema to ``revision`` (``base`` removes every wf_persist table)."""
    from alembic import command

    schema = _schema_of(bind, schema)
    with _alembic_lock:
        if sql:
            buf = io.StringIO()
            rng = revision if ":" in revision else f"{SCHEMA_HEAD}:{revision}"
            command.downgrade(_config(None, _url_of(bind), buf, schema), rng, sql=True)
            return buf.getvalue()
        with _connection(bind) as conn:
            command.downgrade(_config(conn, None, None, schema), revision)
    return None


def heads() -> Sequence[str]:
    """The head revisions of the shipped migration scripts."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config(None, None, None)).get_heads()


def current(bind: Bind, *, schema: str | None = None) -> str | None:
    """The revision the database is at, or ``None`` if wf_persist was never migrated there."""
    schema = _schema_of(bind, schema)
    with _connection(bind) as conn:
        return _current(conn, schema)


def _current(conn: Connection, schema: str | None) -> str | None:
    inspector = inspect(conn)
    if inspector.has_table(VERSION_TABLE, schema=schema):
        version = table(VERSION_TABLE, column("version_num"), schema=schema)
        rows = conn.execute(select(version.c.version_num)).scalars().all()
        return ",".join(sorted(rows)) or None
    # Merged mode: a host keeps our revisions in its own version table, beside its own.
    if inspector.has_table(HOST_VERSION_TABLE, schema=schema):
        host = table(HOST_VERSION_TABLE, column("version_num"), schema=schema)
        rows = conn.execute(select(host.c.version_num)).scalars().all()
        return ",".join(sorted(r for r in rows if r.startswith("wf_"))) or None
    return None


def upgrade_command(url: URL, schema: str | None = None) -> str:
    """The command a person runs to bring the database at ``url`` to head."""
    extra = "" if schema is None else f" --schema {schema}"
    return f"wf-persist db upgrade --url '{backends.describe_url(url)}'{extra}"


def assert_at_head(bind: Bind, *, schema: str | None = None) -> None:
    """Raise :class:`SchemaVersionError` (naming the command to run) unless at head."""
    schema = _schema_of(bind, schema)
    with _connection(bind) as conn:
        found = _current(conn, schema)
        url = conn.engine.url
    if found != SCHEMA_HEAD:
        raise SchemaVersionError(found, SCHEMA_HEAD, upgrade_command(url, schema))
