"""Living inside a host application: its engine, its transactions, SQL readers, retention."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist import migrate
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist

from .conftest import HostTables
from .fixtures import family, fencing, messaging
from .fixtures import saga as s
from .fixtures import workflows as w
from .helpers import Processes

DOCS = Path(__file__).resolve().parent.parent / "docs" / "sql.md"


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    s.reset()
    w.CALLS.clear()
    yield
    s.reset()


def _host_table() -> Table:
    return Table(
        "orders", MetaData(), Column("id", Integer, primary_key=True), Column("ref", String(50))
    )


def test_host_engine_is_used_as_is_and_never_mutated(db_engine: Engine) -> None:
    engine = db_engine
    names = ("engine_connect", "begin", "before_cursor_execute")
    listeners = {name: len(getattr(engine.dispatch, name)) for name in names}
    pool_listeners = (len(engine.pool.dispatch.connect), len(engine.pool.dispatch.checkout))
    options = dict(engine.get_execution_options())
    with wp.Runtime(engine) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.result(client.start(w.echo_wf, 3).execution_id).unwrap() == [1, 2, 3]
    assert {name: len(getattr(engine.dispatch, name)) for name in listeners} == listeners
    assert (len(engine.pool.dispatch.connect), len(engine.pool.dispatch.checkout)) == pool_listeners
    assert dict(engine.get_execution_options()) == options
    with engine.connect() as conn:  # the runtime did not dispose the host's engine
        assert conn.execute(text("SELECT 1")).scalar() == 1


@pytest.mark.parametrize("use", ["session", "connection"])
def test_start_inside_the_host_transaction(
    db_engine: Engine, host_tables: HostTables, request: pytest.FixtureRequest, use: str
) -> None:
    engine = db_engine
    orders = host_tables.create(engine, _host_table())
    rt = wp.Runtime(engine)
    request.addfinalizer(rt.close)
    rt.register(w.echo_wf)
    client = rt.client()

    def in_host_transaction(commit: bool, ref: str) -> str:
        if use == "session":
            with Session(engine) as session:
                session.execute(orders.insert().values(ref=ref))
                handle = client.start(w.echo_wf, 2, session=session, idempotency_key=ref)
                session.commit() if commit else session.rollback()
        else:
            with engine.connect() as conn:
                conn.execute(orders.insert().values(ref=ref))
                handle = client.start(w.echo_wf, 2, session=conn, idempotency_key=ref)
                conn.commit() if commit else conn.rollback()
        return handle.execution_id

    rolled_back = in_host_transaction(False, "r-1")
    with pytest.raises(wp.UnknownExecutionError):
        client.status(rolled_back)
    assert client.list(w.echo_wf).items == []
    committed = in_host_transaction(True, "r-2")
    assert client.result(committed).unwrap() == [1, 2]
    with engine.connect() as conn:
        assert conn.execute(select(orders.c.ref)).scalars().all() == ["r-2"]


@wp.workflow(name="host_rb_child", version=1)
def rb_child_wf(ctx: wp.Context, n: int) -> int:
    return n * 10


@wp.workflow(name="host_rb_parent", version=1)
def rb_parent_wf(ctx: wp.Context, n: int) -> int:
    got: int = ctx.run_child("host_rb_child", n)  # by name: the runtime's definition
    return got + 1


@wp.workflow(name="host_rb_child", version=2)
def rb_child_v2(ctx: wp.Context, n: int) -> int:
    return n * 100


def test_a_start_pinning_a_version_rolled_back_from_the_catalog_writes_that_version(
    db_engine: Engine, request: pytest.FixtureRequest
) -> None:
    """``start(v2, version=1)`` after v1's registration rolled back with the host's
    transaction: the definition passed in was cataloged, the version started was not (a
    foreign-key failure on PostgreSQL and MariaDB)."""
    rt = wp.Runtime(db_engine)
    request.addfinalizer(rt.close)
    with Session(db_engine) as session:
        rt.register(rb_child_wf, session=session)
        session.rollback()
    client = rt.client()
    handle = client.start(rb_child_v2, 3, version=1)
    assert handle.version == 1
    assert rt.drive(handle.execution_id)
    assert client.result(handle.execution_id, timeout=0).unwrap() == 30
    with db_engine.connect() as conn:
        found = conn.execute(text("SELECT version FROM wf_workflows ORDER BY version")).all()
    assert [v for (v,) in found] == [1, 2]


@pytest.mark.parametrize("how", ["start", "register", "by-name", "child"])
def test_a_catalog_row_rolled_back_with_the_host_transaction_is_written_again(
    db_engine: Engine, request: pytest.FixtureRequest, how: str
) -> None:
    """A workflow first cataloged in a host's transaction that then rolled back (by a start
    of it there, or a registration) was taken for cataloged: every later start of it failed
    on the catalog's foreign key (PostgreSQL, MariaDB), or wrote a run with no catalog row
    (SQLite without foreign keys, a host's default), and so did a parent's start of it as a
    child by name. The next start writes the row again, in its own transaction or the
    host's."""
    engine = db_engine
    rt = wp.Runtime(engine)
    request.addfinalizer(rt.close)
    client = rt.client()
    with Session(engine) as session:
        if how == "start":
            client.start(w.echo_wf, 2, session=session)
        else:
            rt.register(w.echo_wf, rb_child_wf, session=session)
        session.rollback()
    catalog = text("SELECT name FROM wf_workflows ORDER BY name")
    with engine.connect() as conn:
        assert conn.execute(catalog).scalars().all() == []
    if how == "child":
        rt.register(rb_parent_wf)
        handle = client.start(rb_parent_wf, 4)
        assert rt.drive(handle.execution_id)  # starts the child
        child = client.list("host_rb_child").items
        assert len(child) == 1
        assert rt.drive(child[0].execution_id)
        assert rt.drive(handle.execution_id)
        assert client.result(handle.execution_id, timeout=0).unwrap() == 41
        expected = ["host_rb_child", "host_rb_parent"]
    else:
        workflow: wp.Workflow[int, list[int]] | str = "echo" if how == "by-name" else w.echo_wf
        with Session(engine) as session:  # a host transaction that commits this time
            first = client.start(workflow, 2, session=session)
            session.commit()
        second = client.start(workflow, 3)
        for handle, out in ((first, [1, 2]), (second, [1, 2, 3])):
            assert rt.drive(handle.execution_id)
            assert client.result(handle.execution_id, timeout=0).unwrap() == out
        expected = ["echo"]  # the child registered with it never started: not cataloged
    with engine.connect() as conn:
        names = conn.execute(catalog).scalars().all()
        orphans = conn.execute(
            text(
                "SELECT count(*) FROM wf_executions e WHERE NOT EXISTS (SELECT 1 FROM "
                "wf_workflows c WHERE c.name = e.workflow_name AND c.version = e.workflow_version)"
            )
        ).scalar_one()
    assert names == expected
    assert orphans == 0, "every run has its catalog row"


@pytest.mark.needs("schemas")
def test_tables_in_a_named_schema(blank_db_url: str, make_engine: Callable[..., Engine]) -> None:
    url = blank_db_url
    migrate.upgrade(url, schema="wf")
    assert migrate.current(url, schema="wf") == migrate.SCHEMA_HEAD
    assert migrate.current(url) is None, "nothing in the default schema"
    engine = make_engine(url)
    tables = set(inspect(engine).get_table_names(schema="wf"))
    assert {"wf_executions", "wf_history", "wf_workflows", migrate.VERSION_TABLE} <= tables
    assert not set(inspect(engine).get_table_names())
    with pytest.raises(wp.SchemaVersionError, match="--schema other"):
        wp.Runtime(engine, schema="other")
    with wp.Runtime(engine, schema="wf") as rt:
        rt.register(*w.ALL)
        client = rt.client()
        handle = client.start(w.approval_wf, None)
        with pytest.raises(wp.ResultTimeoutError):
            client.result(handle.execution_id, timeout=0.3)
        client.signal(handle.execution_id, "approval", {"approved": True})
        assert client.result(handle.execution_id, timeout=5).unwrap() == "approved"
        rt.start_worker()
        with wp.Client(engine, schema="wf", poll_interval=0.02) as thin:  # no code, same schema
            assert {e.name for e in thin.workflows()} >= {"echo", "approval"}
            echoed = thin.start("echo", 3).execution_id
            assert thin.result(echoed, timeout=10).unwrap() == [1, 2, 3]
            assert thin.list("echo").items[0].execution_id == echoed
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM wf.wf_history")).scalar()
        assert n and n > 5
        assert conn.execute(text("SELECT count(*) FROM wf.wf_step_attempts")).scalar() == 4
    script = migrate.upgrade(url, sql=True, schema="wf")
    assert script is not None and 'SET LOCAL search_path TO "wf"' in script


@pytest.mark.lacks("schemas")
def test_named_schema_is_refused_where_there_are_none(db_url: str) -> None:
    with pytest.raises(wp.UnsupportedDatabaseError, match="a named schema needs PostgreSQL"):
        wp.Runtime(db_url, schema="wf")


def test_list_filters_time_range_and_actor(runtime: wp.Runtime) -> None:
    clock_value = [dt.datetime(2026, 1, 1, tzinfo=dt.UTC)]
    runtime.clock = lambda: clock_value[0]
    runtime.register(w.echo_wf)
    client = runtime.client()
    ids = []
    for i, actor in enumerate(["ann", "bob", "ann", "cy"]):
        clock_value[0] = dt.datetime(2026, 1, 1 + i, tzinfo=dt.UTC)
        ids.append(client.start(w.echo_wf, 2, actor=actor).execution_id)
    jan2, jan4 = dt.datetime(2026, 1, 2, tzinfo=dt.UTC), dt.datetime(2026, 1, 4, tzinfo=dt.UTC)
    page = client.list(w.echo_wf, created_after=jan2, created_before=jan4)
    assert [i.execution_id for i in page.items] == ids[1:3]
    assert [i.execution_id for i in client.list(w.echo_wf, actor="ann").items] == [ids[0], ids[2]]
    first = client.list(w.echo_wf, actor="ann", limit=1)
    rest = client.list(w.echo_wf, actor="ann", limit=1, cursor=first.next_cursor)
    assert [i.execution_id for i in first.items + rest.items] == [ids[0], ids[2]]
    with pytest.raises(wp.InvalidArgumentError):
        client.list(w.echo_wf, created_after=dt.datetime(2026, 1, 1))


def test_purge_deletes_only_old_finished_runs(runtime: wp.Runtime, db_engine: Engine) -> None:
    runtime.register(*w.ALL)
    client = runtime.client()
    done = [client.start(w.echo_wf, 2).execution_id for _ in range(5)]
    for execution_id in done:
        client.result(execution_id)
    failed = client.start(w.explode_wf, "x").execution_id
    client.result(failed)
    parked = client.start(w.approval_wf, None).execution_id
    with pytest.raises(wp.ResultTimeoutError):
        client.result(parked, timeout=0.2)
    fresh = client.start(w.echo_wf, 2).execution_id
    assert client.purge(older_than=dt.timedelta(hours=1)) == 0
    with pytest.raises(wp.InvalidArgumentError):
        client.purge(older_than=dt.timedelta(0), statuses=("suspended",))
    with pytest.raises(wp.InvalidArgumentError):
        client.purge(older_than=dt.timedelta(0), batch_size=0)
    assert client.purge(older_than=dt.timedelta(0), statuses=("completed",), batch_size=2) == 5
    for execution_id in done:
        with pytest.raises(wp.UnknownExecutionError):
            client.status(execution_id)
    assert client.status(failed) == "failed"
    assert client.purge(older_than=dt.timedelta(0)) == 1
    assert client.status(parked) == "suspended" and client.status(fresh) == "running"
    with db_engine.connect() as conn:
        orphans = conn.execute(
            select(func.count())
            .select_from(hist)
            .where(hist.c.execution_id.not_in(select(ex.c.id)))
        ).scalar_one()
    assert orphans == 0


def test_a_purge_batch_larger_than_a_statement_can_bind_deletes_it_all(
    runtime: wp.Runtime, db_engine: Engine
) -> None:
    """Every id of a batch is a bound parameter: 70,000 are more than one PostgreSQL (at
    most 65,535) or SQLite (32,766) statement takes. Before, such a batch never succeeded."""
    runtime.register(*w.ALL)
    old = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [
        {
            "id": f"purged-{i}",
            "workflow_name": w.echo_wf.name,
            "workflow_version": w.echo_wf.version,
            "status": "completed",
            "next_seq": 3,
            "created_at": old,
            "updated_at": old,
            "finished_at": old,
        }
        for i in range(70_000)
    ]
    with db_engine.begin() as conn:
        conn.execute(ex.insert(), rows)
    assert runtime.client().purge(older_than=dt.timedelta(0), batch_size=100_000) == 70_000
    with db_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ex)).scalar_one() == 0


