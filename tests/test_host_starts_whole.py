"""A start in a host's transaction is whole or absent, and a run a host's AUTOCOMMIT engine
half wrote before its process died is still driven to its end.

- On MySQL/MariaDB a start in a host's transaction is two statements (the run, then its
  ``execution.started``). A lock wait timeout on the second raised ``StatementCancelledError``
  but left the run row in the transaction, which MySQL keeps: a host that committed its own
  work committed a run without its first event, driven to its first park and then failed at
  every drive ("reading its history gave 2 of 3 events").
- Through a host engine in AUTOCOMMIT the two statements commit apart (SQLite, MySQL): a
  process killed between them left such a run too.
- The thin client's ``start(session=)`` read the catalog on a connection of its own: with the
  pool held by the application's requests (each with its session), every start waited out
  ``pool_timeout``; at REPEATABLE READ on PostgreSQL it saw a version the session's
  snapshot does not, and the run's insert failed with a raw ``IntegrityError``.
- ``session=`` given an engine, a string or an async session raised a raw
  ``AttributeError``; a deadlock between two hosts' transactions on PostgreSQL raised a raw
  ``OperationalError``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .helpers import Processes


@wp.step
def add_one(n: int) -> int:
    return n + 1


@wp.workflow(name="whole_start", version=1)
def whole_start_wf(ctx: wp.Context, n: int) -> int:
    ctx.sleep(0.2)
    return ctx.run(add_one, n)


def test_a_start_refused_midway_in_the_hosts_transaction_leaves_no_run(
    backend: str,
    db_engine: Engine,
    make_engine: Callable[..., Engine],
    db_url: str,
    request: pytest.FixtureRequest,
) -> None:
    """Another transaction holds every history row locked; the host's start waits one
    second for it. Whatever the backend does (PostgreSQL and SQLite do not wait here), the
    host then commits: the run is there with its first event, or not at all."""
    rt = wp.Runtime(db_engine)
    request.addfinalizer(rt.close)
    rt.register(whole_start_wf)
    client = rt.client()
    assert client.execute(whole_start_wf, 0).unwrap() == 1  # some history rows exist
    locker = make_engine(db_url).connect()
    request.addfinalizer(locker.close)
    if backend != "sqlite":
        locker.execute(text("SELECT * FROM wf_history FOR UPDATE")).all()
    started: wp.ExecutionHandle | None = None
    with Session(db_engine) as session:
        if backend == "mysql":
            session.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
        with contextlib.suppress(wp.StatementCancelledError):
            started = client.start(whole_start_wf, 1, session=session)
        session.commit()  # the host keeps its own work
    locker.rollback()
    with db_engine.connect() as conn:
        runs = conn.execute(select(func.count()).select_from(ex)).scalar_one()
    assert runs == (1 if started is None else 2)
    if started is not None:
        assert client.result(started.execution_id, timeout=30).unwrap() == 2


_HALF_START = """
import os, sys
import sqlalchemy as sa
from sqlalchemy.orm import Session
import wf_persist as wp
from tests.test_host_starts_whole import whole_start_wf

engine = sa.create_engine(sys.argv[1], isolation_level="AUTOCOMMIT")
rt = wp.Runtime(engine)
rt.register(whole_start_wf)

@sa.event.listens_for(engine, "before_cursor_execute")
def die(conn, cursor, statement, parameters, context, executemany):
    if "INSERT INTO wf_history" in statement:
        os.kill(os.getpid(), 9)

with Session(engine) as session:
    rt.client().start(whole_start_wf, 1, session=session)
    session.commit()
