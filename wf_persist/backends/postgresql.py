"""PostgreSQL (psycopg 3): production, many workers on many machines.

A driver's write is ONE statement: ``WITH bump AS (UPDATE ... WHERE id = $1 AND claim_epoch =
$2 RETURNING next_seq, status) INSERT INTO wf_history SELECT ... FROM bump``, sent in
autocommit: one round trip and one WAL flush per step, and atomic on its own. Claims skip
rows other workers are claiming (``FOR UPDATE SKIP LOCKED``). wf_persist's transactions run
at READ COMMITTED whatever the host engine's default, because its compare-and-sets rely on
an UPDATE re-checking its WHERE against the newest row version (REPEATABLE READ would raise
serialization failures instead).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

from sqlalchemy import (
    Connection,
    Engine,
    String,
    bindparam,
    func,
    insert,
    literal_column,
    select,
    text,
    tuple_,
    union_all,
)
from sqlalchemy.dialects import postgresql

from ..errors import LeaseLostError
from ..events import NewEvent
from ..models import UTC_DATETIME, JSONDoc
from ..models import executions_table as ex
from ..models import history_table as hist
from .base import HOT_COLUMNS, Backend, Fenced, WriteShape, bump
from .slots import SessionLockSlots

#: Key of the advisory lock that serializes concurrent migrations.
MIGRATION_LOCK_KEY: Final = 0x77665F70657273  # "wf_pers"
_JSON_COLUMNS = frozenset({"event", "result", "error", "input"})


class AdvisorySlots(SessionLockSlots):
    def try_lock(self, conn: Connection, k1: int, slot: int) -> bool:
        return bool(conn.execute(select(func.pg_try_advisory_lock(k1, slot))).scalar())

    def unlock(self, conn: Connection, k1: int, slot: int) -> None:
        conn.execute(select(func.pg_advisory_unlock(k1, slot)))


class PostgreSQLBackend(Backend):
    names: ClassVar[tuple[str, ...]] = ("postgresql",)
    extra: ClassVar[str | None] = "postgresql"
    insert_ignoring: ClassVar[Any] = staticmethod(postgresql.insert)
    supports_schemas: ClassVar[bool] = True
    skip_locked: ClassVar[bool] = True

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        super().__init__(engine, owned=owned, schema=schema)
        self.slots = AdvisorySlots(self.engine)
        self._sql: dict[WriteShape, str] = {}
        # The one-statement write runs in autocommit, at the sessions' default isolation
        # (the host's connect options or the database's setting may raise it): above READ
        # COMMITTED its compare-and-set fails on any concurrent update of the run instead of
        # re-checking it, so it is used only where that default is READ COMMITTED.
        with engine.connect() as conn:
            default = conn.exec_driver_sql("SHOW default_transaction_isolation").scalar()
        self.autocommit_writes = default == "read committed"

    def view_options(self) -> dict[str, Any]:
        return {**super().view_options(), "isolation_level": "READ COMMITTED"}

    def requirement_problem(self, version: tuple[int, ...] | None) -> str | None:
        if version is not None and version < (12,):
            return "PostgreSQL >= 12 is needed; found " + ".".join(str(p) for p in version)
        return None

    def keyset_after(self, created_at: dt.datetime, execution_id: str) -> Any:
        # A row comparison is one index range condition.
        return tuple_(ex.c.created_at, ex.c.id) > tuple_(created_at, execution_id)

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        # Wait for a concurrent upgrade, but not forever: fail closed, never go on unlocked.
        conn.execute(text("SET LOCAL lock_timeout = '300s'"))
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})

    @classmethod
    def offline_lock_sql(cls) -> str | None:
        return f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"

    # the hot path ------------------------------------------------------------------

    def _statement(self, shape: WriteShape) -> str:
        found = self._sql.get(shape)
        if found is None:
            top = bump(shape).returning(ex.c.next_seq.label("top"), ex.c.status).cte("bump")
            selects = [
                select(
                    bindparam("p_eid", type_=String(36)),
                    (top.c.top - literal_column(str(shape.n - i))).label("sequence"),
                    bindparam(f"type{i}", type_=String(64)),
                    bindparam(f"act{i}", type_=String(255)),
                    bindparam(f"dk{i}", type_=String(255)),
                    bindparam(f"at{i}", type_=UTC_DATETIME),
                    bindparam(f"ev{i}", type_=JSONDoc),
                ).select_from(top)
                for i in range(shape.n)
            ]
            source = selects[0] if shape.n == 1 else union_all(*selects)
            stmt = (
                insert(hist)
                .from_select(list(HOT_COLUMNS), source)
                .add_cte(top)
                .returning(hist.c.sequence, select(top.c.status).scalar_subquery())
            )
            schema_map = self.schema_map
            translate: dict[str, Any] = (
                {"schema_translate_map": schema_map, "render_schema_translate": True}
                if schema_map
                else {}
            )
            compiled = stmt.compile(dialect=self.base_engine.dialect, **translate)
            found = str(compiled)
            self._sql[shape] = found
        return found

    def write(
        self,
        conn: Connection,
        execution_id: str,
        epoch: int,
        events: Sequence[NewEvent],
        *,
        now: dt.datetime,
        values: Mapping[str, Any] | None = None,
        guard: tuple[str, ...] | None = None,
    ) -> Fenced:
        """The one-statement write, straight to psycopg in autocommit with SQL rendered
        once by SQLAlchemy (psycopg prepares it server-side after a few runs)."""
        if not events or conn.in_transaction() or not self.autocommit_writes:
            return super().write(
                conn, execution_id, epoch, events, now=now, values=values, guard=guard
            )
        n = len(events)
        shape = WriteShape(n, tuple(sorted(values or ())), guard)
        sql = self._statement(shape)
        params: dict[str, Any] = {"p_eid": execution_id, "p_epoch": epoch, "p_now": now}
        for column, value in (values or {}).items():
            params[f"v_{column}"] = (
                json.dumps(value) if column in _JSON_COLUMNS and value is not None else value
            )
        for i, ev in enumerate(events):
            params[f"type{i}"] = ev.type
            params[f"act{i}"] = ev.activity_name
            params[f"dk{i}"] = ev.dedupe_key
            params[f"at{i}"] = ev.created_at
            params[f"ev{i}"] = json.dumps(ev.event)
        raw: Any = conn.connection.driver_connection
        cursor = None
        try:
            raw.autocommit = True
            try:
                with raw.cursor() as cursor:
                    cursor.execute(sql, params)
                    rows = cursor.fetchall()
            finally:
                if not raw.closed:
                    raw.autocommit = False
        except Exception as exc:
            raise self.raw_failure(conn, exc, sql, cursor) from exc
        if len(rows) != n:
            raise LeaseLostError(execution_id)
        return Fenced(sorted(int(r[0]) for r in rows), str(rows[0][1]))