def test_cli_purge(runtime: wp.Runtime, db_url: str, procs: Processes) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    ids = [client.start(w.echo_wf, 2).execution_id for _ in range(3)]
    for execution_id in ids:
        client.result(execution_id)
    purge = ("purge", "--url", db_url)
    assert procs.cli(*purge, "--older-than", "1d").stdout.strip() == "0"
    gone = procs.cli(*purge, "--older-than", "0s", "--batch-size", "2")
    assert gone.stdout.strip() == "3"
    assert "deleted 3 finished run(s)" in gone.stderr
    for age in ("soon", "99999999999d", "9999-12-31T23:00:00-05:00"):
        bad = procs.cli(*purge, "--older-than", age, check=False)
        assert bad.returncode == 1, bad.stderr
        assert bad.stderr.startswith("error: "), bad.stderr  # one line, no traceback


def _doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_docs_ship_at_least_eight_queries() -> None:
    assert len(_doc_queries()) >= 8


def test_documented_queries_run_on_every_backend(
    make_runtime: Callable[..., wp.Runtime], db_engine: Engine, tmp_path: Path
) -> None:
    fencing.reset()
    rt = make_runtime(record_start_after=0.05)
    rt.register(*w.ALL, *s.ALL, *fencing.ALL)
    client = rt.client()
    client.result(client.start(w.echo_wf, 3, actor="checkout").execution_id)
    crashed = client.start(fencing.crashes_once_wf, 0.2).execution_id  # an abandoned attempt
    with pytest.raises(fencing.SimulatedCrash):
        client.result(crashed)
    client.result(crashed)
    with db_engine.begin() as conn:  # a run whose drives failed twice (as the SQL sees it)
        conn.execute(ex.update().where(ex.c.id == crashed).values(drive_failures=2))
    client.result(client.start(s.flaky_wf).execution_id)  # a retried step
    client.result(client.start(s.saga_wf, 1).execution_id)  # failed, compensated
    signalled = client.start(w.approval_wf, None).execution_id
    waiting = client.start(w.approval_wf, None).execution_id
    sleeping = client.start(w.napper_wf, 3600, timeout=7200).execution_id  # a deadline
    for execution_id in (signalled, waiting, sleeping):
        with pytest.raises(wp.ResultTimeoutError):
            client.result(execution_id, timeout=0.3)
    client.signal(signalled, "approval", {"approved": True}, actor="kim")
    client.result(signalled, timeout=5)
    rt.register(*messaging.ALL)  # a buffered signal taken, and events published
    inbox = client.start(messaging.inbox_wf, {"count": 1}).execution_id
    client.signal(inbox, "approval", {"approved": True}, buffer=True)
    client.result(inbox, timeout=5)
    rt.register(*family.ALL)  # a parent with two children
    job = family.ChildJob(marks=str(tmp_path / "marks"), label="q")
    parent = client.start(family.parent_wf, job).execution_id
    rt.start_worker(concurrency=2, poll_interval=0.05)  # drives the children
    client.result(parent, timeout=30)
    params = {"execution_id": signalled, "actor": "checkout", "parent_id": parent}
    with (
        rt.slots.slot("limited-step", "k", 1, parent) as acquire,  # a held Limit slot
        db_engine.connect() as conn,
    ):
        assert acquire()
        for sql in _doc_queries():
            names = set(re.findall(r"(?<!:):(\w+)", sql))
            rows = conn.execute(text(sql.strip().rstrip(";")), {k: params[k] for k in names}).all()
            assert rows, f"no rows for:\n{sql}"
        attempts = conn.execute(
            text(
                "SELECT step_name, attempt, outcome, duration_ms FROM wf_step_attempts"
                " WHERE step_name = 'flaky' ORDER BY attempt"
            )
        ).all()
        expected = [(1, "failed"), (2, "failed"), (3, "completed")]
        assert [(r.attempt, r.outcome) for r in attempts] == expected
        assert all(r.duration_ms is not None and r.duration_ms >= 0 for r in attempts)
        waits = {
            r.execution_id: (r.waiting_kind, r.signal_name)
            for r in conn.execute(
                text("SELECT execution_id, waiting_kind, signal_name FROM wf_execution_waits")
            )
        }
        assert waits[waiting] == ("signal", "approval")
        assert waits[sleeping] == ("timer", None)
        assert signalled not in waits


