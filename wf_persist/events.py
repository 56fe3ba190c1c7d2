"""History events: one typed constructor per event type, the only place their keys are spelled.

The SQL views (``wf_step_attempts``, ``wf_execution_waits``) and ``docs/sql.md`` read these
keys, so they change here or nowhere. Each constructor returns a :class:`NewEvent` carrying
its dedupe key (SPEC section 2.3: events a replay may emit again have one; step, code and
compensation events and client-written events have none). Which status an event moves a run
to is the lifecycle's business (:data:`wf_persist.lifecycle.EVENT_STATUS`), not the event's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append. ``event`` is the whole JSON document, including ``type``."""

    event: dict[str, Any]
    created_at: dt.datetime
    dedupe_key: str | None = None

    @property
    def type(self) -> str:
        return str(self.event["type"])

    @property
    def activity_name(self) -> str | None:
        name = self.event.get("activityName")
        return None if name is None else str(name)


@dataclass(frozen=True, slots=True)
class Activity:
    """Who recorded an event: the run, the call's name, its invocation and activity name.

    ``step`` is true for step and compensation events, whose name key is ``stepName``.
    """

    execution_id: str
    name: str
    invocation: int
    activity: str
    step: bool = False

    def base(self) -> dict[str, Any]:
        return {
            "executionId": self.execution_id,
            "stepName" if self.step else "name": self.name,
            "invocation": self.invocation,
            "activityName": self.activity,
        }


#: Written by clients, never by a driver: any a driver has not read yet is news to it.
CLIENT_EVENT_TYPES: Final = (
    "signal.delivered",
    "signal.buffered",
    "execution.cancelled",
    "child.finished",  # written with a child's outcome, in its parent's history
)


def progress(evs: Sequence[NewEvent]) -> bool:
    """Whether appending ``evs`` is a run's progress: anything but attempts begun (an
    attempt may begin again at every drive, so its ``step.started`` proves nothing)."""
    return any(ev.type != "step.started" for ev in evs)


def _keyed(kind: str, who: Activity, at: dt.datetime, **fields: Any) -> NewEvent:
    return NewEvent({"type": kind, **who.base(), **fields}, at, f"{kind}:{who.activity}")


def _plain(kind: str, who: Activity, at: dt.datetime, **fields: Any) -> NewEvent:
    return NewEvent({"type": kind, **who.base(), **fields}, at)


# the run -------------------------------------------------------------------------------


def execution_started(
    execution_id: str,
    workflow: str,
    version: int,
    payload: Any,
    actor: str | None,
    at: dt.datetime,
    trace: Mapping[str, str] | None = None,
) -> NewEvent:
    """``trace``: the starter's trace context (W3C ``traceparent``, ``tracestate``), which
    the run's drives continue (:mod:`wf_persist.telemetry`); absent while tracing is off."""
    event = {
        "type": "execution.started",
        "executionId": execution_id,
        "workflowName": workflow,
        "version": version,
        "payload": payload,
        "actor": actor,
    }
    if trace:
        event["trace"] = dict(trace)
    return NewEvent(event, at)


def workflow_started(execution_id: str, workflow: str, version: int, at: dt.datetime) -> NewEvent:
    event = {
        "type": "workflow.started",
        "executionId": execution_id,
        "workflowName": workflow,
        "version": version,
    }
    return NewEvent(event, at, "workflow.started")


def workflow_finished(
    execution_id: str, workflow: str, ok: bool, value: Any, at: dt.datetime
) -> NewEvent:
    kind = "workflow.completed" if ok else "workflow.failed"
    event = {
        "type": kind,
        "executionId": execution_id,
        "workflowName": workflow,
        "result" if ok else "error": value,
    }
    return NewEvent(event, at, kind)


def execution_cancelled(
    execution_id: str, compensate: bool, actor: str | None, at: dt.datetime
) -> NewEvent:
    event = {
        "type": "execution.cancelled",
        "executionId": execution_id,
        "compensate": compensate,
        "actor": actor,
    }
    return NewEvent(event, at)


def cancellation_received(
    execution_id: str, compensate: bool, actor: str | None, at: dt.datetime
) -> NewEvent:
    event = {
        "type": "cancellation.received",
        "executionId": execution_id,
        "compensate": compensate,
        "actor": actor,
    }
    return NewEvent(event, at, "cancellation.received")


