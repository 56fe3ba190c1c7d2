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
    for b in os.environ.get("WF_PERSIST_TEST_BACKENDS", "sqlite,postgresql,mysql").split(",")
    if b.strip()
]
#: Admin URLs: the tests create (and drop) scratch databases through them.
ADMIN_URLS = {
    "postgresql": os.environ.get(
        "WF_PERSIST_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get(
        "WF_PERSIST_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
    ),
}
PG_ADMIN_URL = ADMIN_URLS["postgresql"]
TABLES = ("wf_history", "wf_executions", "wf_workflows")


def server_url(backend: str, dbname: str) -> str:
    return make_url(ADMIN_URLS[backend]).set(database=dbname).render_as_string(hide_password=False)


def _pg_url(dbname: str) -> str:
    return server_url("postgresql", dbname)


def _admin(backend: str, sql: str) -> None:
    url = ADMIN_URLS[backend]
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    except Exception as exc:  # the server must be there: fail, never skip
        pytest.fail(f"{backend} backend required but unusable at {url}: {exc}")
    finally:
        engine.dispose()


def create_database(backend: str) -> str:
    name = f"wf_persist_t_{uuid.uuid4().hex[:12]}"
    quote = '"' if backend == "postgresql" else "`"
    _admin(backend, f"CREATE DATABASE {quote}{name}{quote}")
    return name


def drop_database(backend: str, name: str) -> None:
    if backend == "postgresql":
        _admin(backend, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    else:
        _admin(backend, f"DROP DATABASE IF EXISTS `{name}`")


def create_pg_database() -> str:
    return create_database("postgresql")


def drop_pg_database(name: str) -> None:
    drop_database("postgresql", name)


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
def _server_dbs() -> Iterator[dict[str, str]]:
    """One migrated scratch database per server backend for the whole session."""
    made: dict[str, tuple[str, str]] = {}
    urls: dict[str, str] = {}

    class Lazy(dict[str, str]):
        def __missing__(self, backend: str) -> str:
            name = create_database(backend)
            made[backend] = (name, server_url(backend, name))
            migrate.upgrade(made[backend][1])
            self[backend] = made[backend][1]
            return self[backend]

    lazy = Lazy(urls)
    yield lazy
    for backend, (name, _) in made.items():
        drop_database(backend, name)


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
    url: str = request.getfixturevalue("_server_dbs")[backend]
    engine = create_engine(url)
    with engine.begin() as conn:
        if backend == "postgresql":
            conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
        else:
            for table in TABLES:
                conn.execute(text(f"DELETE FROM {table}"))
    engine.dispose()
    return url


@pytest.fixture
def blank_db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """An empty, never-migrated database of the current backend."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'blank.sqlite3'}"
        return
    name = create_database(backend)
    yield server_url(backend, name)
    drop_database(backend, name)


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


@pytest.fixture
def saga_reset() -> Iterator[None]:
    """Clear the saga fixtures' counters and knobs around a test (and open its gate)."""
    from .fixtures import saga

    saga.reset()
    yield
    saga.GATE.set()
    saga.reset()


@pytest.fixture
def rt(runtime: wp.Runtime) -> wp.Runtime:
    """A runtime with every saga fixture workflow registered."""
    from .fixtures import saga

    runtime.register(*saga.ALL)
    return runtime
