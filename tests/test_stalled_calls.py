"""A drive whose database call never gets an answer: a network fault cut its connection
without either end hearing of it (a failover black-holing the old primary, a proxy whose
upstream died). Its lease was renewed from the keeper's own connection all the while, so
the run stayed with the stuck drive for good and no other worker could take it over.

The keeper now stops renewing a lease whose drive has waited on one call past
``max(lease TTL, STALL_AFTER)``, and ends that call: the run is taken over when the lease
lapses, and a step recorded before it never runs again.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, make_url, text

import wf_persist as wp
from wf_persist import leases

from .helpers import wait_until
from .tcpproxy import TCPProxy

CALLS: list[str] = []
GATE = threading.Event()


@wp.step
def _first() -> int:
    CALLS.append("first")
    return 1


@wp.step
def _slow() -> int:
    CALLS.append("slow")
    GATE.wait(2.0)
    return 2


@wp.step
def _last() -> int:
    CALLS.append("last")
    return 3


@wp.workflow(name="stalled_calls", version=1)
def stalled_wf(ctx: wp.Context) -> int:
    return ctx.run(_first) + ctx.run(_slow) + ctx.run(_last)


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[TCPProxy, str]]:
    url = make_url(db_url)
    default = 5432 if url.get_backend_name() == "postgresql" else 3306
    proxy = TCPProxy((url.host or "127.0.0.1", url.port or default))
    try:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    finally:
        proxy.close()


def _server_ports(engine: Engine, runtime: wp.Runtime) -> set[int]:
    """The server-side client ports of the runtime's idle pooled connections."""
    ids = []
    for record in list(runtime.backend.engine.pool._pool.queue):  # type: ignore[attr-defined]
        raw = record.dbapi_connection
        if raw is None:
            continue
        pgconn = getattr(raw, "pgconn", None)
        ids.append(pgconn.backend_pid if pgconn is not None else raw.thread_id())
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            query = "SELECT client_port FROM pg_stat_activity WHERE pid = :i"
        else:
            query = (
                "SELECT CAST(SUBSTRING_INDEX(host, ':', -1) AS UNSIGNED) "
                "FROM information_schema.processlist WHERE id = :i"
            )
        return {int(conn.execute(text(query), {"i": i}).scalar_one()) for i in ids}


@pytest.mark.needs("server")
def test_a_run_whose_drive_waits_forever_on_a_cut_connection_is_taken_over(
    proxied: tuple[TCPProxy, str],
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leases, "STALL_AFTER", 2.0)
    CALLS.clear()
    GATE.clear()
    proxy, proxy_url = proxied
    stuck = wp.Runtime(proxy_url, lease_ttl=2)
    try:
        stuck.register(stalled_wf)
        stuck.start_worker(concurrency=2)
        run = stuck.client().start(stalled_wf).execution_id
        wait_until(lambda: "slow" in CALLS, what="the slow step", timeout=20)
        time.sleep(0.3)  # its connection back in the pool while it runs
        for port in _server_ports(make_engine(db_url), stuck) & proxy.server_ports():
            proxy.silence(port)  # its next write waits for an answer that never comes
        GATE.set()
        other = make_runtime(lease_ttl=2)
        other.register(stalled_wf)
        other.start_worker(concurrency=2)
        assert other.client().result(run, timeout=60).unwrap() == 6
        assert CALLS.count("first") == 1, CALLS  # recorded before the cut: never again
        assert CALLS.count("last") == 1, CALLS  # both runtimes are in this process
    finally:
        proxy.close()  # the silenced connections end: nothing waits on them any more
        stuck.close()


HOLDING: list[Engine] = []


@wp.step
def _hold_the_pool() -> int:
    """The application takes every connection of the pool it shares, for 2.5 s."""
    CALLS.append("hold")
    engine = HOLDING[0]

    def hold() -> None:
        taken = [engine.connect() for _ in range(3)]
        time.sleep(2.5)
        for conn in taken:
            conn.close()

    threading.Thread(target=hold).start()
    time.sleep(0.2)
    return 1


@wp.step
def _long() -> int:
    CALLS.append("long")
    time.sleep(4)
    return 2


@wp.workflow(name="pool_wait", version=1)
def pool_wait_wf(ctx: wp.Context) -> int:
    return ctx.run(_hold_the_pool) + ctx.run(_long)


def test_a_wait_for_a_pooled_connection_is_no_stall(
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write waiting past the bound for the host's pool (its pool_timeout bounds that
    wait) was counted as a stall: the lease was never renewed again, and the next step
    longer than the lease ran in a second drive at once."""
    monkeypatch.setattr(leases, "STALL_AFTER", 1.0)
    CALLS.clear()
    HOLDING[:] = [make_engine(db_url, pool_size=3, max_overflow=0, pool_timeout=30)]
    with wp.Runtime(HOLDING[0], lease_ttl=1) as first:
        first.register(pool_wait_wf)
        first.start_worker(concurrency=1)
        run = first.client().start(pool_wait_wf).execution_id
        wait_until(lambda: "long" in CALLS, what="the long step", timeout=20)
        other = make_runtime(lease_ttl=1)
        other.register(pool_wait_wf)
        other.start_worker(concurrency=1)
        assert other.client().result(run, timeout=30).unwrap() == 3
        assert CALLS.count("long") == 1, CALLS


def _probes_in_seconds(raw: Any) -> None:
    """The driver connection's socket has keepalives (10 s idle) and a 30 s user timeout."""
    pgconn = getattr(raw, "pgconn", None)
    if pgconn is not None:
        fileno = pgconn.socket
    elif getattr(raw, "_sock", None) is not None:  # PyMySQL
        fileno = raw._sock.fileno()
    else:  # aiomysql: the socket under its stream's transport
        fileno = raw._writer.get_extra_info("socket").fileno()
    with socket.socket(fileno=os.dup(fileno)) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000


@pytest.mark.needs("server")
def test_connections_of_our_own_engines_notice_a_dead_server(
    runtime: wp.Runtime, db_url: str
) -> None:
    """Keepalives and a user timeout on every connection of an engine wf_persist made (a
    runtime's, an AsyncClient's and its side engine's): a server gone without a word (a
    host crash, a partition) failed nothing for hours."""
    with runtime.backend.engine.connect() as conn:
        _probes_in_seconds(conn.connection.driver_connection)

    async def through_async_client() -> None:
        client = wp.AsyncClient(db_url)
        try:
            await client.list("nothing")
            async with client.engine.connect() as conn:
                _probes_in_seconds((await conn.get_raw_connection()).driver_connection)
            side = client._client.backend.side_engine()  # type: ignore[union-attr]
            try:
                with side.connect() as plain:
                    _probes_in_seconds(plain.connection.driver_connection)
            finally:
                side.dispose()
        finally:
            await client.close()

    asyncio.run(through_async_client())
