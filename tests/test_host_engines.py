"""Host engines configured any legal way: wf_persist drives runs correctly on each, and
hands the host's connections back as it found them."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, make_url, text
from sqlalchemy.pool import NullPool

import wf_persist as wp
from wf_persist import migrate

from .fixtures import fencing as f
from .fixtures import saga as s
from .fixtures import workflows as w
from .helpers import wait_for_mark, wait_until

#: Engine arguments per backend family: each a configuration an application may use.
CONFIGURATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "embedded": {
        "driver-default": {},  # pysqlite's legacy transaction handling
        "autocommit": {"isolation_level": "AUTOCOMMIT"},
        "no-driver-transactions": {"connect_args": {"isolation_level": None}},
        "serializable": {"isolation_level": "SERIALIZABLE"},
        "null-pool": {"poolclass": NullPool},
        # pysqlite takes :name parameters too: the hot path's positional SQL does not apply
        "named-paramstyle": {"paramstyle": "named"},
    },
    "server": {
        "driver-default": {},
        "autocommit": {"isolation_level": "AUTOCOMMIT"},
        "serializable": {"isolation_level": "SERIALIZABLE"},
        "repeatable-read": {"isolation_level": "REPEATABLE READ"},
        "pre-ping-null-pool": {"poolclass": NullPool, "pool_pre_ping": True},
        # A level among the engine's execution options is set at each checkout, after
        # any level of an engine derived from it.
        "options-repeatable-read": {"execution_options": {"isolation_level": "REPEATABLE READ"}},
        "options-serializable": {"execution_options": {"isolation_level": "SERIALIZABLE"}},
        "derived-repeatable-read": {},  # engine.execution_options(isolation_level=...)
    },
}


def _configurations() -> list[str]:
    return sorted({name for family in CONFIGURATIONS.values() for name in family})


@pytest.mark.parametrize("configuration", _configurations())
def test_runs_are_driven_correctly_on_every_host_configuration(
    configuration: str, backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    from .conftest import CAPABILITIES

    family = "embedded" if "embedded" in CAPABILITIES[backend] else "server"
    kwargs = CONFIGURATIONS[family].get(configuration)
    if kwargs is None:
        kwargs = CONFIGURATIONS[family]["driver-default"]  # same as the default there
    s.reset()
    f.reset()
    engine = make_engine(db_url, **kwargs)
    if configuration == "derived-repeatable-read" and family == "server":
        engine = engine.execution_options(isolation_level="REPEATABLE READ")
    with wp.Runtime(engine, lease_ttl=5) as rt:
        if family == "server":  # wf_persist's transactions run at its level, whatever the host's
            with rt.backend.engine.begin() as conn:
                assert conn.get_isolation_level() == "READ COMMITTED"
        rt.register(*w.ALL, *s.ALL, *f.ALL)
        client = rt.client()
        # steps, a durable sleep, a signal wait, a saga unwind, an idempotent start
        assert client.result(client.start(w.echo_wf, 3).execution_id, timeout=20).unwrap() == [
            1,
            2,
            3,
        ]
        assert client.result(client.start(f.nap_wf, 0.2).execution_id, timeout=20).unwrap() == (
            "rested"
        )
        waiting = client.start(w.approval_wf, None).execution_id

        def parked() -> bool:
            rt.drive(waiting)  # through its short sleep, to the wait
            return bool(client.pending_signals(waiting))

        wait_until(parked, what="the signal wait")
        client.signal(waiting, "approval", {"approved": True})
        assert client.result(waiting, timeout=20).unwrap() == "approved"
        saga = client.result(client.start(s.saga_wf, 1).execution_id, timeout=20)
        assert isinstance(saga, wp.Failed)
        ids = set()
        barrier = threading.Barrier(4)

        def start() -> None:
            barrier.wait()
            ids.add(client.start(w.echo_wf, 1, idempotency_key="one").execution_id)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(ids) == 1
        worker = rt.start_worker(concurrency=2, poll_interval=0.02)
        many = [client.start(w.echo_wf, 2).execution_id for _ in range(10)]
        for execution_id in many:
            assert client.result(execution_id, timeout=30).unwrap() == [1, 2]
        worker.stop()
    # the host's connections come back as the host configured them
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
        if family == "embedded" and configuration == "driver-default":
            raw: Any = conn.connection.driver_connection
            assert raw.isolation_level == ""  # pysqlite's legacy mode, as created


def test_transactions_hold_on_an_autocommit_engine_already_at_read_committed(
    backend: str, db_url: str, make_engine: Callable[..., Engine], saga_reset: None
) -> None:
    """AUTOCOMMIT is a driver setting, not an isolation level: a host engine in AUTOCOMMIT
    whose sessions already run at READ COMMITTED (MySQL configured so, as PostgreSQL is by
    default) still gets real transactions. Three cancels queued behind a host's lock on the
    run record one cancellation; the others are refused (no duplicate-key error, no second
    cancellation)."""
    from .conftest import has

    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"}
    if has(backend, "sql_mode"):
        kwargs["connect_args"] = {
            "init_command": "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
        }
    engine = make_engine(db_url, **kwargs)
    holder = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(*s.ALL)
        client = rt.client()
        execution_id = client.start(s.reserve_then_wait_wf).execution_id

        def parked() -> bool:
            rt.drive(execution_id)
            return bool(client.pending_signals(execution_id))

        wait_until(parked, what="the signal wait")
        results: list[str] = []

        def cancel() -> None:
            try:
                client.cancel(execution_id)
                results.append("ok")
            except wp.CannotCancelError:
                results.append("refused")
            except Exception as exc:  # what the test is about: report it, do not hang
                results.append(repr(exc))

        threads = [threading.Thread(target=cancel) for _ in range(3)]
        with holder.begin() as conn:  # the host holds the run's row while cancels queue
            conn.execute(
                text("UPDATE wf_executions SET updated_at = updated_at WHERE id = :i"),
                {"i": execution_id},
            )
            for t in threads:
                t.start()
            time.sleep(0.5)  # every cancel is waiting for the row now
            assert results == []
        for t in threads:
            t.join(30)
        assert sorted(results) == ["ok", "refused", "refused"], results
        types = [r.event["type"] for r in client.history(execution_id)]
        assert types.count("execution.cancelled") == 1


@pytest.mark.needs("server")
def test_a_host_engine_that_maps_the_default_schema(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host engine with a ``schema_translate_map`` puts wf_persist's tables where it maps
    them: every statement goes there, the one-statement fast path and the lease keeper's
    renewals included (a live lease is never taken over)."""
    from wf_persist import migrate

    from .conftest import has

    f.reset()
    name = f"wf_map_{uuid.uuid4().hex[:8]}"
    admin = make_engine(db_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {name}"))
    try:

        def mapped() -> Engine:
            return make_engine(db_url).execution_options(schema_translate_map={None: name})

        if has(backend, "schemas"):
            migrate.upgrade(mapped())
        else:  # MySQL/MariaDB: the schema is a database, migrated by its own URL
            migrate.upgrade(make_engine(make_url(db_url).set(database=name)))
        with (
            wp.Runtime(mapped(), lease_ttl=1.0) as rt,
            wp.Runtime(mapped(), lease_ttl=1.0) as other,
        ):
            rt.register(*w.ALL, *f.ALL)
            other.register(*f.ALL)
            client = rt.client()
            done = client.result(client.start(w.echo_wf, 2).execution_id, timeout=20)
            assert done.unwrap() == [1, 2]
            handle = client.start(f.slow_wf, 2.5)
            rt.start_worker(concurrency=1, poll_interval=0.02)
            wait_until(
                lambda: client.describe(handle.execution_id).started_at is not None,
                what="the claim",
            )
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert other.drive(handle.execution_id) is False, "a live lease was taken over"
                time.sleep(0.05)
            assert client.result(handle.execution_id, timeout=20).unwrap() == 2.5
            assert f.CONTROL["slow_runs"] == 1
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {name}{' CASCADE' if has(backend, 'schemas') else ''}"))


@pytest.mark.needs("server")
@pytest.mark.parametrize("engine_of", ["host", "own"])
def test_a_session_default_above_read_committed_does_not_fail_fenced_writes(
    backend: str,
    db_url: str,
    make_engine: Callable[..., Engine],
    tmp_path: Path,
    engine_of: str,
) -> None:
    """Sessions whose default isolation is SERIALIZABLE (the host's connect options, or
    the database's own setting): a step's fenced write that meets a concurrent update of its
    run (a lease renewal, say; here a host's) re-checks the run and is recorded, instead of
    failing with a serialization error and counting a failed drive. An engine wf_persist
    makes itself from such a URL sets READ COMMITTED once per connection (not at every
    checkout): its connections stay there, also after a user of ``runtime.engine`` chose
    another level for one of them."""
    from .conftest import has

    f.reset()
    connect_args = (
        {"init_command": "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"}
        if has(backend, "sql_mode")
        else {"options": "-c default_transaction_isolation=serializable"}
    )
    bind: Engine | str = (
        make_engine(db_url, connect_args=connect_args)
        if engine_of == "host"
        else make_url(db_url).update_query_dict(connect_args).render_as_string(False)
    )
    holder = make_engine(db_url)
    marks, release = tmp_path / "marks", tmp_path / "release"
    with wp.Runtime(bind, lease_ttl=30) as rt:
        if engine_of == "own":
            with rt.engine.connect() as mine:  # an application's use of our engine
                mine.execution_options(isolation_level="SERIALIZABLE")
                with mine.begin():
                    assert mine.get_isolation_level() == "SERIALIZABLE"
            taken = [rt.backend.engine.connect() for _ in range(3)]  # the same one among them
            for conn in taken:
                with conn.begin():
                    assert conn.get_isolation_level() == "READ COMMITTED"
                conn.close()
        rt.register(*f.ALL)
        client = rt.client()
        handle = client.start(f.fenced_wf, {"marks": str(marks), "release": str(release)})
        driving = threading.Thread(target=rt.drive, args=(handle.execution_id,))
        driving.start()
        wait_for_mark(marks, "hold-start")
        with holder.begin() as conn:  # the run's row changes while the step's write waits
            conn.execute(
                text("UPDATE wf_executions SET updated_at = updated_at WHERE id = :i"),
                {"i": handle.execution_id},
            )
            release.touch()
            time.sleep(0.5)
        driving.join(30)
        types = [r.event["type"] for r in client.history(handle.execution_id)]
        assert "drive.failed" not in types
        assert client.result(handle.execution_id, timeout=20).unwrap() == ["held", "one", "two"]


@pytest.mark.needs("libpq")
def test_driver_state_an_application_leaves_on_a_raw_connection_is_put_back(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """An application borrows connections of ``runtime.engine`` raw (as SQLAlchemy documents
    for driver-level work: ``CREATE INDEX CONCURRENTLY`` wants autocommit), changes their
    driver state and gives them back; the pool undoes only changes made through SQLAlchemy.
    wf_persist's transactions must still run at READ COMMITTED and still be transactions."""
    import psycopg

    rt = make_runtime()

    def leave(**state: Any) -> None:
        borrowed = [rt.engine.raw_connection() for _ in range(4)]
        for fairy in borrowed:
            for name, value in state.items():
                setattr(fairy.driver_connection, name, value)
        for fairy in borrowed:
            fairy.close()

    leave(isolation_level=psycopg.IsolationLevel.SERIALIZABLE, read_only=True)
    with rt.transaction() as conn:
        assert conn.get_isolation_level() == "READ COMMITTED"
        assert conn.exec_driver_sql("SHOW transaction_read_only").scalar() == "off"
    with rt.backend.begin() as conn:
        assert conn.get_isolation_level() == "READ COMMITTED"

    leave(autocommit=True)
    with rt.transaction() as conn:
        first = conn.exec_driver_sql("SELECT txid_current()").scalar()
        assert conn.exec_driver_sql("SELECT txid_current()").scalar() == first


@pytest.mark.needs("embedded")
def test_a_sqlite_host_engine_that_never_waits_for_the_lock(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """pysqlite ``timeout=0`` (busy timeout 0: fail at once on a lock): wf_persist writes
    and reads from several connections at once, and its starts failed each other's with a
    raw "database is locked". Its transactions wait for the lock as long as they need (the
    floor), and the host's connections keep their own timeout."""
    engine = make_engine(db_url, connect_args={"timeout": 0.0})
    failures: list[str] = []
    with wp.Runtime(engine) as rt:
        rt.register(w.echo_wf)
        rt.start_worker(concurrency=4, poll_interval=0.01)
        client = rt.client()

        def starts() -> None:
            try:
                for _ in range(15):
                    run = client.start(w.echo_wf, 3).execution_id
                    assert client.result(run, timeout=30).unwrap() == [1, 2, 3]
            except Exception as exc:  # what the test is about: report it
                failures.append(repr(exc))

        threads = [threading.Thread(target=starts) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert failures == []
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 0


@pytest.mark.needs("embedded")
@pytest.mark.parametrize("option", ["cache=shared", "nolock=1"])
def test_sqlite_uris_whose_connections_cannot_wait_for_each_other_are_refused(
    option: str, db_url: str
) -> None:
    """Shared cache (table locks that fail at once) and nolock (no lock at all): concurrent
    starts failed with raw "database table is locked" or "disk I/O error"."""
    wp.Runtime(db_url).close()  # the file, migrated
    url = f"sqlite:///file:{make_url(db_url).database}?{option}&uri=true"
    for opening in (wp.Runtime, wp.Client):
        with pytest.raises(wp.UnsupportedDatabaseError, match=option):
            opening(url)


@pytest.mark.needs("embedded")
def test_a_sqlite_host_engine_with_count_changes_is_refused(
    db_url: str, make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """``PRAGMA count_changes`` (deprecated) makes every write return a row of its count:
    a run's drives failed forever on a raw IntegrityError (stuck), and an upgrade with a
    raw-sounding "expected to match one row"."""

    def counting(url: str) -> Engine:
        engine = make_engine(url)

        @event.listens_for(engine, "connect")
        def _count(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.execute("PRAGMA count_changes = ON")

        return engine

    wp.Runtime(db_url).close()  # the file, migrated
    for opening in (wp.Runtime, wp.Client):
        with pytest.raises(wp.UnsupportedDatabaseError, match="count_changes"):
            opening(counting(db_url))
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    with pytest.raises(wp.UnsupportedDatabaseError, match="count_changes"):
        migrate.upgrade(counting(fresh))
    with make_engine(fresh).connect() as conn:  # nothing of it was left
        assert conn.exec_driver_sql("SELECT name FROM sqlite_master").all() == []


@pytest.mark.needs("embedded")
def test_a_busy_timeout_the_host_changes_later_is_the_one_put_back(
    db_url: str, make_engine: Callable[..., Engine], runtime: wp.Runtime
) -> None:
    """Raised for wf_persist's transactions, a short busy timeout is put back as the host
    last set it, not as it was when wf_persist first saw the connection."""
    runtime.register(w.echo_wf)
    engine = make_engine(db_url, connect_args={"timeout": 0.0}, pool_size=1, max_overflow=0)
    with wp.Client(engine) as client:
        client.start("echo", 2)  # the one connection, seen at 0
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA busy_timeout = 2000")
        client.start("echo", 2)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 2000


@pytest.mark.needs("schemas")
@pytest.mark.parametrize("path", ["", "no_such_schema"])
def test_a_search_path_naming_no_schema_is_refused_for_what_it_is(
    path: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Every name resolved nowhere, and the runtime said the database was not migrated."""
    engine = make_engine(db_url, connect_args={"options": f"-c search_path={path}"})
    for opening in (wp.Runtime, wp.Client):
        with pytest.raises(wp.UnsupportedDatabaseError, match="names no schema"):
            opening(engine)


@pytest.mark.needs("schemas")
def test_a_search_path_that_shadows_postgresql_functions_is_refused(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host's own ``statement_timestamp()`` found before pg_catalog's (a legal
    ``search_path=public,x,pg_catalog``) was wf_persist's clock: a frozen one left every
    timer never due, the run suspended for good. Refused at open, naming it; a schema after
    pg_catalog, or one with only names wf_persist never calls, is fine."""
    admin = make_engine(db_url)
    clock, other = (f"shadow_{uuid.uuid4().hex[:8]}" for _ in range(2))
    frozen = "RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT timestamptz '2001-01-01Z' $$"
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {clock}")
        conn.exec_driver_sql(f"CREATE FUNCTION {clock}.statement_timestamp() {frozen}")
        conn.exec_driver_sql(f"CREATE SCHEMA {other}")
        conn.exec_driver_sql(f"CREATE FUNCTION {other}.format(int) {frozen}")
        conn.exec_driver_sql(f"CREATE TABLE {other}.line (x int)")  # a type named as one
        conn.exec_driver_sql(f"CREATE TABLE {other}.count (x int)")  # a type named as count()
        conn.exec_driver_sql(f"CREATE FUNCTION {other}.less(text, int) {frozen}")
        # "-" for other operands than any of PostgreSQL's (as an extension's own types have)
        conn.exec_driver_sql(
            f"CREATE OPERATOR {other}.- (FUNCTION={other}.less, LEFTARG=text, RIGHTARG=int)"
        )
        conn.exec_driver_sql(
            f"CREATE FUNCTION {clock}.alike(text, text) RETURNS bool LANGUAGE sql AS 'SELECT true'"
        )
        conn.exec_driver_sql(
            f"CREATE OPERATOR {clock}.~~ (FUNCTION={clock}.alike, LEFTARG=text, RIGHTARG=text)"
        )
    try:
        for function in ("statement_timestamp", "~~"):
            if function == "~~":  # now the only one of PostgreSQL's there
                with admin.begin() as conn:
                    conn.exec_driver_sql(f"DROP FUNCTION {clock}.statement_timestamp()")
            shadowing = make_engine(
                db_url, connect_args={"options": f"-c search_path=public,{clock},pg_catalog"}
            )
            for opening in (wp.Runtime, wp.Client):
                with pytest.raises(wp.UnsupportedDatabaseError, match=f"finds {clock}.{function}"):
                    opening(shadowing)
        for path in (f"public,pg_catalog,{clock}", f"public,{other},pg_catalog"):
            engine = make_engine(db_url, connect_args={"options": f"-c search_path={path}"})
            with wp.Runtime(engine) as rt:
                rt.register(w.napper_wf)
                assert rt.client().execute(w.napper_wf, 0.05).unwrap() == "ok"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {clock}, {other} CASCADE")
