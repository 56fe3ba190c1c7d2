"""Names and keys that differ only by trailing spaces are distinct on every backend.

MySQL/MariaDB's ``utf8mb4_bin`` pads (``'k' = 'k '``): a start with key ``'k '`` returned the
run of ``'k'``, workflow ``'pay '`` conflicted with ``'pay'`` and an actor filter matched
padded actors. wf_0010 moved those columns to a NO PAD binary collation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, delete, insert, inspect, select, text
from sqlalchemy.exc import IntegrityError

import wf_persist as wp
from wf_persist import migrate
from wf_persist.models import (
    MARIADB_KEY_COLLATION,
    MYSQL_KEY_COLLATION,
    executions_table,
    history_table,
    workflows_table,
)

from .conftest import has
from .helpers import drive_until_parked

#: Every name and key column, by table.
KEY_COLUMNS = {
    "wf_workflows": {"name"},
    "wf_executions": {"workflow_name", "idempotency_key", "actor"},
    "wf_history": {"type", "activity_name", "dedupe_key"},
}
FK_COLUMNS = (["workflow_name", "workflow_version"], "wf_workflows", ["name", "version"])


@wp.workflow(name="pay", version=1)
def pay_wf(ctx: wp.Context, n: int) -> int:
    return n


@wp.workflow(name="pay ", version=1)
def padded_pay_wf(ctx: wp.Context, n: int) -> int:
    return -n


@wp.workflow(name="nopad-wait", version=1)
def wait_wf(ctx: wp.Context, n: int) -> int:
    got = ctx.wait_for_signal("go", int)
    assert not isinstance(got, wp.TimedOut)
    return got.value + n


def test_idempotency_keys_differing_by_trailing_spaces_start_different_runs(
    runtime: wp.Runtime, client: wp.WorkflowClient
) -> None:
    runtime.register(pay_wf)
    first = client.start(pay_wf, 1, idempotency_key="k")
    second = client.start(pay_wf, 2, idempotency_key="k ")
    assert (first.created, second.created) == (True, True)
    assert first.execution_id != second.execution_id
    again = client.start(pay_wf, 3, idempotency_key="k ")
    assert (again.execution_id, again.created) == (second.execution_id, False)
    assert client.result(first.execution_id, timeout=20).unwrap() == 1
    assert client.result(second.execution_id, timeout=20).unwrap() == 2


def test_workflow_names_differing_by_trailing_spaces_are_different_workflows(
    runtime: wp.Runtime, client: wp.WorkflowClient
) -> None:
    runtime.register(pay_wf, padded_pay_wf)
    assert sorted(e.name for e in client.workflows()) == ["pay", "pay "]
    assert [e.name for e in client.workflows("pay ")] == ["pay "]
    plain = client.start("pay", 5).execution_id
    padded = client.start("pay ", 5).execution_id
    assert client.result(plain, timeout=20).unwrap() == 5
    assert client.result(padded, timeout=20).unwrap() == -5
    assert [r.execution_id for r in client.list("pay").items] == [plain]
    assert [r.execution_id for r in client.list("pay ").items] == [padded]


def test_actor_filter_matches_exactly(runtime: wp.Runtime, client: wp.WorkflowClient) -> None:
    runtime.register(pay_wf)
    kim = client.start(pay_wf, 1, actor="kim").execution_id
    padded = client.start(pay_wf, 2, actor="kim ").execution_id
    assert [r.execution_id for r in client.list(actor="kim").items] == [kim]
    assert [r.execution_id for r in client.list(actor="kim ").items] == [padded]
    assert client.list(actor="kim  ").items == []


def test_a_signal_name_with_a_trailing_space_is_another_signal(
    runtime: wp.Runtime, client: wp.WorkflowClient
) -> None:
    runtime.register(wait_wf)
    run = client.start(wait_wf, 1).execution_id
    drive_until_parked(client, run)
    with pytest.raises(wp.SignalNotWaitingError):
        client.signal(run, "go ", 1)
    assert client.signal(run, "go", 41) == "delivered"
    assert client.result(run, timeout=20).unwrap() == 42


@pytest.mark.parametrize(
    ("url", "collation"),
    [
        # Either server may sit behind a mysql:// URL: each runs its own executable comment.
        (
            "mysql://u@nowhere.invalid:1/app",
            f"/*M!100200 {MARIADB_KEY_COLLATION} */ /*!80017 {MYSQL_KEY_COLLATION} */",
        ),
        ("mariadb://u@nowhere.invalid:1/app", MARIADB_KEY_COLLATION),
    ],
)
def test_offline_sql_recollates_every_key_column(url: str, collation: str) -> None:
    """``--sql`` (no server to ask) names the collation of the URL's kind (for ``mysql://``
    both servers', each in a comment only it runs), and wf_0010 moves every name and key
    column to it around the catalog's foreign key."""
    script = migrate.upgrade(url, sql=True)
    assert script is not None
    recollate = script[script.index("Running upgrade wf_0009 -> wf_0010") :]
    for table, columns in KEY_COLUMNS.items():
        altered = re.search(rf"ALTER TABLE {table} (MODIFY [^;]*);", recollate)
        assert altered is not None, table
        for column in columns:
            assert re.search(
                rf"MODIFY {column} VARCHAR\(\d+\) [^,]*COLLATE {re.escape(collation)}", altered[1]
            )
    assert "utf8mb4_bin" not in recollate
    dropped = recollate.index("DROP FOREIGN KEY")
    assert dropped < recollate.index("ALTER TABLE wf_workflows")
    assert recollate.index("ALTER TABLE wf_workflows") < recollate.index("ADD CONSTRAINT")


