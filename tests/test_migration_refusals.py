"""Databases a migration must refuse before writing anything, and the commands errors name.

- Names of ours already taken where no revision of ours is recorded (a host's own table or
  view, or our tables with their version record lost): the first revision would fail on
  them, on MySQL/MariaDB halfway (its DDL is not transactional).
- A ``--sql`` script rendered for a ``mysql://`` URL, applied to MariaDB (either server may
  sit behind such a URL).
- A host engine mapping our tables into another database of a server without schemas: the
  command an error names migrates that database.
- A host session whose transaction had already failed (PostgreSQL refuses every statement
  in it until it is rolled back).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist import migrate, schema_reads
from wf_persist.backends import backend_type, normalize_url
from wf_persist.models import metadata

from .conftest import create_database, drop_database, has, server_url
from .fixtures import workflows as w
from .helpers import Processes


def _names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            found = inspect(conn)
            return set(found.get_table_names()) | set(found.get_view_names())
    finally:
        engine.dispose()


def _execute(url: str, *statements: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def _refused_everywhere(url: str, procs: Processes, names: set[str]) -> None:
    """Runtime, ``migrate.upgrade`` and the CLI all refuse with the typed error naming what
    is in the way, and nothing is written."""
    before = _names(url)
    with pytest.raises(wp.SchemaNamesTakenError) as opened:
        wp.Runtime(url)
    with pytest.raises(wp.SchemaNamesTakenError) as upgraded:
        migrate.upgrade(url)
    for exc in (opened.value, upgraded.value):
        assert set(exc.names) == names
        assert isinstance(exc, wp.SchemaVersionError) and exc.current is None
        assert all(name in str(exc) for name in names)
    out = procs.cli("db", "upgrade", "--url", url, check=False)
    assert out.returncode != 0
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr
    assert "named as wf_persist's" in out.stderr
    assert _names(url) == before  # no version table, no wf_workflows: nothing half-built


def test_a_hosts_table_named_as_ours_is_refused(blank_db_url: str, procs: Processes) -> None:
    _execute(blank_db_url, "CREATE TABLE wf_executions (id INTEGER PRIMARY KEY, junk VARCHAR(10))")
    _refused_everywhere(blank_db_url, procs, {"wf_executions"})


def test_a_hosts_view_named_as_ours_is_refused(blank_db_url: str, procs: Processes) -> None:
    """MySQL would have replaced it (our views are created OR REPLACE there)."""
    _execute(
        blank_db_url,
        "CREATE TABLE host_things (id INTEGER PRIMARY KEY)",
        "CREATE VIEW wf_run_tree AS SELECT id FROM host_things",
    )
    _refused_everywhere(blank_db_url, procs, {"wf_run_tree"})
    engine = create_engine(blank_db_url)
    try:
        with engine.connect() as conn:  # still the host's view
            columns = [c["name"] for c in inspect(conn).get_columns("wf_run_tree")]
        assert columns == ["id"]
    finally:
        engine.dispose()


def test_our_tables_with_their_record_lost_are_refused(
    backend: str, blank_db_url: str, procs: Processes
) -> None:
    """Everywhere the views say a first revision did not just stop midway; where DDL is
    transactional the tables say it too, and on MySQL those a later revision changed (a
    table as our first revision makes it could be what it left)."""
    migrate.upgrade(blank_db_url)
    _execute(blank_db_url, f"DELETE FROM {migrate.VERSION_TABLE}")
    tables = set(migrate.FIRST_TABLES)
    if has(backend, "sql_mode"):
        grown = {n: set(metadata.tables[n].c.keys()) for n in tables}
        tables = {n for n in tables if grown[n] != migrate.FIRST_TABLES[n]}
        assert tables and tables != set(migrate.FIRST_TABLES)  # both kinds are met
    later = set(metadata.tables) - set(migrate.FIRST_TABLES)  # made by later revisions
    ours = {*tables, *later, *migrate.VIEWS}
    _refused_everywhere(blank_db_url, procs, ours)
    _execute(blank_db_url, f"INSERT INTO {migrate.VERSION_TABLE} VALUES ('{migrate.SCHEMA_HEAD}')")
    with wp.Runtime(blank_db_url) as rt:  # the record restored, the database is whole again
        rt.register(w.echo_wf)
        assert rt.client().execute(w.echo_wf, 2).unwrap() == [1, 2]


@pytest.mark.needs("sql_mode")
def test_an_interrupted_first_revision_is_still_done_again(blank_db_url: str) -> None:
    """MySQL: tables our first revision made before it was killed are ours (their columns
    are), not a host's: the upgrade goes on from them."""
    script = migrate.upgrade(blank_db_url, "wf_0001", sql=True)
    assert script is not None
    first = re.search(r"CREATE TABLE wf_workflows \(.*?\)[^;]*;", script, re.S)
    assert first is not None
    _execute(blank_db_url, first.group(0).rstrip(";"))
    assert migrate.state(blank_db_url).taken == ()
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def _statements(script: str) -> list[str]:
    """The statements of a rendered script (Alembic ends each with ``;`` and a blank line)."""
    parts = [p.strip() for p in re.split(r";\s*\n", script)]
    return [p for p in parts if p and not all(line.startswith("--") for line in p.splitlines())]


