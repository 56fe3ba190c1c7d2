"""Append-only history: the general append, and one-read replay loads.

:func:`append` locks the execution row, then inserts each event; an event with a dedupe key
goes through the backend's insert that ignores a conflict on ``(execution_id, dedupe_key)``
and nothing else. A dropped duplicate takes no sequence number and applies no status
change. ``next_seq`` and the status (moved as :mod:`wf_persist.lifecycle` says) are written
back under the same lock, in the caller's transaction. A driver's step writes take the
backend's fenced fast path instead (:meth:`wf_persist.backends.Backend.write`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, Row, insert, select, update

from .. import lifecycle
from ..backends.clock import db_now
from ..backends.sql import P_ID, history_row
from ..errors import LeaseLostError, StaleHistoryError, UnknownExecutionError
from ..events import CLIENT_EVENT_TYPES, NewEvent, child_finished, progress
from ..models import DEDUPE_KEY
from ..models import executions_table as ex
from ..models import history_table as hist
from ..wakeups import DUE
from . import Executor, connection_of, rowcount

if TYPE_CHECKING:
    from ..backends import Backend

_insert = insert(hist)


#: Built once: a reused statement keeps its cache key.
_LOAD = (
    select(hist.c.sequence, hist.c.created_at, hist.c.event)
    .where(hist.c.execution_id == P_ID)
    .order_by(hist.c.sequence)
)


@dataclass(slots=True)
class AppendResult:
    sequences: list[int] = field(default_factory=list)
    status: str = ""
    #: True when at least one status-moving event was appended and its status applied.
    transitioned: bool = False
    #: True when an appended event is progress (:func:`wf_persist.events.progress`).
    progressed: bool = False


def append(
    conn: Executor,
    backend: Backend,
    execution_id: str,
    events: Sequence[NewEvent],
    *,
    now: dt.datetime,
    epoch: int | None = None,
    on_transition: dict[str, Any] | None = None,
    force_status: str | None = None,
    seen_through: int | None = None,
    values: dict[str, Any] | None = None,
    on_progress: dict[str, Any] | None = None,
) -> AppendResult:
    """Append ``events`` under the execution row lock, in the caller's transaction.

    Args:
        epoch: when given, the write is fenced: :class:`LeaseLostError` unless the run's
            claim epoch is still this one.
        on_transition: extra execution columns written only if a status change applied
            (e.g. the error and ``finished_at`` of a cancellation).
        force_status: a status set regardless of the events (cancellations).
        seen_through: the last sequence the caller has read; if a client event arrived
            after it, raise :class:`StaleHistoryError` instead of writing.
        values: execution columns written in any case.
        on_progress: execution columns written only if an appended event is progress (a
            dropped duplicate is not: a driver's replay records keyed events again).

    Raises:
        UnknownExecutionError: no such execution.
        LeaseLostError: ``epoch`` is stale.
    """
    core = connection_of(conn)
    locked = backend.lock_run(core, execution_id)
    if locked is None:
        raise UnknownExecutionError(execution_id)
    if epoch is not None and int(locked.claim_epoch) != epoch:
        raise LeaseLostError(execution_id)
    if seen_through is not None and has_news(core, execution_id, seen_through):
        raise StaleHistoryError(execution_id)
    seq = int(locked.next_seq)
    status = str(locked.status)
    result = AppendResult(status=status)
    plain: list[dict[str, Any]] = []
    appended: list[NewEvent] = []
    for ev in events:
        if ev.dedupe_key is None:
            plain.append(history_row(execution_id, seq, ev))
        else:
            if plain:
                core.execute(_insert, plain)
                plain = []
            if not backend.insert_once(core, hist, history_row(execution_id, seq, ev), DEDUPE_KEY):
                continue  # a replayed duplicate: no sequence, no status change
        appended.append(ev)
        result.sequences.append(seq)
        seq += 1
        moved = lifecycle.event_transition(status, ev.type)
        if moved is not None:
            status = moved
            result.transitioned = True
    if plain:
        core.execute(_insert, plain)
    changes: dict[str, Any] = {"next_seq": seq, "updated_at": now, **(values or {})}
    result.progressed = progress(appended)
    if on_progress and result.progressed:
        changes.update(on_progress)
    if force_status is not None:
        status = force_status
        result.transitioned = True
    if result.transitioned:
        changes["status"] = status
        changes.update(on_transition or {})
    core.execute(update(ex).where(ex.c.id == execution_id).values(changes))
    result.status = status
    if result.transitioned and status in lifecycle.TERMINAL and locked.parent_id is not None:
        tell_parent(core, backend, str(locked.parent_id), execution_id, status, changes, now)
    return result


def tell_parent(
    conn: Connection,
    backend: Backend,
    parent_id: str,
    child_id: str,
    status: str,
    changes: dict[str, Any],
    now: dt.datetime,
) -> None:
    """A child run ended (in this transaction): its outcome goes into its parent's history
    as ``child.finished`` (news to the parent's driver) and a parked parent is woken, in
    the same transaction, so the parent can never miss it. Every way a run ends appends
    through here. A parent that has ended itself hears nothing."""
    locked = backend.lock_run(conn, parent_id)
    if locked is None or str(locked.status) in lifecycle.TERMINAL:
        return
    ok = status == lifecycle.COMPLETED.value
    value = changes.get("result") if ok else changes.get("error")
    told = append(
        conn,
        backend,
        parent_id,
        [child_finished(parent_id, child_id, ok, value, now)],
        now=now,
    )
    if not told.sequences:
        return  # already told
    woken = conn.execute(
        update(ex)
        .where(ex.c.id == parent_id, ex.c.lease_expires_at.is_(None))
        .values(wake_at=db_now()),
        execution_options=backend.statement_options,
    )
    if rowcount(woken):
        backend.announce(conn, DUE)


def has_news(conn: Executor, execution_id: str, seen_through: int) -> bool:
    """Whether a client event was appended after sequence ``seen_through``."""
    found = (
        connection_of(conn)
        .execute(
            select(hist.c.sequence)
            .where(
                hist.c.execution_id == execution_id,
                hist.c.sequence > seen_through,
                hist.c.type.in_(CLIENT_EVENT_TYPES),
            )
            .limit(1)
        )
        .first()
    )
    return found is not None


def load(conn: Executor, execution_id: str) -> Sequence[Row[Any, Any, Any]]:
    """Every event of one execution, in sequence order: one query per replay."""
    return connection_of(conn).execute(_LOAD, {"p_id": execution_id}).all()


def first(conn: Executor, execution_id: str) -> dict[str, Any] | None:
    """The run's ``execution.started`` (sequence 1): one primary-key read."""
    found = (
        connection_of(conn)
        .execute(
            select(hist.c.event).where(hist.c.execution_id == execution_id, hist.c.sequence == 1)
        )
        .scalar()
    )
    return None if found is None else dict(found)


def dedupe_keys(conn: Executor, execution_id: str) -> set[str]:
    """The dedupe keys of a run's events: a keyed event whose key is among them would be
    appended as nothing."""
    rows = connection_of(conn).execute(
        select(hist.c.dedupe_key).where(
            hist.c.execution_id == execution_id, hist.c.dedupe_key.is_not(None)
        )
    )
    return {str(r.dedupe_key) for r in rows}


#: How many of a run's newest published events a look for one key reads first.
RECENT_EVENTS: Final = 16


def event_set(conn: Executor, execution_id: str, key: str) -> tuple[bool, Any]:
    """Whether the run published ``key`` with ``ctx.set_event``, and its latest value. The
    newest few published events first (a run updating its progress finds it there, however
    long its history); only a key set long ago costs the whole read."""
    rows = connection_of(conn).execute(
        select(hist.c.event)
        .where(hist.c.execution_id == execution_id, hist.c.type == "event.set")
        .order_by(hist.c.sequence.desc())
        .limit(RECENT_EVENTS)
    )
    recent = [r.event for r in rows]
    for event in recent:
        if event.get("key") == key:
            return True, event.get("value")
    if len(recent) < RECENT_EVENTS:
        return False, None
    found = events_set(conn, execution_id)
    return key in found, found.get(key)


def events_set(conn: Executor, execution_id: str) -> dict[str, Any]:
    """The values a run published with ``ctx.set_event``, the latest per key."""
    rows = connection_of(conn).execute(
        select(hist.c.event)
        .where(hist.c.execution_id == execution_id, hist.c.type == "event.set")
        .order_by(hist.c.sequence)
    )
    return {str(r.event.get("key")): r.event.get("value") for r in rows}
