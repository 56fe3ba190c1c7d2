"""Append-only history: sequence allocation, dedupe-keyed appends, one-read replay loads.

Two write paths:

* :func:`append` is the general one. It locks the execution row, then inserts each event with
  a dialect insert that ignores a conflict on ``(execution_id, dedupe_key)``. A dropped
  duplicate takes no sequence number and applies no status change. ``next_seq`` and the
  status are written back under the same lock, in the caller's transaction.
* :func:`append_fenced` is the hot path for events that carry no dedupe key (step
  attempts). It bumps ``next_seq`` and inserts the events only if this runtime still holds the
  lease. On PostgreSQL it is ONE statement (an ``UPDATE ... RETURNING`` in a WITH feeding the
  INSERT), so a step costs one round trip and one WAL flush when run in autocommit.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    Connection,
    Row,
    String,
    bindparam,
    insert,
    literal_column,
    select,
    union_all,
    update,
)

from .. import _dialect
from ..errors import LeaseLostError, StaleHistoryError, UnknownExecutionError
from ..models import DEDUPE_KEY_SET, JSONDoc, UTCDateTime
from ..models import executions_table as ex
from ..models import history_table as hist
from . import Executor, dialect_of, rowcount

#: Event types written from outside the driving runtime (clients). The driver never writes
#: them, so any it has not seen are news.
CLIENT_EVENT_TYPES: Final = ("signal.delivered", "execution.cancelled")

_DEDUPE = ["execution_id", "dedupe_key"]

#: Statuses that event-driven transitions never leave (SPEC section 3 guards).
_STICKY = frozenset({"completed", "failed", "compensating"})


def transition_allowed(current: str, target: str) -> bool:
    """Terminal states are final; only a failure (or cancellation) leaves ``compensating``."""
    if target == "failed":
        return current not in ("completed", "failed")
    return current not in _STICKY


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append. ``event`` is the whole JSON document, including ``type``."""

    event: dict[str, Any]
    created_at: dt.datetime
    dedupe_key: str | None = None
    #: Status this event moves the run to, if it is appended (not dropped as a duplicate).
    status: str | None = None

    @property
    def type(self) -> str:
        return str(self.event["type"])

    @property
    def activity_name(self) -> str | None:
        name = self.event.get("activityName")
        return None if name is None else str(name)


class Fenced(NamedTuple):
    sequences: list[int]
    status: str


@dataclass(slots=True)
class AppendResult:
    sequences: list[int] = field(default_factory=list)
    status: str = ""
    #: True when at least one status-carrying event was appended and its status applied.
    transitioned: bool = False


def _row(execution_id: str, seq: int, ev: NewEvent) -> dict[str, Any]:
    return {
        "execution_id": execution_id,
        "sequence": seq,
        "type": ev.type,
        "activity_name": ev.activity_name,
        "dedupe_key": ev.dedupe_key,
        "created_at": ev.created_at,
        "event": ev.event,
    }


def append(
    conn: Executor,
    execution_id: str,
    events: Sequence[NewEvent],
    *,
    now: dt.datetime,
    owner: str | None = None,
    on_transition: dict[str, Any] | None = None,
    force_status: str | None = None,
    seen_through: int | None = None,
) -> AppendResult:
    """Append ``events`` under the execution row lock, in the caller's transaction.

    Args:
        owner: when given, the write is fenced: it fails with :class:`LeaseLostError` unless
            this owner holds the run's lease.
        on_transition: extra execution columns written only if a status change applied
            (e.g. the result and ``finished_at`` of a completion).
        force_status: a status set regardless of the events (cancellation claims).
        seen_through: the last sequence the caller has read; if a client event arrived
            after it, raise :class:`StaleHistoryError` instead of writing.

    Raises:
        UnknownExecutionError: no such execution.
        LeaseLostError: ``owner`` does not hold the lease.
    """
    locked = conn.execute(
        select(ex.c.next_seq, ex.c.status, ex.c.lease_owner)
        .where(ex.c.id == execution_id)
        .with_for_update()
    ).one_or_none()
    if locked is None:
        raise UnknownExecutionError(execution_id)
    if owner is not None and locked.lease_owner != owner:
        raise LeaseLostError(execution_id)
    if seen_through is not None and has_news(conn, execution_id, seen_through):
        raise StaleHistoryError(execution_id)
    seq = int(locked.next_seq)
    status = str(locked.status)
    result = AppendResult(status=status)
    dialect = dialect_of(conn)
    plain: list[dict[str, Any]] = []
    for ev in events:
        if ev.dedupe_key is None:
            plain.append(_row(execution_id, seq, ev))
        else:
            if plain:
                conn.execute(insert(hist), plain)
                plain = []
            inserted = rowcount(
                conn.execute(
                    _dialect.insert_ignoring(dialect, hist, _DEDUPE, DEDUPE_KEY_SET),
                    _row(execution_id, seq, ev),
                )
            )
            if inserted != 1:
                continue  # a replayed duplicate: no sequence, no status change
        result.sequences.append(seq)
        seq += 1
        if ev.status is not None and transition_allowed(status, ev.status):
            status = ev.status
            result.transitioned = True
    if plain:
        conn.execute(insert(hist), plain)
    values: dict[str, Any] = {"next_seq": seq, "updated_at": now}
    if force_status is not None:
        status = force_status
        result.transitioned = True
    if result.transitioned:
        values["status"] = status
        values.update(on_transition or {})
    conn.execute(update(ex).where(ex.c.id == execution_id).values(values))
    result.status = status
    return result