@pytest.mark.needs("sql_mode")
def test_offline_script_of_a_mysql_url_applies_whole(blank_db_url: str) -> None:
    """The ``mysql://`` script carries both servers' NO PAD collations, each in a comment only
    its server runs: applied to this server it reaches head with the collation an online
    upgrade gives (MariaDB's ``utf8mb4_0900_bin`` does not exist)."""
    url = make_url(blank_db_url)
    assert url.get_backend_name() == "mysql"
    script = migrate.upgrade(url.set(host="nowhere.invalid", port=1), sql=True)
    assert script is not None
    assert "/*M!100200 utf8mb4_nopad_bin */ /*!80017 utf8mb4_0900_bin */" in script
    _execute(blank_db_url, *_statements(script))
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    online = server_url("mysql", create_database("mysql"))
    try:
        migrate.upgrade(online)
        query = (
            "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'wf\\_%'"
            " AND TABLE_NAME IN ('wf_workflows', 'wf_executions', 'wf_history')"
            " ORDER BY 1, 2"
        )
        found = []
        for each in (blank_db_url, online):
            engine = create_engine(each)
            with engine.connect() as conn:
                found.append(conn.execute(text(query)).all())
            engine.dispose()
        assert found[0] == found[1]
        assert ("wf_executions", "idempotency_key", "utf8mb4_nopad_bin") in found[0] or (
            "wf_executions",
            "idempotency_key",
            "utf8mb4_0900_bin",
        ) in found[0]
    finally:
        drop_database("mysql", make_url(online).database or "")


@pytest.mark.lacks("schemas")
def test_a_mapped_database_is_named_by_its_own_url(
    backend: str, tmp_path: Path, procs: Processes, make_engine: Callable[..., Engine]
) -> None:
    """A host engine whose ``schema_translate_map`` puts our tables in another database (an
    attached SQLite file, another MySQL database): the command the error names is that
    database's upgrade, which the engine then opens at head."""
    if has(backend, "embedded"):
        main = tmp_path / "host.sqlite3"
        other = tmp_path / "other.sqlite3"
        sqlite3.connect(main).execute("CREATE TABLE host_things (id INTEGER)").connection.close()
        engine = make_engine(f"sqlite:///{main}")

        @event.listens_for(engine, "connect")
        def attach(dbapi: sqlite3.Connection, record: object) -> None:
            dbapi.execute(f"ATTACH DATABASE '{other}' AS other")

        expected = f"sqlite:///{other}"
        mapped = engine.execution_options(schema_translate_map={None: "other"})
        created: str | None = None
    else:
        created = create_database(backend)
        home = create_database(backend)
        expected = server_url(backend, created)
        mapped = make_engine(server_url(backend, home)).execution_options(
            schema_translate_map={None: created}
        )
    try:
        with pytest.raises(wp.SchemaVersionError) as behind:
            wp.Runtime(mapped)
        assert "--schema" not in behind.value.command
        assert str(make_url(expected).database) in behind.value.command
        out = procs.cli("db", "upgrade", "--url", make_url(expected).render_as_string(False))
        assert migrate.SCHEMA_HEAD in out.stdout + out.stderr
        assert migrate.current(expected) == migrate.SCHEMA_HEAD
        with wp.Runtime(mapped) as rt:
            rt.register(w.echo_wf)
            assert rt.client().execute(w.echo_wf, 2).unwrap() == [1, 2]
    finally:
        if created is not None:
            mapped.dispose()
            drop_database(backend, created)
            drop_database(backend, home)


def _fail_a_statement(run: Callable[[str], object]) -> None:
    try:
        run("SELECT * FROM no_such_table_here")
    except DBAPIError:
        pass
    else:  # pragma: no cover - every backend refuses an unknown table
        raise AssertionError("the statement should have failed")


