"""The run lifecycle: statuses, allowed transitions, and which event moves a run where.

Every writer asks this module; nothing else spells a status or a guard. The rules are SPEC
section 3's: terminal states are final, ``compensating`` only ever ends ``failed``, and an
event appended on replay that was already recorded (a dedupe drop) changes nothing.

    running ──sleep.started / signal.waiting / signal.rejected──▶ suspended
    suspended ──sleep.completed / signal.received / signal.timeout / delivery──▶ running
    running | suspended ──cancel(compensate)──▶ compensating ──▶ failed
    running | suspended | compensating ──cancel(no compensation)──▶ failed
    running | suspended ──workflow.completed──▶ completed
    running | suspended | compensating ──workflow.failed──▶ failed
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final


class Status(StrEnum):
    """A run's status, stored in ``wf_executions.status``."""

    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPENSATING = "compensating"
    COMPLETED = "completed"
    FAILED = "failed"


RUNNING: Final = Status.RUNNING
SUSPENDED: Final = Status.SUSPENDED
COMPENSATING: Final = Status.COMPENSATING
COMPLETED: Final = Status.COMPLETED
FAILED: Final = Status.FAILED

#: Every status, in lifecycle order (the CHECK constraint lists the same).
STATUSES: Final[tuple[str, ...]] = tuple(s.value for s in Status)
#: Statuses a run never leaves.
TERMINAL: Final = frozenset({COMPLETED.value, FAILED.value})
#: Statuses of a run that still needs a driver (claims look only at these).
ACTIVE: Final = frozenset(STATUSES) - TERMINAL
#: ``cancel`` applies here; anything else is a :class:`CannotCancelError` (but see
#: :func:`cancellable`).
CANCELLABLE: Final = frozenset({RUNNING.value, SUSPENDED.value})
#: A signal can be delivered (or buffered) only to a run in one of these.
SIGNALABLE: Final = frozenset({RUNNING.value, SUSPENDED.value})
#: A completion is recorded only from these: a run being compensated can only fail.
COMPLETABLE: Final = frozenset({RUNNING.value, SUSPENDED.value})
#: A failure is recorded from any active status.
FAILABLE: Final = ACTIVE

#: Allowed transitions (from -> to).
TRANSITIONS: Final[Mapping[str, frozenset[str]]] = {
    RUNNING.value: frozenset({SUSPENDED, COMPENSATING, COMPLETED, FAILED}),
    SUSPENDED.value: frozenset({RUNNING, COMPENSATING, COMPLETED, FAILED}),
    COMPENSATING.value: frozenset({FAILED}),
    COMPLETED.value: frozenset(),
    FAILED.value: frozenset(),
}

#: The status an appended event moves a run to (events not listed leave it alone).
EVENT_STATUS: Final[Mapping[str, Status]] = {
    "sleep.started": SUSPENDED,
    "signal.waiting": SUSPENDED,
    # A wait refused a signal (buffered, or delivered): it waits on, unless a signal.received
    # or signal.timeout written after it in the same write moves it on.
    "signal.rejected": SUSPENDED,
    "child.waiting": SUSPENDED,
    "sleep.completed": RUNNING,
    "signal.received": RUNNING,
    "signal.timeout": RUNNING,
    "signal.delivered": RUNNING,
    "child.finished": RUNNING,
    "workflow.completed": COMPLETED,
    "workflow.failed": FAILED,
}


def can_transition(current: str, target: str) -> bool:
    """Whether a run in ``current`` may move to ``target`` (staying put is always allowed)."""
    return current == target or target in TRANSITIONS.get(current, frozenset())


def event_transition(current: str, event_type: str) -> str | None:
    """The status an appended ``event_type`` moves a run in ``current`` to, if any.

    Event-driven moves never leave a terminal or compensating run (a late ``signal.received``
    replayed during an unwind must not flip it back to running).
    """
    target = EVENT_STATUS.get(event_type)
    if target is None or target == current:
        return None
    if current == COMPENSATING and target != FAILED:
        return None
    return target.value if can_transition(current, target) else None


def cancellable(status: str, compensate: bool, unwinding_too: bool = True) -> bool:
    """Whether a run in ``status`` takes a cancellation: a run being compensated takes one
    without compensation, which ends it at once (the way out of an unwind that no worker
    runs: its version served nowhere any more), unless ``unwinding_too`` is off (a tree's
    cancel reaching a child: that child's own unwind runs its course)."""
    return status in CANCELLABLE or (unwinding_too and status == COMPENSATING and not compensate)


def cancellation_status(compensate: bool) -> Status:
    """Where a cancellation takes a run: unwinding first, or straight to failed."""
    return COMPENSATING if compensate else FAILED


def is_terminal(status: str) -> bool:
    return status in TERMINAL
