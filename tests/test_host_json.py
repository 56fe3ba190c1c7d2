"""A host engine's own JSON serializer and deserializer. ``create_engine(json_serializer=,
json_deserializer=)`` (or psycopg's ``set_json_loads`` on a connection) configures how the
host's JSON columns are written and read; wf_persist read its own through them too, so a
replay got another value than its run had seen when it recorded it: numbers as ``Decimal``
or floats, keys sorted. A step's result replayed as ``7.0`` sent a run down the branch its
first drive had not taken. wf_persist writes and reads its columns with its own encoder and
``json.loads``; the host's columns keep the host's functions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, event

import wf_persist as wp


def _loads(text: str | bytes) -> Any:
    return json.loads(text, parse_float=Decimal, parse_int=float)


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


@wp.step
def produce(seed: int) -> Any:
    return {"zz": seed, "a": 1.5, "list": [1, 2.25]}


@wp.step
def kinds(doc: Any) -> Any:
    """What the run saw of the produced value: keys in order and each value's type."""
    return [[k, type(v).__name__] for k, v in doc.items()]


@wp.workflow(name="host-json", version=1)
def host_json_wf(ctx: wp.Context, seed: Any) -> Any:
    doc = ctx.run(produce, 7)
    first = ctx.run(kinds, doc)  # recorded on the first drive
    ctx.sleep(0.01)  # the next drive replays both steps from the history
    again = [[k, type(v).__name__] for k, v in doc.items()]
    return {"seed": seed, "doc": doc, "first": first, "again": again}


@pytest.fixture
def host_table(db_url: str) -> Callable[[Engine], Any]:
    """A host table with a JSON column, read through the host's engine."""
    table = sa.Table("host_json_doc", sa.MetaData(), sa.Column("doc", sa.JSON))

    def read_back(engine: Engine) -> Any:
        table.create(engine, checkfirst=True)
        try:
            with engine.begin() as conn:
                conn.execute(table.insert().values(doc={"x": 1.5}))
                return conn.execute(sa.select(table.c.doc)).scalar_one()
        finally:
            table.drop(engine)

    return read_back


def test_a_host_engines_json_functions_do_not_reach_wf_persists_columns(
    backend: str,
    db_url: str,
    make_engine: Callable[..., Engine],
    host_table: Callable[[Engine], Any],
) -> None:
    engine = make_engine(db_url, json_serializer=_dumps, json_deserializer=_loads)
    runtime = wp.Runtime(engine)
    try:
        _drive_through(runtime, engine)
    finally:
        runtime.close()
    # The host's own column still reads with the host's function.
    assert host_table(engine) == {"x": Decimal("1.5")}


SEED: Final = {"b": 2, "a": 0.5}


def _replayed(runtime: wp.Runtime) -> tuple[str, Any]:
    """A run whose first drive records two steps and parks at a sleep, and whose next
    drive replays them from the history; its id and outcome."""
    runtime.register(host_json_wf)
    client = runtime.client()
    run = client.start(host_json_wf, SEED).execution_id
    assert runtime.drive(run)
    time.sleep(0.05)
    runtime.drive(run)
    return run, client.result(run, timeout=20).unwrap()


def _drive_through(runtime: wp.Runtime, engine: Engine) -> None:
    """:func:`_replayed`, every read of it exact."""
    client = runtime.client()
    run, out = _replayed(runtime)
    # The replay saw the value the first drive saw: same keys in the same order, same types.
    assert out["again"] == out["first"], out
    assert dict((k, t) for k, t in out["first"]) == {"zz": "int", "a": "float", "list": "list"}
    assert type(out["doc"]["zz"]) is int and type(out["doc"]["a"]) is float
    assert [type(v) for v in out["doc"]["list"]] == [int, float]
    assert out["seed"] == SEED and type(out["seed"]["b"]) is int
    described = client.describe(run)
    assert described.input == SEED and type(described.input["a"]) is float
    completed = [r.event for r in client.history(run) if r.event["type"] == "step.completed"]
    assert type(completed[0]["result"]["zz"]) is int
    with wp.Client(engine) as thin:
        assert thin.result(run, timeout=5).unwrap() == out
        assert type(thin.describe(run).input["a"]) is float