def test_start_in_a_failed_host_transaction(backend: str, runtime: wp.Runtime) -> None:
    """PostgreSQL refuses every statement of a transaction after one failed: the start says
    so in a typed error, and after the host's rollback the same session starts the run.
    Elsewhere the failed statement alone is undone and the start goes on."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    engine = runtime.database.backend.engine
    aborts = has(backend, "schemas")  # PostgreSQL
    with Session(engine) as session:
        _fail_a_statement(lambda sql: session.execute(text(sql)))
        if aborts:
            with pytest.raises(wp.InvalidArgumentError, match="roll it back"):
                client.start(w.echo_wf, 2, session=session)
            session.rollback()
        handle = client.start(w.echo_wf, 2, session=session)
        session.commit()
    assert client.result(handle.execution_id, timeout=60).unwrap() == [1, 2]


def test_async_start_in_a_failed_host_transaction(
    backend: str, runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(w.echo_wf)

    async def app() -> str:
        url = normalize_url(db_url)
        engine = create_async_engine(backend_type(url.get_backend_name()).async_url(url))
        try:
            client = wp.AsyncClient(engine)
            async with AsyncSession(engine) as session:
                with contextlib.suppress(DBAPIError):
                    await session.execute(text("SELECT * FROM no_such_table_here"))
                if has(backend, "schemas"):
                    with pytest.raises(wp.InvalidArgumentError, match="roll it back"):
                        await client.start("echo", 2, session=session)
                    await session.rollback()
                handle = await client.start("echo", 2, session=session)
                await session.commit()
            await client.close()
            return handle.execution_id
        finally:
            await engine.dispose()

    execution_id = asyncio.run(app())
    assert runtime.client().result(execution_id, timeout=60).unwrap() == [1, 2]


def test_a_hosts_table_with_some_of_our_columns_is_refused(
    blank_db_url: str, procs: Processes
) -> None:
    """Columns a subset of ours are not what our first revision leaves (it makes each table
    whole): on MySQL too such a table is the host's, refused before anything is written."""
    _execute(blank_db_url, "CREATE TABLE wf_history (execution_id VARCHAR(36), type VARCHAR(64))")
    _refused_everywhere(blank_db_url, procs, {"wf_history"})


@pytest.mark.needs("sql_mode")
def test_the_first_revisions_columns_are_what_it_renders(blank_db_url: str) -> None:
    script = migrate.upgrade(blank_db_url, "wf_0001", sql=True)
    assert script is not None
    for name, columns in migrate.FIRST_TABLES.items():
        body = re.search(rf"CREATE TABLE {name} \((.*?)\n\)", script, re.S)
        assert body is not None, name
        found = {
            line.split()[0]
            for line in body.group(1).splitlines()
            if line.strip() and not line.strip().startswith(("PRIMARY", "CONSTRAINT", "FOREIGN"))
        }
        assert found == columns, name


