"""Flat at any number of runs: every statement the everyday operations run reads wf_executions
and wf_history through an index, never a whole table.

The database holds a few thousand finished runs (with their history) and a few unfinished
ones; each operation runs through the public API while :class:`Recorder` takes down every
statement the runtime's engine sent, with its values, whatever path it took (SQLAlchemy, or
the raw driver fast paths); each statement that touches a run table is then explained on the
same database and the plan checked per backend:

* PostgreSQL (analyzed, as autovacuum leaves a table): no ``Seq Scan`` on a run table;
* SQLite (no ``ANALYZE``: nothing runs one for an embedded database): no ``SCAN`` of a run
  table that is not through an index;
* MySQL/MariaDB (analyzed: InnoDB keeps persistent statistics): no access of type ``ALL``.

The catalog (``wf_workflows``, one row per workflow version) is left out: it does not grow
with runs.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, insert, text

import wf_persist as wp
from wf_persist.backends import pg_wire
from wf_persist.models import executions_table, history_table
from wf_persist.records import encode_cursor

from .fixtures import workflows as w

FINISHED = 3000
RUN_TABLES = re.compile(r"\bwf_(executions|history)\b")
#: Statements that read nothing of a run table whatever their text says.
SKIPPED = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SET|SHOW|PRAGMA)\b", re.I)
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _run_id(i: int) -> str:
    return f"{i:08x}-0000-4000-8000-{i:012x}"


# recording and explaining, per backend -------------------------------------------------


class Recorder:
    """Every statement (and its values) sent on connections of ``engine`` while recording."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sent: list[tuple[str, Any]] = []
        self.on = False

    def record(self, sql: str, params: Any = None) -> None:
        if self.on and RUN_TABLES.search(sql) and not SKIPPED.match(sql):
            self.sent.append((sql, params))

    def take(self) -> list[tuple[str, Any]]:
        found, self.sent = self.sent, []
        return found


