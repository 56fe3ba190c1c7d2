"""A statement the database cancels (a lock wait or statement timeout of a host engine's
settings) is one typed error at the public entry points, still SQLAlchemy's
``OperationalError``, with nothing written: :class:`wp.StatementCancelledError`."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

import wf_persist as wp
from wf_persist import migrate
from wf_persist.migrate import VERSION_TABLE
from wf_persist.models import history_table as hist
from wf_persist.web import create_app

from .webserver import serving


@wp.workflow(name="cancelled-statement-waits", version=1)
def waits(ctx: wp.Context) -> int:
    got = ctx.wait_for_signal("go", int)
    assert isinstance(got, wp.Received)
    return got.value


def _impatient(backend: str, db_url: str, make_engine: Callable[..., Engine]) -> Engine:
    """A host engine whose statements give up a lock wait quickly (each backend's legal
    setting for it)."""
    if backend == "postgresql":
        return make_engine(db_url, connect_args={"options": "-c lock_timeout=100"})
    if backend == "mysql":
        init = "SET SESSION innodb_lock_wait_timeout = 1, lock_wait_timeout = 1"
        return make_engine(db_url, connect_args={"init_command": init})
    return make_engine(db_url, connect_args={"timeout": 0.1})


@contextlib.contextmanager
def _locked(backend: str, db_url: str, execution_id: str) -> Iterator[None]:
    """The run's row locked (on SQLite the whole database) by another connection."""
    if backend == "sqlite":
        path = make_url(db_url).database
        assert path is not None
        raw = sqlite3.connect(path, isolation_level=None)
        try:
            raw.execute("BEGIN IMMEDIATE")
            yield
            raw.execute("ROLLBACK")
        finally:
            raw.close()
        return
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            conn.execute(
                text("SELECT id FROM wf_executions WHERE id = :id FOR UPDATE"), {"id": execution_id}
            )
            yield
            conn.rollback()
    finally:
        engine.dispose()


def _events(engine: Engine, execution_id: str) -> int:
    with engine.connect() as conn:
        query = select(func.count()).where(hist.c.execution_id == execution_id)
        return int(conn.execute(query).scalar_one())


def _cancelled(call: Callable[[], Any]) -> wp.StatementCancelledError:
    with pytest.raises(wp.StatementCancelledError) as info:
        call()
    error = info.value
    assert isinstance(error, wp.WfPersistError) and isinstance(error, OperationalError)
    assert error.orig is not None and "cancelled a statement" in str(error)
    return error


def test_a_lock_wait_the_database_gives_up_is_the_typed_error_and_nothing_is_written(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A signal, a cancel and a start waiting on a lock another transaction holds, on an
    engine whose lock waits time out: the driver's error escaped raw (a MariaDB session's
    max_statement_time, a PostgreSQL lock_timeout); the call may be repeated once the lock
    is gone."""
    engine = _impatient(backend, db_url, make_engine)
    with wp.Runtime(engine) as rt:
        rt.register(waits)
        client = rt.client()
        execution_id = client.start(waits).execution_id
        assert rt.drive(execution_id)
        before = _events(engine, execution_id)
        with _locked(backend, db_url, execution_id):
            _cancelled(lambda: client.signal(execution_id, "go", 7))
            _cancelled(lambda: client.cancel(execution_id))
            if backend == "sqlite":  # the whole file is locked: a start waits too
                _cancelled(lambda: client.start(waits))
            with (
                wp.Client(engine) as thin,
                serving(create_app(client=thin, allow_actions=True, token="t")) as base,
                httpx.Client(base_url=base, timeout=30) as http,
            ):
                answer = http.post(
                    f"/api/runs/{execution_id}/signal",
                    json={"name": "go", "payload": 7},
                    headers={"authorization": "Bearer t"},
                )
                assert answer.status_code == 503, answer.text  # busy: try again
                assert "cancelled a statement" in answer.json()["error"]
        assert _events(engine, execution_id) == before, "nothing recorded"
        assert client.status(execution_id) == "suspended"
        assert client.signal(execution_id, "go", 7) == "delivered"
        assert rt.drive(execution_id)
        assert client.result(execution_id, timeout=0).unwrap() == 7


@pytest.mark.needs("server")
def test_opening_on_a_locked_schema_is_the_typed_error(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A runtime opened while another transaction holds the version table (as a migration
    may): its check of the schema's revision gave up the wait with the driver's raw error,
    and so did the migration functions that read it."""
    engine = _impatient(backend, db_url, make_engine)
    holder = create_engine(db_url)
    lock, unlock = (
        (f"LOCK TABLE {VERSION_TABLE} IN ACCESS EXCLUSIVE MODE", "ROLLBACK")
        if backend == "postgresql"
        else (f"LOCK TABLES {VERSION_TABLE} WRITE", "UNLOCK TABLES")
    )
    try:
        with holder.connect() as conn:
            conn.execute(text(lock))
            _cancelled(lambda: wp.Runtime(engine))
            _cancelled(lambda: migrate.current(engine))
            _cancelled(lambda: migrate.state(engine))
            _cancelled(lambda: migrate.assert_at_head(engine))
            conn.execute(text(unlock))
    finally:
        holder.dispose()
    with wp.Runtime(engine) as rt:
        assert rt.client().list().items == []