def _collations(conn: Any) -> dict[tuple[str, str], str]:
    rows = conn.execute(
        text(
            "SELECT table_name, column_name, collation_name FROM information_schema.columns"
            " WHERE table_schema = DATABASE() AND table_name IN"
            " ('wf_workflows', 'wf_executions', 'wf_history')"
        )
    )
    return {(str(t), str(c)): str(k) for t, c, k in rows if str(c) in KEY_COLUMNS[str(t)]}


def _catalog_key(conn: Any) -> list[Any]:
    """The runs' foreign keys to the catalog, as the database reports them."""
    return [
        (fk["constrained_columns"], fk["referred_table"], fk["referred_columns"])
        for fk in inspect(conn).get_foreign_keys("wf_executions")
        if fk["referred_table"] == "wf_workflows"
    ]


def _snapshot(conn: Any) -> list[list[Any]]:
    return [
        conn.execute(select(table).order_by(*table.primary_key.columns)).all()
        for table in (workflows_table, executions_table, history_table)
    ]


def _run(run_id: str, workflow: str, key: str | None, actor: str | None, now: Any) -> Any:
    return {
        "id": run_id,
        "workflow_name": workflow,
        "workflow_version": 1,
        "status": "running",
        "idempotency_key": key,
        "actor": actor,
        "next_seq": 2,
        "created_at": now,
        "updated_at": now,
    }


def _event(run_id: str, sequence: int, dedupe: str | None, now: Any) -> Any:
    return {
        "execution_id": run_id,
        "sequence": sequence,
        "type": "signal.delivered",
        "activity_name": "go",
        "dedupe_key": dedupe,
        "created_at": now,
        "event": {"type": "signal.delivered"},
    }


def _padded_rows(conn: Any, now: Any) -> None:
    """Rows that differ from the seeded ones only by a trailing space, in every unique key."""
    conn.execute(
        insert(workflows_table),
        {"name": "pay ", "version": 1, "source_hash": "y" * 64, "registered_at": now},
    )
    conn.execute(insert(executions_table), _run("run-padded", "pay", "k ", "kim ", now))
    conn.execute(insert(history_table), _event("run-1", 2, "d ", now))