"""


def test_a_start_half_written_by_an_autocommit_engine_that_died_is_driven_to_its_end(
    db_url: str, make_runtime: Callable[..., wp.Runtime], procs: Processes
) -> None:
    make_runtime().register(whole_start_wf)  # the schema and the version, before the crash
    child = procs.python("-c", _HALF_START, db_url)
    assert child.wait(60) == -signal.SIGKILL
    rt = make_runtime()
    rt.register(whole_start_wf)
    client = rt.client()
    with rt.engine.connect() as conn:
        ids = conn.execute(select(ex.c.id)).scalars().all()
    for run in ids:  # none where the start is one statement (PostgreSQL)
        assert client.result(run, timeout=30).unwrap() == 2


def test_a_thin_clients_start_in_a_session_takes_no_second_connection(
    db_url: str, make_engine: Callable[..., Engine], make_runtime: Callable[..., wp.Runtime]
) -> None:
    make_runtime().register(whole_start_wf)
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=1)
    thin = wp.Client(engine)
    try:
        with Session(engine) as session:
            session.execute(text("SELECT 1")).all()  # the request's own work: the one connection
            handle = thin.start("whole_start", 1, session=session)
            session.commit()
    finally:
        thin.close()
    worker = make_runtime()
    worker.register(whole_start_wf)
    assert worker.client().result(handle.execution_id, timeout=30).unwrap() == 2


@wp.workflow(name="whole_start", version=2)
def whole_start_v2(ctx: wp.Context, n: int) -> int:
    return n + 100


def test_a_thin_clients_start_in_a_snapshot_starts_the_version_the_snapshot_sees(
    backend: str,
    db_url: str,
    make_engine: Callable[..., Engine],
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """At REPEATABLE READ a version cataloged after the session's snapshot is not the
    session's to start (its run's row would refer to a catalog row it cannot see)."""
    make_runtime().register(whole_start_wf)
    engine = make_engine(db_url, isolation_level="REPEATABLE READ" if backend != "sqlite" else None)
    thin = wp.Client(engine)
    try:
        with Session(engine) as session:
            session.execute(select(func.count()).select_from(ex)).all()  # its snapshot
            make_runtime().register(whole_start_v2)  # a deploy catalogs version 2 meanwhile
            handle = thin.start("whole_start", 1, session=session)
            session.commit()
    finally:
        thin.close()
    assert handle.version in (1, 2)  # 1 where the snapshot is older (PostgreSQL, MariaDB)
    worker = make_runtime()
    worker.register(whole_start_wf, whole_start_v2)
    value = worker.client().result(handle.execution_id, timeout=30).unwrap()
    assert value == (2 if handle.version == 1 else 101)


def test_session_must_be_a_session_or_a_connection(runtime: wp.Runtime, db_engine: Engine) -> None:
    runtime.register(whole_start_wf)
    thin = wp.Client(db_engine)
    try:
        for wrong in (db_engine, "sqlite://", object()):
            with pytest.raises(wp.InvalidArgumentError, match="session must be"):
                runtime.client().start(whole_start_wf, 1, session=wrong)  # type: ignore[arg-type]
            with pytest.raises(wp.InvalidArgumentError, match="session must be"):
                thin.start("whole_start", 1, session=wrong)  # type: ignore[arg-type]
            with pytest.raises(wp.InvalidArgumentError, match="session must be"):
                runtime.register(whole_start_wf, session=wrong)  # type: ignore[arg-type]
    finally:
        thin.close()
    with db_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ex)).scalar_one() == 0


@pytest.mark.needs("server")
def test_a_deadlock_between_two_hosts_transactions_is_a_typed_error(
    db_engine: Engine, runtime: wp.Runtime
) -> None:
    """Each holds one idempotency key and asks for the other's: the database rolls one
    back, which its host retries as a ``StatementCancelledError``."""
    runtime.register(whole_start_wf)
    client = runtime.client()
    errors: list[BaseException] = []
    first, second = Session(db_engine), Session(db_engine)
    try:
        client.start(whole_start_wf, 1, idempotency_key="a", session=first)
        client.start(whole_start_wf, 1, idempotency_key="b", session=second)

        def cross() -> None:
            try:
                client.start(whole_start_wf, 1, idempotency_key="b", session=first)
            except Exception as exc:  # judged below
                errors.append(exc)

        waiting = threading.Thread(target=cross)
        waiting.start()
        time.sleep(0.5)  # first waits for b
        try:
            client.start(whole_start_wf, 1, idempotency_key="a", session=second)
        except Exception as exc:  # judged below
            errors.append(exc)
        second.rollback()
        waiting.join(timeout=60)
    finally:
        first.rollback()
        first.close()
        second.close()
    assert errors and all(isinstance(e, wp.StatementCancelledError) for e in errors), errors


def test_an_embedded_start_in_a_session_takes_no_second_connection(
    db_url: str, make_engine: Callable[..., Engine], request: pytest.FixtureRequest
) -> None:
    """A version registered in a host's transaction is not known cataloged: the start's
    look at the workflow's timeout read the catalog on a connection of its own."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=1)
    rt = wp.Runtime(engine)
    request.addfinalizer(rt.close)
    with Session(engine) as session:
        rt.register(whole_start_wf, session=session)
        handle = rt.client().start(whole_start_wf, 1, session=session)
        session.commit()
    with Session(engine) as session:
        again = rt.client().start(whole_start_wf, 2, session=session)
        session.commit()
    assert rt.client().result(handle.execution_id, timeout=30).unwrap() == 2
    assert rt.client().result(again.execution_id, timeout=30).unwrap() == 3


