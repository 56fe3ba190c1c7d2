"""Hostile input an adversarial hunt found passing an entry point untyped or stored
silently wrong: each is one typed error now, with nothing written."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, event, func, make_url, select, text
from sqlalchemy.pool import AssertionPool, Pool, QueuePool, StaticPool

import wf_persist as wp
from wf_persist import migrate
from wf_persist.cli.common import read_json
from wf_persist.models import executions_table
from wf_persist.web import create_app

from .conftest import _admin, drop_database, server_url
from .fixtures import workflows as w
from .helpers import Processes
from .test_cli_runs import one_error_line
from .test_web import _run_approval
from .webserver import serving


@pytest.mark.parametrize("bad", [["a"], {"a": 1}, {1, 2}])
def test_result_refuses_an_id_that_is_no_string(runtime: wp.Runtime, db_url: str, bad: Any) -> None:
    with wp.Client(db_url) as thin:
        for client in (runtime.client(), thin):
            with pytest.raises(wp.InvalidArgumentError, match="an execution id is a string"):
                client.result(bad, timeout=1)


class Shifty(str):
    """An id whose own hash and equality would let it match another run's."""

    def __hash__(self) -> int:
        raise RuntimeError("hashed")

    def __eq__(self, other: object) -> bool:
        return True


def test_an_id_of_a_str_subclass_is_read_as_plain_text(runtime: wp.Runtime) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    run = client.start(w.echo_wf, 2).execution_id
    assert client.result(Shifty(run), timeout=30).unwrap() == [1, 2]


@wp.workflow(name="hunt_any_input", version=1)
def any_input(ctx: wp.Context, value: Any) -> Any:
    return value


@wp.step
def float_keys() -> dict[float, str]:
    return {float("nan"): "a", float("inf"): "b"}


@wp.workflow(name="hunt_float_keys", version=1)
def returns_float_keys(ctx: wp.Context) -> Any:
    return ctx.run(float_keys)


@pytest.mark.parametrize(
    "value",
    [{float("nan"): 1}, {float("inf"): 1, float("-inf"): 2}, {"ok": {float("nan"): 1}}],
    ids=["nan", "infinities", "nested"],
)
def test_a_nan_or_infinite_key_is_refused_not_stored_as_text(
    runtime: wp.Runtime, db_url: str, value: Any
) -> None:
    runtime.register(any_input)
    with pytest.raises(wp.NotSerializableError, match="NaN or an infinity"):
        runtime.client().start(any_input, value)
    with runtime.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(executions_table)).scalar() == 0


def test_a_step_result_with_nan_keys_fails_the_step_typed(runtime: wp.Runtime) -> None:
    runtime.register(returns_float_keys)
    outcome = runtime.client().execute(returns_float_keys)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["cause"]["name"] == "NotSerializableError"


def test_keys_that_are_only_the_text_of_such_floats_are_kept(runtime: wp.Runtime) -> None:
    runtime.register(any_input)
    value = {"None": 1, "nan": 2, "inf": 3, "-inf": 4}
    assert runtime.client().execute(any_input, value).unwrap() == value


def test_a_json_integer_too_long_to_read_is_one_error(tmp_path: Path) -> None:
    digits = "1" * 5000
    with pytest.raises(wp.InvalidArgumentError, match="cannot be read"):
        read_json(digits, "--input")
    path = tmp_path / "big.json"
    path.write_text(digits)
    with pytest.raises(wp.InvalidArgumentError, match=f"--input file {path} cannot be read"):
        read_json(f"@{path}", "--input")