def workflow_timed_out(execution_id: str, deadline: dt.datetime, at: dt.datetime) -> NewEvent:
    """The run's deadline passed: it unwinds like a cancellation with compensation."""
    event = {
        "type": "workflow.timed_out",
        "executionId": execution_id,
        "deadline": deadline.isoformat(),
    }
    return NewEvent(event, at, "workflow.timed_out")


def child_started(
    who: Activity,
    child_id: str,
    workflow: str,
    version: int,
    cancel_with_parent: bool,
    at: dt.datetime,
    plain: bool = False,
) -> NewEvent:
    """A parent started a child run (in the same transaction as the child's row);
    ``plain``: its result comes back as JSON (the parent's process did not serve it), on
    every replay, whatever the replaying process serves."""
    extra = {"plainResult": True} if plain else {}
    return _keyed(
        "child.started",
        who,
        at,
        childExecutionId=child_id,
        workflowName=workflow,
        version=version,
        cancelWithParent=cancel_with_parent,
        **extra,
    )


def child_waiting(who: Activity, child_id: str, at: dt.datetime) -> NewEvent:
    """A parent parked until its child ends."""
    return _keyed("child.waiting", who, at, childExecutionId=child_id)


def child_finished(
    parent_id: str, child_id: str, ok: bool, value: Any, at: dt.datetime
) -> NewEvent:
    """A child's outcome, appended to its parent's history with the child's own outcome."""
    event = {
        "type": "child.finished",
        "executionId": parent_id,
        "childExecutionId": child_id,
        "ok": ok,
        "result" if ok else "error": value,
    }
    return NewEvent(event, at, f"child.finished:{child_id}")


def drive_failed(
    execution_id: str, error: dict[str, Any], failures: int, at: dt.datetime
) -> NewEvent:
    """A drive stopped on an error that was not a lost lease (counted on the run)."""
    event = {
        "type": "drive.failed",
        "executionId": execution_id,
        "error": error,
        "failures": failures,
    }
    return NewEvent(event, at)


# steps ---------------------------------------------------------------------------------


def step_started(who: Activity, attempt: int, inputs: Any, at: dt.datetime) -> NewEvent:
    return _plain("step.started", who, at, attempt=attempt, input=inputs)


def step_completed(who: Activity, attempt: int, result: Any, at: dt.datetime) -> NewEvent:
    return _plain("step.completed", who, at, attempt=attempt, result=result)


def step_failed(
    who: Activity,
    attempt: int,
    error: dict[str, Any],
    at: dt.datetime,
    *,
    final: bool,
    declared: str | None = None,
    retry_at: dt.datetime | None = None,
) -> NewEvent:
    """A failed attempt. ``declared`` names the terminal error type it matched, if any;
    ``retry_at`` is when the next attempt may start (recorded so a replay waits the same)."""
    fields: dict[str, Any] = {"attempt": attempt, "error": error, "final": final}
    if declared is not None:
        fields["terminal"] = True
        fields["declared"] = declared
    if retry_at is not None:
        fields["retryAt"] = retry_at.isoformat()
    return _plain("step.failed", who, at, **fields)


def compensation_started(
    who: Activity, result: Any, inputs: Any, reason: Any, at: dt.datetime
) -> NewEvent:
    return _plain("compensation.started", who, at, result=result, input=inputs, reason=reason)


def compensation_finished(who: Activity, error: dict[str, Any] | None, at: dt.datetime) -> NewEvent:
    if error is None:
        return _plain("compensation.completed", who, at)
    return _plain("compensation.failed", who, at, error=error)


# other calls ---------------------------------------------------------------------------


def value_recorded(kind: str, who: Activity, value: Any, at: dt.datetime) -> NewEvent:
    """``now``, ``random`` or ``uuid``: the value a replay returns."""
    return _plain(f"{kind}.recorded", who, at, value=value)


def code_started(who: Activity, reason: str | None, at: dt.datetime) -> NewEvent:
    return _plain("code.started", who, at, reason=reason)


def code_finished(
    who: Activity, reason: str | None, ok: bool, value: Any, at: dt.datetime
) -> NewEvent:
    if ok:
        return _plain("code.completed", who, at, reason=reason, result=value)
    return _plain("code.failed", who, at, reason=reason, error=value)


def all_started(who: Activity, branches: list[str], at: dt.datetime) -> NewEvent:
    return _keyed("all.started", who, at, branches=len(branches), branchActivities=branches)