def test_upgrade_to_nopad_keys_keeps_rows_and_foreign_keys(
    blank_db_url: str, backend: str, make_engine: Callable[..., Engine]
) -> None:
    """wf_0009 -> head with a catalog, runs and history: every row and both foreign keys are
    kept; on MySQL/MariaDB every name and key column is NO PAD binary afterwards, so values
    that differ by a trailing space go in as distinct keys; downgrade refuses while such
    values would collide, then returns to utf8mb4_bin once they are gone."""
    migrate.upgrade(blank_db_url, "wf_0009")
    now = datetime.now(UTC)
    engine = make_engine(blank_db_url)
    with engine.connect() as conn:
        mariadb = getattr(conn.dialect, "is_mariadb", False)
    nopad = MARIADB_KEY_COLLATION if mariadb else MYSQL_KEY_COLLATION
    with engine.begin() as conn:
        conn.execute(
            insert(workflows_table),
            {"name": "pay", "version": 1, "source_hash": "x" * 64, "registered_at": now},
        )
        conn.execute(
            insert(executions_table),
            [_run("run-1", "pay", "k", "kim", now), _run("run-2", "pay", None, None, now)],
        )
        conn.execute(insert(history_table), [_event("run-1", 1, "d", now)])
        before = _snapshot(conn)
        if backend == "mysql":
            assert set(_collations(conn).values()) == {"utf8mb4_bin"}
            # The bug: under PAD SPACE 'k ' is 'k', so the second key collides.
            with pytest.raises(IntegrityError), conn.begin_nested():
                conn.execute(insert(executions_table), _run("run-x", "pay", "k ", None, now))

    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
    with engine.begin() as conn:
        assert _snapshot(conn) == before
        assert _catalog_key(conn) == [FK_COLUMNS]
        if backend == "mysql":
            found = _collations(conn)
            assert set(found) == {(t, c) for t, cs in KEY_COLUMNS.items() for c in cs}
            assert set(found.values()) == {nopad}
        _padded_rows(conn, now)
        if has(backend, "server"):  # the re-created key still refuses an uncataloged run
            with pytest.raises(IntegrityError), conn.begin_nested():
                conn.execute(insert(executions_table), _run("run-y", "pay  ", None, None, now))
    with wp.Runtime(blank_db_url, auto_migrate=False) as rt:
        client = rt.client()
        assert [r.execution_id for r in client.list(actor="kim ").items] == ["run-padded"]
        assert sorted(e.name for e in client.workflows()) == ["pay", "pay "]

    if backend == "mysql":
        with pytest.raises(wp.UnsupportedDatabaseError, match="differ only by trailing spaces"):
            migrate.downgrade(blank_db_url, "wf_0009")
        # The revisions after wf_0010 (no-ops here) went down; wf_0010 itself refused.
        assert migrate.current(blank_db_url) == "wf_0010"
        with engine.connect() as conn:
            assert set(_collations(conn).values()) == {nopad}, "nothing was changed"
            assert _catalog_key(conn) == [FK_COLUMNS]
    with engine.begin() as conn:
        conn.execute(delete(history_table).where(history_table.c.dedupe_key == "d "))
        conn.execute(delete(executions_table).where(executions_table.c.id == "run-padded"))
        conn.execute(delete(workflows_table).where(workflows_table.c.source_hash == "y" * 64))
    migrate.downgrade(blank_db_url, "wf_0009")
    assert migrate.current(blank_db_url) == "wf_0009"
    with engine.connect() as conn:
        assert _snapshot(conn) == before
        assert _catalog_key(conn) == [FK_COLUMNS]
        if backend == "mysql":
            assert set(_collations(conn).values()) == {"utf8mb4_bin"}
    engine.dispose()
    migrate.upgrade(blank_db_url)
    assert migrate.current(blank_db_url) == migrate.SCHEMA_HEAD