def test_the_cli_says_so_in_one_line(db_url: str, procs: Processes, tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text("1" * 5000)
    env = {"WF_PERSIST_DATABASE_URL": db_url}
    done = procs.cli("runs", "start", "echo", "--input", f"@{path}", check=False, env=env)
    one_error_line(done, "cannot be read")


def test_the_web_api_refuses_a_body_nested_past_the_parser(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*w.ALL)
    run = _run_approval(runtime)
    token = {"Authorization": "Bearer s3cret"}
    with wp.Client(db_url) as client:
        app = create_app(client=client, allow_actions=True, token="s3cret")
        with serving(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            deep = "[" * 100_000 + "]" * 100_000
            answer = http.post(f"/api/runs/{run}/signal", content=deep, headers=token)
            assert answer.status_code == 400
            assert answer.json() == {"error": "the request body is nested too deeply"}
            inner = '{"name": "approval", "payload": ' + "[" * 3000 + "]" * 3000 + "}"
            answer = http.post(f"/api/runs/{run}/signal", content=inner, headers=token)
            assert answer.status_code == 400
        assert [p.name for p in client.pending_signals(run)] == ["approval"]  # none delivered


@pytest.mark.needs("libpq")
def test_a_date_style_psycopg_cannot_read_is_refused_when_the_engine_opens(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """psycopg reads times only in the ISO style: a start under another one committed,
    then failed reading its own answer."""
    engine = make_engine(db_url, connect_args={"options": "-c DateStyle=German"})
    with pytest.raises(wp.UnsupportedDatabaseError, match="DateStyle 'German, DMY'"):
        wp.Runtime(engine)
    iso = make_engine(db_url, connect_args={"options": "-c DateStyle=ISO,DMY"})
    with wp.Runtime(iso) as runtime:  # ISO with any order of day and month reads fine
        runtime.register(any_input)
        assert runtime.client().execute(any_input, {"at": "now"}).unwrap() == {"at": "now"}


@pytest.mark.needs("libpq")
def test_a_client_encoding_other_than_utf8_is_refused_when_the_engine_opens(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Under LATIN1 a start with an input of another script wrote its run, then failed
    decoding its own answer (a raw UnicodeDecodeError); a worker then claimed that run again
    and again, failing the same way, and an emoji or a Cyrillic key failed in the driver."""
    engine = make_engine(db_url, connect_args={"client_encoding": "LATIN1"})
    with pytest.raises(wp.UnsupportedDatabaseError, match="client_encoding 'LATIN1'"):
        wp.Runtime(engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match="client_encoding 'LATIN1'"):
        wp.Client(engine)
    utf8 = make_engine(db_url, connect_args={"client_encoding": "utf8"})
    with wp.Runtime(utf8) as runtime:
        runtime.register(any_input)
        text = {"at": "café ключ 😀"}
        assert runtime.client().execute(any_input, text, idempotency_key="ключ😀").unwrap() == text


@pytest.mark.needs("libpq")
def test_a_database_whose_encoding_is_not_utf8_is_refused_when_the_engine_opens(
    make_engine: Callable[..., Engine],
) -> None:
    """A LATIN1 database cannot hold every text wf_persist stores: refused at once, with
    nothing created in it."""
    name = f"wf_persist_t_latin1_{uuid.uuid4().hex[:8]}"
    _admin(
        "postgresql",
        f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    try:
        engine = make_engine(server_url("postgresql", name))
        with pytest.raises(wp.UnsupportedDatabaseError, match="encoding is 'LATIN1'"):
            wp.Runtime(engine)
        with engine.connect() as conn:
            assert (
                conn.scalar(text("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'wf%'")) == 0
            )
        engine.dispose()
    finally:
        drop_database("postgresql", name)


@pytest.mark.needs("sql_mode")
@pytest.mark.parametrize("charset", ["latin1", "utf8mb3"])
def test_a_character_set_narrower_than_utf8mb4_is_refused_when_the_engine_opens(
    db_url: str, make_engine: Callable[..., Engine], charset: str
) -> None:
    """An actor, key or workflow name with an emoji failed in the driver or the server
    (a raw error, and a half-written catalog)."""
    engine = make_engine(db_url, connect_args={"charset": charset})
    with pytest.raises(wp.UnsupportedDatabaseError, match=f"character set {charset}"):
        wp.Runtime(engine)
    fine = make_engine(db_url, connect_args={"charset": "utf8mb4"})
    with wp.Runtime(fine) as runtime:
        runtime.register(any_input)
        out = runtime.client().execute(any_input, 1, actor="a😀", idempotency_key="k😀")
        assert out.unwrap() == 1


@pytest.mark.parametrize("pool", [StaticPool, AssertionPool])
def test_a_pool_that_shares_one_connection_between_threads_is_refused(
    db_url: str, make_engine: Callable[..., Engine], pool: type[Pool]
) -> None:
    """The lease keeper, timers, workers and callers write at once: on one connection
    their transactions interleaved (a start reported for a run never saved, raw errors)."""
    engine = make_engine(db_url, poolclass=pool)
    with pytest.raises(wp.UnsupportedDatabaseError, match=pool.__name__):
        wp.Runtime(engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match=pool.__name__):
        wp.Client(engine)


@pytest.mark.needs("embedded")
def test_sqlite_connections_kept_to_their_thread_are_refused(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``check_same_thread=True``: accepted, then every call failed with a raw
    ``sqlite3.ProgrammingError`` (a pooled connection serves one thread, then another)."""
    engine = make_engine(db_url, connect_args={"check_same_thread": True})
    with pytest.raises(wp.UnsupportedDatabaseError, match="check_same_thread"):
        wp.Runtime(engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match="check_same_thread"):
        wp.Client(engine)
    with wp.Runtime(make_engine(db_url, connect_args={"check_same_thread": False})) as runtime:
        runtime.register(any_input)
        assert runtime.client().execute(any_input, 1).unwrap() == 1


@pytest.mark.needs("embedded")
@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?uri=true"]
)
def test_a_host_engine_on_an_in_memory_database_is_refused(
    backend: str, url: str, make_engine: Callable[..., Engine]
) -> None:
    """Each connection has its own in-memory database: a worker's had no tables, and its
    claims failed (logged, retried) for ever."""
    with pytest.raises(wp.UnsupportedDatabaseError, match="in memory"):
        wp.Runtime(make_engine(url), auto_migrate=True)
    with wp.Runtime(url) as runtime:  # the same URL given to wf_persist: a private file
        runtime.register(any_input)
        runtime.start_worker()
        client = runtime.client()
        assert client.result(client.start(any_input, 3).execution_id, timeout=30).unwrap() == 3


@pytest.mark.parametrize(
    "value",
    [
        dict([((float("nan"), 1), "first"), ((float("nan"), 1), "second")]),
        {Decimal("NaN"): 1},
        {Decimal("Infinity"): 1, Decimal("-Infinity"): 2},
    ],
    ids=["tuple-keys", "decimal-nan", "decimal-infinities"],
)
def test_nan_inside_tuple_or_decimal_keys_is_refused(runtime: wp.Runtime, value: Any) -> None:
    runtime.register(any_input)
    with pytest.raises(wp.NotSerializableError, match="NaN or an infinity"):
        runtime.client().start(any_input, value)


def test_a_key_pydantic_cannot_write_is_a_typed_error(runtime: wp.Runtime) -> None:
    runtime.register(any_input)
    with pytest.raises(wp.NotSerializableError, match="frozenset"):
        runtime.client().start(any_input, {frozenset({1}): 1})


def test_keys_that_merely_contain_such_text_are_kept(runtime: wp.Runtime) -> None:
    runtime.register(any_input)
    value = {"Information": 1, "Nonetheless": 2, "1,2": 3}
    assert runtime.client().execute(any_input, value).unwrap() == value


class NoHash(str):
    __hash__ = None  # type: ignore[assignment]


def test_the_async_client_reads_an_id_as_plain_text(runtime: wp.Runtime, db_url: str) -> None:
    runtime.register(any_input)
    run = runtime.client().execute(any_input, 4).execution_id

    async def ask() -> Any:
        async with wp.AsyncClient(db_url) as client:
            with pytest.raises(wp.InvalidArgumentError):
                await client.result(["x"], timeout=1)  # type: ignore[arg-type]
            return (await client.result(NoHash(run), timeout=30)).unwrap()

    assert asyncio.run(ask()) == 4


@pytest.mark.needs("sql_mode")
def test_results_in_a_narrower_character_set_are_refused(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A connect hook setting ``character_set_results``: names read back failed to decode,
    then the driver lost track of its packets."""
    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def _latin1_results(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET character_set_results = latin1")

    with pytest.raises(wp.UnsupportedDatabaseError, match="character set latin1"):
        wp.Runtime(engine)


@pytest.mark.needs("embedded")
def test_a_host_engine_is_judged_by_its_connections_not_its_url(
    backend: str, tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """A ``creator`` opening a file under ``sqlite://`` is a file database (the URL alone
    said in memory); every URI spelling of an in-memory database is refused."""
    path = tmp_path / "created.sqlite3"
    wp.migrate.upgrade(f"sqlite:///{path}")
    on_file = make_engine(
        "sqlite://",
        creator=lambda: sqlite3.connect(path, check_same_thread=False),
        poolclass=QueuePool,
    )
    with wp.Runtime(on_file) as runtime:
        runtime.register(any_input)
        assert runtime.client().execute(any_input, 5).unwrap() == 5
    for url in ("sqlite:///file:memx?mode=memory&uri=true", "sqlite:///file::memory:?uri=1"):
        with pytest.raises(wp.UnsupportedDatabaseError, match="in memory"):
            wp.Runtime(make_engine(url, poolclass=QueuePool))
    with wp.Runtime("sqlite:///file::memory:?uri=1") as runtime:  # wf_persist's own: a file
        runtime.register(any_input)
        runtime.start_worker()
        client = runtime.client()
        assert client.result(client.start(any_input, 6).execution_id, timeout=30).unwrap() == 6


@pytest.mark.needs("embedded")
def test_opening_a_host_engine_on_a_missing_file_creates_nothing(
    backend: str, tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """Judging the engine connects only where the URL says in memory: a connection to a
    missing file would create it (read-only commands must not)."""
    missing = tmp_path / "missing.sqlite3"
    with pytest.raises(wp.SchemaVersionError):
        wp.Runtime(make_engine(f"sqlite:///{missing}"))
    assert not missing.exists()


#: How a host makes each backend's sessions read-only: a pool ``connect`` event, or on
#: PostgreSQL a connection option (a SET there would be rolled back with its transaction).
READ_ONLY_SESSION = {
    "sqlite": "PRAGMA query_only = ON",
    "mysql": "SET SESSION TRANSACTION READ ONLY",
}


def read_only_engine(backend: str, url: str, make_engine: Callable[..., Engine]) -> Engine:
    """An engine on ``url`` whose sessions are read-only, made as a host would."""
    if backend == "postgresql":
        options = {"options": "-c default_transaction_read_only=on"}
        return make_engine(url, connect_args=options)
    engine = make_engine(url)

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(READ_ONLY_SESSION[backend])
        cursor.close()

    return engine


def test_a_read_only_engine_is_refused_by_a_runtime_and_only_reads_through_a_client(
    backend: str,
    db_url: str,
    make_engine: Callable[..., Engine],
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A host engine whose sessions cannot write: a runtime (which writes its catalog,
    claims and steps) is refused when it opens; a client opens and reads, and its starts,
    signals and cancellations are one typed error each with nothing written (they were the
    driver's errors, and a worker retried its claim forever)."""
    writer = make_runtime()
    writer.register(w.two_approvals_wf)
    run = writer.client().start(w.two_approvals_wf).execution_id
    assert writer.drive(run)
    engine = read_only_engine(backend, db_url, make_engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
        wp.Runtime(engine)
    before = writer.client().history(run)
    with wp.Client(engine) as client:
        assert client.status(run) == "suspended"
        assert [p.name for p in client.pending_signals(run)] == ["approval"]
        for write in (
            lambda: client.start("two-approvals"),
            lambda: client.signal(run, "approval", {"approved": True}),
            lambda: client.cancel(run),
            lambda: client.purge(older_than=dt.timedelta(0)),
        ):
            with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
                write()
    assert writer.client().history(run) == before
    assert writer.client().status(run) == "suspended"


@pytest.mark.needs("embedded")
@pytest.mark.parametrize("file", ["migrated", "empty"])
def test_an_exclusive_sqlite_locking_mode_is_refused_when_the_engine_opens(
    db_url: str,
    make_engine: Callable[..., Engine],
    make_runtime: Callable[..., wp.Runtime],
    file: str,
) -> None:
    """Under locking_mode EXCLUSIVE the first connection to write keeps the lock: a worker
    could never claim (the run stayed running while its claim loop retried). Also on an
    empty file, which reads as no database yet (its checks were skipped as for a file not
    there, whose connecting would create it)."""
    if file == "migrated":
        make_runtime().close()
    else:
        path = make_url(db_url).database
        assert path is not None
        Path(path).write_bytes(b"")
    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def _exclusive(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA locking_mode = EXCLUSIVE")

    with pytest.raises(wp.UnsupportedDatabaseError, match="locking_mode EXCLUSIVE"):
        wp.Runtime(engine, auto_migrate=True)


def test_cancel_takes_compensate_as_a_bool_only(runtime: wp.Runtime) -> None:
    """``compensate="yes"`` was taken as true (the web API refused it)."""
    runtime.register(w.two_approvals_wf)
    client = runtime.client()
    run = client.start(w.two_approvals_wf).execution_id
    for bad in ("yes", 1, None):
        with pytest.raises(wp.InvalidArgumentError, match="compensate must be True or False"):
            client.cancel(run, compensate=bad)  # type: ignore[arg-type]
    assert client.status(run) == "running"
    assert "execution.cancelled" not in [r.event["type"] for r in client.history(run)]


@pytest.mark.needs("embedded")
def test_a_sqlite_file_opened_read_only_by_its_uri_is_refused_by_a_runtime(
    db_url: str, make_runtime: Callable[..., wp.Runtime], make_engine: Callable[..., Engine]
) -> None:
    """``file:...?mode=ro`` (or ``immutable=1``): its query_only is off, and the first write
    was the driver's error."""
    make_runtime().close()  # the file, migrated
    path = make_url(db_url).database
    for options in ("mode=ro", "immutable=1"):
        url = f"sqlite:///file:{path}?{options}&uri=true"
        with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
            wp.Runtime(url)
        with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
            wp.Runtime(make_engine(url))
        with wp.Client(make_engine(url)) as client:
            assert client.list().items == []
            with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
                client.purge(older_than=dt.timedelta(0))
        # By its URL too: a client's open looked to migrate the file, and was refused.
        with wp.Client(url) as client:
            assert client.list().items == []
        with pytest.raises(wp.UnsupportedDatabaseError, match="read-only"):
            wp.Client(url, auto_migrate=True)


@pytest.mark.needs("libpq")
def test_a_client_encoding_of_sql_ascii_is_refused_when_the_engine_opens(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """SQL_ASCII (a database's or role's setting) has psycopg hand text over as bytes:
    SQLAlchemy's reading of the server's version failed with a raw TypeError at every
    entry point (Runtime, Client, migrate, the CLI)."""
    engine = make_engine(db_url, connect_args={"client_encoding": "SQL_ASCII"})
    with pytest.raises(wp.UnsupportedDatabaseError, match="SQL_ASCII"):
        wp.Runtime(engine)
    url = make_url(db_url).update_query_dict({"client_encoding": "SQL_ASCII"})
    plain = url.render_as_string(hide_password=False)
    with pytest.raises(wp.UnsupportedDatabaseError, match="SQL_ASCII"):
        wp.Client(plain)
    with pytest.raises(wp.UnsupportedDatabaseError, match="SQL_ASCII"):
        migrate.upgrade(plain)


@pytest.mark.needs("server")
def test_a_host_connect_listeners_own_type_error_is_raised_as_it_came(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Only the dialect's first reading of the server's answers is read as a database
    wf_persist cannot use; a host's own bug in a connect listener stays its own."""
    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def broken(dbapi_connection: Any, record: Any) -> None:
        raise TypeError("host listener bug")

    with pytest.raises(TypeError, match="host listener bug"):
        wp.Runtime(engine)


@pytest.mark.needs("libpq")
def test_another_engines_setup_failing_in_a_host_listener_stays_the_hosts(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Only this engine's dialect setup is read as a database wf_persist cannot use: a
    host listener connecting to another engine whose setup fails is the host's matter."""
    other = make_engine(db_url, connect_args={"client_encoding": "SQL_ASCII"})
    engine = make_engine(db_url)

    @event.listens_for(engine, "connect")
    def reach_the_other(dbapi_connection: Any, record: Any) -> None:
        other.connect().close()

    with pytest.raises(TypeError):
        wp.Runtime(engine)


def test_connection_arguments_the_driver_refuses_are_one_typed_error(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """An option the driver does not know (a typo in ``connect_args``, or in the URL's
    query on a server) escaped as the driver's raw error: psycopg's ProgrammingError,
    PyMySQL's and sqlite3's TypeError."""
    engine = make_engine(db_url, connect_args={"no_such_option": 1})
    with pytest.raises(wp.UnsupportedDatabaseError, match="refused the connection arguments"):
        wp.Runtime(engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match="refused the connection arguments"):
        wp.Client(engine)


@pytest.mark.needs("libpq")
def test_a_url_option_libpq_does_not_know_is_one_typed_error(db_url: str) -> None:
    url = make_url(db_url).update_query_dict({"no_such_option": "1"})
    with pytest.raises(wp.UnsupportedDatabaseError, match="no_such_option"):
        wp.Client(url.render_as_string(hide_password=False))