_HOT_COLUMNS = (
    "execution_id",
    "sequence",
    "type",
    "activity_name",
    "dedupe_key",
    "created_at",
    "event",
)
#: Built once per shape: SQLAlchemy then only looks up its compiled form.
_fenced_statements: dict[tuple[Any, ...], Any] = {}
_insert_history = insert(hist)


def _bump(n: int, columns: tuple[str, ...], guard: tuple[str, ...] | None) -> Any:
    """UPDATE the execution row if ``owner`` holds its lease (and its status is in ``guard``)."""
    stmt = update(ex).where(ex.c.id == bindparam("p_eid"), ex.c.lease_owner == bindparam("p_owner"))
    if guard is not None:
        stmt = stmt.where(ex.c.status.in_([literal_column(f"'{status}'") for status in guard]))
    values: dict[str, Any] = {
        # Constants are rendered inline: one statement per shape, no anonymous parameters.
        "next_seq": ex.c.next_seq + literal_column(str(int(n))),
        "updated_at": bindparam("p_now", type_=UTCDateTime()),
    }
    for column in columns:
        values[column] = bindparam(f"v_{column}", type_=ex.c[column].type)
    return stmt.values(values)


def _fenced_statement(
    family: str, n: int, columns: tuple[str, ...], guard: tuple[str, ...] | None
) -> Any:
    key = (family, n, columns, guard)
    stmt = _fenced_statements.get(key)
    if stmt is not None:
        return stmt
    if family == "cte":
        # WITH bump AS (UPDATE ... RETURNING next_seq) INSERT ... SELECT ... FROM bump
        bump = (
            _bump(n, columns, guard).returning(ex.c.next_seq.label("top"), ex.c.status).cte("bump")
        )
        selects = [
            select(
                bindparam("p_eid", type_=String(36)),
                (bump.c.top - literal_column(str(n - i))).label("sequence"),
                bindparam(f"type{i}", type_=String(64)),
                bindparam(f"act{i}", type_=String(255)),
                bindparam(f"dk{i}", type_=String(255)),
                bindparam(f"at{i}", type_=UTCDateTime()),
                bindparam(f"ev{i}", type_=JSONDoc),
            ).select_from(bump)
            for i in range(n)
        ]
        source = selects[0] if n == 1 else union_all(*selects)
        stmt = (
            insert(hist)
            .from_select(list(_HOT_COLUMNS), source)
            .add_cte(bump)
            .returning(hist.c.sequence, select(bump.c.status).scalar_subquery())
        )
    elif family == "returning":
        stmt = _bump(n, columns, guard).returning(ex.c.next_seq, ex.c.status)
    else:
        locked = select(ex.c.next_seq, ex.c.status).where(
            ex.c.id == bindparam("p_eid"), ex.c.lease_owner == bindparam("p_owner")
        )
        if guard is not None:
            locked = locked.where(
                ex.c.status.in_([literal_column(f"'{status}'") for status in guard])
            )
        stmt = (locked.with_for_update(), _bump(n, columns, guard))
    _fenced_statements[key] = stmt
    return stmt


