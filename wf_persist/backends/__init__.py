"""One object per backend, chosen once when an engine is opened: the only place that tells
SQLite, PostgreSQL and MySQL/MariaDB apart (see :mod:`.base` for what a backend owns)."""

from __future__ import annotations

import os
import re
import shutil
import weakref
from typing import Any, Final

from sqlalchemy import Engine, make_url
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from ..errors import UnsupportedDatabaseError
from .base import Backend
from .connections import dispose_pool
from .mysql import MySQLBackend
from .opening import connect, describe_url, reason
from .postgresql import PostgreSQLBackend
from .sql import STALE, Cataloged, Claim, Fenced, Stale
from .sqlite import SQLiteBackend

__all__ = [
    "STALE",
    "Backend",
    "Cataloged",
    "Claim",
    "Fenced",
    "Stale",
    "connect",
    "create_engine",
    "describe_url",
    "dispose_engine",
    "open_backend",
    "reason",
    "resolve_url",
]

#: Environment variable that names the database when no URL is passed.
DATABASE_URL_ENV: Final = "WF_PERSIST_DATABASE_URL"
#: The embedded default: a SQLite file in the working directory.
DEFAULT_URL: Final = "sqlite:///wf_persist.sqlite3"

_BACKENDS: Final[tuple[type[Backend], ...]] = (SQLiteBackend, PostgreSQLBackend, MySQLBackend)
#: URL schemes without a driver, and the driver wf_persist uses for them.
_DEFAULT_DRIVERS: Final = {
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mariadb": "mariadb+pymysql",
}
#: The process each engine :func:`create_engine` made was made in.
_MADE_IN: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
#: Engines with a private file (an in-memory SQLite URL) and the finalizer that removes it.
_PRIVATE_FILES: weakref.WeakKeyDictionary[Engine, weakref.finalize[Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def backend_type(name: str) -> type[Backend]:
    """The backend class for a SQLAlchemy dialect or backend name."""
    for kind in _BACKENDS:
        if name in kind.names:
            return kind
    raise UnsupportedDatabaseError(
        f"the {name} database is not supported (SQLite, PostgreSQL, MySQL/MariaDB are)"
    )


def open_backend(engine: Engine, *, owned: bool, schema: str | None = None) -> Backend:
    """The backend object for ``engine`` (checks nothing on the database yet; a server's
    backend reads the session's settings, and a failure to connect is a typed error)."""
    return backend_type(engine.dialect.name)(engine, owned=owned, schema=schema)


def normalize_url(url: str | URL) -> URL:
    """Parse ``url`` and pick wf_persist's driver where none is named (psycopg 3 for
    ``postgresql://``, PyMySQL for ``mysql://``); an unknown scheme is a typed error."""
    try:
        parsed = make_url(url)
    except Exception as exc:  # ArgumentError, ValueError: not a URL at all
        message = f"not a database URL: {url!r} ({exc})"
        raise UnsupportedDatabaseError(_mask_password(message)) from None
    driver = _DEFAULT_DRIVERS.get(parsed.drivername)
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    backend_type(parsed.get_backend_name())
    return parsed


def _mask_password(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@`` in it as ``***``: a URL
    that does not parse cannot be rendered with its password hidden, yet is still quoted."""
    return re.sub(r"(://[^:/?#@\s]*:)[^\s]*@", r"\1***@", text)


def resolve_url(url: str | URL | None) -> URL:
    """The URL to use: the argument, else ``$WF_PERSIST_DATABASE_URL``, else embedded SQLite."""
    if url is None:
        url = os.environ.get(DATABASE_URL_ENV) or DEFAULT_URL
    return normalize_url(url)


def create_engine(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """An engine configured the way wf_persist wants its own engines.

    SQLite gets WAL, ``synchronous=FULL`` (a commit survives power loss), foreign keys, a busy
    timeout and ``BEGIN IMMEDIATE`` for write transactions; ``sqlite://`` (in memory) works,
    shared by every thread. PostgreSQL gets READ COMMITTED (wf_persist's level, set once per
    connection, whatever the database's default), MySQL/MariaDB READ COMMITTED and strict
    mode. Engines a host
    hands to wf_persist are never changed; this function is only for engines it owns (and
    for applications that want the same settings).
    """
    resolved = resolve_url(url)
    kind = backend_type(resolved.get_backend_name())
    if kwargs.get("poolclass") is None:
        # A drive holds one connection; claims, slots and reads borrow more.
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 40)
    resolved, kwargs = kind.configure_engine(resolved, kwargs)
    tempdir = kwargs.pop("wf_persist_tempdir", None)
    try:
        engine = sa_create_engine(resolved, **kwargs)
    except ImportError as exc:
        hint = (
            ""
            if kind.extra is None
            else f"; install it with: pip install 'wf-persist[{kind.extra}]'"
        )
        raise UnsupportedDatabaseError(
            f"the driver for {describe_url(resolved)} is not installed ({exc}){hint}"
        ) from exc
    except sa_exc.NoSuchModuleError as exc:  # mysql+nodriver://: no such dialect plugin
        raise UnsupportedDatabaseError(
            f"no SQLAlchemy driver {resolved.drivername!r:.60} for {describe_url(resolved)}"
        ) from exc
    except TypeError as exc:  # an argument this pool or dialect does not take
        raise UnsupportedDatabaseError(
            f"cannot create an engine for {describe_url(resolved)}: {exc}"
        ) from exc
    if tempdir is not None:
        _PRIVATE_FILES[engine] = weakref.finalize(engine, _remove_private, tempdir, os.getpid())
    _MADE_IN[engine] = os.getpid()
    kind.on_own_engine(engine)
    return engine


def _remove_private(tempdir: str, pid: int) -> None:
    """Remove a private database's directory: only in the process that made it (a child
    forked after, exiting, must not take its parent's database with it)."""
    if os.getpid() == pid:
        shutil.rmtree(tempdir, True)


def dispose_engine(engine: Engine) -> None:
    """Close an engine :func:`create_engine` made, and remove the private file an in-memory
    URL was given (at once, not when the engine is garbage-collected). In a process forked
    after it was made, only the pool is let go: its connections and file are the parent's."""
    if os.getpid() == _MADE_IN.get(engine, os.getpid()):
        dispose_pool(engine)
    else:
        engine.dispose(close=False)
    remove = _PRIVATE_FILES.pop(engine, None)
    if remove is not None:
        remove()
