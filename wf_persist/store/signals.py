"""Signals: which waits are pending, and race-free delivery to one of them."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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


#: What the waits' states are read from: what settles a wait, and what reopens one (a
#: delivery its wait refused) and is buffered for it meanwhile.
_WAIT_EVENTS = (*SIGNAL_EVENT_TYPES, "signal.rejected", "signal.buffered")


@dataclass
class _Waits:
    """The run's signal waits as its history tells them."""

    #: Pending waits by activity (history order).
    pending: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: How settled ones were settled (by event type).
    settled: dict[str, str] = field(default_factory=dict)
    #: The latest wait of each signal name, pending or not (its schema judges a buffered one).
    latest: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Waits that refused the payload delivered to them: the next signal sent to one is
    #: buffered for it (its delivery is taken); pending until that one is sent.
    reopened: set[str] = field(default_factory=set)
    #: Signal names with a buffered signal no wait has taken or refused yet.
    queued: set[str] = field(default_factory=set)


def _waits(conn: Executor, execution_id: str) -> _Waits:
    rows = (
        connection_of(conn)
        .execute(
            select(hist.c.type, hist.c.activity_name, hist.c.event)
            .where(hist.c.execution_id == execution_id, hist.c.type.in_(_WAIT_EVENTS))
            .order_by(hist.c.sequence)
        )
        .all()
    )
    found = _Waits()
    waits: dict[str, Mapping[str, Any]] = {}
    buffered: dict[str, str] = {}  # signal id -> name, until taken or refused
    for row in rows:
        event, activity = row.event, row.activity_name
        if row.type == "signal.waiting" or "payloadSchema" in event:  # a wait's schema
            found.latest[str(event.get("name"))] = event
        if row.type == "signal.buffered":
            buffered[str(event.get("signalId"))] = str(event.get("name"))
        elif row.type == "signal.rejected" or (
            row.type == "signal.received" and "signalId" in event
        ):
            buffered.pop(str(event.get("signalId")), None)
        if row.type == "signal.waiting":
            waits[activity] = found.pending[activity] = event
        elif row.type == "signal.rejected":
            if event.get("delivery") is True and activity in waits:
                found.pending[activity] = waits[activity]
                found.reopened.add(activity)
                found.settled.pop(activity, None)
        elif row.type != "signal.buffered" and activity in found.pending:
            found.settled[activity] = row.type
            del found.pending[activity]
            found.reopened.discard(activity)
    found.queued = set(buffered.values())
    for activity in list(found.reopened):
        wait = found.pending.get(activity)
        if wait is not None and str(wait.get("name")) in found.queued:
            # Its one signal is in: as a wait whose delivery is, it takes no other (a
            # buffered one waits for the next wait on the name).
            del found.pending[activity]
            found.settled[activity] = "signal.delivered"
    return found


def pending(conn: Executor, execution_id: str) -> list[Mapping[str, Any]]:
    """``signal.waiting`` events with no delivery, receipt or timeout yet, in history order."""
    return list(_waits(conn, execution_id).pending.values())


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
    found = _waits(core, execution_id)
    named = [w for w in found.pending.values() if w.get("name") == name]
    if not named and buffer:
        stored = validate(dict(found.latest.get(name) or {}))
        signal_id = str(uuid.uuid4())
        buffered = events.signal_buffered(execution_id, name, signal_id, stored, actor, now)
        history.append(core, backend, execution_id, [buffered], now=now)
        return True
    if not named:
        settled = found.settled
        last = next((a for a in reversed(list(settled)) if a.rsplit("#", 1)[0] == name), None)
        if last is not None and settled[last] in ("signal.delivered", "signal.received"):
            raise SignalAlreadyDeliveredError(execution_id, name)
        raise SignalNotWaitingError(execution_id, name)
    wait = dict(named[-1])
    if str(wait["activityName"]) in found.reopened:
        # Its delivery was refused by the wait (the type asks more than the JSON Schema
        # judged here): this one is buffered for it, one at a time as a delivery is.
        stored = validate(wait)
        signal_id = str(uuid.uuid4())
        buffered = events.signal_buffered(execution_id, name, signal_id, stored, actor, now)
        history.append(core, backend, execution_id, [buffered], now=now)
        executions.wake(core, backend, execution_id)
        return False
    stored = validate(wait)
    appended = history.append(
        core, backend, execution_id, [events.signal_delivered(wait, stored, actor, now)], now=now
    )
    if not appended.sequences:
        raise SignalAlreadyDeliveredError(execution_id, name)
    executions.wake(core, backend, execution_id)
    return False
