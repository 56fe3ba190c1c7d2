"""Signals: which waits are pending, and race-free delivery to one of them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from ..errors import SignalAlreadyDeliveredError, SignalNotWaitingError, UnknownExecutionError
from ..models import TERMINAL_STATUSES
from ..models import executions_table as ex
from ..models import history_table as hist
from . import Executor, executions, history
from .history import NewEvent

_SIGNAL_TYPES = ("signal.waiting", "signal.received", "signal.timeout", "signal.delivered")


def pending(conn: Executor, execution_id: str) -> list[Mapping[str, Any]]:
    """``signal.waiting`` events with no delivery, receipt or timeout yet, in history order."""
    rows = conn.execute(
        select(hist.c.type, hist.c.activity_name, hist.c.event)
        .where(hist.c.execution_id == execution_id, hist.c.type.in_(_SIGNAL_TYPES))
        .order_by(hist.c.sequence)
    ).all()
    waits: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        if row.type == "signal.waiting":
            waits[row.activity_name] = row.event
        else:
            waits.pop(row.activity_name, None)
    return list(waits.values())


def deliver(
    conn: Executor,
    execution_id: str,
    wait: Mapping[str, Any],
    payload: Any,
    actor: str | None,
    now: dt.datetime,
) -> int:
    """Record ``signal.delivered`` for one pending wait and make the run due.

    The row lock serializes deliveries and the wait's outcome; the dedupe key
    ``signal.delivered:<activity>`` makes exactly one of two concurrent deliveries win.

    Returns:
        The event's sequence number.

    Raises:
        SignalNotWaitingError: the wait was resolved (or the run finished) meanwhile.
        SignalAlreadyDeliveredError: another delivery to this wait won.
    """
    name, activity = str(wait["name"]), str(wait["activityName"])
    status = conn.execute(
        select(ex.c.status).where(ex.c.id == execution_id).with_for_update()
    ).scalar_one_or_none()
    if status is None:
        raise UnknownExecutionError(execution_id)
    if status in TERMINAL_STATUSES:
        raise SignalNotWaitingError(execution_id, name)
    keys = [f"{kind}:{activity}" for kind in _SIGNAL_TYPES[1:]]
    resolved = set(
        conn.execute(
            select(hist.c.type).where(
                hist.c.execution_id == execution_id, hist.c.dedupe_key.in_(keys)
            )
        ).scalars()
    )
    if "signal.delivered" in resolved:
        raise SignalAlreadyDeliveredError(execution_id, name)
    if resolved:
        raise SignalNotWaitingError(execution_id, name)
    event = {
        "type": "signal.delivered",
        "executionId": execution_id,
        "name": name,
        "invocation": wait.get("invocation"),
        "activityName": activity,
        "payload": payload,
        "actor": actor,
    }
    appended = history.append(
        conn,
        execution_id,
        [NewEvent(event, now, f"signal.delivered:{activity}", "running")],
        now=now,
    )
    if not appended.sequences:
        raise SignalAlreadyDeliveredError(execution_id, name)
    executions.wake(conn, execution_id, now)
    return appended.sequences[0]