@pytest.mark.needs("libpq")
def test_psycopg_loaders_a_host_sets_on_its_connections_do_not_reach_wf_persist(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    from psycopg.types.json import set_json_loads

    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def _host_loads(dbapi_connection: Any, _record: Any) -> None:
        set_json_loads(_loads, dbapi_connection)

    runtime = wp.Runtime(engine)
    try:
        _drive_through(runtime, engine)
    finally:
        runtime.close()
    with engine.connect() as conn:  # the host's statements keep the host's loader
        assert conn.exec_driver_sql("SELECT '{\"x\": 1.5}'::jsonb").scalar_one() == {
            "x": Decimal("1.5")
        }


def test_an_async_host_engines_json_functions_do_not_reach_wf_persists_columns(
    runtime: wp.Runtime, db_url: str
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from wf_persist.backends import backend_type, normalize_url

    url = normalize_url(db_url)
    async_url = backend_type(url.get_backend_name()).async_url(url)
    run, expected = _replayed(runtime)

    async def read() -> None:
        engine = create_async_engine(async_url, json_serializer=_dumps, json_deserializer=_loads)
        try:
            async with wp.AsyncClient(engine) as host:
                got = (await host.result(run, timeout=10)).unwrap()
                assert got == expected and type(got["doc"]["a"]) is float
                assert list(got["doc"]) == list(expected["doc"])
                info = await host.describe(run)
                assert type(info.input["a"]) is float and type(info.input["b"]) is int
                events = [r.event for r in await host.history(run)]
                done = next(e for e in events if e["type"] == "step.completed")
                assert type(done["result"]["zz"]) is int
        finally:
            await engine.dispose()

    asyncio.run(read())


@pytest.mark.needs("libpq")
def test_a_host_loader_class_derived_from_psycopgs_does_not_reach_wf_persist(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A loader class of the host's that derives from psycopg's JSON loaders and brings its
    own ``load`` inherits psycopg's ``json.loads``: looking at that function alone took it
    for psycopg's own."""
    from psycopg.types.json import JsonbBinaryLoader, JsonbLoader, JsonLoader

    class HostJson(JsonLoader):
        def load(self, data: Any) -> Any:
            return _loads(bytes(data))

    class HostJsonb(JsonbLoader):
        def load(self, data: Any) -> Any:
            return _loads(bytes(data))

    class HostJsonbBinary(JsonbBinaryLoader):
        def load(self, data: Any) -> Any:
            return _loads(bytes(data)[1:])

    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def _host_loaders(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.adapters.register_loader("json", HostJson)
        dbapi_connection.adapters.register_loader("jsonb", HostJsonb)
        dbapi_connection.adapters.register_loader("jsonb", HostJsonbBinary)

    with wp.Runtime(engine) as runtime:
        _, out = _replayed(runtime)
    assert out["again"] == out["first"]
    assert dict(out["first"]) == {"zz": "int", "a": "float", "list": "list"}


@pytest.mark.needs("libpq")
def test_loaders_a_host_sets_on_a_connection_wf_persist_already_used_do_not_reach_it(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """libpq's fast path kept the connection's own adapters: loaders the host set on the
    connection after wf_persist's first statement there reached wf_persist's reads."""
    from psycopg.types.json import set_json_loads

    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with wp.Runtime(engine) as runtime:
        runtime.register(host_json_wf)
        runtime.client().start(host_json_wf, 0)  # the one connection, through libpq
        with engine.connect() as conn:
            set_json_loads(_loads, conn.connection.driver_connection)
        _, out = _replayed(runtime)
    assert out["again"] == out["first"]
    assert dict(out["first"]) == {"zz": "int", "a": "float", "list": "list"}


def test_starts_in_a_host_transaction_and_async_starts_never_read_through_the_host(
    db_url: str, make_engine: Callable[..., Engine], runtime: wp.Runtime
) -> None:
    """A start in the host's own transaction (``session=``) and an asyncio client's start
    run on the host's connections: the row the start returned was decoded by the host's
    function, and one that refuses wf_persist's documents failed the start."""
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.orm import Session

    from wf_persist.backends import backend_type, normalize_url

    seen: list[Any] = []

    def refusing(text: Any) -> Any:
        seen.append(text)
        raise ValueError("the host's format only")

    runtime.register(host_json_wf)  # cataloged
    host = make_engine(db_url, json_deserializer=refusing)
    with wp.Runtime(host) as on_host:
        on_host.register(host_json_wf)
        with Session(host) as session, session.begin():
            first = on_host.client().start(host_json_wf, {"a": 0.5}, session=session)
    url = normalize_url(db_url)
    async_url = backend_type(url.get_backend_name()).async_url(url)

    async def start() -> str:
        engine = create_async_engine(async_url, json_deserializer=refusing)
        try:
            async with wp.AsyncClient(engine) as client:
                return (await client.start("host-json", {"a": 1.5})).execution_id
        finally:
            await engine.dispose()

    second = asyncio.run(start())
    assert seen == []
    for run, seed in ((first.execution_id, {"a": 0.5}), (second, {"a": 1.5})):
        assert runtime.client().describe(run).input == seed
