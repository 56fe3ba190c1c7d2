"""Statements sent through libpq itself (PostgreSQL with psycopg 3): prepared once per
connection, they must survive what a host does to its connections (forgetting prepared
statements, refusing them, dying) and fail as every other path does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, event, make_url, text
from sqlalchemy.exc import OperationalError

import wf_persist as wp

from .fixtures import workflows as w
from .tcpproxy import TCPProxy

pytestmark = pytest.mark.needs("libpq")


def _ours_prepared(engine: Engine) -> int:
    """How many of our prepared statements the pool's one connection holds."""
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'wfp\\_%'")
        ).scalar_one()
        conn.rollback()
    return int(found)


def _run(rt: wp.Runtime, n: int) -> list[int]:
    client = rt.client()
    handle = client.start(w.echo_wf, n)
    assert rt.drive(handle.execution_id)
    result: list[int] = client.result(handle.execution_id, timeout=10).unwrap()
    return result


@pytest.mark.parametrize("forget", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_statements_the_host_made_the_server_forget_are_prepared_again(
    forget: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        assert _run(rt, 3) == [1, 2, 3]
        assert _ours_prepared(engine) > 0  # the steps went through libpq
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(forget)
        assert _ours_prepared(engine) == 0
        assert _run(rt, 4) == [1, 2, 3, 4]
        assert _ours_prepared(engine) > 0


def test_a_connection_that_must_not_prepare_parses_each_statement(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``prepare_threshold=None`` is psycopg's setting behind a transaction-mode pooler,
    where a prepared statement may be on another server connection at the next use."""
    engine = make_engine(
        db_url, pool_size=1, max_overflow=0, connect_args={"prepare_threshold": None}
    )
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        assert _run(rt, 5) == [1, 2, 3, 4, 5]
        assert _ours_prepared(engine) == 0


def test_a_connection_killed_between_writes_is_replaced(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The server ends the pooled connection between two runs: the next write through
    libpq fails as a disconnect (SQLAlchemy's error, the connection never reused)
    and the run is driven to its end."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    admin = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=1) as rt:
        rt.register(w.echo_wf)
        assert _run(rt, 2) == [1, 2]
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            conn.rollback()
        with admin.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        client = rt.client()
        with pytest.raises(OperationalError) as failed:  # as the cursor's path reports it
            client.start(w.echo_wf, 3)
        assert failed.value.connection_invalidated
        assert isinstance(failed.value, wp.DatabaseUnavailableError)
        handle = client.start(w.echo_wf, 3)  # the dead connection was dropped
        rt.drive(handle.execution_id)
        assert client.result(handle.execution_id, timeout=10).unwrap() == [1, 2, 3]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
            conn.rollback()


def test_a_server_that_ended_every_connection_costs_no_failed_look(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The server ends all of a pool's connections at once (a restart, a failover): the
    first look that meets a dead one is made again on a fresh connection, and the pool
    replaces the others before they are used (each would otherwise fail a call of its own,
    as many calls as the pool had connections: a second try would not cover them)."""
    engine = make_engine(db_url, pool_size=5, max_overflow=0)
    admin = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        handle = rt.client().start(w.echo_wf, 2)
        assert rt.drive(handle.execution_id)
        thin = wp.Client(engine)
        held = [engine.connect() for _ in range(5)]
        pids = [c.execute(text("SELECT pg_backend_pid()")).scalar_one() for c in held]
        for conn in held:
            conn.rollback()
            conn.close()
        with admin.begin() as conn:
            for pid in pids:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        failures = []
        for _ in range(7):
            try:
                assert thin.describe(handle.execution_id).status == "completed"
            except OperationalError as exc:
                failures.append(exc)
        assert failures == []
        assert thin.result(handle.execution_id, timeout=5).unwrap() == [1, 2]


def test_a_look_at_an_unreachable_database_raises_sqlalchemys_error(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Connecting fails (the server is gone): a look raises what ``engine.connect()``
    raises, SQLAlchemy's OperationalError, not the driver's own."""
    url = make_url(db_url)
    proxy = TCPProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        engine = make_engine(url.set(host="127.0.0.1", port=proxy.port))
        with wp.Runtime(engine, lease_ttl=5) as rt:
            rt.register(w.echo_wf)
            handle = rt.client().start(w.echo_wf, 2)
            thin = wp.Client(engine)
            assert thin.describe(handle.execution_id).status == "running"
            proxy.close()
            engine.dispose()
            for look in (thin.describe, thin.outcome, thin.status):
                with pytest.raises(OperationalError):
                    look(handle.execution_id)
    finally:
        proxy.close()


def _pids(engine: Engine, n: int) -> set[int]:
    """The backends of ``n`` connections the pool hands out at once."""
    held = [engine.connect() for _ in range(n)]
    try:
        return {c.execute(text("SELECT pg_backend_pid()")).scalar_one() for c in held}
    finally:
        for conn in held:
            conn.rollback()
            conn.close()


def _terminate(admin: Engine, *pids: int) -> None:
    with admin.begin() as conn:
        for pid in pids:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


def test_a_lost_connection_of_another_pool_leaves_the_runs_pool_alone(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host's connection from an engine of its own dies under a start written in it: that
    connection's pool is the one whose older connections are replaced, never the pool the
    runtime's runs use (each of its connections would reconnect and prepare anew)."""
    engine = make_engine(db_url, pool_size=2, max_overflow=0)
    host = make_engine(db_url, pool_size=1, max_overflow=0)
    admin = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        client.start(w.echo_wf, 1)
        ours = _pids(engine, 2)
        with host.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            conn.commit()
            _terminate(admin, pid)
            with pytest.raises(OperationalError) as failed:
                client.start(w.echo_wf, 2, session=conn)
            assert failed.value.connection_invalidated
        assert _pids(engine, 2) == ours
        assert pid not in _pids(host, 1)


def test_a_host_whose_handle_error_keeps_the_pool_keeps_it(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host's ``handle_error`` listener may keep the pool on a disconnect
    (``invalidate_pool_on_disconnect = False``); listeners never see a fast path's errors,
    so on such an engine a lost connection replaces only itself (the look that met it is
    made again on a fresh one)."""
    engine = make_engine(db_url, pool_size=2, max_overflow=0)

    @event.listens_for(engine, "handle_error")
    def keep_pool(ctx: Any) -> None:
        ctx.invalidate_pool_on_disconnect = False

    admin = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        handle = rt.client().start(w.echo_wf, 1)
        thin = wp.Client(engine)
        dead, alive = sorted(_pids(engine, 2))
        _terminate(admin, dead)
        for _ in range(2):  # one of the two looks meets the dead connection, and looks again
            assert thin.describe(handle.execution_id).status in ("running", "completed")
        assert alive in _pids(engine, 2) and dead not in _pids(engine, 2)
