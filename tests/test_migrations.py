"""Migrations are the only way the schema is made; they match the models on every backend."""

from __future__ import annotations

import ast
import re
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from wf_persist import migrate
from wf_persist.models import ONLY_ON, executions_table

from .conftest import has, server_url
from .fixtures import workflows as w
from .fixtures.revisions import below_head, cli_env, future_revision, wf_cli
from .helpers import Processes

ROOT = Path(__file__).resolve().parent.parent
WF_TABLES = {"wf_workflows", "wf_executions", "wf_history"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_single_head_matching_the_code() -> None:
    assert list(migrate.heads()) == [migrate.SCHEMA_HEAD]


def test_revision_files_are_well_formed() -> None:
    files = sorted((ROOT / "alembic" / "versions").glob("*.py"))
    assert files
    roots = 0
    for path in files:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree) and "Why" in ast.get_docstring(tree), path  # type: ignore[operator]
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"upgrade", "downgrade"} <= names, path
        assigns: dict[str, ast.expr] = {
            n.target.id: n.value
            for n in tree.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value
        }
        revision = ast.literal_eval(assigns["revision"])
        assert revision.startswith("wf_") and revision in path.name
        assert "wf_persist" not in {
            node.names[0].name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and node.names
        } - {"alembic"}
        if ast.literal_eval(assigns["down_revision"]) is None:
            roots += 1
            assert ast.literal_eval(assigns["branch_labels"]) == ("wf_persist",)
    assert roots == 1


