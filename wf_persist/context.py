"""The workflow context: every durable call a workflow makes goes through it.

Each call gets an activity name ``<name>#<n>`` (n counts calls of that name in this run, one
counter per name shared by every kind of call, as the seed does). Before anything runs, the
call is compared with the journal entry recorded at the same position; a different call is a
:class:`NonDeterminismError` and its side effect never happens. A call whose outcome is
recorded returns that outcome without running again.
"""

from __future__ import annotations

import datetime as dt
import random as _random
import sys
import uuid as _uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, overload

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from .authoring import Step, adapter_for
from .errors import (
    InvalidArgumentError,
    InvalidPayloadError,
    NonDeterminismError,
    NotSerializableError,
    StepExecutionError,
    error_document,
)
from .store.history import NewEvent

R = TypeVar("R")
T = TypeVar("T")

#: Which kind of journal entry each event type records.
_KIND_OF_EVENT: Mapping[str, str] = {
    "step.started": "step",
    "step.completed": "step",
    "step.failed": "step",
    "now.recorded": "now",
    "random.recorded": "random",
    "uuid.recorded": "uuid",
    "sleep.started": "sleep",
    "sleep.completed": "sleep",
    "signal.waiting": "signal",
    "signal.received": "signal",
    "signal.timeout": "signal",
}
_VALUE_EVENTS = frozenset({"now.recorded", "random.recorded", "uuid.recorded"})


class Halt(BaseException):
    """Unwinds a workflow function when the runtime cannot go on (lease lost, database down).

    A ``BaseException`` so a workflow's ``except Exception`` cannot swallow it: the run must
    stop where it is and be resumed by replay, not continue with an unrecorded step.
    """

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Suspended(BaseException):
    """Unwinds the workflow function once the run is parked (a sleep or a signal wait).

    Nothing is kept in memory: the run is a row with a wake time (or none, until a signal).
    """


class Reload(BaseException):
    """Someone else wrote to the run (a signal, a cancellation) after its history was read:
    replay again from the fresh history instead of suspending on a stale view."""


