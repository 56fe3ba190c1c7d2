"""An upgrade or downgrade interrupted after any one of its DDL statements (a deploy job's
timeout, a SIGKILL) can be run again, and ends with the schema a clean run makes.

MySQL and MariaDB commit each DDL statement on its own: a revision cut short has done its
first statements and is still recorded as not done, and running it again met "table
already exists" or "duplicate column" for ever. Elsewhere DDL is transactional and the
interrupted revision left nothing. The interruption is raised right after the k-th DDL
statement returned, for every k the run has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, event, inspect, text

import wf_persist as wp
from wf_persist import migrate

from .conftest import create_database, drop_database, server_url
from .fixtures import workflows as w
from .test_migrations import models_diff

_DDL = ("CREATE", "ALTER", "DROP")
WF_TABLES = {"wf_workflows", "wf_executions", "wf_history"}
_VIEWS = ("wf_step_attempts", "wf_execution_waits", "wf_run_tree")


class _Killed(BaseException):
    """Stands for the process dying right after a statement (the server kept it)."""


@contextlib.contextmanager
def _cut_after(engine: Engine, k: int | None) -> Iterator[list[str]]:
    """Count the DDL statements sent on ``engine``; raise :class:`_Killed` right after the
    ``k``-th (never, for None)."""
    seen: list[str] = []

    def after(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith(_DDL):
            seen.append(statement)
            if len(seen) == k:
                raise _Killed(statement)

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        event.remove(engine, "after_cursor_execute", after)


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Empty databases of the current backend, made on demand and dropped at teardown."""
    made: list[str] = []

    def make() -> str:
        name = create_database(backend) if backend != "sqlite" else f"db{len(made)}"
        made.append(name)
        return (
            f"sqlite:///{tmp_path / name}.sqlite3"
            if backend == "sqlite"
            else server_url(backend, name)
        )

    yield make
    for name in made if backend != "sqlite" else ():
        drop_database(backend, name)


def _as_a_clean_upgrade_leaves_it(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            assert models_diff(conn) == []
            for view in _VIEWS:
                conn.execute(text(f"SELECT * FROM {view} WHERE 1 = 0")).all()
    finally:
        engine.dispose()
    assert migrate.current(url) == migrate.SCHEMA_HEAD
    with wp.Runtime(url) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.result(client.start(w.echo_wf, 2).execution_id).unwrap() == [1, 2]


def _run(url: str, k: int | None, fn: Callable[[Engine], object]) -> list[str]:
    """``fn`` on an engine of ``url``, cut after its ``k``-th DDL statement (what runs
    after the cut, a lock's release, may fail on the connection it left: it dies with the
    process)."""
    engine = create_engine(url)
    try:
        with _cut_after(engine, k) as seen:
            if k is None:
                fn(engine)
            else:
                with pytest.raises(BaseException):  # noqa: B017 (_Killed, or what it left)
                    fn(engine)
                assert len(seen) == k
        return seen
    finally:
        engine.dispose()


def _down(engine: Engine) -> None:
    migrate.downgrade(engine, "base")


def test_an_upgrade_cut_after_any_statement_runs_again_to_the_same_schema(
    fresh_url: Callable[[], str],
) -> None:
    statements = len(_run(fresh_url(), None, migrate.upgrade))
    assert statements >= 10
    for k in range(1, statements + 1):
        url = fresh_url()
        _run(url, k, migrate.upgrade)
        migrate.upgrade(url)  # raised "already exists" on MySQL before
        _as_a_clean_upgrade_leaves_it(url)


def test_a_downgrade_cut_after_any_statement_runs_again_to_nothing(
    fresh_url: Callable[[], str],
) -> None:
    url = fresh_url()
    migrate.upgrade(url)
    statements = len(_run(url, None, _down))
    for k in range(1, statements + 1, 3):
        url = fresh_url()
        migrate.upgrade(url)
        _run(url, k, _down)
        migrate.downgrade(url, "base")
        assert migrate.current(url) is None
        engine = create_engine(url)
        try:
            assert not (WF_TABLES & set(inspect(engine).get_table_names()))
        finally:
            engine.dispose()