@pytest.mark.needs("sql_mode")
def test_a_concurrent_first_upgrade_is_seen_through_a_repeatable_read_snapshot(
    blank_db_url: str, make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another deploy finishes the first upgrade between our read of the (empty) version
    table and our look for taken names: the second read of the record is a fresh snapshot
    (MariaDB's default REPEATABLE READ kept the first), so its tables are not "taken"."""
    _execute(blank_db_url, f"CREATE TABLE {migrate.VERSION_TABLE} (version_num VARCHAR(32))")
    host = make_engine(blank_db_url, isolation_level="REPEATABLE READ")
    look = schema_reads.taken
    done: list[bool] = []

    def other_deploy_first(*args: object) -> tuple[str, ...]:
        if not done:
            done.append(True)
            migrate.upgrade(blank_db_url)  # another process, committed meanwhile
        return look(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(schema_reads, "taken", other_deploy_first)
    found = migrate.state(host)
    assert done and found.error() is None and found.revision == migrate.SCHEMA_HEAD


@pytest.mark.needs("embedded")
def test_an_attached_uri_database_is_named_by_a_plain_url(
    tmp_path: Path, procs: Processes, make_engine: Callable[..., Engine]
) -> None:
    main, other = tmp_path / "main.sqlite3", tmp_path / "other.sqlite3"
    sqlite3.connect(main).execute("CREATE TABLE host_things (id INTEGER)").connection.close()
    engine = make_engine(f"sqlite:///file:{main}?mode=rwc&uri=true")

    @event.listens_for(engine, "connect")
    def attach(dbapi: sqlite3.Connection, record: object) -> None:
        dbapi.execute(f"ATTACH DATABASE '{other}' AS other")

    mapped = engine.execution_options(schema_translate_map={None: "other"})
    with pytest.raises(wp.SchemaVersionError) as behind:
        wp.Runtime(mapped)
    assert f"'sqlite:///{other}'" in behind.value.command
    procs.cli("db", "upgrade", "--url", f"sqlite:///{other}")
    assert migrate.current(mapped) == migrate.SCHEMA_HEAD
    assert sorted(p.name for p in tmp_path.iterdir() if "?" in p.name) == []


@pytest.mark.needs("sql_mode")
def test_tables_another_upgrade_is_building_are_not_taken(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """MySQL commits each DDL statement: while another session holds the migration lock, a
    table it built halfway is not called taken (a deploy racing it waits for the lock;
    a runtime opening meanwhile hears "not migrated"). Once the lock is free with nothing
    recorded, the same table is refused."""
    from wf_persist.backends.mysql import MIGRATION_LOCK

    builder = make_engine(blank_db_url)
    with builder.connect() as conn:
        assert conn.execute(text(f"SELECT GET_LOCK({MIGRATION_LOCK}, 5)")).scalar() == 1
        conn.execute(text("CREATE TABLE wf_history (execution_id VARCHAR(36), type VARCHAR(64))"))
        found = migrate.state(blank_db_url)
        assert found.taken == ()
        assert type(found.error()) is wp.SchemaVersionError
        conn.execute(text(f"SELECT RELEASE_LOCK({MIGRATION_LOCK})"))
    found = migrate.state(blank_db_url)
    assert found.taken == ("wf_history",)
    assert isinstance(found.error(), wp.SchemaNamesTakenError)


@pytest.mark.needs("sql_mode")
def test_names_taken_are_read_through_a_session_with_max_join_size(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host's max_join_size refuses even SHOW FULL TABLES: the look for taken names is
    allowed for its duration (the refusal is the typed one) and the setting put back."""
    _execute(blank_db_url, "CREATE TABLE wf_executions (id INTEGER PRIMARY KEY, junk INTEGER)")
    setting = "SET SESSION max_join_size=10"
    engine = make_engine(blank_db_url, connect_args={"init_command": setting}, pool_size=1)
    with pytest.raises(wp.SchemaNamesTakenError):
        migrate.upgrade(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT @@sql_big_selects").scalar() == 0


def test_a_revision_half_applied_by_hand_fails_typed(blank_db_url: str, backend: str) -> None:
    """A column of wf_0007 added by hand before the upgrade: PostgreSQL and SQLite fail the
    revision's ALTER, which raised the driver's raw error, and roll the revision back;
    MySQL/MariaDB revisions look at what is there first and go on."""
    migrate.upgrade(blank_db_url, "wf_0006")
    _execute(blank_db_url, "ALTER TABLE wf_executions ADD COLUMN parent_id VARCHAR(36)")
    try:
        migrate.upgrade(blank_db_url)
    except wp.UnsupportedDatabaseError as exc:
        assert backend != "mysql"
        assert "parent_id" in str(exc) and "changed by hand" in str(exc), str(exc)
        assert migrate.current(blank_db_url) == "wf_0006"
    else:
        assert backend == "mysql"
        assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def test_a_revision_meeting_a_column_dropped_by_hand_says_so(
    blank_db_url: str, backend: str
) -> None:
    """A column a later revision indexes, dropped by hand: the failure names the statement
    and the tables changed by hand, not "wf-persist db upgrade brings it to head" (what a
    missing column means to a running process), printed by that very command. (wf_0009's
    index is PostgreSQL's: elsewhere the upgrade goes through.)"""
    migrate.upgrade(blank_db_url, "wf_0008")
    _execute(blank_db_url, "ALTER TABLE wf_executions DROP COLUMN lease_owner")
    try:
        migrate.upgrade(blank_db_url)
    except wp.UnsupportedDatabaseError as exc:
        assert backend == "postgresql"
        assert "lease_owner" in str(exc) and "changed by hand" in str(exc), str(exc)
        assert "db upgrade" not in str(exc)
    else:
        assert backend != "postgresql"


def test_a_schema_taken_down_under_an_open_client_fails_its_calls_typed(
    blank_db_url: str,
) -> None:
    """An operator's downgrade under a live client: every call says the tables are not
    where it looks. On SQLite an INSERT naming a column the table lacks ("table ... has no
    column named ...") raised the driver's raw error from ``start``."""
    migrate.upgrade(blank_db_url)
    with wp.Runtime(blank_db_url) as rt:
        rt.register(w.echo_wf)
        run = rt.client().start(w.echo_wf, 1).execution_id
    with wp.Client(blank_db_url) as client:
        assert client.status(run) == "running"
        migrate.downgrade(blank_db_url, "wf_0006")
        calls: tuple[Callable[[], object], ...] = (
            lambda: client.status(run),
            lambda: client.start("echo", 2),
            lambda: client.start("echo", 3, idempotency_key="k"),
        )
        for call in calls:
            with pytest.raises(wp.UnsupportedDatabaseError, match="not where"):
                call()
