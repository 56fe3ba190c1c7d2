"""Replay bookkeeping: what a run recorded, and whether a replay makes the same calls.

Each durable call gets an activity name ``<name>#<n>`` (n counts calls of that name in the
run, one counter per name shared by every kind of call, as the seed does). The
:class:`Cursor` compares each call with the journal entry recorded at the same position
before anything runs; the branches of a ``ctx.all`` must be the recorded branches; and a body
that ends before it consumed every recorded call diverged too. A divergence is a
:class:`NonDeterminismError` that sticks: once seen, no new call may run, even if the
workflow catches it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from .errors import CancelledCallError, NonDeterminismError

#: How much of an ending exception's text a divergence quotes.
END_TEXT: Final = 500


def _said(exc: BaseException) -> str:
    """``Type: text`` of an exception, or its type alone if its text cannot be had."""
    name = type(exc).__name__
    try:
        return f"{name}: {str(exc)[:END_TEXT]}"
    except Exception:
        return name


T = TypeVar("T")

#: Which kind of journal entry each event type records.
KIND_OF_EVENT: Final[Mapping[str, str]] = {
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
    "event.set": "event",
    "child.started": "child",
    "child.waiting": "child",
}
_VALUE_EVENTS = frozenset({"now.recorded", "random.recorded", "uuid.recorded"})


@dataclass(frozen=True)
class Received(Generic[T]):
    """``wait_for_signal`` got a signal; ``value`` is validated into the payload type."""

    value: T
    timed_out: bool = False


@dataclass(frozen=True)
class TimedOut:
    """``wait_for_signal`` reached its timeout first (a value, not an exception)."""

    timed_out: bool = True


@dataclass(slots=True)
class StepRecord:
    """A step activity's attempts so far."""

    #: Highest attempt number recorded (started, failed or completed).
    last_attempt: int = 0
    #: Attempts that failed and will be retried.
    failures: int = 0
    #: When the next attempt may start (the last retried failure's ``retryAt``).
    retry_at: dt.datetime | None = None


@dataclass(slots=True)
class Journal:
    """What a run recorded, rebuilt from its history in one pass.

    ``entries`` are the positional calls, ``(kind, activity)``; steps run as branches of
    ``ctx.all`` are matched by activity name instead of position (branches finish in any
    order), and the branch list itself is checked against ``branches``.
    """

    entries: list[tuple[str, str]] = field(default_factory=list)
    outcomes: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    steps: dict[str, StepRecord] = field(default_factory=dict)
    #: ``all`` activity -> its recorded branch activities.
    branches: dict[str, list[str]] = field(default_factory=dict)
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
    #: Whether a drive already recorded that it saw the cancellation
    #: (``cancellation.received``): a replay need not record it again.
    cancel_seen: bool = False
    #: ``all`` activities whose end (``all.completed``/``all.failed``) was recorded: a
    #: replay records neither it nor ``all.started`` again.
    blocks_done: set[str] = field(default_factory=set)
    #: The deadline (ISO text) once ``workflow.timed_out`` was recorded.
    timed_out: str | None = None
    #: Child activity -> its ``child.started`` event.
    children: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Child activities whose parent already parked on them (``child.waiting``).
    child_waits: set[str] = field(default_factory=set)
    #: Child activity -> ``(ok, result or error)`` once ``child.finished`` arrived.
    children_done: dict[str, tuple[bool, Any]] = field(default_factory=dict)
    #: Child activities whose end arrived after the run's cancellation or timeout was
    #: recorded: a wait for one ends with that, as it would have had the child been slower
    #: (a tree's cancel ends the children after the parent's cancellation).
    children_late: set[str] = field(default_factory=set)
    #: Signal name -> buffered signals no wait has taken or rejected yet, oldest first, as
    #: ``(signalId, payload)``.
    buffered: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Sequence[Mapping[str, Any]]) -> Journal:
        journal = cls()
        seen: set[str] = set()
        in_branches: set[str] = set()
        for ev in events:
            etype = ev["type"]
            activity: str = ev.get("activityName") or ""
            if etype == "execution.cancelled":
                journal.cancelled = (bool(ev.get("compensate", True)), ev.get("actor"))
            elif etype == "workflow.timed_out":
                journal.timed_out = str(ev.get("deadline"))
            elif etype == "cancellation.received":
                journal.cancel_seen = True
            elif etype in ("all.completed", "all.failed"):
                journal.blocks_done.add(activity)
            elif etype == "compensation.completed":
                journal.compensated[activity] = None
            elif etype == "compensation.failed":
                journal.compensated[activity] = ev.get("error") or {}
            kind = KIND_OF_EVENT.get(etype)
            if kind is None:
                continue
            if etype == "all.started":
                names = [str(a) for a in ev.get("branchActivities") or []]
                journal.branches[activity] = names
                in_branches.update(names)
            if activity not in seen and activity not in in_branches:
                seen.add(activity)
                journal.entries.append((kind, activity))
            if kind == "step":
                journal._step_event(etype, activity, ev)
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
            elif etype == "event.set":
                journal.outcomes[activity] = (True, None)
            elif etype == "child.started":
                journal.children[activity] = ev
            elif etype == "child.waiting":
                journal.child_waits.add(activity)
        taken: set[str] = set()
        child_activity = {str(e["childExecutionId"]): a for a, e in journal.children.items()}
        stopped = False
        for ev in events:  # client-written: not journal positions
            etype = ev["type"]
            stopped = stopped or etype in ("execution.cancelled", "workflow.timed_out")
            if etype == "signal.delivered" and ev["activityName"] in journal.waiting:
                journal.delivered[ev["activityName"]] = ev.get("payload")
            elif etype == "signal.rejected" and ev.get("delivery") is True:
                journal.delivered.pop(str(ev.get("activityName")), None)  # the wait goes on
            elif etype in ("signal.received", "signal.rejected") and ev.get("signalId"):
                taken.add(str(ev["signalId"]))
            elif etype == "child.finished" and ev.get("childExecutionId") in child_activity:
                ok = bool(ev.get("ok"))
                done = (ok, ev.get("result") if ok else ev.get("error"))
                child = child_activity[str(ev["childExecutionId"])]
                journal.children_done[child] = done
                if stopped:
                    journal.children_late.add(child)
        for ev in events:
            if ev["type"] == "signal.buffered" and ev.get("signalId") not in taken:
                queue = journal.buffered.setdefault(str(ev.get("name")), [])
                queue.append((str(ev.get("signalId")), ev.get("payload")))
        return journal

    def _step_event(self, etype: str, activity: str, ev: Mapping[str, Any]) -> None:
        record = self.steps.setdefault(activity, StepRecord())
        record.last_attempt = max(record.last_attempt, int(ev.get("attempt") or 1))
        if etype == "step.completed":
            self.outcomes[activity] = (True, ev.get("result"))
        elif etype == "step.failed":
            if ev.get("final", True):
                self.outcomes[activity] = (False, ev)
            else:
                record.failures += 1
                retry_at = ev.get("retryAt")
                record.retry_at = None if retry_at is None else dt.datetime.fromisoformat(retry_at)


