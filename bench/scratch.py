"""Scratch databases: one per system for a backend run, created empty and removed afterwards.

PostgreSQL: ``wf_persist_bench_<system>`` databases made through the admin URL (never a table
of the admin database itself). SQLite: files in a temporary directory.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from sqlalchemy import Engine, text
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import URL, make_url

import wf_persist as wp

SYSTEMS: Final = ("ours", "floor", "dbos", "absurd")
PREFIX: Final = "wf_persist_bench_"


def psycopg_url(url: str | URL) -> URL:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def url_string(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL without SQLAlchemy's driver suffix (for psycopg and psql directly)."""
    return url_string(make_url(url).set(drivername="postgresql"))


@dataclass
class Scratch:
    """Database URLs of one backend run, by system."""

    backend: str
    urls: dict[str, str]
    directory: str

    def url(self, system: str) -> str:
        return self.urls[system]

    def server_version(self) -> str | None:
        if self.backend != "postgresql":
            return None
        engine = sa_create_engine(self.urls["ours"])
        try:
            with engine.connect() as conn:
                return str(conn.execute(text("SHOW server_version")).scalar())
        finally:
            engine.dispose()


def _recreate(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))


def _drop(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def scratch(backend: str, pg_admin_url: str) -> Iterator[Scratch]:
    """Fresh, empty databases for one backend run (ours migrated), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-") as tmp:
        if backend == "sqlite":
            urls = {s: f"sqlite:///{tmp}/{s}.sqlite3" for s in SYSTEMS}
            wp.migrate.upgrade(urls["ours"])
            yield Scratch(backend, urls, tmp)
            return
        admin_url = psycopg_url(pg_admin_url)
        admin = sa_create_engine(admin_url, isolation_level="AUTOCOMMIT")
        names = {s: PREFIX + s for s in SYSTEMS}
        try:
            for name in names.values():
                _recreate(admin, name)
            urls = {s: url_string(admin_url.set(database=n)) for s, n in names.items()}
            wp.migrate.upgrade(urls["ours"])
            yield Scratch(backend, urls, tmp)
        finally:
            for name in names.values():
                _drop(admin, name)
            admin.dispose()
