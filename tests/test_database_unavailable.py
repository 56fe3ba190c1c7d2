"""The database out of reach during a call (its connections cut, the server refusing new
ones) is one typed error at every public entry point, still SQLAlchemy's
``OperationalError``: :class:`wp.DatabaseUnavailableError`."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

import wf_persist as wp
from tests.tcpproxy import TCPProxy
from tests.webserver import serving
from wf_persist.web import create_app

pytestmark = pytest.mark.needs("server")


@wp.workflow(name="unavailable-waits", version=1)
def waits(ctx: wp.Context) -> str:
    return str(ctx.wait_for_signal("go"))


@pytest.fixture
def cut_off(db_url: str) -> Iterator[tuple[TCPProxy, str]]:
    """A proxy to the test database, and the database's URL through it."""
    url = make_url(db_url)
    default = 3306 if url.get_backend_name() == "mysql" else 5432
    proxy = TCPProxy((url.host or "127.0.0.1", url.port or default))
    try:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    finally:
        proxy.close()


@pytest.fixture(autouse=True)
def _collected() -> Iterator[None]:
    """A pooled connection SQLAlchemy lost track of (see below) is collected here, not in a
    later test."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()


def _parked_run(runtime: wp.Runtime) -> str:
    """A run of ``waits``, started (not yet driven) through the direct URL."""
    runtime.register(waits)
    return runtime.client().start(waits).execution_id


def _unavailable(call: Callable[[], Any]) -> None:
    with pytest.raises(wp.DatabaseUnavailableError) as caught:
        call()
    exc = caught.value
    assert isinstance(exc, wp.WfPersistError) and isinstance(exc, OperationalError)
    assert "the database could not be reached" in str(exc)
    assert exc.orig is not None


def _operations(client: wp.Client | wp.WorkflowClient, run: str) -> dict[str, Callable[[], Any]]:
    return {
        "start": lambda: client.start("unavailable-waits"),
        "status": lambda: client.status(run),
        "describe": lambda: client.describe(run),
        "history": lambda: client.history(run),
        "list": lambda: client.list("unavailable-waits"),
        "pending_signals": lambda: client.pending_signals(run),
        "events": lambda: client.events(run),
        "workflows": lambda: client.workflows(),
        "outcome": lambda: client.outcome(run),
        "result": lambda: client.result(run, timeout=1),
        "signal": lambda: client.signal(run, "go", "x"),
        "cancel": lambda: client.cancel(run),
    }


def test_every_client_call_raises_the_typed_error_once_the_database_is_out_of_reach(
    runtime: wp.Runtime, cut_off: tuple[TCPProxy, str]
) -> None:
    proxy, url = cut_off
    run = _parked_run(runtime)
    runtime.drive(run)  # parked on the signal
    thin = wp.Client(url)
    embedded = wp.Runtime(url)
    try:
        embedded.register(waits)
        clients: list[wp.Client | wp.WorkflowClient] = [thin, embedded.client()]
        for client in clients:
            assert client.status(run) == "suspended"  # the pool holds a live connection
        proxy.close()  # every connection cut; new ones refused
        for client in clients:
            for name, call in _operations(client, run).items():
                try:
                    _unavailable(call)
                except AssertionError as exc:
                    raise AssertionError(f"{type(client).__name__}.{name}: {exc}") from exc
        _unavailable(lambda: embedded.client().execute(waits))
        _unavailable(lambda: embedded.register(waits))
    finally:
        thin.close()
        embedded.close(timeout=5)
    # Nothing the cut calls tried was half-written.
    client = runtime.client()
    assert client.status(run) == "suspended"
    assert [p.name for p in client.pending_signals(run)] == ["go"]
    assert len(client.list("unavailable-waits").items) == 1


#: SQLAlchemy's own leak (aiomysql): a driver's error raised while a new connection gets its
#: isolation level leaves that connection checked out; the collector warns as it ends it.
@pytest.mark.filterwarnings("ignore:The garbage collector is trying to clean up")
def test_the_async_client_raises_it_too(runtime: wp.Runtime, cut_off: tuple[TCPProxy, str]) -> None:
    proxy, url = cut_off
    run = _parked_run(runtime)

    async def main() -> None:
        async with wp.AsyncClient(url) as client:
            assert await client.status(run) in ("running", "suspended")
            proxy.close()
            for call in (
                lambda: client.status(run),
                lambda: client.start("unavailable-waits"),
                lambda: client.result(run, timeout=1),
            ):
                with pytest.raises(wp.DatabaseUnavailableError):
                    await call()

    asyncio.run(main())


def test_the_web_view_answers_503_while_the_database_is_out_of_reach(
    runtime: wp.Runtime, cut_off: tuple[TCPProxy, str]
) -> None:
    """Not 400: the request was fine, a retry later may succeed."""
    proxy, url = cut_off
    run = _parked_run(runtime)
    with (
        wp.Client(url) as client,
        serving(create_app(client=client)) as base,
        httpx.Client(base_url=base, timeout=30) as http,
    ):
        assert http.get("/api/runs").status_code == 200
        proxy.close()
        for path in ("/api/runs", f"/api/runs/{run}", "/api/workflows", "/"):
            answer = http.get(path)
            assert answer.status_code == 503, (path, answer.status_code)
            if path.startswith("/api/"):
                assert "could not be reached" in answer.json()["error"]


@pytest.mark.needs("libpq")
def test_a_statement_the_driver_will_not_send_is_not_the_database_out_of_reach(
    runtime: wp.Runtime, db_engine: Engine
) -> None:
    """psycopg refuses to send more than 65,535 parameters with an ``OperationalError``
    that has no SQLSTATE, as a lost connection's has none: sent again it fails again, so
    it is not taken for an outage (which callers may retry)."""
    ids = ",".join(["%s"] * 70_000)
    with db_engine.connect() as conn, pytest.raises(DBAPIError) as caught:
        conn.exec_driver_sql(f"SELECT 1 WHERE 1 IN ({ids})", tuple(range(70_000)))
    assert "number of parameters" in str(caught.value)
    assert not runtime.backend.unreachable(caught.value)