def test_upgrade_matches_models_and_uses_own_version_table(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    assert migrate.current(blank_db_url) is None
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    tables = _tables(blank_db_url)
    assert WF_TABLES | {migrate.VERSION_TABLE} <= tables
    assert "alembic_version" not in tables
    with make_engine(blank_db_url).connect() as conn:
        diff = models_diff(conn)
        predicates = _index_predicates(conn)
    assert diff == []
    expected = _model_predicates(conn.dialect.name)
    assert {name: predicates.get(name, "missing") for name in expected} == expected


def models_diff(conn: Any) -> list[Any]:
    """What Alembic's autogenerate finds between the wf_ tables and the models."""
    ctx = MigrationContext.configure(
        conn,
        opts={
            "include_name": migrate.include_name,
            "include_object": migrate.include_object_on(conn.dialect.name),
            "compare_type": True,
        },
    )
    return list(compare_metadata(ctx, wp.metadata))


def _literals(predicate: object) -> frozenset[str] | None:
    """The quoted values of a partial index's predicate (each backend spells the rest its
    own way), or None for a full index."""
    if predicate is None:
        return None
    return frozenset(re.findall(r"'([^']*)'", str(predicate)))


def _index_predicates(conn: Any) -> dict[str, frozenset[str] | None]:
    """Per index of the wf_ tables, as the database reports it: what compare_metadata does
    not look at (a migration that made an index full or partial against the models)."""
    found: dict[str, frozenset[str] | None] = {}
    inspector = inspect(conn)
    for table in sorted(WF_TABLES):
        for index in inspector.get_indexes(table):
            options = index.get("dialect_options", {})
            where = options.get(f"{conn.dialect.name}_where")
            found[str(index["name"])] = _literals(where)
    return found


def _model_predicates(dialect: str) -> dict[str, frozenset[str] | None]:
    return {
        str(index.name): _literals(index.dialect_options[dialect].get("where"))
        if dialect in ("postgresql", "sqlite")
        else None
        for table in wp.metadata.sorted_tables
        if table.name in WF_TABLES
        for index in table.indexes
        if index.info.get(ONLY_ON, dialect) == dialect
    }


def test_downgrade_to_base_and_up_again_with_rows_present(blank_db_url: str) -> None:
    migrate.upgrade(blank_db_url)
    with wp.Runtime(blank_db_url) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        done = client.start(w.echo_wf, 2)
        client.result(done.execution_id)
        client.start(w.echo_wf, 2)
    migrate.downgrade(blank_db_url, "base")
    assert not (WF_TABLES & _tables(blank_db_url))
    assert migrate.current(blank_db_url) is None
    migrate.upgrade(blank_db_url)
    with wp.Runtime(blank_db_url) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        again = client.start(w.echo_wf, 3)
        assert client.result(again.execution_id).unwrap() == [1, 2, 3]


def test_unmigrated_database_error_names_the_command(blank_db_url: str, backend: str) -> None:
    with pytest.raises(wp.SchemaVersionError) as info:
        wp.Runtime(blank_db_url, auto_migrate=False)
    assert info.value.current is None and info.value.head == migrate.SCHEMA_HEAD
    assert "wf-persist db upgrade --url" in str(info.value)
    assert "not migrated" in str(info.value)
    if has(backend, "server"):  # only an embedded database migrates itself implicitly
        with pytest.raises(wp.SchemaVersionError):
            wp.Runtime(blank_db_url)
        assert not (WF_TABLES & _tables(blank_db_url))
    else:
        assert not (WF_TABLES & _tables(blank_db_url))
        wp.Runtime(blank_db_url).close()
        assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def test_outdated_database_error_reports_the_revision(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    migrate.upgrade(blank_db_url)
    migrate.downgrade(blank_db_url, below_head())
    with pytest.raises(wp.SchemaVersionError) as info:
        wp.Runtime(blank_db_url, auto_migrate=False)
    assert type(info.value) is wp.SchemaVersionError
    assert info.value.current == below_head()
    assert f"is at revision {below_head()}" in str(info.value)
    assert "wf-persist db upgrade --url" in info.value.command


def _record(url: str, table: str, revision: str) -> None:
    """Overwrite the recorded revision, as another wf_persist would have left it."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_database_newer_than_the_code(blank_db_url: str) -> None:
    migrate.upgrade(blank_db_url)
    future = future_revision()
    _record(blank_db_url, migrate.VERSION_TABLE, future)
    for attempt in (
        lambda: wp.Runtime(blank_db_url, auto_migrate=False),
        lambda: wp.Runtime(blank_db_url, auto_migrate=True),
        lambda: migrate.upgrade(blank_db_url),  # not Alembic's "can't locate revision"
        lambda: migrate.downgrade(blank_db_url, "base"),
    ):
        with pytest.raises(wp.SchemaTooNewError) as info:
            attempt()
        assert (info.value.current, info.value.head) == (future, migrate.SCHEMA_HEAD)
        message = str(info.value)
        assert f"at {future}, this wf_persist knows up to {migrate.SCHEMA_HEAD}" in message
        assert "upgrade wf_persist" in message and "db upgrade" not in message
    assert migrate.current(blank_db_url) == future
    assert _tables(blank_db_url) >= WF_TABLES, "nothing was undone"
    out = wf_cli("db", "current", "--url", blank_db_url)
    assert (out.returncode, out.stdout.strip()) == (4, future)
    assert "upgrade wf_persist" in out.stderr


def test_a_revision_after_our_head_is_too_new(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Known to the scripts but after the head this code needs: still a newer database."""
    older = below_head()
    monkeypatch.setattr(migrate, "SCHEMA_HEAD", older)
    with pytest.raises(wp.SchemaTooNewError) as info:
        migrate.assert_at_head(db_url)
    assert (info.value.current, info.value.head) == (migrate.heads()[0], older)


def test_embedded_sqlite_default_migrates_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WF_PERSIST_DATABASE_URL", raising=False)
    with wp.Runtime() as rt:
        rt.register(w.echo_wf)
        assert rt.client().result(rt.client().start(w.echo_wf, 2).execution_id).unwrap() == [1, 2]
    assert (tmp_path / "wf_persist.sqlite3").exists()
    assert migrate.current(f"sqlite:///{tmp_path / 'wf_persist.sqlite3'}") == migrate.SCHEMA_HEAD


#: What each backend's rendered upgrade script must contain besides the tables.
OFFLINE_MARKERS = {
    "sqlite": ["CREATE TABLE wf_executions", "CREATE UNIQUE INDEX"],
    "postgresql": ["pg_advisory_xact_lock", "JSONB", "CREATE TABLE wf_executions"],
    "mysql": ["CREATE TABLE wf_executions", "utf8mb4_bin", "ENGINE=InnoDB"],
}


def test_offline_sql_for_review(backend: str, tmp_path: Path) -> None:
    """``--sql`` renders without a connection: the URL names a host that does not exist."""
    if has(backend, "embedded"):
        url = f"sqlite:///{tmp_path / 'unused.sqlite3'}"
    else:
        url = (
            make_url(server_url(backend, "db"))
            .set(host="nowhere.invalid", port=1)
            .render_as_string(False)
        )
    script = migrate.upgrade(url, sql=True)
    assert script is not None
    assert migrate.VERSION_TABLE in script
    for marker in OFFLINE_MARKERS[backend]:
        assert marker in script, marker
    down = migrate.downgrade(url, "base", sql=True)
    assert down is not None and "DROP TABLE wf_history" in down
    assert not (tmp_path / "unused.sqlite3").exists()


def test_concurrent_upgrades_are_serialized(blank_db_url: str, procs: Processes) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrate.upgrade(blank_db_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    upgrades = [
        procs.python("-m", "wf_persist.cli", "db", "upgrade", "--url", blank_db_url)
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for child in upgrades:
        procs.finish(child)
    assert errors == []
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def test_cli_upgrade_current_downgrade(blank_db_url: str, procs: Processes) -> None:
    env = {"WF_PERSIST_DATABASE_URL": blank_db_url}
    out = procs.cli("db", "current", env=env, check=False)
    assert (out.returncode, out.stdout.strip()) == (3, "none")  # behind: not migrated
    procs.cli("db", "upgrade", "--url", blank_db_url)
    assert procs.cli("db", "current", env=env).stdout.strip() == migrate.SCHEMA_HEAD
    sql = procs.cli("db", "upgrade", "--sql", env=env)
    assert "CREATE TABLE wf_workflows" in sql.stdout
    procs.cli("db", "downgrade", below_head(), env=env)
    out = procs.cli("db", "current", env=env, check=False)
    assert (out.returncode, out.stdout.strip()) == (3, below_head())
    procs.cli("db", "downgrade", "base", env=env)
    assert not (WF_TABLES & _tables(blank_db_url))
    bad = procs.cli("db", "upgrade", "--url", "nosuchdb://x", check=False)
    assert bad.returncode == 1 and "not supported" in bad.stderr


def test_cli_current_documents_its_exit_status() -> None:
    out = wf_cli("db", "current", "--help", env=cli_env(COLUMNS="200"))
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "Exit status: 0 at head; 3 behind head or never migrated; 4 migrated by a newer" in text


def test_current_never_creates_a_sqlite_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.sqlite3"
    url = f"sqlite:///{missing}"
    assert migrate.current(url) is None
    assert not missing.exists()
    engine = create_engine(url)
    found = migrate.state(engine)
    engine.dispose()
    assert found.missing and found.mode == "none"
    with pytest.raises(wp.SchemaVersionError, match="not migrated"):
        migrate.assert_at_head(url)
    with pytest.raises(wp.SchemaVersionError):
        wp.Runtime(url, auto_migrate=False)
    out = wf_cli("db", "current", "--url", "sqlite:///missing.sqlite3", cwd=tmp_path)
    assert (out.returncode, out.stdout.strip()) == (3, "none")
    assert "no database file" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_installed_wheel_migrates_from_any_directory(tmp_path: Path, procs: Processes) -> None:
    """The migrations ship inside the wheel: install it elsewhere and migrate from there."""
    wheels = tmp_path / "wheels"
    pip = (sys.executable, "-m", "pip")
    procs.run(
        [*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    )
    (wheel,) = wheels.glob("wf_persist-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    # Drivers are extras (SQLite needs none); the license travels with the wheel.
    requires = [
        line for line in metadata.decode().splitlines() if line.startswith("Requires-Dist:")
    ]
    assert "Requires-Dist: psycopg[binary]>=3.1; extra == 'postgresql'" in requires
    assert "Requires-Dist: pymysql>=1.1; extra == 'mysql'" in requires
    assert not [r for r in requires if ("psycopg" in r or "pymysql" in r) and "extra ==" not in r]
    assert "License-Expression: MIT" in metadata.decode() or "License: MIT" in metadata.decode()
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    site = tmp_path / "site"
    procs.run([*pip, "install", "--no-deps", "-q", "--target", str(site), str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import wf_persist, sys; from wf_persist import migrate;"
        "assert wf_persist.__file__.startswith(sys.argv[1]), wf_persist.__file__;"
        "assert str(migrate.script_location()).startswith(sys.argv[1]);"
        "migrate.upgrade('sqlite:///db.sqlite3'); print(migrate.current('sqlite:///db.sqlite3'))"
    )
    out = procs.run(
        [sys.executable, "-c", probe, str(site)], cwd=elsewhere, env={"PYTHONPATH": str(site)}
    )
    assert out.stdout.strip() == migrate.SCHEMA_HEAD


def test_upgrade_to_the_unfinished_claim_index_keeps_runs_and_claims(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """wf_0004 -> head on a database holding runs in every status: every row is kept as it
    was, and a claim takes exactly the due unfinished runs (expired leases among them)."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import insert, select

    from wf_persist.models import executions_table as ex

    migrate.upgrade(blank_db_url, "wf_0004")
    now = datetime.now(UTC)
    past, ahead = now - timedelta(hours=1), now + timedelta(hours=1)
    # (status, wake_at, lease_expires_at) -> whether a claim takes it
    cases = {
        "done": ("completed", None, None, False),
        "done-with-stale-wake": ("completed", past, None, False),
        "failed": ("failed", past, None, False),
        "due": ("running", past, None, True),
        "lease-lapsed": ("running", past, past, True),
        "leased": ("running", ahead, ahead, False),
        "timer-ahead": ("suspended", ahead, None, False),
        "timer-due": ("suspended", past, None, True),
        "on-signal": ("suspended", None, None, False),
        "unwinding": ("compensating", past, None, True),
    }
    engine = make_engine(blank_db_url)
    with engine.begin() as conn:
        _catalog(conn, "scaled", now)
        conn.execute(
            insert(ex),
            [
                {
                    "id": name,
                    "workflow_name": "scaled",
                    "workflow_version": 1,
                    "status": status,
                    "next_seq": 2,
                    "wake_at": wake,
                    "lease_owner": "gone" if lease else None,
                    "lease_expires_at": lease,
                    "created_at": now,
                    "updated_at": now,
                    "finished_at": now if status in ("completed", "failed") else None,
                }
                for name, (status, wake, lease, _) in cases.items()
            ],
        )
        before = conn.execute(select(*_AT_WF_0004).order_by(ex.c.id)).all()
    engine.dispose()

    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    with engine.connect() as conn:
        assert conn.execute(select(*_AT_WF_0004).order_by(ex.c.id)).all() == before
        names = {i["name"] for i in inspect(conn).get_indexes("wf_executions")}
        if conn.dialect.name == "postgresql":  # a populated table is analyzed at once
            assert _reltuples(conn, "wf_executions") == len(cases)
    assert "ix_wf_executions__status_wake_at" in names
    engine.dispose()
    with wp.Runtime(blank_db_url, auto_migrate=False) as rt:
        claims = rt.backend.claim_batch("claimer", 30.0, 100, [("scaled", 1)], [])
        assert sorted(c.execution_id for c in claims) == sorted(
            name for name, (*_, due) in cases.items() if due
        )
        assert {c.epoch for c in claims} == {1}
        assert rt.backend.claim_batch("claimer", 30.0, 100, [("scaled", 1)], []) == []
    migrate.downgrade(blank_db_url, "wf_0004")
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def _reltuples(conn: Any, table: str) -> float:
    """PostgreSQL's row count estimate of ``table``: -1 while it was never analyzed."""
    found = conn.execute(
        text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:t)"), {"t": table}
    ).scalar_one()
    return float(found)


@pytest.mark.needs("initdb")
def test_a_new_database_is_not_analyzed_while_its_tables_are_empty(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """An empty table that was analyzed is taken for a small one by the planner from then
    on, so statements prepared while a new database is tiny settle on plans that scan the
    whole table, and keep them as it grows when nothing analyzes it again (autovacuum off).
    Left never analyzed, it is assumed to be at least 10 pages, and the plans use the
    indexes from the start."""
    migrate.upgrade(blank_db_url)
    with make_engine(blank_db_url).connect() as conn:
        version = int(conn.exec_driver_sql("SHOW server_version_num").scalar_one())
        never = -1 if version >= 140000 else 0  # before 14 both read 0 (and plan alike)
        for table in ("wf_executions", "wf_history"):
            assert _reltuples(conn, table) == never, table


@pytest.mark.needs("initdb")
def test_migrations_need_no_procedural_language(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A hardened database revokes PL/pgSQL from PUBLIC: a role owning the tables migrates
    to head anyway (wf_0005 decides in Python whether the table has rows to analyze)."""
    import uuid

    role = f"wf_mig_{uuid.uuid4().hex[:8]}"
    admin = make_engine(blank_db_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        conn.exec_driver_sql("REVOKE USAGE ON LANGUAGE plpgsql FROM PUBLIC")
        conn.exec_driver_sql(f"GRANT CREATE ON SCHEMA public TO {role}")
    try:
        as_role = make_url(blank_db_url).set(username=role).render_as_string(False)
        migrate.upgrade(as_role, "wf_0004")
        migrate.upgrade(as_role)
        assert migrate.current(as_role) == migrate.SCHEMA_HEAD
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql("GRANT USAGE ON LANGUAGE plpgsql TO PUBLIC")
            conn.exec_driver_sql(f"REASSIGN OWNED BY {role} TO CURRENT_USER")
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


#: The columns of wf_executions at wf_0004 and wf_0005 (deadline_at came with wf_0006,
#: parent_id with wf_0007).
_AT_WF_0004 = [c for c in executions_table.c if c.name not in ("deadline_at", "parent_id")]


def test_upgrade_to_deadlines_and_child_links_keeps_runs_and_they_run_on(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """wf_0005 -> head with a parked run and a finished one: both kept as they were, with no
    deadline; the parked run resumes and completes (no timeout invented); downgrading drops
    the column and keeps every run."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import insert, select

    from wf_persist.models import history_table, workflows_table

    migrate.upgrade(blank_db_url, "wf_0005")
    now = datetime.now(UTC)
    engine = make_engine(blank_db_url)
    version = w.echo_wf.version
    with engine.begin() as conn:
        conn.execute(
            insert(workflows_table),
            {
                "name": "echo",
                "version": version,
                "source_hash": w.echo_wf.source_hash,
                "registered_at": now,
            },
        )
        rows = [
            {
                "id": name,
                "workflow_name": "echo",
                "workflow_version": version,
                "status": status,
                "input": 2,
                "next_seq": 2,
                "wake_at": now - timedelta(seconds=1) if status == "running" else None,
                "created_at": now,
                "updated_at": now,
                "finished_at": now if status == "completed" else None,
                "result": [1, 2] if status == "completed" else None,
            }
            for name, status in (("old-parked", "running"), ("old-done", "completed"))
        ]
        conn.execute(insert(executions_table), rows)
        conn.execute(
            insert(history_table),
            [
                {
                    "execution_id": r["id"],
                    "sequence": 1,
                    "type": "execution.started",
                    "created_at": now,
                    "event": {"type": "execution.started", "executionId": r["id"]},
                }
                for r in rows
            ],
        )
        before = conn.execute(select(*_AT_WF_0004).order_by(executions_table.c.id)).all()
    engine.dispose()

    migrate.upgrade(blank_db_url)
    with engine.connect() as conn:
        assert conn.execute(select(*_AT_WF_0004).order_by(executions_table.c.id)).all() == before
        assert set(conn.execute(select(executions_table.c.deadline_at)).scalars()) == {None}
        assert set(conn.execute(select(executions_table.c.parent_id)).scalars()) == {None}
        assert conn.execute(text("SELECT COUNT(*) FROM wf_run_tree")).scalar() == 0
    engine.dispose()
    with wp.Runtime(blank_db_url, auto_migrate=False) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.result("old-parked", timeout=30).unwrap() == [1, 2]
        assert client.describe("old-parked").deadline_at is None
        timed = client.start(w.echo_wf, 1, timeout=3600).execution_id
        assert client.describe(timed).deadline_at is not None
    with engine.begin() as conn:  # a child link, as a parent's start_child writes it
        conn.execute(
            executions_table.update()
            .where(executions_table.c.id == timed)
            .values(parent_id="old-done")
        )
        tree = conn.execute(text("SELECT parent_id, execution_id FROM wf_run_tree")).all()
        assert [tuple(r) for r in tree] == [("old-done", timed)]
    migrate.downgrade(blank_db_url, "wf_0005")
    with engine.connect() as conn:
        ids = conn.execute(select(executions_table.c.id).order_by(executions_table.c.id))
        assert sorted(ids.scalars()) == sorted(["old-done", "old-parked", timed])
        columns = {c["name"] for c in inspect(conn).get_columns("wf_executions")}
        assert not {"deadline_at", "parent_id"} & columns
    engine.dispose()
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


def test_upgrade_to_the_partial_history_type_index_keeps_history_and_finds_by_type(
    blank_db_url: str, backend: str, make_engine: Callable[..., Engine]
) -> None:
    """wf_0007 -> head with a history holding step events and others: every row is kept;
    on PostgreSQL (wf_0008) and SQLite (wf_0011) the type index leaves step events out and
    a query for another type still reads it (PostgreSQL's planner proves the predicate;
    SQLite's needs the query to repeat it); MySQL keeps the full index. Downgrading to
    wf_0007 restores the full index everywhere."""
    from datetime import UTC, datetime

    from sqlalchemy import insert, select

    from wf_persist.models import history_table

    migrate.upgrade(blank_db_url, "wf_0007")
    now = datetime.now(UTC)
    engine = make_engine(blank_db_url)
    types = ["execution.started", "step.started", "step.completed", "signal.delivered"]
    with engine.begin() as conn:
        _catalog(conn, "typed", now)
        conn.execute(
            insert(executions_table),
            {
                "id": "run-1",
                "workflow_name": "typed",
                "workflow_version": 1,
                "status": "running",
                "next_seq": len(types) + 1,
                "created_at": now,
                "updated_at": now,
            },
        )
        conn.execute(
            insert(history_table),
            [
                {
                    "execution_id": "run-1",
                    "sequence": i + 1,
                    "type": kind,
                    "created_at": now,
                    "event": {"type": kind},
                }
                for i, kind in enumerate(types)
            ],
        )
        before = conn.execute(select(history_table).order_by(history_table.c.sequence)).all()
    engine.dispose()

    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    index = "ix_wf_history__type_created_at"
    with engine.connect() as conn:
        assert (
            conn.execute(select(history_table).order_by(history_table.c.sequence)).all() == before
        )
        found = {i["name"]: i for i in inspect(conn).get_indexes("wf_history")}
        assert found[index]["column_names"] == ["type", "created_at"]
        options = found[index].get("dialect_options", {})
        where = options.get("postgresql_where", options.get("sqlite_where"))
        by_type = (
            "SELECT execution_id FROM wf_history WHERE type = 'signal.delivered' "
            "AND type NOT IN ('step.completed', 'step.started') ORDER BY created_at"
        )
        if backend == "postgresql":
            assert where is not None and "step.started" in str(where), found[index]
            conn.execute(text("SET LOCAL enable_seqscan = off"))
            plan = "\n".join(str(r[0]) for r in conn.execute(text(f"EXPLAIN {by_type}")))
            assert index in plan, plan
        elif backend == "sqlite":
            assert where is not None and "step.started" in str(where), found[index]
            plan = "\n".join(
                str(r[-1]) for r in conn.execute(text(f"EXPLAIN QUERY PLAN {by_type}"))
            )
            assert f"USING INDEX {index}" in plan, plan
        else:
            assert where is None, found[index]
        conn.rollback()
    engine.dispose()
    migrate.downgrade(blank_db_url, "wf_0007")
    with engine.connect() as conn:
        found = {i["name"]: i for i in inspect(conn).get_indexes("wf_history")}
        options = found[index].get("dialect_options", {})
        assert not options.get("postgresql_where") and not options.get("sqlite_where")
        assert len(conn.execute(select(history_table)).all()) == len(types)
    engine.dispose()
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD


@pytest.mark.needs("embedded")
def test_the_sqlite_type_index_revision_runs_again_after_an_interruption(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A host whose migration environment commits each statement (merged mode) and was
    stopped between wf_0011's DROP INDEX and its CREATE INDEX: the index is gone, the
    revision not recorded. Running it again must not fail on the missing index (else the
    database is stuck below head); nor must its downgrade."""
    index = "ix_wf_history__type_created_at"
    migrate.upgrade(blank_db_url, "wf_0010")
    engine = make_engine(blank_db_url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {index}"))
    engine.dispose()
    migrate.upgrade(blank_db_url)
    with engine.connect() as conn:
        found = {i["name"]: i for i in inspect(conn).get_indexes("wf_history")}
        assert "step.started" in str(found[index]["dialect_options"]["sqlite_where"])
        conn.execute(text(f"DROP INDEX {index}"))
        conn.commit()
    engine.dispose()
    migrate.downgrade(blank_db_url, "wf_0010")
    with engine.connect() as conn:
        found = {i["name"]: i for i in inspect(conn).get_indexes("wf_history")}
        assert found[index]["column_names"] == ["type", "created_at"]
        assert not found[index].get("dialect_options", {}).get("sqlite_where")
    engine.dispose()


def test_upgrade_to_the_lease_owner_index_keeps_runs_and_reaps_through_it(
    blank_db_url: str, backend: str, make_engine: Callable[..., Engine]
) -> None:
    """wf_0008 -> head with runs in flight: every run is kept; on PostgreSQL the partial
    lease-owner index exists and the reaper's look reads it (and still takes over the runs
    of an owner whose presence lock is free); elsewhere there is no such index. Downgrade
    drops it."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import insert, select

    from wf_persist.backends.pg_presence import REAP

    migrate.upgrade(blank_db_url, "wf_0008")
    now = datetime.now(UTC)
    engine = make_engine(blank_db_url)
    owners = ["gone:1:aaaa!", "alive:2:bbbb!", "plain:3:cccc"]
    with engine.begin() as conn:
        _catalog(conn, "leased", now)
        conn.execute(
            insert(executions_table),
            [
                {
                    "id": f"run-{i}",
                    "workflow_name": "leased",
                    "workflow_version": 1,
                    "status": "running" if owner else "completed",
                    "next_seq": 2,
                    "lease_owner": owner,
                    "lease_expires_at": now + timedelta(seconds=30) if owner else None,
                    "wake_at": now + timedelta(seconds=30) if owner else None,
                    "claim_epoch": 1,
                    "created_at": now,
                    "updated_at": now,
                }
                for i, owner in enumerate([*owners, None])
            ],
        )
        before = conn.execute(select(executions_table).order_by(executions_table.c.id)).all()
    engine.dispose()

    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    index = "ix_wf_executions__lease_owner"
    with engine.connect() as conn:
        rows = conn.execute(select(executions_table).order_by(executions_table.c.id)).all()
        assert rows == before
        found = {i["name"]: i for i in inspect(conn).get_indexes("wf_executions")}
        if backend != "postgresql":
            assert index not in found
            return
        assert found[index]["column_names"] == ["lease_owner"]
        where = str(found[index].get("dialect_options", {}).get("postgresql_where"))
        assert "lease_owner IS NOT NULL" in where and "running" in where, where
    holder = engine.connect()  # the live owner's process: it holds its presence lock
    holder.execute(text("SELECT pg_advisory_lock(hashtextextended('alive:2:bbbb!', 0))"))
    holder.commit()
    try:
        sql = REAP.format(table="wf_executions")
        with engine.connect() as conn:
            # 2,000 more runs in flight, all the live owner's: the look walks the owners (a
            # few index entries read), never every run in flight. (Taking a dead owner's runs
            # over reads its runs, by the index on a large table.)
            conn.execute(
                text(
                    "INSERT INTO wf_executions (id, workflow_name, workflow_version, status,"
                    " next_seq, lease_owner, lease_expires_at, wake_at, claim_epoch,"
                    " created_at, updated_at) SELECT 'busy-' || g, 'leased', 1, 'running', 2,"
                    " 'alive:2:bbbb!', now() + interval '30 s', now() + interval '30 s', 1,"
                    " now(), now() FROM generate_series(1, 2000) AS g"
                )
            )
            conn.commit()
            conn.execute(text("ANALYZE wf_executions"))
            conn.commit()
            # The steady state: every owner alive (the gone one's lock held for the while).
            holder.execute(text("SELECT pg_advisory_lock(hashtextextended('gone:1:aaaa!', 0))"))
            holder.commit()
            explained = conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + sql, {"me": "me:0:0000!", "grace": 0.0}
            ).scalar_one()
            conn.rollback()  # EXPLAIN ANALYZE ran the UPDATE
            holder.execute(text("SELECT pg_advisory_unlock(hashtextextended('gone:1:aaaa!', 0))"))
            holder.commit()
            assert _uses(explained[0]["Plan"], index), explained
            read = _rows_read(explained[0]["Plan"], "wf_executions")
            assert read < 20, (read, explained)
            reaped = conn.exec_driver_sql(sql, {"me": "me:0:0000!", "grace": 0.0}).all()
            conn.commit()
        # Only the owner whose lock is free, and only one that holds a presence lock at all.
        assert [r[0] for r in reaped] == ["run-0"]
    finally:
        holder.close()
        engine.dispose()
    migrate.downgrade(blank_db_url, "wf_0008")
    with engine.connect() as conn:
        assert index not in {i["name"] for i in inspect(conn).get_indexes("wf_executions")}
        assert len(conn.execute(select(executions_table)).all()) == len(owners) + 1 + 2000
    engine.dispose()
    migrate.upgrade(blank_db_url)


def _uses(node: dict[str, Any], index: str) -> bool:
    """Whether a plan (``EXPLAIN (FORMAT JSON)``) reads ``index`` anywhere."""
    return node.get("Index Name") == index or any(_uses(c, index) for c in node.get("Plans", ()))


def _rows_read(node: dict[str, Any], table: str) -> int:
    """Rows a plan (``EXPLAIN (ANALYZE, FORMAT JSON)``) read from ``table``, by any scan:
    those it kept and those its filters removed."""
    rows = 0
    if node.get("Relation Name") == table and "Scan" in str(node.get("Node Type")):
        kept = int(node["Actual Rows"]) + int(node.get("Rows Removed by Filter", 0))
        rows += kept * int(node["Actual Loops"])
    for child in node.get("Plans", ()):
        rows += _rows_read(child, table)
    return rows


def _catalog(conn: Any, name: str, now: Any) -> None:
    """Catalog version 1 of ``name`` (what the runs a test inserts by hand point at)."""
    from sqlalchemy import insert

    from wf_persist.models import workflows_table

    conn.execute(
        insert(workflows_table),
        {"name": name, "version": 1, "source_hash": "x" * 64, "registered_at": now},
    )


@pytest.mark.lacks("schemas")
def test_migrating_into_a_named_schema_is_refused_typed_where_the_backend_has_none(
    blank_db_url: str,
) -> None:
    # Migrations create the schema and set PostgreSQL's search path: elsewhere upgrade
    # raised the driver's raw syntax error. (A host engine mapping its tables elsewhere
    # still runs; that database is migrated by its own URL.)
    engine = create_engine(blank_db_url).execution_options(schema_translate_map={None: "aux"})
    try:
        calls: tuple[Callable[[], object], ...] = (
            lambda: migrate.upgrade(blank_db_url, schema="aux"),
            lambda: migrate.upgrade(blank_db_url, sql=True, schema="aux"),
            lambda: migrate.downgrade(blank_db_url, "base", schema="aux"),
            lambda: migrate.upgrade(engine),
        )
        for call in calls:
            with pytest.raises(wp.UnsupportedDatabaseError, match="needs PostgreSQL"):
                call()
    finally:
        engine.dispose()
    assert migrate.current(blank_db_url) is None


@pytest.mark.parametrize("command", ["upgrade", "downgrade"])
def test_an_unknown_revision_is_refused_before_the_database_is_touched(
    blank_db_url: str, command: str
) -> None:
    """``db upgrade wf_9999`` was refused, but only after connecting had made a SQLite file
    (in WAL mode) and Alembic an empty version table on MySQL/MariaDB."""
    with pytest.raises(wp.InvalidArgumentError, match="wf_9999"):
        getattr(migrate, command)(blank_db_url, "wf_9999")
    url = make_url(blank_db_url)
    if url.get_backend_name() == "sqlite":
        assert not Path(str(url.database)).exists()
        return
    engine = create_engine(blank_db_url)
    try:
        with engine.connect() as conn:
            assert inspect(conn).get_table_names() == []
    finally:
        engine.dispose()