LEGACY = Path(__file__).resolve().parent / "fixtures" / "legacy" / "wf_0001_rows.sql"


def test_upgrade_keeps_data_from_the_oldest_revision(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    migrate.upgrade(blank_db_url, "wf_0001")
    engine = make_engine(blank_db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":  # the fixture's times are UTC wall clock
            conn.execute(text("SET LOCAL TIME ZONE 'UTC'"))
        for statement in LEGACY.read_text().split(";\n"):
            if statement.strip():
                conn.execute(text(statement))
    migrate.upgrade(blank_db_url, "wf_0003")  # the revision before the newest, with data
    assert migrate.current(blank_db_url) == "wf_0003"
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    with wp.Client(engine) as thin:  # cataloged before schemas were recorded
        assert [(e.name, e.input_schema) for e in thin.workflows()] == [("echo", None)]
    # Down to the previous revision and up again: the catalog rows and runs survive.
    migrate.downgrade(blank_db_url, "wf_0003")
    migrate.upgrade(blank_db_url)
    with wp.Runtime(engine) as rt:
        rt.register(w.echo_wf)
        assert [e.input_schema for e in rt.client().workflows()] == [{"type": "integer"}]
        client = rt.client()
        info = client.describe("00000000-0000-4000-8000-000000000001")
        assert (info.status, info.actor, info.version) == ("completed", "legacy-actor", 1)
        assert client.result(info.execution_id).unwrap() == [1, 2]
        history = client.history(info.execution_id)
        assert [r.event["type"] for r in history] == [
            "execution.started",
            "workflow.started",
            "step.started",
            "step.completed",
            "step.started",
            "step.completed",
            "workflow.completed",
        ]
        assert history[0].created_at == dt.datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=dt.UTC)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT step_name, outcome FROM wf_step_attempts ORDER BY started_at")
        ).all()
    assert [tuple(r) for r in rows] == [("echo", "completed"), ("echo", "completed")]


