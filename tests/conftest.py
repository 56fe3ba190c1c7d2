"""One database fixture parametrized over every backend, selected by capability.

Backends come from ``WF_PERSIST_TEST_BACKENDS`` (default ``sqlite,postgresql,mysql``). Each
listed backend is required: the session starts by opening every one of them, and an
unreachable server stops the run as a failure, never as a skip.

Tests choose backends by what they need, never by name, so every backend that has a
capability is tested for it::

    @pytest.mark.needs("skip_locked")    # every listed backend whose claims SKIP LOCKED
    @pytest.mark.lacks("schemas")        # every listed backend without named schemas

The capabilities (:data:`CAPABILITIES`) are read from the backend objects themselves:
``skip_locked``, ``schemas`` (``supports_schemas``), ``embedded``, ``server`` (not embedded),
``notify`` (``can_listen``: LISTEN/NOTIFY wake-ups), ``presence`` (presence locks) and
``idle_limit``
(the server ends a write transaction of ours whose process paused in it).
``tests/test_backends.py`` pins which backend has which, so a capability lost by accident
fails there instead of quietly dropping a backend from the tests that need it. A test whose
parameter set comes out empty (no listed backend has what it needs) fails; it is not skipped.

With ``WF_PERSIST_TEST_STRICT=1`` (set by ``.ci/run``) every known backend must be listed,
and a skipped test (or module) fails the run.

PostgreSQL and MySQL/MariaDB tests share one migrated scratch database per server for the
session, emptied before each test; tests that need an empty, unmigrated database get their
own. Child processes, engines and host tables a test makes are owned by fixtures
(``procs``, ``make_engine``, ``host_tables``) and cleaned up even when the test fails; a
failing test's report ends with the tail of each child's stderr.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Table, create_engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from wf_persist import migrate
from wf_persist.backends import Backend, open_backend

from .helpers import Processes

#: Every backend the project supports; strict mode requires all of them.
KNOWN_BACKENDS = ("sqlite", "postgresql", "mysql")
BACKENDS = [
    b.strip()
    for b in os.environ.get("WF_PERSIST_TEST_BACKENDS", ",".join(KNOWN_BACKENDS)).split(",")
    if b.strip()
]
STRICT = os.environ.get("WF_PERSIST_TEST_STRICT", "") not in ("", "0")
#: Admin URLs: the tests create (and drop) scratch databases through them.
ADMIN_URLS = {
    "postgresql": os.environ.get(
        "WF_PERSIST_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get(
        "WF_PERSIST_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
    ),
}
TABLES = ("wf_history", "wf_executions", "wf_workflows", "wf_slots")
#: The capabilities a ``needs``/``lacks`` marker may name.
CAPABILITY_NAMES = frozenset(
    {
        "skip_locked",
        "schemas",
        "embedded",
        "server",
        "sql_mode",
        "initdb",
        "notify",
        "presence",
        "idle_limit",
        "libpq",
    }
)
#: Capabilities of each listed backend, read from its backend object at session start.
CAPABILITIES: dict[str, frozenset[str]] = {}

PROCS_KEY = pytest.StashKey[Processes]()


def capabilities_of(backend: Backend) -> frozenset[str]:
    """What a backend object can do, in the terms the ``needs``/``lacks`` markers use."""
    kind = type(backend)
    found = {"embedded" if kind.embedded else "server"}
    if kind.skip_locked:
        found.add("skip_locked")
    if kind.supports_schemas:
        found.add("schemas")
    if getattr(backend, "sql_mode", None) is not None:
        found.add("sql_mode")  # a session sql_mode that could truncate values (MySQL)
    if "postgresql" in kind.names:
        found.add("initdb")  # a private server of it can be started (and restarted) by a test
    if kind.can_listen:
        found.add("notify")  # LISTEN/NOTIFY wake-ups
    if kind.idle_timeout is not None:
        found.add("idle_limit")  # the server ends a write transaction of ours left idle
    if getattr(backend, "wire", None) is not None:
        found.add("libpq")  # statements on an idle connection go through libpq itself
    if backend.owner_mark():
        found.add("presence")  # presence locks: a dead worker's runs are taken over at once
    return frozenset(found)


def has(backend: str, capability: str) -> bool:
    """Whether the listed ``backend`` has ``capability`` (for the odd in-test branch)."""
    assert capability in CAPABILITY_NAMES, capability
    return capability in CAPABILITIES[backend]


def _probe(name: str) -> frozenset[str]:
    with tempfile.TemporaryDirectory(prefix="wf-persist-probe-") as tmp:
        url = f"sqlite:///{tmp}/probe.sqlite3" if name == "sqlite" else ADMIN_URLS[name]
        engine = create_engine(url)
        try:
            backend = open_backend(engine, owned=False)
            backend.check()
            return capabilities_of(backend)
        finally:
            engine.dispose()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Open every listed backend before anything runs: one that is missing or unreachable
    fails the session (it is never skipped)."""
    unknown = [b for b in BACKENDS if b not in KNOWN_BACKENDS]
    if unknown or not BACKENDS:
        pytest.exit(
            f"WF_PERSIST_TEST_BACKENDS={','.join(BACKENDS)!r}: expected a subset of "
            f"{','.join(KNOWN_BACKENDS)}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    if STRICT and set(BACKENDS) != set(KNOWN_BACKENDS):
        missing = sorted(set(KNOWN_BACKENDS) - set(BACKENDS))
        pytest.exit(
            "WF_PERSIST_TEST_STRICT=1 (CI) requires every backend: WF_PERSIST_TEST_BACKENDS "
            f"leaves out {', '.join(missing)}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    for name in BACKENDS:
        try:
            CAPABILITIES[name] = _probe(name)
        except Exception as exc:
            where = "sqlite://" if name == "sqlite" else ADMIN_URLS[name]
            pytest.exit(
                f"the {name} backend is listed in WF_PERSIST_TEST_BACKENDS but unusable at "
                f"{where}: {exc}",
                returncode=pytest.ExitCode.TESTS_FAILED,
            )


def server_url(backend: str, dbname: str) -> str:
    return make_url(ADMIN_URLS[backend]).set(database=dbname).render_as_string(hide_password=False)


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


@dataclass(frozen=True)
class NoBackend:
    """The parameter of a test no listed backend can run: it fails at setup."""

    message: str


def _marker_args(metafunc: pytest.Metafunc, name: str) -> set[str]:
    found: set[str] = set()
    for marker in metafunc.definition.iter_markers(name):
        found.update(marker.args)
    unknown = found - CAPABILITY_NAMES
    if unknown:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: unknown capability {sorted(unknown)} in "
            f"@pytest.mark.{name} (known: {sorted(CAPABILITY_NAMES)})"
        )
    return found


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    needs = _marker_args(metafunc, "needs")
    lacks = _marker_args(metafunc, "lacks")
    chosen = [
        b
        for b in BACKENDS
        if needs <= CAPABILITIES.get(b, frozenset()) and not lacks & CAPABILITIES.get(b, set())
    ]
    params: list[Any] = [pytest.param(b, marks=getattr(pytest.mark, b)) for b in chosen]
    if not params:
        wanted = ", ".join([*sorted(needs), *(f"no {c}" for c in sorted(lacks))])
        message = (
            f"no backend in WF_PERSIST_TEST_BACKENDS={','.join(BACKENDS)} has what this test "
            f"needs ({wanted}): list one that does"
        )
        params = [pytest.param(NoBackend(message), id="no-backend")]
    metafunc.parametrize("backend", params, indirect=True, scope="session")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test (a name in KNOWN_BACKENDS)."""
    param = request.param
    if isinstance(param, NoBackend):
        pytest.fail(param.message, pytrace=False)
    assert isinstance(param, str)
    return param


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but WF_PERSIST_TEST_STRICT=1 allows no skip: {reason}"
    procs = item.stash.get(PROCS_KEY, None)
    if report.failed and procs is not None:
        for name, tail in procs.tails():
            report.sections.append((f"stderr of {name} (tail)", tail))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if STRICT and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but WF_PERSIST_TEST_STRICT=1 allows no skip: {reason}"
    return report


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
    try:
        with engine.begin() as conn:
            if backend == "postgresql":
                conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
            else:
                for table in TABLES:
                    conn.execute(text(f"DELETE FROM {table}"))
    finally:
        engine.dispose()
    return url


@pytest.fixture
def blank_db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """An empty, never-migrated database of the current backend."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'blank.sqlite3'}"
        return
    name = create_database(backend)
    try:
        yield server_url(backend, name)
    finally:
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
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Factory for plain SQLAlchemy engines; every one is disposed at teardown."""
    made: list[Engine] = []

    def make(url: str, **kwargs: Any) -> Engine:
        engine = create_engine(url, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.dispose()


@pytest.fixture
def db_engine(db_url: str, make_engine: Callable[..., Engine]) -> Engine:
    """A plain engine on the test database (disposed at teardown)."""
    return make_engine(db_url)


class HostTables:
    """Tables a test creates as a host application would; dropped at teardown."""

    def __init__(self) -> None:
        self._made: list[tuple[Table, Engine]] = []

    def create(self, engine: Engine, table: Table) -> Table:
        self._made.append((table, engine))
        table.create(engine)
        return table

    def drop_all(self) -> None:
        for table, engine in reversed(self._made):
            table.drop(engine, checkfirst=True)
        self._made.clear()


@pytest.fixture
def host_tables() -> Iterator[HostTables]:
    tables = HostTables()
    yield tables
    tables.drop_all()


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Processes]:
    """Child processes of this test: each child's stderr goes to a file (its tail is added
    to the report of a failing test) and every child still running at teardown is killed."""
    owner = Processes(tmp_path / "procs")
    request.node.stash[PROCS_KEY] = owner
    yield owner
    owner.close()


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
