"""One database fixture parametrized over every backend.

Backends come from ``WF_PERSIST_TEST_BACKENDS`` (default ``sqlite,postgresql``); each listed
backend is required: an unreachable server fails the run, it never skips. PostgreSQL tests
share one migrated scratch database per session, emptied before each test; tests that need an
empty, unmigrated database get their own.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from wf_persist import migrate

BACKENDS = [
    b.strip()
    for b in os.environ.get("WF_PERSIST_TEST_BACKENDS", "sqlite,postgresql").split(",")
    if b.strip()
]
PG_ADMIN_URL = os.environ.get(
    "WF_PERSIST_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TABLES = ("wf_history", "wf_executions", "wf_workflows")


def _pg_url(dbname: str) -> str:
    return make_url(PG_ADMIN_URL).set(database=dbname).render_as_string(hide_password=False)


def _pg_admin(sql: str) -> None:
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    except Exception as exc:  # the server must be there: fail, never skip
        pytest.fail(f"PostgreSQL backend required but unusable at {PG_ADMIN_URL}: {exc}")
    finally:
        engine.dispose()


def create_pg_database() -> str:
    name = f"wf_persist_t_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    return name


def drop_pg_database(name: str) -> None:
    _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        only = metafunc.definition.get_closest_marker("backends")
        chosen = [b for b in BACKENDS if only is None or b in only.args]
        metafunc.parametrize(
            "backend",
            [pytest.param(b, marks=getattr(pytest.mark, b)) for b in chosen],
            scope="session",
        )


@pytest.fixture(scope="session")
def _pg_session_db() -> Iterator[str]:
    name = create_pg_database()
    url = _pg_url(name)
    migrate.upgrade(url)
    yield url
    drop_pg_database(name)


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.sqlite3"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database of the current backend."""
    if backend == "sqlite":
        template: Path = request.getfixturevalue("_sqlite_template")
        target = tmp_path / "wf.sqlite3"
        shutil.copy(template, target)
        return f"sqlite:///{target}"
    url: str = request.getfixturevalue("_pg_session_db")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def blank_db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """An empty, never-migrated database of the current backend."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'blank.sqlite3'}"
        return
    name = create_pg_database()
    yield _pg_url(name)
    drop_pg_database(name)


@pytest.fixture
def make_runtime(db_url: str) -> Iterator[Callable[..., wp.Runtime]]:
    """Factory for runtimes on the test database; all are closed at teardown."""
    made: list[wp.Runtime] = []

    def make(**kwargs: object) -> wp.Runtime:
        rt = wp.Runtime(db_url, **kwargs)  # type: ignore[arg-type]
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


@pytest.fixture
def runtime(make_runtime: Callable[..., wp.Runtime]) -> wp.Runtime:
    return make_runtime()


@pytest.fixture
def client(runtime: wp.Runtime) -> wp.WorkflowClient:
    return runtime.client()
