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
import uuid as _uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from .authoring import Step
from .errors import (
    InvalidPayloadError,
    NonDeterminismError,
    NotSerializableError,
    StepExecutionError,
    error_document,
)
from .store.history import NewEvent

R = TypeVar("R")

#: Which kind of journal entry each event type records.
_KIND_OF_EVENT: Mapping[str, str] = {
    "step.started": "step",
    "step.completed": "step",
    "step.failed": "step",
    "now.recorded": "now",
    "random.recorded": "random",
    "uuid.recorded": "uuid",
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


#: Persists events for the run being driven (provided by the runtime).
Recorder = Callable[[Sequence[NewEvent]], None]


@dataclass(slots=True)
class Journal:
    """What a run recorded, rebuilt from its history in one pass."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    outcomes: dict[str, tuple[bool, Any]] = field(default_factory=dict)

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
        record: Recorder,
        clock: Callable[[], dt.datetime],
    ) -> None:
        self._execution_id = execution_id
        self._journal = journal
        self._record = record
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