def describe(kind: str, activity: str) -> str:
    """A call as a divergence names it (a child's activity names its kind already)."""
    return activity if kind == "child" else f"{kind}:{activity}"


class Cursor:
    """Walks the journal as the workflow makes its calls, and catches every divergence."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._counters: dict[str, int] = {}
        self._position = 0
        #: Set when the replay diverged; the run fails with it even if user code catches it.
        self.divergence: NonDeterminismError | None = None

    def _diverge(self, expected: str, actual: str) -> NonDeterminismError:
        self.divergence = NonDeterminismError(expected, actual)
        return self.divergence

    def cancelled(self, call: str, how: str) -> None:
        """The body cancelled ``call`` (or ended while it was under way): the run fails with
        that, as with any divergence, whatever the body does next."""
        if self.divergence is None:
            self.divergence = CancelledCallError(call, how)

    def next_name(self, name: str) -> tuple[str, int]:
        """The activity name and invocation of the next call named ``name``."""
        invocation = self._counters.get(name, 0) + 1
        self._counters[name] = invocation
        return f"{name}#{invocation}", invocation

    def replaying(self) -> bool:
        """Whether the next call has a place in the journal (else it is new)."""
        return self._position < len(self.journal.entries)

    def upcoming(self, kind: str, name: str) -> str | None:
        """The activity name of this call if the next place in the journal is one of its
        kind and name (``enter`` not made), else None."""
        entries = self.journal.entries
        activity = f"{name}#{self._counters.get(name, 0) + 1}"
        if self._position < len(entries) and entries[self._position] == (kind, activity):
            return activity
        return None

    def enter(self, kind: str, name: str) -> tuple[str, int]:
        """Position the next call; raise if it is not the call recorded at this position."""
        if self.divergence is not None:  # caught by the workflow: still nothing new may run
            raise self.divergence
        activity, invocation = self.next_name(name)
        position = self._position
        self._position += 1
        entries = self.journal.entries
        if position < len(entries) and entries[position] != (kind, activity):
            raise self._diverge(describe(*entries[position]), describe(kind, activity))
        return activity, invocation

    def check_branches(self, activity: str, branches: list[str]) -> None:
        """A replayed ``ctx.all`` must run exactly the recorded branches, in order."""
        recorded = self.journal.branches.get(activity)
        if recorded is not None and recorded != branches:
            raise self._diverge(
                f"all:{activity} branches={recorded}", f"all:{activity} branches={branches}"
            )

    def check_exhausted(self, raised: BaseException | None = None) -> None:
        """The body ended (by raising ``raised``, if given): it must have made every
        recorded call (an edited workflow that now returns early would otherwise complete
        over a history it never replayed). A body that raised says what: a recorded value
        that no longer fits its type, say, is the cause to fix."""
        if self.divergence is not None:
            raise self.divergence
        entries = self.journal.entries
        if self._position < len(entries):
            end = "the end of the workflow"
            if raised is not None:
                end = f"{end}, which raised {_said(raised)}"[:END_TEXT]
            raise self._diverge(describe(*entries[self._position]), end)
