"""The libpq path (``pg_wire``): what each connection keeps between statements follows the
connection (its encoding and time zone now, its lifetime), as a cursor's does, and a
connection prepares a bounded number of statements."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.pool import NullPool

import wf_persist as wp
from wf_persist.backends import pg_wire

from .fixtures import workflows as w
from .tcpproxy import delaying_proxy

pytestmark = pytest.mark.needs("libpq")


def test_a_client_encoding_the_host_set_later_is_the_one_values_are_sent_in(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The host changes ``client_encoding`` on a pooled connection after wf_persist used it:
    a cursor would dump text in the new encoding; the kept transformer must too, or
    non-ASCII text is stored as mojibake (``José`` -> ``JosÃ©``) without any error."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        client.start(w.echo_wf, 2, actor="first")  # the connection's pg_wire session exists
        with engine.connect() as conn:  # the host, on the same pooled connection
            conn.exec_driver_sql("SET client_encoding TO 'LATIN1'")
            conn.commit()
        handle = client.start(w.echo_wf, 2, actor="José Müller")
    with make_engine(db_url).connect() as conn:
        actor = conn.execute(
            text("SELECT actor FROM wf_executions WHERE id = :id"), {"id": handle.execution_id}
        ).scalar_one()
        conn.rollback()
    assert actor == "José Müller"


def _live_connections() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, psycopg.Connection))


def test_a_closed_connection_leaves_nothing_behind(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """What the libpq path keeps per connection (prepared names, a transformer) goes with
    the connection: with NullPool (each checkout a new connection) no psycopg Connection
    outlives the engine, nor does its last result."""
    engine = make_engine(db_url, poolclass=NullPool)
    before = _live_connections()
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        for _ in range(3):
            handle = client.start(w.echo_wf, 3)
            assert rt.drive(handle.execution_id)
            assert client.result(handle.execution_id, timeout=10).unwrap() == [1, 2, 3]
    engine.dispose()
    assert _live_connections() <= before


def test_values_are_loaded_in_the_session_time_zone_the_host_set_later(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A time read through libpq is in the session's time zone as a cursor would load it,
    also after the host changed ``TimeZone`` on the connection."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        raw: Any = conn.connection.driver_connection
        for zone in ("UTC", "Asia/Tokyo"):
            conn.exec_driver_sql(f"SET TIME ZONE '{zone}'")
            [(through_libpq,)] = pg_wire.execute(raw, conn.info, "SELECT now()", {})
            with raw.cursor() as cursor:
                (through_cursor,) = cursor.execute("SELECT now()").fetchone()
            assert str(through_libpq.tzinfo) == str(through_cursor.tzinfo) == zone


def test_past_the_prepared_limit_statements_are_parsed_each_time(
    db_url: str, make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_wire, "MAX_PREPARED", 1)
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        for n in (2, 3):
            handle = client.start(w.echo_wf, n)
            assert rt.drive(handle.execution_id)
            assert client.result(handle.execution_id, timeout=10).unwrap() == list(range(1, n + 1))
    with engine.connect() as conn:
        prepared = conn.execute(
            text("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'wfp\\_%'")
        ).scalar_one()
        conn.rollback()
    assert prepared == 1


def test_a_plan_made_while_a_table_was_tiny_is_made_again_as_it_grows(
    db_url: str, make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server keeps the plan a prepared statement settled on after a few executions.
    Made while a table was tiny (a new database, analyzed while empty), that plan scans the
    whole table; with nothing to analyze it again (autovacuum off) every execution would go
    on scanning it as it grows to millions of rows. A statement is prepared again after
    ``REPLAN_AFTER`` executions, and then plans with the index."""
    monkeypatch.setattr(pg_wire, "REPLAN_AFTER", 30)
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    table = "wf_test_replan"
    lookup = f"SELECT v FROM {table} WHERE k = %(k)s"

    def plan(conn: Any) -> str:
        _, name, _, _ = pg_wire.converted(lookup)
        rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE {name.decode()}('k1')").all()
        conn.rollback()
        return "\n".join(r[0] for r in rows)

    with engine.connect() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        conn.exec_driver_sql(f"CREATE TABLE {table} (k TEXT PRIMARY KEY, v INT NOT NULL)")
        conn.exec_driver_sql(f"ANALYZE {table}")  # while empty, as a new database's was
        conn.commit()
        raw: Any = conn.connection.driver_connection
        try:
            for _ in range(10):  # the server settles on the tiny table's plan
                assert pg_wire.execute(raw, conn.info, lookup, {"k": "k1"}) == []
            conn.exec_driver_sql(
                f"INSERT INTO {table} SELECT 'k' || i, i FROM generate_series(1, 50000) i"
            )
            conn.commit()
            assert "Seq Scan" in plan(conn)  # what the kept plan does now
            for _ in range(30):
                assert pg_wire.execute(raw, conn.info, lookup, {"k": "k1"}) == [(1,)]
            assert "Index" in plan(conn) and "Seq Scan" not in plan(conn)
        finally:
            conn.rollback()
            conn.exec_driver_sql(f"DROP TABLE {table}")
            conn.commit()


def test_forgetting_a_statement_lets_other_threads_run(db_url: str) -> None:
    """A statement is prepared anew every thousand runs; forgetting the old one is a round
    trip, and libpq's blocking Close held the interpreter's lock through it (every thread
    of the process stopped; for seconds on a connection that had just died). Through a
    proxy that delays the server's answers by 0.2 s, another thread runs meanwhile."""
    url = make_url(db_url)
    with delaying_proxy(url.host or "127.0.0.1", url.port or 5432, 0.2) as port:
        raw = psycopg.connect(
            host="127.0.0.1", port=port, user=url.username, dbname=url.database, autocommit=True
        )
        try:
            raw.pgconn.prepare(b"wfp_probe", b"SELECT 1")
            ticks = [0]
            stop = threading.Event()

            def tick() -> None:
                while not stop.is_set():
                    ticks[0] += 1
                    time.sleep(0.001)

            ticker = threading.Thread(target=tick)
            ticker.start()
            try:
                time.sleep(0.05)
                before = ticks[0]
                pg_wire._deallocate(raw, b"wfp_probe")
                during = ticks[0] - before
            finally:
                stop.set()
                ticker.join()
            assert during >= 20, f"the other thread ran {during} times in 0.2 s"
        finally:
            raw.close()


def test_a_connection_on_a_descriptor_past_1024_is_prepared_again(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy process has sockets past 1024, which ``select`` cannot watch: preparing a
    statement again (forgetting the old one first) must wait some other way, or every
    thousandth run of a statement fails and leaves its connection mid-command."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    monkeypatch.setattr(pg_wire, "REPLAN_AFTER", 2)
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        url = make_url(db_url)
        raw = psycopg.connect(
            host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
        )
        try:
            assert raw.pgconn.socket >= 1024
            info: dict[Any, Any] = {}
            for i in range(7):  # prepared, then forgotten and prepared again, twice
                rows = pg_wire.execute(raw, info, "SELECT %(x)s::int", {"x": i})
                assert rows == [(i,)]
        finally:
            raw.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