@pytest.mark.needs("server")
def test_a_statement_cancelled_while_connecting_is_not_a_failure_to_connect(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host engine whose statements may run a microsecond: the first connection's own
    queries are cancelled, which was reported as "cannot connect to the database" (a
    ``DatabaseConnectError``), sending its reader after the wrong cause."""
    kinds: set[str] = set()
    for _ in range(5):
        if backend == "postgresql":
            engine = make_engine(db_url, connect_args={"options": "-c statement_timeout=1"})
        else:
            init = "SET SESSION max_statement_time = 0.000001"
            engine = make_engine(db_url, connect_args={"init_command": init})
        for opening in (wp.Runtime, wp.Client):
            try:
                opening(engine).close()
            except wp.WfPersistError as exc:
                kinds.add(type(exc).__name__)
    assert kinds == {"StatementCancelledError"}


@pytest.mark.needs("embedded")
@pytest.mark.parametrize("held", [0.4, 3.0])
def test_opening_waits_a_second_for_a_writer_whatever_the_engines_busy_timeout(
    db_url: str, make_engine: Callable[..., Engine], held: float
) -> None:
    """A file in rollback-journal mode, where a writer's lock keeps readers out, opened by
    a host engine with no busy timeout while another connection writes: the runtime's
    check of the schema failed at once ("database is locked") where wf_persist's own
    transactions wait at least a second. It waits that second now, and says so typed if
    the writer holds on longer."""
    path = make_url(db_url).database
    assert path is not None
    setup = sqlite3.connect(path, isolation_level=None)
    assert setup.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    setup.close()
    engine = make_engine(db_url, connect_args={"timeout": 0})
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(held, lambda: writer.execute("COMMIT"))
    release.start()
    began = time.monotonic()
    try:
        if held < 1:
            with wp.Runtime(engine) as rt:
                assert rt.client().list().items == []
            assert time.monotonic() - began >= held - 0.05  # it waited for the writer
        else:
            _cancelled(lambda: wp.Runtime(engine))
            assert 0.9 <= time.monotonic() - began < held  # a second, not the writer's time
    finally:
        release.join()
        writer.close()


@wp.workflow(name="cancelled-statement-child", version=1)
def sleepy_child(ctx: wp.Context, n: int) -> int:
    ctx.sleep(3600)
    return n


@wp.workflow(name="cancelled-statement-parent", version=1)
def waiting_parent(ctx: wp.Context, n: int) -> int:
    got: int = ctx.run_child(sleepy_child, n)
    return got


@pytest.mark.needs("server")
def test_a_cancel_of_a_tree_cut_off_by_a_lock_timeout_leaves_the_parent_to_cancel_the_rest(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A child's row held by another transaction: the tree's cancel falls back to one run
    per transaction, the parent's commits and the child's is cancelled. The error no longer
    claims that everything rolled back (the message said so); the parent, cancelled, cancels
    its child when it is next driven."""
    engine = _impatient(backend, db_url, make_engine)
    with wp.Runtime(engine) as rt:
        rt.register(waiting_parent, sleepy_child)
        client = rt.client()
        parent = client.start(waiting_parent, 1).execution_id
        assert rt.drive(parent)
        (child,) = [r.execution_id for r in client.list(sleepy_child).items]
        with _locked(backend, db_url, child):
            error = _cancelled(lambda: client.cancel(parent))
            assert "rolled back" not in str(error)
        assert client.status(parent) == "compensating"
        assert client.status(child) == "running"
        assert rt.drive(parent)
        assert client.status(parent) == "failed"
        assert client.status(child) == "compensating"  # cancelled by its parent's drive
        assert rt.drive(child)
        assert client.status(child) == "failed"
