"""Step execution: attempts, retries, secrets, concurrency slots and the saga unwind.

Replay bookkeeping (which call this is, whether it was recorded) is :mod:`.replay`'s; this
module runs what replay says is new. One attempt is one write: ``step.started`` and its
outcome commit together, except that an attempt still running after the driver's
``record_start_after`` seconds has its ``step.started`` recorded then, so an attempt cut
short by a crash stays visible in history (and the next one is numbered after it).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import inspect
import logging
import random as _random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from . import drive_telemetry, events
from .authoring import Step, outside_body
from .bridge import bridged, checked_first, checked_in_thread, in_thread, off_loop
from .control import Suspended, interrupting
from .driving import Driver
from .error_documents import error_document, rebuild_error
from .errors import (
    InvalidPayloadError,
    NotSerializableError,
    StepExecutionError,
    ValueTooLargeError,
)
from .events import Activity, NewEvent
from .logs import run_fields
from .loops import check_can_await, settle
from .policies import key_text
from .replay import Journal
from .secrets import Redactor, contains_reference, resolve_references
from .timeouts import call_within
from .values import fresh, from_json, resolve_type_reference, to_json

#: Retry delays up to this long are waited in the driving thread; longer ones park the run.
INLINE_BACKOFF_SECONDS = 1.0


log = logging.getLogger("wf_persist.steps")

T = TypeVar("T")


@dataclass(slots=True)
class StepCall:
    """One ``ctx.run`` (or ``ctx.all`` branch): the step, its arguments and its activity."""

    step: Step[Any]
    arguments: dict[str, Any]
    activity: str
    invocation: int
    #: The arguments as stored, when already made (and their size checked).
    stored: dict[str, Any] | None = None

    def who(self, execution_id: str) -> Activity:
        return Activity(execution_id, self.step.name, self.invocation, self.activity, step=True)

    def inputs(self) -> dict[str, Any]:
        """The arguments as stored (validated JSON, secret references kept)."""
        if self.stored is not None:
            return self.stored
        step = self.step
        return {
            param: to_json(
                step.param_adapters[param], value, f"argument {param!r} of step {step.name}"
            )
            for param, value in self.arguments.items()
        }


@dataclass(slots=True)
class Compensation:
    """A succeeded step whose ``compensate`` runs if the workflow fails."""

    call: StepCall
    result: Any
    stored_result: Any
    inputs: dict[str, Any]


class _StartWatch:
    """Records an attempt's ``step.started`` on its own once it runs long enough."""

    def __init__(self, driver: Driver, started: NewEvent, lock: threading.Lock) -> None:
        self._driver = driver
        self._started = started
        self._write_lock = lock
        self._state = threading.Lock()
        self._done = False
        self.recorded = False
        self.error: BaseException | None = None
        delay = driver.record_start_after
        self._cancel: Callable[[], None] | None = None
        if delay == 0:  # every start recorded before the attempt runs
            self._fire()
            if self.error is not None:
                raise self.error
        elif delay is not None:
            self._cancel = driver.after(delay, self._fire)

    def _fire(self) -> None:
        with self._state:
            if self._done:
                return
            try:
                with self._write_lock:
                    self._driver.record([self._started])
                self.recorded = True
            except BaseException as exc:  # the completion write reports it
                self.error = exc

    def _stop(self) -> None:
        with self._state:
            self._done = True

    def finish(self, *, quiet: bool = False) -> list[NewEvent]:
        """Stop watching; the events the outcome write must include."""
        # On a thread when bridged: the timer thread holds _state through its write (which
        # may wait for a row lock or a connection); the loop thread must not wait for it.
        off_loop(self._stop)
        if self._cancel is not None:
            self._cancel()
        if self.error is not None and not quiet:
            raise self.error
        return [] if self.recorded else [self._started]