class Driver(Protocol):
    """What the runtime provides to a context for the run it drives."""

    def record(self, events: Sequence[NewEvent]) -> None:
        """Append dedupe-free events (one write; the hot path)."""

    def record_checked(self, events: Sequence[NewEvent]) -> None:
        """Append under the row lock; raise :class:`Reload` if news arrived first."""

    def suspend(self, events: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        """Append, release the lease and park the run until ``wake_at`` (or a signal)."""


@dataclass(frozen=True)
class Received(Generic[T]):
    """``wait_for_signal`` got a signal; ``value`` is validated into the payload type."""

    value: T
    timed_out: bool = False


@dataclass(frozen=True)
class TimedOut:
    """``wait_for_signal`` reached its timeout first (a value, not an exception)."""

    timed_out: bool = True


def _seconds(duration: dt.timedelta | float, what: str) -> float:
    seconds = duration.total_seconds() if isinstance(duration, dt.timedelta) else duration
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise InvalidArgumentError(f"{what} must be a non-negative duration, got {duration!r}")
    return float(seconds)


def type_reference(tp: Any) -> str | None:
    """``module:qualname`` of a class defined at module level, else ``None``."""
    module, qualname = getattr(tp, "__module__", None), getattr(tp, "__qualname__", None)
    if not isinstance(tp, type) or not module or not qualname or "<locals>" in qualname:
        return None
    return f"{module}:{qualname}"


def resolve_type_reference(ref: str | None) -> Any:
    """The class a :func:`type_reference` names, if its module is already imported."""
    if not ref:
        return None
    module_name, _, qualname = ref.partition(":")
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target if isinstance(target, type) else None


@dataclass(slots=True)
class Journal:
    """What a run recorded, rebuilt from its history in one pass."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    outcomes: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    #: Sleep activity -> wake time; present while started and not completed.
    sleeping: dict[str, dt.datetime] = field(default_factory=dict)
    #: Signal wait activity -> its ``signal.waiting`` event, while pending.
    waiting: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Signal wait activity -> payload delivered by a client, not yet received.
    delivered: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Sequence[Mapping[str, Any]]) -> Journal:
        journal = cls()
        seen: set[str] = set()
        for ev in events:
            etype = ev["type"]
            kind = _KIND_OF_EVENT.get(etype)
            if kind is None:
                continue
            activity = ev["activityName"]
            if activity not in seen:
                seen.add(activity)
                journal.entries.append((kind, activity))
            if etype == "step.completed":
                journal.outcomes[activity] = (True, ev.get("result"))
            elif etype == "step.failed" and ev.get("final", True):
                journal.outcomes[activity] = (False, ev.get("error"))
            elif etype in _VALUE_EVENTS:
                journal.outcomes[activity] = (True, ev.get("value"))
            elif etype == "sleep.started":
                journal.sleeping[activity] = dt.datetime.fromisoformat(ev["wakeAt"])
            elif etype == "sleep.completed":
                journal.sleeping.pop(activity, None)
                journal.outcomes[activity] = (True, None)
            elif etype == "signal.waiting":
                journal.waiting[activity] = ev
            elif etype == "signal.received":
                journal.waiting.pop(activity, None)
                journal.outcomes[activity] = (True, Received(ev.get("payload")))
            elif etype == "signal.timeout":
                journal.waiting.pop(activity, None)
                journal.outcomes[activity] = (True, TimedOut())
        for ev in events:  # client-written: not journal positions
            if ev["type"] == "signal.delivered" and ev["activityName"] in journal.waiting:
                journal.delivered[ev["activityName"]] = ev.get("payload")
        return journal


def _to_json(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """Validate ``value`` and return its JSON form (what gets stored)."""
    try:
        return adapter.dump_python(adapter.validate_python(value), mode="json")
    except ValidationError as exc:
        raise InvalidPayloadError(what, [dict(e) for e in exc.errors(include_url=False)]) from exc
    except PydanticSerializationError as exc:
        raise NotSerializableError(what, str(exc)) from exc


class Context:
    """Handed to a workflow function as ``ctx``; the only door to durable effects."""

    def __init__(
        self,
        execution_id: str,
        journal: Journal,
        driver: Driver,
        clock: Callable[[], dt.datetime],
    ) -> None:
        self._execution_id = execution_id
        self._journal = journal
        self._driver = driver
        self._record = driver.record
        self._clock = clock
        self._counters: dict[str, int] = {}
        self._position = 0
        #: Set when a replay diverged; the run fails with it even if user code catches it.
        self.divergence: NonDeterminismError | None = None

    @property
    def execution_id(self) -> str:
        """The id of the run being executed."""
        return self._execution_id

    def _enter(self, kind: str, name: str) -> tuple[str, int]:
        invocation = self._counters.get(name, 0) + 1
        self._counters[name] = invocation
        activity = f"{name}#{invocation}"
        position = self._position
        self._position += 1
        entries = self._journal.entries
        if position < len(entries) and entries[position] != (kind, activity):
            expected_kind, expected_activity = entries[position]
            self.divergence = NonDeterminismError(
                f"{expected_kind}:{expected_activity}", f"{kind}:{activity}"
            )
            raise self.divergence
        return activity, invocation

    def run(self, step: Step[R], *args: Any, **kwargs: Any) -> R:
        """Run ``step`` durably: once per run, its result recorded before the next call.

        Arguments are validated against the step's annotations before anything is recorded.
        A failure is recorded and raised into the workflow as :class:`StepExecutionError`.
        """
        try:
            bound = step.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidPayloadError(
                f"arguments of step {step.name}", [{"loc": (), "msg": str(exc)}]
            ) from exc
        activity, invocation = self._enter("step", step.name)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            ok, value = recorded
            if ok:
                return step.output_adapter.validate_python(value)  # type: ignore[no-any-return]
            raise StepExecutionError(step.name, value.get("cause", value))
        return self._execute(step, bound.arguments, activity, invocation)

    def _execute(
        self, step: Step[R], arguments: dict[str, Any], activity: str, invocation: int
    ) -> R:
        base = {
            "executionId": self._execution_id,
            "stepName": step.name,
            "invocation": invocation,
            "activityName": activity,
            "attempt": 1,
        }
        inputs: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for param, value in arguments.items():
            adapter = step.param_adapters[param]
            doc = _to_json(adapter, value, f"argument {param!r} of step {step.name}")
            inputs[param] = doc
            values[param] = adapter.validate_python(doc)
        started_at = self._clock()
        started = NewEvent({"type": "step.started", **base, "input": inputs}, started_at)
        try:
            result = step.fn(**values)
            stored = _to_json(step.output_adapter, result, f"result of step {step.name}")
        except Exception as exc:
            cause = error_document(exc)
            failed = {"type": "step.failed", **base, "error": cause, "final": True}
            self._record([started, NewEvent(failed, self._clock())])
            raise StepExecutionError(step.name, cause) from exc
        completed = {"type": "step.completed", **base, "result": stored}
        self._record([started, NewEvent(completed, self._clock())])
        return step.output_adapter.validate_python(stored)  # type: ignore[no-any-return]

    def _value(self, kind: str, make: Callable[[], Any]) -> Any:
        activity, invocation = self._enter(kind, kind)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            return recorded[1]
        value = make()
        event = {
            "type": f"{kind}.recorded",
            "executionId": self._execution_id,
            "name": kind,
            "invocation": invocation,
            "activityName": activity,
            "value": value,
        }
        self._record([NewEvent(event, self._clock())])
        return value

    def now(self) -> dt.datetime:
        """The current UTC time, recorded: a replay sees the same instant."""
        return dt.datetime.fromisoformat(self._value("now", lambda: self._clock().isoformat()))

    def random(self) -> float:
        """A float in [0, 1), recorded: a replay sees the same number."""
        return float(self._value("random", _random.random))

    def uuid(self) -> _uuid.UUID:
        """A random UUID4, recorded: a replay sees the same id."""
        return _uuid.UUID(self._value("uuid", lambda: str(_uuid.uuid4())))

    def _base(self, name: str, invocation: int, activity: str) -> dict[str, Any]:
        return {
            "executionId": self._execution_id,
            "name": name,
            "invocation": invocation,
            "activityName": activity,
        }

    def sleep(self, duration: dt.timedelta | float, *, name: str | None = None) -> None:
        """Sleep durably (``timedelta`` or seconds). The run is parked as a row with a wake
        time and resumed when due, by whichever worker is alive then.

        The default name is ``sleep:<seconds>s``, so the activity is e.g. ``sleep:30s#1``.
        """
        seconds = _seconds(duration, "sleep duration")
        base_name = name or f"sleep:{seconds:g}s"
        activity, invocation = self._enter("sleep", base_name)
        if activity in self._journal.outcomes:
            return
        base = self._base(base_name, invocation, activity)
        wake_at = self._journal.sleeping.get(activity)
        if wake_at is None:
            now = self._clock()
            wake_at = now + dt.timedelta(seconds=seconds)
            event = {
                "type": "sleep.started",
                **base,
                "duration": seconds,
                "wakeAt": wake_at.isoformat(),
            }
            key = f"sleep.started:{activity}"
            self._driver.suspend([NewEvent(event, now, key, "suspended")], wake_at)
            raise Suspended
        if self._clock() < wake_at:
            self._driver.suspend([], wake_at)
            raise Suspended
        event = {
            "type": "sleep.completed",
            **base,
            "duration": seconds,
            "wakeAt": wake_at.isoformat(),
        }
        self._driver.record_checked(
            [NewEvent(event, self._clock(), f"sleep.completed:{activity}", "running")]
        )

    @overload
    def wait_for_signal(
        self, name: str, payload_type: type[T], *, timeout: dt.timedelta | float | None = None
    ) -> Received[T] | TimedOut: ...
    @overload
    def wait_for_signal(
        self, name: str, payload_type: Any = Any, *, timeout: dt.timedelta | float | None = None
    ) -> Received[Any] | TimedOut: ...

    def wait_for_signal(
        self,
        name: str,
        payload_type: Any = Any,
        *,
        timeout: dt.timedelta | float | None = None,
    ) -> Received[Any] | TimedOut:
        """Park the run until a signal ``name`` arrives or ``timeout`` passes.

        Returns :class:`Received` with the payload validated into ``payload_type``, or
        :class:`TimedOut`. Each wait on a name is one invocation (``approval#1``,
        ``approval#2``), so waiting again in a loop replays safely.
        """
        limit = None if timeout is None else _seconds(timeout, "signal timeout")
        activity, invocation = self._enter("signal", name)
        adapter = adapter_for(payload_type)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            outcome = recorded[1]
            if isinstance(outcome, Received):
                return Received(adapter.validate_python(outcome.value))
            return TimedOut()
        base = self._base(name, invocation, activity)
        waiting = self._journal.waiting.get(activity)
        if waiting is None:
            now = self._clock()
            deadline = None if limit is None else now + dt.timedelta(seconds=limit)
            event = {
                "type": "signal.waiting",
                **base,
                "timeout": limit,
                "deadline": None if deadline is None else deadline.isoformat(),
                "payloadSchema": adapter.json_schema(),
                "payloadType": type_reference(payload_type),
            }
            key = f"signal.waiting:{activity}"
            self._driver.suspend([NewEvent(event, now, key, "suspended")], deadline)
            raise Suspended
        if activity in self._journal.delivered:
            payload = self._journal.delivered[activity]
            event = {"type": "signal.received", **base, "payload": payload}
            self._driver.record_checked(
                [NewEvent(event, self._clock(), f"signal.received:{activity}", "running")]
            )
            return Received(adapter.validate_python(payload))
        deadline_text = waiting.get("deadline")
        deadline = None if deadline_text is None else dt.datetime.fromisoformat(deadline_text)
        if deadline is not None and self._clock() >= deadline:
            event = {"type": "signal.timeout", **base, "timeout": waiting.get("timeout")}
            # Checked: a signal delivered since the history was read wins over the timeout.
            self._driver.record_checked(
                [NewEvent(event, self._clock(), f"signal.timeout:{activity}", "running")]
            )
            return TimedOut()
        self._driver.suspend([], deadline)
        raise Suspended