def append_fenced(
    conn: Executor,
    execution_id: str,
    owner: str,
    events: Sequence[NewEvent],
    *,
    now: dt.datetime,
    values: Mapping[str, Any] | None = None,
    from_statuses: tuple[str, ...] | None = None,
) -> Fenced:
    """Append events and update the execution row, if ``owner`` holds the lease.

    This is the hot path: a step's events, or a run's outcome (``values`` sets the status,
    result and releases the lease; ``from_statuses`` guards the transition). Events are
    inserted as they are: a dedupe key is recorded but not checked, because the lease (and
    the status guard) already make the write happen once.

    On PostgreSQL this is one statement, safe in autocommit (it is atomic on its own): one
    round trip and one WAL flush per step. Elsewhere it is an UPDATE (... RETURNING) plus
    one INSERT in the caller's transaction. The lease itself is renewed by the runtime's
    keeper, not here, so a step leaves indexed columns alone (a HOT update on PostgreSQL).

    Returns:
        The new events' sequence numbers and the run's status after the write (a driver
        learns of a cancellation this way, at no extra cost).

    Raises:
        LeaseLostError: the lease is held by someone else, the run is gone, or its status is
            not in ``from_statuses``.
    """
    dialect = dialect_of(conn)
    n = len(events)
    columns = tuple(sorted(values)) if values else ()
    params: dict[str, Any] = {"p_eid": execution_id, "p_owner": owner, "p_now": now}
    for column in columns:
        params[f"v_{column}"] = values[column]  # type: ignore[index]
    if _dialect.supports_dml_cte(dialect):
        for i, ev in enumerate(events):
            params[f"type{i}"] = ev.type
            params[f"act{i}"] = ev.activity_name
            params[f"dk{i}"] = ev.dedupe_key
            params[f"at{i}"] = ev.created_at
            params[f"ev{i}"] = ev.event
        stmt = _fenced_statement("cte", n, columns, from_statuses)
        rows = conn.execute(stmt, params).all()
        if len(rows) != n:
            raise LeaseLostError(execution_id)
        return Fenced(sorted(int(r[0]) for r in rows), str(rows[0][1]))
    if dialect.update_returning:
        stmt = _fenced_statement("returning", n, columns, from_statuses)
        top = conn.execute(stmt, params).one_or_none()
        if top is None:
            raise LeaseLostError(execution_id)
        base, status = int(top[0]) - n, str(top[1])
    else:
        lock, bump = _fenced_statement("locking", n, columns, from_statuses)
        locked = conn.execute(lock, params).one_or_none()
        if locked is None:
            raise LeaseLostError(execution_id)
        conn.execute(bump, params)
        base, status = int(locked[0]), str(locked[1])
    if events:
        conn.execute(
            _insert_history, [_row(execution_id, base + i, ev) for i, ev in enumerate(events)]
        )
    return Fenced([base + i for i in range(n)], status)


def _sqlite_value(value: Any, kind: str) -> Any:
    """Python value -> what SQLAlchemy's SQLite types would bind (see the test that compares)."""
    if value is None:
        return None
    if kind == "ts":
        naive = value.astimezone(dt.UTC).replace(tzinfo=None)
        return naive.strftime("%Y-%m-%d %H:%M:%S.%f")
    if kind == "json":
        return json.dumps(value)
    return value


_SQLITE_KINDS = {
    "created_at": "ts",
    "updated_at": "ts",
    "finished_at": "ts",
    "wake_at": "ts",
    "lease_expires_at": "ts",
    "event": "json",
    "result": "json",
    "error": "json",
    "input": "json",
}


class _SqliteSQL(NamedTuple):
    bump: str
    insert: str
    bump_order: tuple[str, ...]
    insert_order: tuple[str, ...]


_sqlite_sql: dict[tuple[Any, ...], _SqliteSQL] = {}


def _sqlite_statements(
    n: int, columns: tuple[str, ...], guard: tuple[str, ...] | None, dialect: Any
) -> _SqliteSQL:
    """The SQLite UPDATE ... RETURNING and INSERT, rendered once by SQLAlchemy."""
    key = (n, columns, guard)
    found = _sqlite_sql.get(key)
    if found is None:
        bump = _fenced_statement("returning", n, columns, guard).compile(dialect=dialect)
        ins = _insert_history.values({c: bindparam(c) for c in _HOT_COLUMNS}).compile(
            dialect=dialect
        )
        found = _SqliteSQL(
            str(bump), str(ins), tuple(bump.positiontup or ()), tuple(ins.positiontup or ())
        )
        _sqlite_sql[key] = found
    return found