class StepRunner:
    """Runs the new steps of one replay, and unwinds their compensations on failure."""

    def __init__(
        self,
        execution_id: str,
        journal: Journal,
        driver: Driver,
        redactor: Redactor,
        before_new_call: Callable[[], None],
    ) -> None:
        self.execution_id = execution_id
        self.journal = journal
        self.driver = driver
        self.redactor = redactor
        self._before_new_call = before_new_call
        #: ``ctx.all`` branches share the driver's connection.
        self.write_lock = threading.Lock()
        self.compensations: list[Compensation] = []

    def error_document(self, exc: BaseException) -> dict[str, Any]:
        """The stored form of an error, with every resolved secret value scrubbed."""
        doc: dict[str, Any] = self.redactor.scrub(error_document(exc, self.redactor.scrub))
        return doc

    def record(self, evs: Sequence[NewEvent]) -> None:
        with self.write_lock:
            self.driver.record(evs)

    @staticmethod
    def bind(step: Step[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        names = step.positional
        if not kwargs and names is not None and len(args) == len(names):
            return dict(zip(names, args, strict=True))
        try:
            return dict(step.signature.bind(*args, **kwargs).arguments)
        except TypeError as exc:
            raise InvalidPayloadError(
                f"arguments of step {step.name}", [{"loc": (), "msg": str(exc)}]
            ) from exc

    def stored_inputs(self, step: Step[Any], arguments: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments as they would be stored, checked (type, JSON, size)."""
        inputs = StepCall(step, arguments, "", 0).inputs()
        self.driver.check_size(f"arguments of step {step.name}", inputs)
        return inputs

    # running -----------------------------------------------------------------------

    def run(self, call: StepCall, *, inline: bool) -> Any:
        """The recorded outcome of ``call``, or its execution if it has none."""
        recorded = self.journal.outcomes.get(call.activity)
        if recorded is None:
            self._before_new_call()
            return self._execute(call, inline)
        ok, value = recorded
        step = call.step
        if not ok:
            raise _recorded_step_error(step, value)
        result = from_json(step.output_adapter, value, f"recorded result of step {step.name}")
        self._register(call, result, value, None)
        return result

    def _register(
        self, call: StepCall, result: Any, stored: Any, inputs: dict[str, Any] | None
    ) -> None:
        if call.step.compensate is not None:
            inputs = call.inputs() if inputs is None else inputs
            self.compensations.append(Compensation(call, result, stored, inputs))

    def _execute(self, call: StepCall, inline: bool) -> Any:
        step = call.step
        fn = self.driver.step_function(step)
        if step.is_async(fn):
            check_can_await(fn, f"step {step.name}")
        who = call.who(self.execution_id)
        checked = call.stored is not None
        inputs = call.inputs()
        if not checked:
            self.driver.check_size(f"arguments of step {step.name}", inputs)
        record = self.journal.steps.get(call.activity)
        attempt = 1 if record is None else record.last_attempt + 1
        failures = 0 if record is None else record.failures
        if record is not None:
            self.wait_until(record.retry_at, inline)
        while True:
            started = events.step_started(who, attempt, inputs, self.driver.clock())
            watch = _StartWatch(self.driver, started, self.write_lock)
            traced = drive_telemetry.step_attempt(
                self.execution_id, self.driver.workflow, call.activity, step.name, attempt
            )
            called = False
            try:
                returned = self._attempt(step, inputs)
                called = True
                result, stored = self._stored(step, returned)
            except BaseException as exc:
                if interrupting(exc):  # control flow, a signal: this attempt just ends
                    if traced is not None:
                        traced.end("interrupted")
                    watch.finish(quiet=True)
                    raise
                terminal = step.is_terminal(exc)
                # A result that cannot be kept fails the step once: another attempt would
                # repeat its effects for a value that again could not be (one of the wrong
                # shape, InvalidPayloadError, is retried as before).
                unkept = called and isinstance(exc, NotSerializableError | ValueTooLargeError)
                final = terminal or unkept or failures + 1 >= step.retry.attempts
                if traced is not None:
                    traced.end("failed" if final else "retrying", exc, self.redactor.scrub)
                pending = watch.finish()
                cause = self.error_document(exc)
                retry_at = None
                if not final:
                    delay = step.retry.delay(failures + 2, _random.random)
                    retry_at = self.driver.clock() + dt.timedelta(seconds=delay)
                declared = next((e.__name__ for e in step.errors if isinstance(exc, e)), None)
                failed = events.step_failed(
                    who,
                    attempt,
                    cause,
                    self.driver.clock(),
                    final=final,
                    declared=declared if terminal else None,
                    retry_at=retry_at,
                )
                self.record([*pending, failed])
                self._log_failure(step.name, attempt, cause, retry_at, final=final)
                if terminal:
                    # What a replay raises (rebuilt from the record, its long texts cut and
                    # its non-JSON arguments as text), so the body sees the same both times.
                    raise _recorded_step_error(step, failed.event) from exc
                if final:
                    raise StepExecutionError(step.name, cause) from exc
                failures += 1
                self._before_new_call()
                self.wait_until(retry_at, inline)
                attempt += 1
                continue
            if traced is not None:
                traced.end("completed")
            done = [
                *watch.finish(),
                events.step_completed(who, attempt, stored, self.driver.clock()),
            ]
            if inline:  # a branch of ctx.all: its siblings write meanwhile
                self.record(done)
            else:
                self.driver.defer(done)
            self._register(call, result, stored, inputs)
            return result

    def _resolved(self, step: Step[Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """The step's arguments with secrets resolved, validated again."""
        if not contains_reference(inputs):
            adapters = step.param_adapters
            return {p: adapters[p].validate_python(fresh(v)) for p, v in inputs.items()}
        resolved = resolve_references(inputs, self.driver.secret_resolver(), self.redactor)
        try:
            return {p: step.param_adapters[p].validate_python(v) for p, v in resolved.items()}
        except ValidationError as exc:
            # Said without the input: it holds a resolved secret, and errors are stored.
            errors = [
                {"loc": e["loc"], "type": e["type"], "msg": "rejected after resolving secrets"}
                for e in exc.errors(include_url=False, include_input=False, include_context=False)
            ]
            raise InvalidPayloadError(f"arguments of step {step.name}", errors) from None

    def _attempt(self, step: Step[Any], inputs: dict[str, Any]) -> Any:
        """One attempt: resolve secrets, take a concurrency slot, run; what the step returned."""
        values = self._resolved(step, inputs)
        limit = step.concurrency
        with outside_body(), self.driver.user_code():
            # The lease is checked as late as possible, right before the step's own code:
            # resolving secrets or waiting for a slot may take longer than the lease.
            if limit is None:
                self.driver.check_lease()
                result = self._call(step, values)
            else:
                key = step.name if limit.key is None else key_text(limit.key(**values))
                with contextlib.ExitStack() as slot:
                    still_held = slot.enter_context(self.driver.concurrency_slot(step, key))
                    self.driver.check_lease()
                    # An attempt given up at its timeout runs on: it keeps the slot.
                    result = self._call(step, values, lambda: slot.pop_all().close, still_held)
        return result

    def _stored(self, step: Step[Any], result: Any) -> tuple[Any, Any]:
        """The step's result as the body sees it (read back from what is stored, as a
        replay reads it) and as it is stored."""
        what = f"result of step {step.name}"
        stored = self.driver.as_stored(to_json(step.output_adapter, result, what))
        self.driver.check_size(what, stored)
        try:
            return step.output_adapter.validate_python(stored), stored
        except ValidationError as exc:  # a type whose JSON form it does not itself read
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "the value"
            raise NotSerializableError(
                what,
                f"its JSON form does not read back as its type ({where}: {first['msg']}); "
                "a model with aliases needs populate_by_name=True",
            ) from None

    def _call(
        self,
        step: Step[Any],
        values: dict[str, Any],
        keep: Callable[[], Callable[[], None]] | None = None,
        still_held: Callable[[], None] | None = None,
    ) -> Any:
        fn = self.driver.step_function(step)
        if step.is_async(fn):  # awaited on the async body's loop, cancelled at its timeout
            if still_held is not None:
                still_held()
            return settle(fn(**values), step.timeout, step.name)
        # In the async worker a synchronous step runs on a thread (off_loop), after a wait
        # for one if all are busy: the lease (and a Limit's slot) is checked again there,
        # right before the call (the check on the loop may be long past, and the run another
        # worker's meanwhile). Checked before a timeout's clock starts: a slow check is not
        # the step's time.
        call: Callable[..., Any] = fn if step.timeout is None else call_within
        if bridged():

            def check() -> None:
                self.driver.check_lease()
                if still_held is not None:
                    still_held()

            call = checked_first(check, call)
        elif still_held is not None:
            still_held()
        if step.timeout is None:
            return in_thread(call, **values)
        return in_thread(call, fn, values, step.timeout, step.name, keep)

    def wait_until(self, when: dt.datetime | None, inline: bool) -> None:
        """Wait for a retry time: in this thread if it is soon (or inside ``ctx.all``),
        else park the run and let a worker resume it when due."""
        if when is None:
            return
        remaining = (when - self.driver.clock()).total_seconds()
        if remaining <= 0:
            return
        if remaining <= INLINE_BACKOFF_SECONDS or inline:
            # In pieces, checked between them as before a new call: the run's deadline, a
            # caller handing the run over or a cancellation ends the wait (a backoff in a
            # ctx.all branch may last minutes), and the next attempt starts only past them.
            while remaining > 0:
                self.driver.pause(min(remaining, INLINE_BACKOFF_SECONDS))
                self._before_new_call()
                remaining = (when - self.driver.clock()).total_seconds()
            return
        self.driver.suspend([], when)
        raise Suspended

    # the saga ----------------------------------------------------------------------

    def compensate(self, reason: dict[str, Any]) -> list[dict[str, Any]]:
        """Unwind: run registered compensations newest first; return their errors.

        A failing compensation is recorded and the unwind continues. Each finished
        compensation is recorded, so a crash in the middle resumes without repeating it.
        A compensation's arguments are the step's, secrets resolved as for the step.
        """
        errors: list[dict[str, Any]] = []
        for comp in reversed(self.compensations):
            call = comp.call
            where = {"stepName": call.step.name, "activityName": call.activity}
            if call.activity in self.journal.compensated:
                recorded = self.journal.compensated[call.activity]
                if recorded is not None:
                    errors.append({**where, "error": recorded})
                continue
            who = call.who(self.execution_id)
            started = events.compensation_started(
                who, comp.stored_result, comp.inputs, reason, self.driver.clock()
            )
            self.driver.flush()  # the last step's outcome is recorded before an undo runs
            try:
                self._call_compensation(comp, reason)
            except BaseException as exc:
                if interrupting(exc):
                    raise
                doc = self.error_document(exc)
                self.record([started, events.compensation_finished(who, doc, self.driver.clock())])
                errors.append({**where, "error": doc})
                log.error(
                    "run %s (%s): compensation of step %s failed: %s: %s",
                    self.execution_id,
                    self.driver.workflow,
                    call.step.name,
                    doc.get("name"),
                    doc.get("message"),
                    extra=run_fields(self.execution_id, self.driver.workflow, call.step.name),
                )
                continue
            self.record([started, events.compensation_finished(who, None, self.driver.clock())])
        return errors

    def _log_failure(
        self,
        step: str,
        attempt: int,
        cause: dict[str, Any],
        retry_at: dt.datetime | None,
        *,
        final: bool,
    ) -> None:
        """One line per failed attempt: retried (warning) or the step's last (error)."""
        workflow = self.driver.workflow
        what = f"{cause.get('name')}: {cause.get('message')}"
        extra = run_fields(self.execution_id, workflow, step, attempt)
        if final:
            log.error(
                "run %s (%s): step %s failed at attempt %d, not retried: %s",
                self.execution_id,
                workflow,
                step,
                attempt,
                what,
                extra=extra,
            )
        else:
            log.warning(
                "run %s (%s): step %s attempt %d failed, retried at %s: %s",
                self.execution_id,
                workflow,
                step,
                attempt,
                retry_at.isoformat() if retry_at else "once",
                what,
                extra=extra,
            )

    def _call_compensation(self, comp: Compensation, reason: dict[str, Any]) -> None:
        fn = comp.call.step.compensate
        assert fn is not None
        step = comp.call.step
        bound = step.signature.bind_partial(**self._resolved(step, comp.inputs))
        kwargs = dict(bound.kwargs)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if "reason" in params:
            kwargs["reason"] = reason
        with outside_body(), self.driver.user_code():
            # New work like a step: not started without the lease (checked as late).
            call = functools.partial(fn, comp.result, *bound.args, **kwargs)
            settle(checked_in_thread(self.driver.check_lease, call), own_loop=True)


def _recorded_step_error(step: Step[Any], failed: Any) -> BaseException:
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
