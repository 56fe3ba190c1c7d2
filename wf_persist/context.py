"""The workflow context: every durable call a workflow makes goes through it.

Each call gets an activity name ``<name>#<n>`` (n counts calls of that name in this run, one
counter per name shared by every kind of call, as the seed does). Before anything runs, the
call is compared with the journal entry recorded at the same position; a different call is a
:class:`NonDeterminismError` and its side effect never happens. A call whose outcome is
recorded returns that outcome without running again.
"""

from __future__ import annotations

import datetime as dt
import inspect
import random as _random
import sys
import threading
import time
import uuid as _uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, Protocol, TypeVar, overload

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from .authoring import Call, Step, adapter_for
from .errors import (
    Cancelled,
    CodeExecutionError,
    InvalidArgumentError,
    InvalidPayloadError,
    NonDeterminismError,
    NotSerializableError,
    StepExecutionError,
    error_document,
    rebuild_error,
)
from .secrets import SecretResolver, contains_reference, resolve_references
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
    "code.started": "code",
    "code.completed": "code",
    "code.failed": "code",
    "all.started": "all",
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

    def record(self, events: Sequence[NewEvent]) -> str:
        """Append events in one write (the hot path); return the run's status after it."""

    def record_checked(self, events: Sequence[NewEvent]) -> None:
        """Append under the row lock; raise :class:`Reload` if news arrived first."""

    def suspend(self, events: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        """Append, release the lease and park the run until ``wake_at`` (or a signal)."""

    def secret_resolver(self) -> SecretResolver | None:
        """The resolver of the process running the step."""

    def concurrency_slot(self, step: Step[Any], key: str) -> AbstractContextManager[None]:
        """Hold one of the step's concurrency slots while it runs."""


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


#: Retry delays up to this long are waited in the driving thread; longer ones park the run.
INLINE_BACKOFF_SECONDS = 1.0


@dataclass(slots=True)
class Journal:
    """What a run recorded, rebuilt from its history in one pass.

    ``entries`` are the positional calls, ``(kind, activity, branches)``; steps run as
    branches of ``ctx.all`` are matched by activity name instead of position, because
    branches finish in any order.
    """

    entries: list[tuple[str, str, int | None]] = field(default_factory=list)
    outcomes: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    #: Step activity -> its non-final ``step.failed`` events (attempts that will be retried).
    attempts: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    #: Sleep activity -> wake time; present while started and not completed.
    sleeping: dict[str, dt.datetime] = field(default_factory=dict)
    #: Signal wait activity -> its ``signal.waiting`` event, while pending.
    waiting: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Signal wait activity -> payload delivered by a client, not yet received.
    delivered: dict[str, Any] = field(default_factory=dict)
    #: Compensated step activity -> None (completed) or the error document (failed).
    compensated: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    #: ``(compensate, actor)`` once ``execution.cancelled`` was recorded.
    cancelled: tuple[bool, str | None] | None = None

    @classmethod
    def from_events(cls, events: Sequence[Mapping[str, Any]]) -> Journal:
        journal = cls()
        seen: set[str] = set()
        branches: set[str] = set()
        for ev in events:
            etype = ev["type"]
            activity: str = ev.get("activityName") or ""
            if etype == "execution.cancelled":
                journal.cancelled = (bool(ev.get("compensate", True)), ev.get("actor"))
            elif etype == "compensation.completed":
                journal.compensated[activity] = None
            elif etype == "compensation.failed":
                journal.compensated[activity] = ev.get("error") or {}
            kind = _KIND_OF_EVENT.get(etype)
            if kind is None:
                continue
            if etype == "all.started":
                branches.update(ev.get("branchActivities") or [])
            if activity not in seen and activity not in branches:
                seen.add(activity)
                count = ev.get("branches") if kind == "all" else None
                journal.entries.append((kind, activity, count))
            if etype == "step.completed":
                journal.outcomes[activity] = (True, ev.get("result"))
            elif etype == "step.failed":
                if ev.get("final", True):
                    journal.outcomes[activity] = (False, ev)
                else:
                    journal.attempts.setdefault(activity, []).append(ev)
            elif etype in _VALUE_EVENTS:
                journal.outcomes[activity] = (True, ev.get("value"))
            elif etype == "code.completed":
                journal.outcomes[activity] = (True, ev.get("result"))
            elif etype == "code.failed":
                journal.outcomes[activity] = (False, ev.get("error"))
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


def _unstorable(value: Any) -> bool:
    """Text no database stores: NUL characters, or lone surrogates (not valid UTF-8)."""
    if isinstance(value, str):
        if "\x00" in value:
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_unstorable(k) or _unstorable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_unstorable(v) for v in value)
    return False


