"""The workflow context: every durable call a workflow makes goes through it.

A call is positioned and checked against history by the replay :class:`~.replay.Cursor`
before anything runs; a call whose outcome is recorded returns that outcome without running
again; a new step is run by the :class:`~.steps.StepRunner`. Sleeps and signal waits park the
run (:class:`~.control.Suspended`); a cancellation is raised at the first call that would do
something new.
"""

from __future__ import annotations

import datetime as dt
import random as _random
import uuid as _uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, overload

from pydantic import TypeAdapter, ValidationError

from . import events
from .arguments import validate_signal
from .authoring import Call, Step, Workflow, adapter_for, check_call_name, outside_body
from .bridge import checked_in_thread, on_threads, settled_here
from .children import ChildHandle, ChildRunner
from .control import Reload, Suspended, fail_with, latched
from .driving import Driver
from .error_documents import shown
from .errors import (
    Cancelled,
    CancelledCallError,
    CodeExecutionError,
    InvalidArgumentError,
    InvalidPayloadError,
    SignalPayloadError,
    WorkflowDefinitionError,
    WorkflowTimeoutError,
)
from .events import Activity
from .loops import check_can_await, settle
from .replay import Cursor, Journal, Received, TimedOut
from .steps import StepCall, StepRunner
from .timeouts import MAX_DURATION_SECONDS as MAX_DURATION_SECONDS
from .timeouts import duration_seconds, plain_number
from .values import from_json, to_json, type_reference

__all__ = ["Context", "Received", "TimedOut"]

R = TypeVar("R")
T = TypeVar("T")
Out = TypeVar("Out")


def _seconds(duration: dt.timedelta | float, what: str) -> float:
    return duration_seconds(duration, what)