class Backend:
    """How statements are recorded and explained on one database, and what a bad plan is."""

    def install(self, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
        raise NotImplementedError

    def analyze(self, engine: Engine) -> None:
        """Statistics as the database has them in service."""

    def plan(self, engine: Engine, sql: str, params: Any) -> list[str]:
        """The plan of ``sql`` with ``params``, one line per step."""
        raise NotImplementedError

    def bad(self, plan: list[str]) -> list[str]:
        """The plan lines reading a run table without an index (empty: index access only)."""
        raise NotImplementedError


class SQLite(Backend):
    def install(self, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
        @event.listens_for(recorder.engine, "checkout")
        def _trace(raw: Any, _record: Any, _proxy: Any) -> None:
            raw.set_trace_callback(recorder.record)  # SQLite's own text, values expanded

    def plan(self, engine: Engine, sql: str, params: Any) -> list[str]:
        path = engine.url.database
        assert path is not None
        raw = sqlite3.connect(path)
        try:
            return [str(r[3]) for r in raw.execute("EXPLAIN QUERY PLAN " + sql).fetchall()]
        finally:
            raw.close()

    def bad(self, plan: list[str]) -> list[str]:
        return [
            line
            for line in plan
            if re.match(r"SCAN (wf_executions|wf_history)\b", line) and " INDEX " not in line
        ]


class PostgreSQL(Backend):
    def install(self, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
        sent_by_libpq = pg_wire.execute  # statements on an idle connection skip the cursor

        def recording(raw: Any, info: Any, sql: str, params: Any) -> Any:
            recorder.record(sql, params)
            return sent_by_libpq(raw, info, sql, params)

        monkeypatch.setattr(pg_wire, "execute", recording)

        class Recording(psycopg.Cursor[Any]):
            def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
                recorder.record(str(query), params)
                return super().execute(query, params, **kw)

        @event.listens_for(recorder.engine, "checkout")
        def _factory(raw: Any, _record: Any, _proxy: Any) -> None:
            raw.cursor_factory = Recording

    def analyze(self, engine: Engine) -> None:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE wf_executions"))
            conn.execute(text("ANALYZE wf_history"))
            conn.commit()

    def plan(self, engine: Engine, sql: str, params: Any) -> list[str]:
        raw = engine.raw_connection()
        try:
            cursor = raw.driver_connection.cursor()  # type: ignore[union-attr]
            cursor.execute("EXPLAIN " + sql, params)
            lines = [str(r[0]) for r in cursor.fetchall()]
            raw.rollback()
        finally:
            raw.close()
        return lines

    def bad(self, plan: list[str]) -> list[str]:
        return [line for line in plan if re.search(r"Seq Scan on wf_(executions|history)", line)]


class MySQL(Backend):
    def install(self, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
        @event.listens_for(recorder.engine, "after_cursor_execute")
        def _executed(conn: Any, cursor: Any, *_args: Any) -> None:
            executed = cursor._executed  # PyMySQL's text, values in place
            recorder.record(
                executed.decode() if isinstance(executed, bytes | bytearray) else executed
            )

    def analyze(self, engine: Engine) -> None:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE TABLE wf_executions, wf_history")).all()

    def plan(self, engine: Engine, sql: str, params: Any) -> list[str]:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("EXPLAIN " + sql.replace("%", "%%")).mappings().all()
            conn.rollback()
        return [json.dumps(dict(r), default=str) for r in rows]

    def bad(self, plan: list[str]) -> list[str]:
        return [
            line
            for line in plan
            # An INSERT's own row is no read (its type says ALL).
            if RUN_TABLES.fullmatch(str(json.loads(line)["table"]))
            and json.loads(line)["select_type"] != "INSERT"
            and json.loads(line)["type"] == "ALL"
        ]


BACKENDS: dict[str, Backend] = {"sqlite": SQLite(), "postgresql": PostgreSQL(), "mysql": MySQL()}


# the database ------------------------------------------------------------------------


def _load(engine: Engine) -> None:
    """FINISHED finished runs of ``echo``, four history events each, one per millisecond."""
    runs, events = [], []
    for i in range(1, FINISHED + 1):
        at = T0 + dt.timedelta(milliseconds=i)
        run_id = _run_id(i)
        runs.append(
            {
                "id": run_id,
                "workflow_name": w.echo_wf.name,
                "workflow_version": 1,
                "status": "completed" if i % 10 else "failed",
                "input": 1,
                "result": [1],
                "idempotency_key": f"k{i}",
                "next_seq": 5,
                "claim_epoch": 1,
                "drive_failures": 0,
                "created_at": at,
                "started_at": at,
                "finished_at": at,
                "updated_at": at,
            }
        )
        for seq, kind in enumerate(
            ("execution.started", "workflow.started", "step.completed", "workflow.completed"), 1
        ):
            events.append(
                {
                    "execution_id": run_id,
                    "sequence": seq,
                    "type": kind,
                    "activity_name": "echo#1" if seq == 3 else None,
                    "dedupe_key": kind if seq == 2 else None,
                    "created_at": at,
                    "event": {"type": kind, "executionId": run_id},
                }
            )
    with engine.begin() as conn:
        conn.execute(insert(executions_table), runs)
        conn.execute(insert(history_table), events)


@pytest.fixture
def loaded(
    backend: str, make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[wp.Runtime, Backend, Recorder]]:
    rt = make_runtime()
    rt.register(w.echo_wf, w.two_approvals_wf)
    engine = rt.backend.base_engine
    _load(engine)
    # Unfinished runs besides: one parked on a signal, one on a timer far ahead.
    client = rt.client()
    waiting = client.start(w.two_approvals_wf).execution_id
    rt.drive(waiting)
    assert client.status(waiting) == "suspended"
    planner = BACKENDS[backend]
    planner.analyze(engine)
    recorder = Recorder(engine)
    planner.install(recorder, monkeypatch)
    yield rt, planner, recorder


def test_everyday_operations_read_run_tables_through_indexes(
    loaded: tuple[wp.Runtime, Backend, Recorder],
) -> None:
    rt, planner, recorder = loaded
    client = rt.client()
    deep = encode_cursor(T0 + dt.timedelta(milliseconds=FINISHED - 100), _run_id(FINISHED - 100))
    some = _run_id(FINISHED // 2)
    waiting = client.list(w.two_approvals_wf, status="suspended").items[0].execution_id
    approve = {"approved": True}

    def claim_nothing_due() -> None:  # an idle worker's look
        rt.wakeups()  # its listener: where the database has presence locks, reap() reaps
        assert rt.claim_due(4) == []
        rt.seconds_to_next_wake()
        rt.reap()

    def claim_one_due() -> None:
        handle = client.start(w.echo_wf, 2)
        claims = rt.claim_due(4)
        assert [c.execution_id for c in claims] == [handle.execution_id]
        rt.drive_claim(claims[0])

    def get_event() -> None:
        with pytest.raises(wp.EventNotSetError):
            client.get_event(some, "progress", timeout=0)

    operations: dict[str, Callable[[], object]] = {
        "claim, nothing due": claim_nothing_due,
        "claim, one due (and its drive)": claim_one_due,
        "list, first page": lambda: client.list(w.echo_wf, limit=50),
        "list, deep page": lambda: client.list(w.echo_wf, limit=50, cursor=deep),
        "list, every workflow, deep page": lambda: client.list(limit=50, cursor=deep),
        "list, by status, deep page": lambda: client.list(
            w.echo_wf, status="completed", limit=50, cursor=deep
        ),
        "status": lambda: client.status(some),
        "start": lambda: client.start(w.echo_wf, 3, idempotency_key="new"),
        "start, key taken": lambda: client.start(w.echo_wf, 3, idempotency_key="k7"),
        "signal": lambda: client.signal(waiting, "approval", approve),
        "pending signals": lambda: client.pending_signals(waiting),
        "history": lambda: client.history(some),
        "get event": get_event,
        "events": lambda: client.events(some),
    }
    engine = rt.backend.base_engine
    problems: list[str] = []
    explained = 0
    for name, operation in operations.items():
        recorder.on = True
        try:
            operation()
        finally:
            recorder.on = False
        sent = recorder.take()
        assert sent, f"{name}: no statement recorded"
        for sql, params in sent:
            explained += 1
            for line in planner.bad(planner.plan(engine, sql, params)):
                problems.append(f"{name}: {line}\n    in {' '.join(sql.split())[:400]}")
    assert not problems, "\n".join(problems)
    assert explained >= len(operations)