def test_requirements_are_checked_and_explained(db_engine: Engine) -> None:
    from wf_persist import backends

    engine = db_engine
    backend = backends.open_backend(engine, owned=False)
    backend.check()  # the servers of this machine qualify
    problem = backend.requirement_problem
    if backend.names == ("sqlite",):
        assert (
            problem((3, 31, 1)) == "SQLite >= 3.35 is needed (UPDATE ... RETURNING); found 3.31.1"
        )
    elif backend.names == ("postgresql",):
        assert "PostgreSQL >= 12" in (problem((11, 9)) or "")
    else:
        mariadb = bool(getattr(engine.dialect, "is_mariadb", False))
        assert problem((10, 11, 6) if mariadb else (8, 0, 30)) is None
        old = problem((10, 5, 9) if mariadb else (5, 7, 40)) or ""
        assert ("MariaDB >= 10.6" if mariadb else "MySQL >= 8.0.17") in old
    assert problem(None) is None
    with pytest.raises(wp.UnsupportedDatabaseError, match="not supported"):
        backends.backend_type("oracle")


@pytest.mark.needs("embedded")
def test_documented_queries_by_type_read_the_type_index_on_sqlite(
    make_runtime: Callable[..., wp.Runtime], db_engine: Engine
) -> None:
    # SQLite uses its partial type index (step events left out) only for a query that
    # repeats the index's condition: every documented query of wf_history by type does.
    make_runtime()  # a migrated database
    by_type = [q for q in _doc_queries() if "FROM wf_history" in q and "WHERE type" in q]
    assert len(by_type) >= 3
    with db_engine.connect() as conn:
        for sql in by_type:
            plan = " ".join(
                str(r[-1])
                for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql.strip().rstrip(";")))
            )
            assert "ix_wf_history__type_created_at" in plan, (sql, plan)