def _to_json(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """Validate ``value`` and return its JSON form (what gets stored).

    Text a database rejects (NUL, lone surrogates) is refused here, as a typed error of the
    step or workflow; a write the database rejected would otherwise be retried forever.
    """
    try:
        doc = adapter.dump_python(adapter.validate_python(value), mode="json")
    except ValidationError as exc:
        raise InvalidPayloadError(what, [dict(e) for e in exc.errors(include_url=False)]) from exc
    except PydanticSerializationError as exc:
        raise NotSerializableError(what, str(exc)) from exc
    if _unstorable(doc):
        raise NotSerializableError(
            what, "it contains a NUL character or invalid UTF-8 text, which databases reject"
        )
    return doc


def _from_json(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """Decode a recorded value; a value that no longer fits its type is a typed error."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise InvalidPayloadError(what, [dict(e) for e in exc.errors(include_url=False)]) from exc


@dataclass(slots=True)
class _StepCall:
    """One ``ctx.run`` (or ``ctx.all`` branch): the step, its arguments and its activity."""

    step: Step[Any]
    arguments: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    activity: str
    invocation: int

    def event_base(self, execution_id: str) -> dict[str, Any]:
        return {
            "executionId": execution_id,
            "stepName": self.step.name,
            "invocation": self.invocation,
            "activityName": self.activity,
        }


@dataclass(slots=True)
class _Compensation:
    """A succeeded step whose ``compensate`` runs if the workflow fails."""

    call: _StepCall
    result: Any
    stored_result: Any
    inputs: dict[str, Any]


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
        self._clock = clock
        self._counters: dict[str, int] = {}
        self._position = 0
        self._write_lock = threading.Lock()
        self._compensations: list[_Compensation] = []
        #: Set when a cancellation was recorded (in history, or seen by a step write).
        self.cancelled: tuple[bool, str | None] | None = journal.cancelled
        #: Set when a replay diverged; the run fails with it even if user code catches it.
        self.divergence: NonDeterminismError | None = None

    @property
    def execution_id(self) -> str:
        """The id of the run being executed."""
        return self._execution_id

    # bookkeeping --------------------------------------------------------------------

    def _record(self, events: Sequence[NewEvent]) -> None:
        with self._write_lock:  # ctx.all branches share the driver's connection
            status = self._driver.record(events)
        if status == "compensating" and self.cancelled is None:
            self.cancelled = (True, None)

    def _next(self, name: str) -> tuple[str, int]:
        invocation = self._counters.get(name, 0) + 1
        self._counters[name] = invocation
        return f"{name}#{invocation}", invocation

    def _enter(self, kind: str, name: str, branches: int | None = None) -> tuple[str, int]:
        if self.divergence is not None:  # caught by the workflow: still nothing new may run
            raise self.divergence
        activity, invocation = self._next(name)
        position = self._position
        self._position += 1
        entries = self._journal.entries
        if position < len(entries) and entries[position] != (kind, activity, branches):
            expected_kind, expected_activity, expected_branches = entries[position]
            self.divergence = NonDeterminismError(
                _describe(expected_kind, expected_activity, expected_branches),
                _describe(kind, activity, branches),
            )
            raise self.divergence
        return activity, invocation

    def _check_cancelled(self) -> None:
        """Raised at the first call that would do something new after a cancellation."""
        if self.cancelled is None:
            return
        compensate, actor = self.cancelled
        event = {
            "type": "cancellation.received",
            "executionId": self._execution_id,
            "compensate": compensate,
            "actor": actor,
        }
        self._driver.record_checked([NewEvent(event, self._clock(), "cancellation.received")])
        raise Cancelled(compensate, actor)

    def _base(self, name: str, invocation: int, activity: str) -> dict[str, Any]:
        return {
            "executionId": self._execution_id,
            "name": name,
            "invocation": invocation,
            "activityName": activity,
        }

    # steps --------------------------------------------------------------------------

    def run(self, step: Step[R], *args: Any, **kwargs: Any) -> R:
        """Run ``step`` durably: once per run, its result recorded before the next call.

        Arguments are validated against the step's annotations before anything is recorded.
        A raised exception is retried per the step's ``retry``; once attempts are exhausted it
        is raised here as :class:`StepExecutionError`. A declared terminal error (``errors=``)
        is never retried and is raised as itself.
        """
        bound = self._bind(step, args, kwargs)
        activity, invocation = self._enter("step", step.name)
        return self._step(_StepCall(step, bound, args, kwargs, activity, invocation), inline=False)  # type: ignore[no-any-return]

    def _bind(
        self, step: Step[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            return dict(step.signature.bind(*args, **kwargs).arguments)
        except TypeError as exc:
            raise InvalidPayloadError(
                f"arguments of step {step.name}", [{"loc": (), "msg": str(exc)}]
            ) from exc

    def _step(self, call: _StepCall, *, inline: bool) -> Any:
        recorded = self._journal.outcomes.get(call.activity)
        if recorded is None:
            self._check_cancelled()
            return self._execute(call, inline)
        ok, value = recorded
        if not ok:
            raise _recorded_step_error(call.step, value)
        step = call.step
        result = _from_json(step.output_adapter, value, f"recorded result of step {step.name}")
        self._register(call, result, value, None)
        return result

    def _register(
        self, call: _StepCall, result: Any, stored: Any, inputs: dict[str, Any] | None
    ) -> None:
        if call.step.compensate is not None:
            inputs = self._inputs(call) if inputs is None else inputs
            self._compensations.append(_Compensation(call, result, stored, inputs))

    @staticmethod
    def _inputs(call: _StepCall) -> dict[str, Any]:
        """The step's arguments as stored (validated JSON, secret references kept)."""
        step = call.step
        return {
            param: _to_json(
                step.param_adapters[param], value, f"argument {param!r} of step {step.name}"
            )
            for param, value in call.arguments.items()
        }

    def _execute(self, call: _StepCall, inline: bool) -> Any:
        step, activity = call.step, call.activity
        base = call.event_base(self._execution_id)
        inputs = self._inputs(call)
        previous = self._journal.attempts.get(activity, [])
        attempt = len(previous) + 1
        if previous:
            retry_at = previous[-1].get("retryAt")
            self._wait_until(
                None if retry_at is None else dt.datetime.fromisoformat(retry_at), inline
            )
        while True:
            started = NewEvent(
                {"type": "step.started", **base, "attempt": attempt, "input": inputs},
                self._clock(),
            )
            try:
                result, stored = self._attempt(step, inputs)
            except Exception as exc:
                cause = error_document(exc)
                terminal = step.is_terminal(exc)
                final = terminal or attempt >= step.retry.attempts
                failed: dict[str, Any] = {
                    "type": "step.failed",
                    **base,
                    "attempt": attempt,
                    "error": cause,
                    "final": final,
                }
                if terminal:
                    failed["terminal"] = True
                    failed["declared"] = next(e.__name__ for e in step.errors if isinstance(exc, e))
                retry_at = None
                if not final:
                    delay = step.retry.delay(attempt + 1, _random.random)
                    retry_at = self._clock() + dt.timedelta(seconds=delay)
                    failed["retryAt"] = retry_at.isoformat()
                self._record([started, NewEvent(failed, self._clock())])
                if terminal:
                    raise
                if final:
                    raise StepExecutionError(step.name, cause) from exc
                self._journal.attempts.setdefault(activity, []).append(failed)
                if self.cancelled is not None:
                    self._check_cancelled()
                self._wait_until(retry_at, inline)
                attempt += 1
                continue
            completed = {"type": "step.completed", **base, "attempt": attempt, "result": stored}
            self._record([started, NewEvent(completed, self._clock())])
            self._register(call, result, stored, inputs)
            return result

    def _attempt(self, step: Step[R], inputs: dict[str, Any]) -> tuple[R, Any]:
        """One attempt: resolve secrets, take a concurrency slot, run, validate the result."""
        if contains_reference(inputs):
            resolved = resolve_references(inputs, self._driver.secret_resolver())
            try:
                values = {p: step.param_adapters[p].validate_python(v) for p, v in resolved.items()}
            except ValidationError as exc:
                # Said without the input: it holds a resolved secret, and errors are stored.
                errors = [
                    {"loc": e["loc"], "type": e["type"], "msg": "rejected after resolving secrets"}
                    for e in exc.errors(
                        include_url=False, include_input=False, include_context=False
                    )
                ]
                raise InvalidPayloadError(f"arguments of step {step.name}", errors) from None
        else:
            values = {p: step.param_adapters[p].validate_python(v) for p, v in inputs.items()}
        limit = step.concurrency
        if limit is None:
            result = step.fn(**values)
        else:
            key = step.name if limit.key is None else str(limit.key(**values))
            with self._driver.concurrency_slot(step, key):
                result = step.fn(**values)
        stored = _to_json(step.output_adapter, result, f"result of step {step.name}")
        return step.output_adapter.validate_python(stored), stored

    def _wait_until(self, when: dt.datetime | None, inline: bool) -> None:
        """Wait for a retry time: in this thread if it is soon (or inside ``ctx.all``),
        else park the run and let a worker resume it when due."""
        if when is None:
            return
        remaining = (when - self._clock()).total_seconds()
        if remaining <= 0:
            return
        if remaining <= INLINE_BACKOFF_SECONDS or inline:
            time.sleep(remaining)
            return
        self._driver.suspend([], when)
        raise Suspended

    # recorded values ------------------------------------------------------------------

    def _value(self, kind: str, make: Callable[[], Any]) -> Any:
        activity, invocation = self._enter(kind, kind)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            return recorded[1]
        value = make()
        event = {
            "type": f"{kind}.recorded",
            **self._base(kind, invocation, activity),
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

    def code(
        self, name: str, fn: Callable[[], T], *, output: Any = Any, reason: str | None = None
    ) -> T:
        """Run a plain computation once and record its value (validated by ``output``).

        Not retried: an exception fails here as :class:`CodeExecutionError`, and a replay
        raises it again without running ``fn``.
        """
        activity, invocation = self._enter("code", name)
        adapter = adapter_for(output)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            ok, value = recorded
            if not ok:
                raise CodeExecutionError(name, value)
            return _from_json(adapter, value, f"recorded result of code block {name}")  # type: ignore[no-any-return]
        self._check_cancelled()
        base = {**self._base(name, invocation, activity), "reason": reason}
        started = NewEvent({"type": "code.started", **base}, self._clock())
        try:
            stored = _to_json(adapter, fn(), f"result of code block {name}")
        except Exception as exc:
            cause = error_document(exc)
            self._record(
                [started, NewEvent({"type": "code.failed", **base, "error": cause}, self._clock())]
            )
            raise CodeExecutionError(name, cause) from exc
        self._record(
            [started, NewEvent({"type": "code.completed", **base, "result": stored}, self._clock())]
        )
        return adapter.validate_python(stored)  # type: ignore[no-any-return]

    # failure --------------------------------------------------------------------------

    def fail(self, error: BaseException) -> NoReturn:
        """Fail the run with a typed error callers can match (``Failed.matches``).

        Registered compensations run first, newest first.
        """
        raise error

    def compensate(self, reason: dict[str, Any]) -> list[dict[str, Any]]:
        """Unwind: run registered compensations newest first; return their errors.

        A failing compensation is recorded and the unwind continues. Each finished
        compensation is recorded, so a crash in the middle resumes without repeating it.
        """
        errors: list[dict[str, Any]] = []
        for comp in reversed(self._compensations):
            call = comp.call
            where = {"stepName": call.step.name, "activityName": call.activity}
            if call.activity in self._journal.compensated:
                recorded = self._journal.compensated[call.activity]
                if recorded is not None:
                    errors.append({**where, "error": recorded})
                continue
            base = call.event_base(self._execution_id)
            started = NewEvent(
                {
                    "type": "compensation.started",
                    **base,
                    "result": comp.stored_result,
                    "input": comp.inputs,
                    "reason": reason,
                },
                self._clock(),
            )
            try:
                _call_compensation(comp, reason)
            except Exception as exc:
                doc = error_document(exc)
                failed = {"type": "compensation.failed", **base, "error": doc}
                self._record([started, NewEvent(failed, self._clock())])
                errors.append({**where, "error": doc})
                continue
            completed = {"type": "compensation.completed", **base}
            self._record([started, NewEvent(completed, self._clock())])
        return errors

    # parallel -------------------------------------------------------------------------

    def all(
        self, calls: Sequence[Call[Any]], *, concurrency: int | None = None, name: str = "all"
    ) -> list[Any]:
        """Run steps concurrently; return their results in input order.

        Each branch is a step call (``wp.call(step, *args)``) with its own activity name;
        finished branches are not re-run on replay. A failing branch fails the block once
        every branch settled (its error is raised here); branches that succeeded are
        registered for compensation. A replay with a different branch count is a
        :class:`NonDeterminismError`.
        """
        if concurrency is not None and (isinstance(concurrency, bool) or concurrency < 1):
            raise InvalidArgumentError(
                f"concurrency must be a positive integer, got {concurrency!r}"
            )
        prepared = [(c, self._bind(c.step, c.args, c.kwargs)) for c in calls]
        activity, invocation = self._enter("all", name, len(prepared))
        branch_names = [self._next(c.step.name) for c, _ in prepared]
        base = {**self._base(name, invocation, activity), "branches": len(prepared)}
        if activity not in self._journal.outcomes and not any(
            a in self._journal.outcomes for a, _ in branch_names
        ):
            self._check_cancelled()
        started = {"type": "all.started", **base, "branchActivities": [a for a, _ in branch_names]}
        self._driver.record_checked([NewEvent(started, self._clock(), f"all.started:{activity}")])

        def branch(i: int) -> Any:
            call, arguments = prepared[i]
            act, inv = branch_names[i]
            return self._step(
                _StepCall(call.step, arguments, call.args, call.kwargs, act, inv), inline=True
            )

        workers = min(len(prepared), concurrency or len(prepared)) or 1
        with ThreadPoolExecutor(workers, thread_name_prefix="wf-persist-all") as pool:
            futures = [pool.submit(branch, i) for i in range(len(prepared))]
        failures = [f.exception() for f in futures if f.exception() is not None]
        for f in futures:  # control flow (lease lost, cancellation) wins over step errors
            exc = f.exception()
            if exc is not None and not isinstance(exc, Exception):
                raise exc
        if failures:
            error = failures[0]
            assert error is not None
            ended = {"type": "all.failed", **base, "error": error_document(error)}
            self._driver.record_checked([NewEvent(ended, self._clock(), f"all.failed:{activity}")])
            raise error
        self._driver.record_checked(
            [
                NewEvent(
                    {"type": "all.completed", **base}, self._clock(), f"all.completed:{activity}"
                )
            ]
        )
        return [f.result() for f in futures]

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
        self._check_cancelled()
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
        if activity not in self._journal.delivered:
            self._check_cancelled()
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


def _describe(kind: str, activity: str, branches: int | None) -> str:
    return f"{kind}:{activity}" + ("" if branches is None else f" branches={branches}")


def _recorded_step_error(step: Step[Any], failed: Mapping[str, Any]) -> BaseException:
    """The failure a replay raises again: the declared type itself, or StepExecutionError."""
    cause = dict(failed.get("error") or {})
    if failed.get("terminal"):
        raised = resolve_type_reference(f"{cause.get('module')}:{cause.get('name')}")
        if raised is not None and issubclass(raised, step.errors):
            return rebuild_error(raised, cause)  # the subclass itself, when importable
        declared = step.error_type(failed.get("declared") or cause.get("name"))
        if declared is not None:
            return rebuild_error(declared, cause)
    return StepExecutionError(step.name, cause)


def _call_compensation(comp: _Compensation, reason: dict[str, Any]) -> None:
    fn = comp.call.step.compensate
    assert fn is not None
    kwargs = dict(comp.call.kwargs)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "reason" in params:
        kwargs["reason"] = reason
    fn(comp.result, *comp.call.args, **kwargs)
