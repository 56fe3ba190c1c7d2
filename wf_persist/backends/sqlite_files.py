"""What a SQLite URL opens: a file (which path), a database in memory, a URI filename's
options; read from the URL and the file system without connecting, because connecting
would create a missing file and an engine of wf_persist's writes a header into an empty
one."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

from sqlalchemy.engine import URL


def _is_uri(url: URL) -> bool:
    """Whether the URL's database is a URI filename (``file:...`` with ``uri=true``)."""
    uri = str(url.query.get("uri", "")).lower() in ("true", "1", "yes", "on")
    return (url.database or "").startswith("file:") and uri


def _path_and_modes(url: URL) -> tuple[str, list[str | None]]:
    """A URI filename's path and the ``mode`` options given (in it and in the URL)."""
    parts = urllib.parse.urlsplit(url.database or "")
    modes = [*urllib.parse.parse_qs(parts.query).get("mode", ()), url.query.get("mode")]
    return parts.path, modes


def file_of(url: URL) -> str | None:
    """The path of the file a SQLite URL opens, ``None`` for an in-memory database."""
    database = url.database or ""
    if database.startswith("file:") and url.query.get("uri") == "true":
        # A URI filename (file:PATH?mode=...): SQLite creates PATH unless told otherwise.
        path, modes = _path_and_modes(url)
        if "memory" in modes:
            return None
        database = urllib.parse.unquote(path)
    if database in ("", ":memory:"):
        return None
    # Anything else is a path, "file:x" included when it is no URI (SQLAlchemy hands
    # SQLite its absolute path, a plain file named "file:x").
    return database


def file_size(path: str) -> int:
    """A file's size; 0 for one not there (nor reachable)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def absent(url: URL) -> bool:
    """Whether connecting would create the database file (reading an empty one writes
    nothing, unless an engine of ours opens it)."""
    path = file_of(url)
    return path is not None and not os.path.exists(path)


def empty(url: URL) -> bool:
    """Whether the URL's file holds no database yet: missing or empty (and so is its
    write-ahead log, which may hold one)."""
    path = file_of(url)
    return path is not None and file_size(path) == 0 and file_size(path + "-wal") == 0


def in_memory(url: URL) -> bool:
    """Whether ``url`` names an in-memory database: each connection has its own (or,
    shared through a URI's cache, one that locks whole tables without waiting)."""
    database = url.database or ""
    if database in ("", ":memory:"):
        return True
    if _is_uri(url):
        path, modes = _path_and_modes(url)
        return path == ":memory:" or "memory" in modes
    return False


def uri_options(url: URL) -> dict[str, str]:
    """The options of a URI filename (``sqlite:///file:x?mode=ro&uri=true``: the URL's
    query, and any in the filename itself); none for a plain path."""
    if not _is_uri(url):
        return {}
    found = {k: v for k, v in url.query.items() if isinstance(v, str)}
    database = url.database or ""
    return {**found, **dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(database).query))}


def to_wal(cursor: Any, *, only_new: bool) -> None:
    """Put the database in WAL unless it is already; with ``only_new``, only a database
    with no page yet (one this connection creates)."""
    if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    if not only_new or cursor.execute("PRAGMA page_count").fetchone()[0] == 0:
        cursor.execute("PRAGMA journal_mode = WAL")
