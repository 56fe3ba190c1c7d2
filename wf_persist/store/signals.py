"""Signals: which waits are pending, and race-free delivery to one of them."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from .. import events, lifecycle
from ..errors import SignalAlreadyDeliveredError, SignalNotWaitingError, UnknownExecutionError
from ..events import SIGNAL_EVENT_TYPES
from ..models import history_table as hist
from . import Executor, connection_of, executions, history

if TYPE_CHECKING:
    from ..backends import Backend

#: Validates a payload against a wait (its ``signal.waiting`` event); returns what to store.
Validator = Callable[[Mapping[str, Any]], Any]


def _waits(
    conn: Executor, execution_id: str
) -> tuple[dict[str, Mapping[str, Any]], dict[str, str], dict[str, Mapping[str, Any]]]:
    """Pending waits by activity (history order), how settled ones were settled, and the
    latest wait of each signal name (pending or not: its schema judges a buffered signal)."""
    rows = (
        connection_of(conn)
        .execute(
            select(hist.c.type, hist.c.activity_name, hist.c.event)
            .where(hist.c.execution_id == execution_id, hist.c.type.in_(SIGNAL_EVENT_TYPES))
            .order_by(hist.c.sequence)
        )
        .all()
    )
    pending: dict[str, Mapping[str, Any]] = {}
    settled: dict[str, str] = {}
    latest: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        if row.type == "signal.waiting" or "payloadSchema" in row.event:  # a wait's schema
            latest[str(row.event.get("name"))] = row.event
        if row.type == "signal.waiting":
            pending[row.activity_name] = row.event
        elif row.activity_name in pending:
            settled[row.activity_name] = row.type
            del pending[row.activity_name]
    return pending, settled, latest


def pending(conn: Executor, execution_id: str) -> list[Mapping[str, Any]]:
    """``signal.waiting`` events with no delivery, receipt or timeout yet, in history order."""
    return list(_waits(conn, execution_id)[0].values())


def deliver(
    conn: Executor,
    backend: Backend,
    execution_id: str,
    name: str,
    validate: Validator,
    actor: str | None,
    now: dt.datetime,
    *,
    buffer: bool = False,
) -> bool:
    """Record ``signal.delivered`` for the run's latest pending wait on ``name`` and make
    the run due; with ``buffer``, when no wait on ``name`` is pending, record
    ``signal.buffered`` instead, for the run's next wait on ``name`` to take (FIFO).

    Everything is decided under the run's row lock: which wait is pending, whether the
    payload fits it, and the write. So of N concurrent deliveries to one wait exactly one
    wins and every other one finds it delivered (or, with ``buffer``, queues behind it).
    A buffered payload is validated by the latest wait on ``name`` the run recorded, if
    any (``validate({})`` otherwise: the wait validates it when it takes it).

    Returns:
        Whether the signal was buffered (False: delivered to a pending wait).

    Raises:
        SignalNotWaitingError: no pending wait on ``name`` (or the run is not signalable;
            with ``buffer``, the run has finished).
        SignalAlreadyDeliveredError: the latest wait on ``name`` already got its signal.
        SignalPayloadError: from ``validate``; nothing is recorded.
    """
    core = connection_of(conn)
    locked = backend.lock_run(core, execution_id)
    if locked is None:
        raise UnknownExecutionError(execution_id)
    if str(locked.status) not in lifecycle.SIGNALABLE:
        raise SignalNotWaitingError(execution_id, name, status=str(locked.status))
    waits, settled, latest = _waits(core, execution_id)
    named = [w for w in waits.values() if w.get("name") == name]
    if not named and buffer:
        stored = validate(dict(latest.get(name) or {}))
        signal_id = str(uuid.uuid4())
        buffered = events.signal_buffered(execution_id, name, signal_id, stored, actor, now)
        history.append(core, backend, execution_id, [buffered], now=now)
        return True
    if not named:
        last = next((a for a in reversed(list(settled)) if a.rsplit("#", 1)[0] == name), None)
        if last is not None and settled[last] in ("signal.delivered", "signal.received"):
            raise SignalAlreadyDeliveredError(execution_id, name)
        raise SignalNotWaitingError(execution_id, name)
    wait = dict(named[-1])
    stored = validate(wait)
    appended = history.append(
        core, backend, execution_id, [events.signal_delivered(wait, stored, actor, now)], now=now
    )
    if not appended.sequences:
        raise SignalAlreadyDeliveredError(execution_id, name)
    executions.wake(core, backend, execution_id)
    return False