class Context:
    """Handed to a workflow function as ``ctx``; the only door to durable effects."""

    def __init__(self, execution_id: str, journal: Journal, driver: Driver) -> None:
        self._execution_id = execution_id
        self._journal = journal
        self._driver = driver
        self._cursor = Cursor(journal)
        self._steps = StepRunner(
            execution_id, journal, driver, driver.redactor, self._before_new_call
        )
        self._children = ChildRunner(
            execution_id, journal, self._cursor, driver, self._before_new_call
        )
        #: Step name -> the step it names in this run (two steps may not share a name).
        self._step_names: dict[str, Step[Any]] = {}
        #: What stopped this replay, once a durable call raised it (see ``latched``).
        self._stopped: BaseException | None = None
        #: What an async body's durable calls raised (failed steps): see :meth:`failure`.
        self._raised_by_calls: list[Exception] = []

    @property
    def execution_id(self) -> str:
        """The id of the run being executed (with an activity name, the idempotency key to
        hand to external systems: a step in flight at a crash may run again)."""
        return self._execution_id

    # bookkeeping --------------------------------------------------------------------

    def _check_step(self, step: object, where: str) -> None:
        if not isinstance(step, Step):
            raise WorkflowDefinitionError(
                f"{where} needs a step declared with @wp.step, got {step!r}"
            )
        known = self._step_names.setdefault(step.name, step)
        if known is not step:
            raise WorkflowDefinitionError(
                f"two different steps are named {step.name!r} ({known.fn!r} and {step.fn!r}); "
                "their results would be recorded under one activity name: rename one"
            )

    def _who(self, name: str, invocation: int, activity: str) -> Activity:
        return Activity(self._execution_id, name, invocation, activity)

    def _before_new_call(self, *, ending: bool = False) -> None:
        """Checked before anything new runs: a finished step's deferred events are written
        (when the body ended they go out with the outcome instead), the lease is checked,
        then a cancellation, then the run's deadline."""
        if not ending:
            self._driver.flush()
        self._driver.check_lease()
        cancelled = self._journal.cancelled
        if cancelled is not None:
            compensate, actor = cancelled
            if not self._journal.cancel_seen:  # a replay's would be a duplicate, dropped
                at = self._driver.clock()
                self._driver.record_checked(
                    [events.cancellation_received(self._execution_id, compensate, actor, at)]
                )
            raise Cancelled(compensate, actor)
        timed_out = self._journal.timed_out
        deadline = self._driver.deadline
        if timed_out is None and deadline is not None and self._driver.clock() >= deadline:
            at = self._driver.clock()
            self._driver.record_checked(
                [events.workflow_timed_out(self._execution_id, deadline, at)]
            )
            timed_out = deadline.isoformat()
        if timed_out is not None:
            raise WorkflowTimeoutError(self._driver.workflow, timed_out)
        if self._driver.news:  # a fenced write saw a cancellation this replay has not read
            raise Reload

    def _ended(self, raised: BaseException | None = None) -> None:
        """The body ended (by raising ``raised``): every recorded call must have been
        replayed."""
        self._cursor.check_exhausted(raised)

    def _cancelled(self, call: str, how: str) -> None:
        """An ``async def`` body cancelled ``call`` (see
        :class:`~wf_persist.errors.CancelledCallError`)."""
        self._cursor.cancelled(call, how)

    @property
    def divergence(self) -> Exception | None:
        return self._cursor.divergence

    def failure(self, raised: BaseException) -> BaseException:
        """What the run fails with, the body having raised ``raised``: a divergence, even if
        the workflow caught it and failed otherwise; but a durable call an ``async def``
        body cancelled does not hide the failure of another call that the body raised (a
        ``TaskGroup``'s failing step cancels its siblings)."""
        divergence = self._cursor.divergence
        if divergence is None:
            return raised
        if isinstance(divergence, CancelledCallError) and self._from_a_call(raised):
            return raised
        return divergence

    def _from_a_call(self, raised: BaseException) -> bool:
        """Whether ``raised`` is what a durable call raised (or a group of only such): not
        an error the cancel itself made (``wait_for``'s ``TimeoutError``) or led to."""
        if isinstance(raised, BaseExceptionGroup):
            return all(self._from_a_call(e) for e in raised.exceptions)
        return any(raised is e for e in self._raised_by_calls)

    def error_document(self, exc: BaseException) -> dict[str, Any]:
        """A stored error, scrubbed of every secret value resolved in this drive."""
        return self._steps.error_document(exc)

    def compensate(self, reason: dict[str, Any]) -> list[dict[str, Any]]:
        """Run registered compensations newest first (the saga unwind); their errors."""
        return self._steps.compensate(reason)

    # steps --------------------------------------------------------------------------

    @latched
    def run(self, step: Step[R], *args: Any, **kwargs: Any) -> R:
        """Run ``step`` durably: once per run, its result recorded before the next call.

        Arguments are validated against the step's annotations before anything is recorded.
        A raised exception is retried per the step's ``retry``; once attempts are exhausted it
        is raised here as :class:`StepExecutionError`. A declared terminal error (``errors=``)
        is never retried and is raised as itself.
        """
        self._check_step(step, "ctx.run")
        bound = self._steps.bind(step, args, kwargs)
        stored = None
        if self._cursor.upcoming("step", step.name) is None:
            # Not a recorded call: its arguments are checked before it takes a place, so a
            # refusal the body catches moves no call after it (a replay meets it again).
            stored = self._steps.stored_inputs(step, bound)
        activity, invocation = self._cursor.enter("step", step.name)
        call = StepCall(step, bound, activity, invocation, stored)
        return self._steps.run(call, inline=False)  # type: ignore[no-any-return]

    @latched
    def all(
        self, calls: Sequence[Call[Any]], *, concurrency: int | None = None, name: str = "all"
    ) -> list[Any]:
        """Run steps concurrently; return their results in input order.

        Each branch is a step call (``wp.call(step, *args)``) with its own activity name;
        finished branches are not re-run on replay. A failing branch fails the block once
        every branch settled (its error is raised here); branches that succeeded are
        registered for compensation. A replay with different branches (count or steps) is
        a :class:`NonDeterminismError`.
        """
        if concurrency is not None:
            limit = plain_number(concurrency)
            if not isinstance(limit, int) or limit < 1:
                raise InvalidArgumentError(
                    f"concurrency must be a positive integer, got {shown(concurrency)}"
                )
            concurrency = limit
        name = check_call_name(name, "ctx.all name")
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise WorkflowDefinitionError(
                f"ctx.all takes a list of wp.call(step, ...) items, got {calls!r:.80}"
            )
        for c in calls:
            if not isinstance(c, Call):
                raise WorkflowDefinitionError(f"ctx.all takes wp.call(step, ...) items, got {c!r}")
            self._check_step(c.step, "ctx.all")
        prepared = [(c, self._steps.bind(c.step, c.args, c.kwargs)) for c in calls]
        stored: list[dict[str, Any] | None] = [None] * len(prepared)
        if self._cursor.upcoming("all", name) is None:
            # As for ctx.run: a branch's arguments refused before the block takes a place
            # (a refused branch never recorded an outcome, and each replay then met it as a
            # new call in the middle of the history).
            stored = [self._steps.stored_inputs(c.step, args) for c, args in prepared]
        activity, invocation = self._cursor.enter("all", name)
        branch_names = [self._cursor.next_name(c.step.name) for c, _ in prepared]
        self._cursor.check_branches(activity, [a for a, _ in branch_names])
        who = self._who(name, invocation, activity)
        if activity not in self._journal.branches:
            self._before_new_call()
        # A replay of a finished block records neither event again (each would be a
        # row-locked transaction whose duplicate the store drops): no branch runs. An
        # unfinished block's record is the fenced check before its branches run again.
        finished = activity in self._journal.blocks_done
        if not finished:
            self._driver.record_checked(
                [events.all_started(who, [a for a, _ in branch_names], self._driver.clock())]
            )

        def branch(i: int) -> Any:
            call, arguments = prepared[i]
            act, inv = branch_names[i]
            return self._steps.run(StepCall(call.step, arguments, act, inv, stored[i]), inline=True)

        if all(a in self._journal.outcomes for a, _ in branch_names):
            # Every branch recorded (a replay): each returns its outcome without running,
            # so they are read here, in order, with no threads to start.
            futures = [settled_here(branch, i) for i in range(len(prepared))]
        else:
            futures = on_threads(branch, len(prepared), concurrency, "wf-persist-all")
        for f in futures:  # control flow (lease lost, cancellation) wins over step errors
            exc = f.exception()
            if exc is not None and not isinstance(exc, Exception):
                raise exc
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if not finished:
            doc = None if error is None else self.error_document(error)
            self._driver.record_checked(
                [events.all_finished(who, len(prepared), doc, self._driver.clock())]
            )
        if error is not None:
            raise error
        return [f.result() for f in futures]

    # recorded values ------------------------------------------------------------------

    def _value(self, kind: str, make: Callable[[], Any]) -> Any:
        activity, invocation = self._cursor.enter(kind, kind)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            return recorded[1]
        value = make()
        who = self._who(kind, invocation, activity)
        self._steps.record([events.value_recorded(kind, who, value, self._driver.clock())])
        return value

    @latched
    def now(self) -> dt.datetime:
        """The current UTC time by the database's clock, recorded: a replay sees the same."""
        return dt.datetime.fromisoformat(
            self._value("now", lambda: self._driver.clock().isoformat())
        )

    @latched
    def random(self) -> float:
        """A float in [0, 1), recorded: a replay sees the same number."""
        return float(self._value("random", _random.random))

    @latched
    def uuid(self) -> _uuid.UUID:
        """A random UUID4, recorded: a replay sees the same id."""
        return _uuid.UUID(self._value("uuid", lambda: str(_uuid.uuid4())))

    @latched
    def code(
        self, name: str, fn: Callable[[], T], *, output: Any = Any, reason: str | None = None
    ) -> T:
        """Run a plain computation once and record its value (validated by ``output``).

        Not retried: an exception fails here as :class:`CodeExecutionError`, and a replay
        raises it again without running ``fn``.
        """
        name = check_call_name(name, "code block name")
        activity, invocation = self._cursor.enter("code", name)
        adapter = adapter_for(output)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            ok, value = recorded
            if not ok:
                raise CodeExecutionError(name, value)
            return from_json(adapter, value, f"recorded result of code block {name}")  # type: ignore[no-any-return]
        check_can_await(fn, f"code block {name}")
        self._before_new_call()
        who = self._who(name, invocation, activity)
        started = events.code_started(who, reason, self._driver.clock())
        try:
            what = f"result of code block {name}"
            with outside_body(), self._driver.user_code():
                # New work like a step: not started without the lease (checked as late).
                call = self._driver.code_function(name, fn)
                produced = settle(checked_in_thread(self._driver.check_lease, call))
            stored = self._driver.as_stored(to_json(adapter, produced, what))
            self._driver.check_size(what, stored)
        except Exception as exc:
            cause = self.error_document(exc)
            failed = events.code_finished(who, reason, False, cause, self._driver.clock())
            self._steps.record([started, failed])
            raise CodeExecutionError(name, cause) from exc
        completed = events.code_finished(who, reason, True, stored, self._driver.clock())
        self._steps.record([started, completed])
        return adapter.validate_python(stored)  # type: ignore[no-any-return]

    # failure --------------------------------------------------------------------------

    def fail(self, error: BaseException | type[BaseException]) -> NoReturn:
        """Fail the run with a typed error callers can match (``Failed.matches``).

        Registered compensations run first, newest first.
        """
        fail_with(error)

    # suspension -----------------------------------------------------------------------

    @latched
    def sleep(self, duration: dt.timedelta | float, *, name: str | None = None) -> None:
        """Sleep durably (``timedelta`` or seconds). The run is parked as a row with a wake
        time and resumed when due (by the database's clock), by whichever worker is alive.

        The default name is ``sleep:<seconds>s``, so the activity is e.g. ``sleep:30s#1``.
        """
        seconds = _seconds(duration, "sleep duration")
        base_name = f"sleep:{seconds:g}s" if name is None else name
        base_name = check_call_name(base_name, "sleep name")
        activity, invocation = self._cursor.enter("sleep", base_name)
        if activity in self._journal.outcomes:
            return
        who = self._who(base_name, invocation, activity)
        self._before_new_call()
        wake_at = self._journal.sleeping.get(activity)
        if wake_at is None:
            now = self._driver.clock()
            wake_at = now + dt.timedelta(seconds=seconds)
            self._driver.suspend([events.sleep_started(who, seconds, wake_at, now)], wake_at)
            raise Suspended
        if self._driver.clock() < wake_at:
            self._driver.suspend([], wake_at)
            raise Suspended
        self._driver.record_checked(
            [events.sleep_completed(who, seconds, wake_at, self._driver.clock())]
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
        return self._wait_for_signal(name, payload_type, timeout)

    @latched
    def _wait_for_signal(
        self, name: str, payload_type: Any, timeout: dt.timedelta | float | None
    ) -> Received[Any] | TimedOut:
        name = check_call_name(name, "signal name")
        limit = None if timeout is None else _seconds(timeout, "signal timeout")
        activity, invocation = self._cursor.enter("signal", name)
        adapter = adapter_for(payload_type)
        recorded = self._journal.outcomes.get(activity)
        if recorded is not None:
            outcome = recorded[1]
            if isinstance(outcome, Received):
                return Received(from_json(adapter, outcome.value, f"payload of signal {name}"))
            return TimedOut()
        who = self._who(name, invocation, activity)
        rejected: list[events.NewEvent] = []
        schema = adapter.json_schema()
        if activity in self._journal.delivered:
            payload = self._journal.delivered[activity]
            try:
                value = from_json(adapter, payload, f"payload of signal {name}")
            except InvalidPayloadError as exc:
                # The sender judged it by the wait's JSON Schema alone (it lacks the type, or
                # the type is no class): refused here and recorded, and the wait goes on,
                # rather than a misfit sent from outside failing the run.
                at = self._driver.clock()
                rejected.append(events.delivery_rejected(who, _brief_errors(exc.errors), at))
                del self._journal.delivered[activity]
            else:
                self._driver.record_checked(
                    [events.signal_received(who, payload, self._driver.clock())]
                )
                return Received(value)
        if activity not in self._journal.delivered:
            self._before_new_call()
            taken = self._take_buffered(who, payload_type, adapter, schema, rejected)
            if taken is not None:
                return Received(from_json(adapter, taken.value, f"payload of signal {name}"))
        waiting = self._journal.waiting.get(activity)
        if waiting is None:
            now = self._driver.clock()
            deadline = None if limit is None else now + dt.timedelta(seconds=limit)
            event = events.signal_waiting(
                who, limit, deadline, schema, type_reference(payload_type), now
            )
            self._driver.suspend([*rejected, event], deadline)
            raise Suspended
        deadline_text = waiting.get("deadline")
        deadline = None if deadline_text is None else dt.datetime.fromisoformat(deadline_text)
        if deadline is not None and self._driver.clock() >= deadline:
            # Checked: a signal delivered since the history was read wins over the timeout.
            self._driver.record_checked(
                [
                    *rejected,
                    events.signal_timeout(who, waiting.get("timeout"), self._driver.clock()),
                ]
            )
            return TimedOut()
        self._driver.suspend(rejected, deadline)
        raise Suspended

    def _take_buffered(
        self,
        who: Activity,
        payload_type: Any,
        adapter: TypeAdapter[Any],
        schema: dict[str, Any],
        rejected: list[events.NewEvent],
    ) -> Received[Any] | None:
        """The stored payload of the oldest buffered signal for this wait that fits it (a
        ``Received``: the payload itself may be ``None``), recorded as received with the
        rejections of misfits before it; or ``None``: the misfits are left in ``rejected``
        for the write that parks the run."""
        queue = self._journal.buffered.get(who.name) or []
        type_ref = type_reference(payload_type)
        wait = {"payloadType": type_ref, "payloadSchema": schema}
        while queue:
            signal_id, payload = queue.pop(0)
            now = self._driver.clock()
            try:
                stored = validate_signal(self._execution_id, who.name, wait, payload)
                # What the wait does with it: a type without a class (``list[datetime]``) is
                # more than its JSON Schema, and a misfit must be rejected, not fail the run.
                adapter.validate_python(stored)
            except (SignalPayloadError, ValidationError) as exc:
                found = exc.errors if isinstance(exc, SignalPayloadError) else exc.errors()
                rejected.append(events.signal_rejected(who, signal_id, _brief_errors(found), now))
                continue
            taken = events.signal_taken(who, signal_id, stored, schema, type_ref, now)
            self._driver.record_checked([*rejected, taken])
            return Received(stored)
        return None

    # child workflows ----------------------------------------------------------------

    @latched
    def start_child(
        self,
        workflow: Workflow[Any, Out] | str,
        payload: Any = None,
        *,
        version: int | None = None,
        cancel_with_parent: bool = True,
    ) -> ChildHandle[Out]:
        """Start a child run of ``workflow`` (a definition, or a name) and return its
        handle at once; ``version`` pins one. A workflow this runtime does not serve at
        that version starts the version cataloged in the database, input checked against
        its recorded JSON Schema: a worker elsewhere drives it, its result comes back as
        JSON.

        The input is validated like a start's. The child's id derives from this run's id
        and the call, so a replay returns the recorded handle and never starts a second
        child. Any worker drives the child. Cancelling this run (or its timeout) cancels the
        child too, with the same ``compensate`` choice, unless ``cancel_with_parent`` is
        False.
        """
        return self._children.start(workflow, payload, version, cancel_with_parent)

    @latched
    def child_result(self, handle: ChildHandle[Out]) -> Out:
        """The child's result, parking this run (no thread held) until the child ends.

        Raises:
            ChildWorkflowError: the child failed (also when it was cancelled or timed out);
                ``.error`` is its stored error document.
        """
        return self._children.result(handle)

    def run_child(
        self,
        workflow: Workflow[Any, Out] | str,
        payload: Any = None,
        *,
        version: int | None = None,
        cancel_with_parent: bool = True,
    ) -> Out:
        """:meth:`start_child` then :meth:`child_result`."""
        handle = self.start_child(
            workflow, payload, version=version, cancel_with_parent=cancel_with_parent
        )
        return self.child_result(handle)

    def children_to_cancel(self) -> list[str]:
        """The children this run started that have not ended and go with it when it is
        cancelled (as far as this replay knows: the rest have ended or were let go)."""
        j = self._journal
        return [
            str(e["childExecutionId"])
            for a, e in j.children.items()
            if a not in j.children_done and e.get("cancelWithParent", True) is not False
        ]

    @latched
    def set_event(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` for clients (``client.get_event(id, key)``); a
        later call with the same key replaces it. Recorded once: a replay publishes nothing
        again."""
        key = check_call_name(key, "event key")
        if self._cursor.upcoming("event", key) is not None:
            self._cursor.enter("event", key)  # recorded: an event's place is its event.set
            return
        if not self._cursor.replaying():
            self._before_new_call()
        # Checked before the call takes a place: a refusal the body catches must not move
        # the calls after it (a replay meets the refusal again here).
        stored = to_json(adapter_for(Any), value, f"value of event {key}")
        self._driver.check_size(f"value of event {key}", stored)
        activity, invocation = self._cursor.enter("event", key)
        who = self._who(key, invocation, activity)
        self._steps.record([events.event_set(who, key, stored, self._driver.clock())])


#: The longest message a ``signal.rejected`` error keeps.
MAX_REJECTION_MESSAGE = 500


def _brief(msg: object) -> str:
    """A rejection's message, cut: a JSON Schema message quotes the whole value, and a few
    large misfits recorded in one write would not fit MariaDB's packet."""
    text = str(msg)
    if len(text) <= MAX_REJECTION_MESSAGE:
        return text
    return text[:MAX_REJECTION_MESSAGE] + "..."


def _brief_errors(found: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors as a rejection records them: where, and a message cut short."""
    return [{"loc": list(e.get("loc", ())), "msg": _brief(e.get("msg"))} for e in found]