def append_fenced_autocommit(
    conn: Connection,
    execution_id: str,
    owner: str,
    events: Sequence[NewEvent],
    *,
    now: dt.datetime,
    values: Mapping[str, Any] | None = None,
    from_statuses: tuple[str, ...] | None = None,
) -> Fenced:
    """:func:`append_fenced` as a write of its own, committed when it returns.

    For the runtime's hot path on a connection with no transaction open. PostgreSQL: the one
    CTE statement in autocommit. SQLite: ``BEGIN IMMEDIATE``, the UPDATE ... RETURNING, one
    INSERT and ``COMMIT``. Both go straight to the driver connection with SQL rendered once
    by SQLAlchemy: skipping SQLAlchemy's per-execution machinery halves the CPU of a step,
    which is most of its cost next to the commit. Others: a SQLAlchemy transaction.
    """
    dialect = conn.dialect
    if _dialect.supports_dml_cte(dialect) and not conn.in_transaction():
        return _append_postgresql_raw(conn, execution_id, owner, events, now, values, from_statuses)
    if not _dialect.is_sqlite(dialect) or conn.in_transaction():
        with conn.begin_nested() if conn.in_transaction() else conn.begin():
            return append_fenced(
                conn,
                execution_id,
                owner,
                events,
                now=now,
                values=values,
                from_statuses=from_statuses,
            )
    n = len(events)
    columns = tuple(sorted(values)) if values else ()
    sql = _sqlite_statements(n, columns, from_statuses, dialect)
    params: dict[str, Any] = {
        "p_eid": execution_id,
        "p_owner": owner,
        "p_now": _sqlite_value(now, "ts"),
    }
    for column in columns:
        params[f"v_{column}"] = _sqlite_value(values[column], _SQLITE_KINDS.get(column, ""))  # type: ignore[index]
    raw = conn.connection.driver_connection
    assert raw is not None
    cursor = raw.cursor()
    try:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            cursor.execute(sql.bump, [params[name] for name in sql.bump_order])
            top = cursor.fetchone()
            if top is None:
                raise LeaseLostError(execution_id)
            base, status = int(top[0]) - n, str(top[1])
            rows = []
            for i, ev in enumerate(events):
                row = _row(execution_id, base + i, ev)
                row["created_at"] = _sqlite_value(row["created_at"], "ts")
                row["event"] = _sqlite_value(row["event"], "json")
                rows.append([row[name] for name in sql.insert_order])
            if rows:
                cursor.executemany(sql.insert, rows)
            raw.commit()
        except BaseException:
            raw.rollback()
            raise
    finally:
        cursor.close()
    return Fenced([base + i for i in range(n)], status)


_pg_sql: dict[tuple[Any, ...], str] = {}


def _append_postgresql_raw(
    conn: Connection,
    execution_id: str,
    owner: str,
    events: Sequence[NewEvent],
    now: dt.datetime,
    values: Mapping[str, Any] | None,
    from_statuses: tuple[str, ...] | None,
) -> Fenced:
    """The CTE sent straight to psycopg (autocommit), rendered once by SQLAlchemy.

    Same statement and parameters as :func:`append_fenced`; JSON goes as text to the
    statement's ``::JSONB`` casts. psycopg prepares it server-side after a few runs.
    """
    n = len(events)
    columns = tuple(sorted(values)) if values else ()
    schemas = conn.get_execution_options().get("schema_translate_map")
    key = (n, columns, from_statuses, tuple(sorted((schemas or {}).items(), key=str)))
    sql = _pg_sql.get(key)
    if sql is None:
        translate = {"schema_translate_map": schemas, "render_schema_translate": True}
        compiled = _fenced_statement("cte", n, columns, from_statuses).compile(
            dialect=conn.dialect, **(translate if schemas else {})
        )
        sql = str(compiled)
        _pg_sql[key] = sql
    params: dict[str, Any] = {"p_eid": execution_id, "p_owner": owner, "p_now": now}
    for column in columns:
        value = values[column]  # type: ignore[index]
        params[f"v_{column}"] = (
            None
            if value is None
            else json.dumps(value)
            if _SQLITE_KINDS.get(column) == "json"
            else value
        )
    for i, ev in enumerate(events):
        params[f"type{i}"] = ev.type
        params[f"act{i}"] = ev.activity_name
        params[f"dk{i}"] = ev.dedupe_key
        params[f"at{i}"] = ev.created_at
        params[f"ev{i}"] = json.dumps(ev.event)
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    if len(rows) != n:
        raise LeaseLostError(execution_id)
    return Fenced(sorted(int(r[0]) for r in rows), str(rows[0][1]))


def has_news(conn: Executor, execution_id: str, seen_through: int) -> bool:
    """Whether a client event was appended after sequence ``seen_through``."""
    found = conn.execute(
        select(hist.c.sequence)
        .where(
            hist.c.execution_id == execution_id,
            hist.c.sequence > seen_through,
            hist.c.type.in_(CLIENT_EVENT_TYPES),
        )
        .limit(1)
    ).first()
    return found is not None


def load(conn: Executor, execution_id: str) -> Sequence[Row[Any, Any, Any]]:
    """Every event of one execution, in sequence order: one query per replay."""
    return conn.execute(
        select(hist.c.sequence, hist.c.created_at, hist.c.event)
        .where(hist.c.execution_id == execution_id)
        .order_by(hist.c.sequence)
    ).all()
