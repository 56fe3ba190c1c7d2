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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import (
    Insert,
    Row,
    String,
    bindparam,
    cast,
    insert,
    null,
    select,
    union_all,
    update,
)

from .. import _dialect
from ..errors import LeaseLostError, StaleHistoryError, UnknownExecutionError
from ..models import JSONDoc, UTCDateTime
from ..models import executions_table as ex
from ..models import history_table as hist
from . import Executor, dialect_of, rowcount

#: Event types written from outside the driving runtime (clients). The driver never writes
#: them, so any it has not seen are news.
CLIENT_EVENT_TYPES: Final = ("signal.delivered", "execution.cancelled")

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
                    _dialect.insert_ignoring(dialect, hist, ["execution_id", "dedupe_key"]).values(
                        _row(execution_id, seq, ev)
                    )
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
_cte_statements: dict[int, Insert] = {}


def _cte_statement(n: int) -> Insert:
    """``WITH bump AS (UPDATE ... RETURNING next_seq) INSERT ... SELECT ... FROM bump``."""
    stmt = _cte_statements.get(n)
    if stmt is not None:
        return stmt
    bump = (
        update(ex)
        .where(ex.c.id == bindparam("eid"), ex.c.lease_owner == bindparam("owner"))
        .values(
            next_seq=ex.c.next_seq + n,
            updated_at=bindparam("now", type_=UTCDateTime()),
        )
        .returning(ex.c.next_seq.label("top"))
        .cte("bump")
    )
    selects = [
        select(
            bindparam("eid", type_=String(36)),
            (bump.c.top - (n - i)).label("sequence"),
            bindparam(f"type{i}", type_=String(64)),
            bindparam(f"act{i}", type_=String(255)),
            cast(null(), String(255)),
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
        .returning(hist.c.sequence)
    )
    _cte_statements[n] = stmt
    return stmt


def append_fenced(
    conn: Executor,
    execution_id: str,
    owner: str,
    events: Sequence[NewEvent],
    *,
    now: dt.datetime,
) -> list[int]:
    """Append dedupe-free events if ``owner`` holds the lease.

    The lease is renewed by the runtime's keeper, not here: an indexed column left alone
    keeps this UPDATE a heap-only (HOT) update on PostgreSQL.

    On PostgreSQL this is one statement, safe to run in autocommit (it is atomic on its
    own). Elsewhere it is an UPDATE ... RETURNING plus an INSERT; the caller provides the
    transaction.

    Raises:
        LeaseLostError: the lease is held by someone else (or the run is gone).
    """
    dialect = dialect_of(conn)
    n = len(events)
    if _dialect.supports_dml_cte(dialect):
        params: dict[str, Any] = {"eid": execution_id, "owner": owner, "now": now}
        for i, ev in enumerate(events):
            params[f"type{i}"] = ev.type
            params[f"act{i}"] = ev.activity_name
            params[f"at{i}"] = ev.created_at
            params[f"ev{i}"] = ev.event
        seqs = [int(s) for s in conn.execute(_cte_statement(n), params).scalars()]
        if len(seqs) != n:
            raise LeaseLostError(execution_id)
        return sorted(seqs)
    if dialect.update_returning:
        top = conn.execute(
            update(ex)
            .where(ex.c.id == execution_id, ex.c.lease_owner == owner)
            .values(next_seq=ex.c.next_seq + n, updated_at=now)
            .returning(ex.c.next_seq)
        ).scalar_one_or_none()
        if top is None:
            raise LeaseLostError(execution_id)
        base = int(top) - n
    else:
        locked = conn.execute(
            select(ex.c.next_seq)
            .where(ex.c.id == execution_id, ex.c.lease_owner == owner)
            .with_for_update()
        ).scalar_one_or_none()
        if locked is None:
            raise LeaseLostError(execution_id)
        base = int(locked)
        conn.execute(
            update(ex).where(ex.c.id == execution_id).values(next_seq=base + n, updated_at=now)
        )
    conn.execute(insert(hist), [_row(execution_id, base + i, ev) for i, ev in enumerate(events)])
    return [base + i for i in range(n)]


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