def test_a_scoped_session_is_a_session(
    db_url: str, make_engine: Callable[..., Engine], request: pytest.FixtureRequest
) -> None:
    """Flask-SQLAlchemy's ``db.session`` is a ``scoped_session``: a proxy, not a Session."""
    from sqlalchemy.orm import scoped_session, sessionmaker

    engine = make_engine(db_url)
    rt = wp.Runtime(engine)
    request.addfinalizer(rt.close)
    thin = wp.Client(engine)
    request.addfinalizer(thin.close)
    scoped = scoped_session(sessionmaker(engine))
    request.addfinalizer(scoped.remove)
    rt.register(whole_start_wf, session=scoped)
    first = rt.client().start(whole_start_wf, 1, session=scoped)
    second = thin.start("whole_start", 2, session=scoped)
    scoped.commit()
    assert rt.client().result(first.execution_id, timeout=30).unwrap() == 2
    assert rt.client().result(second.execution_id, timeout=30).unwrap() == 3


CHARGED: list[int] = []


@wp.step
def charge_once(n: int) -> int:
    CHARGED.append(n)
    return n


@wp.workflow(name="autocommit_charge", version=1)
def autocommit_charge_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(charge_once, n)


def test_a_start_refused_midway_on_an_autocommit_engine_keeps_a_run_a_worker_took(
    db_url: str, make_engine: Callable[..., Engine], make_runtime: Callable[..., wp.Runtime]
) -> None:
    """On a host engine in AUTOCOMMIT the run row commits on its own; its first event's
    insert then failed after a worker had claimed and driven it. Removing the run there
    took its recorded step with it: the caller's retry (same idempotency key) made a new
    run, and the step ran again."""
    CHARGED.clear()
    rt, other = make_runtime(), make_runtime()
    rt.register(autocommit_charge_wf)
    other.register(autocommit_charge_wf)
    host = make_engine(db_url, isolation_level="AUTOCOMMIT").connect()
    armed = [True]

    def fail_first_history_insert(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if armed[0] and "INSERT INTO wf_history" in statement:
            armed[0] = False
            # A worker meets the committed run meanwhile (where the database lets it: on
            # SQLite the host's connection still holds the write lock).
            with contextlib.suppress(wp.WfPersistError), other.engine.connect() as look:
                for run in look.execute(select(ex.c.id)).scalars():
                    other.drive(run)
            raise RuntimeError("lock wait timeout exceeded (injected)")

    event.listen(host, "before_cursor_execute", fail_first_history_insert)
    try:
        client = rt.client()
        try:  # one statement on PostgreSQL, sent past the hook: it goes through whole
            client.start(autocommit_charge_wf, 7, idempotency_key="order-1", session=host)
        except RuntimeError as exc:
            assert "injected" in str(exc)
        handle = client.start(autocommit_charge_wf, 7, idempotency_key="order-1", session=host)
        assert client.result(handle.execution_id, timeout=30).unwrap() == 7
    finally:
        event.remove(host, "before_cursor_execute", fail_first_history_insert)
        host.close()
    assert CHARGED == [7]
