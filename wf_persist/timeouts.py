"""Durations and time limits: the check every duration argument passes, a run's deadline,
and a step attempt bounded by its ``timeout``.

A run's deadline is checked before each new durable call (a step, sleep, wait, code block,
the outcome): once it passed, ``workflow.timed_out`` is recorded and the body unwinds as if
cancelled with compensation, failing with :class:`~wf_persist.errors.WorkflowTimeoutError`.
A parked run is woken at its deadline at the latest, so a timeout also happens when no
process was alive at that moment: the first worker up drives it.

A synchronous function cannot be stopped from outside in Python. A step attempt with a
timeout therefore runs on a thread of its own while the drive waits for it; when the time
is up the attempt fails with :class:`~wf_persist.errors.StepTimeoutError` (a transient
failure, retried per the step's policy) and the thread is left to finish on its own: what
it returns or raises then is ignored and never recorded. Its side effects do happen, so a
step with a timeout must be safe to run again, as every step must be after a crash.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from . import clocks
from .error_documents import shown
from .errors import InvalidArgumentError, StepTimeoutError

if TYPE_CHECKING:
    from .backends.sql import Claim

T = TypeVar("T")

log = logging.getLogger("wf_persist.runtime")

#: The longest duration accepted anywhere (sleeps, waits, timeouts): 1000 years. Any later
#: wake time would not fit the timestamp columns of every backend.
MAX_DURATION_SECONDS: Final = 1000 * 365.25 * 86400
#: The longest single join of a step attempt's thread (far below ``threading.TIMEOUT_MAX``).
JOIN_PIECE_SECONDS: Final = 86400.0


#: The longest interval a setting may give (a lease, a poll): 100 years (the test kit's
#: leases last ten), below what Python's waits take (``threading.TIMEOUT_MAX``, 292
#: years; a worker whose wait raised would stop claiming for good).
MAX_INTERVAL_SECONDS: Final = 100 * 365 * 86400


def plain_number(value: object) -> int | float | None:
    """An ``int`` or ``float`` argument as the plain number it holds (``None`` for anything
    else, ``bool`` included), asking only ``type()`` of it: a subclass's own methods (a
    comparison, ``__class__``) may raise or lie."""
    kind = type(value)
    if issubclass(kind, bool):
        return None
    if issubclass(kind, int):
        return int.__int__(value)  # type: ignore[arg-type]
    if issubclass(kind, float):
        return float.__float__(value)  # type: ignore[arg-type]
    return None


#: How long (seconds) a web view's statement waits for a lock another session holds before
#: its request answers 503 (``create_app``'s and ``wf-persist web``'s default).
WEB_LOCK_TIMEOUT: Final = 10.0


def positive(value: object, what: str) -> float:
    """An interval setting in seconds, checked: a real number, not a bool, above 0 and at
    most :data:`MAX_INTERVAL_SECONDS`; returned as a plain ``float``."""
    number = plain_number(value)
    if number is None or not 0 < number < float("inf"):
        raise InvalidArgumentError(f"{what} must be a positive number, got {shown(value)}")
    if not number <= MAX_INTERVAL_SECONDS:
        raise InvalidArgumentError(
            f"{what} must be at most {MAX_INTERVAL_SECONDS} seconds (100 years), got {shown(value)}"
        )
    return float(number)


def duration_seconds(duration: dt.timedelta | float, what: str, *, positive: bool = False) -> float:
    """``duration`` (a ``timedelta`` or seconds) in seconds, checked: a real number, not a
    bool, finite, at least 0 (above 0 if ``positive``), at most 1000 years."""
    # The base classes' own methods: a subclass's may raise or lie.
    seconds = (
        dt.timedelta.total_seconds(duration)
        if isinstance(duration, dt.timedelta)
        else plain_number(duration)
    )
    kind = "positive" if positive else "non-negative"
    if seconds is None or not seconds >= 0 or (positive and not seconds > 0):
        raise InvalidArgumentError(f"{what} must be a {kind} duration, got {shown(duration)}")
    if not seconds <= MAX_DURATION_SECONDS:
        raise InvalidArgumentError(
            f"{what} must be finite and at most {MAX_DURATION_SECONDS:.0f} seconds (1000 years), "
            f"got {shown(duration)}"
        )
    return float(seconds)


def call_within(
    fn: Callable[..., T],
    kwargs: dict[str, Any],
    seconds: float,
    step: str,
    keep: Callable[[], Callable[[], None]] | None = None,
) -> T:
    """``fn(**kwargs)`` on a thread of its own; :class:`StepTimeoutError` if it has not
    returned within ``seconds`` (the thread then runs on, its outcome discarded).

    ``keep``: called when the attempt is given up; what it returns is called by the
    attempt's thread once the attempt really ended (a concurrency slot stays held until
    then, so a limit counts attempts that overran their timeout)."""
    outcome: list[tuple[bool, Any]] = []
    context = contextvars.copy_context()
    lock = threading.Lock()
    after: list[Callable[[], None]] = []

    def attempt() -> None:
        try:
            got: tuple[bool, Any] = (True, context.run(fn, **kwargs))
        except BaseException as exc:  # handed to the waiting drive, raised there
            got = (False, exc)
        with lock:
            outcome.append(got)
            late = list(after)
        for release in late:
            try:
                release()
            except Exception as exc:
                log.warning("step %s: releasing what its late attempt held failed: %s", step, exc)

    thread = threading.Thread(target=attempt, name=f"wf-persist-step-{step}", daemon=True)
    thread.start()
    # Joined in pieces: a join longer than about 292 years raises OverflowError, and every
    # duration up to MAX_DURATION_SECONDS is accepted.
    until = clocks.elapsed() + seconds
    while thread.is_alive():
        left = until - clocks.elapsed()
        if left <= 0:
            break
        thread.join(min(left, JOIN_PIECE_SECONDS))
    with lock:
        late = not outcome
        if late and keep is not None:
            after.append(keep())
    if late:
        raise StepTimeoutError(step, seconds)
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


def run_deadline(claim: Claim, timeout: float | None) -> dt.datetime | None:
    """When a run times out: the deadline its start recorded, else ``timeout`` (its
    workflow's) after its creation, else never."""
    if claim.deadline_at is not None:
        return claim.deadline_at
    if timeout is None:
        return None
    return claim.created_at + dt.timedelta(seconds=timeout)