def all_finished(
    who: Activity, branches: int, error: dict[str, Any] | None, at: dt.datetime
) -> NewEvent:
    if error is None:
        return _keyed("all.completed", who, at, branches=branches)
    return _keyed("all.failed", who, at, branches=branches, error=error)


def sleep_started(who: Activity, seconds: float, wake_at: dt.datetime, at: dt.datetime) -> NewEvent:
    return _keyed("sleep.started", who, at, duration=seconds, wakeAt=wake_at.isoformat())


def sleep_completed(
    who: Activity, seconds: float, wake_at: dt.datetime, at: dt.datetime
) -> NewEvent:
    return _keyed("sleep.completed", who, at, duration=seconds, wakeAt=wake_at.isoformat())


def signal_waiting(
    who: Activity,
    timeout: float | None,
    deadline: dt.datetime | None,
    schema: dict[str, Any],
    type_ref: str | None,
    at: dt.datetime,
) -> NewEvent:
    return _keyed(
        "signal.waiting",
        who,
        at,
        timeout=timeout,
        deadline=None if deadline is None else deadline.isoformat(),
        payloadSchema=schema,
        payloadType=type_ref,
    )


def signal_received(who: Activity, payload: Any, at: dt.datetime) -> NewEvent:
    return _keyed("signal.received", who, at, payload=payload)


def signal_timeout(who: Activity, timeout: float | None, at: dt.datetime) -> NewEvent:
    return _keyed("signal.timeout", who, at, timeout=timeout)


def signal_delivered(
    wait: dict[str, Any], payload: Any, actor: str | None, at: dt.datetime
) -> NewEvent:
    """A client's delivery to a pending ``signal.waiting`` event (``wait``)."""
    activity = str(wait["activityName"])
    event = {
        "type": "signal.delivered",
        "executionId": wait["executionId"],
        "name": wait["name"],
        "invocation": wait.get("invocation"),
        "activityName": activity,
        "payload": payload,
        "actor": actor,
    }
    return NewEvent(event, at, f"signal.delivered:{activity}")


def signal_buffered(
    execution_id: str,
    name: str,
    signal_id: str,
    payload: Any,
    actor: str | None,
    at: dt.datetime,
) -> NewEvent:
    """A client's signal for a run not waiting on ``name`` yet: its next wait on ``name``
    takes it (``signal.received`` or ``signal.rejected`` name it by ``signalId``)."""
    event = {
        "type": "signal.buffered",
        "executionId": execution_id,
        "name": name,
        "signalId": signal_id,
        "payload": payload,
        "actor": actor,
    }
    return NewEvent(event, at)


def signal_taken(
    who: Activity,
    signal_id: str,
    payload: Any,
    schema: dict[str, Any],
    type_ref: str | None,
    at: dt.datetime,
) -> NewEvent:
    """A wait received a buffered signal (without suspending). It records the wait's schema
    as ``signal.waiting`` does, so later buffered signals of the name are validated when
    they are sent."""
    return _keyed(
        "signal.received",
        who,
        at,
        payload=payload,
        signalId=signal_id,
        payloadSchema=schema,
        payloadType=type_ref,
    )


def signal_rejected(
    who: Activity, signal_id: str, errors: list[dict[str, Any]], at: dt.datetime
) -> NewEvent:
    """A wait refused a buffered signal whose payload does not fit it; it keeps waiting."""
    event = {"type": "signal.rejected", **who.base(), "signalId": signal_id, "errors": errors}
    return NewEvent(event, at, f"signal.rejected:{signal_id}")


def delivery_rejected(who: Activity, errors: list[dict[str, Any]], at: dt.datetime) -> NewEvent:
    """A wait refused the payload a client delivered to it (judged where it was sent by the
    wait's JSON Schema alone, which the type asks more of): it waits on, and the next signal
    sent to it is buffered for it (one at a time)."""
    event = {"type": "signal.rejected", **who.base(), "delivery": True, "errors": errors}
    return NewEvent(event, at, f"signal.rejected:{who.activity}")


def event_set(who: Activity, key: str, value: Any, at: dt.datetime) -> NewEvent:
    """``ctx.set_event``: a value any client can read by key (the latest one wins)."""
    return _keyed("event.set", who, at, key=key, value=value)


#: The events that settle a signal wait (the wait is pending until one is recorded).
SIGNAL_EVENT_TYPES: Final = (
    "signal.waiting",
    "signal.received",
    "signal.timeout",
    "signal.delivered",
)
