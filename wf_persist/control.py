"""Control flow between a workflow body and the runtime driving it.

All three are ``BaseException`` subclasses so that a workflow's ``except Exception`` cannot
swallow them: the body must stop where it is and the runtime decides what happens next.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Concatenate, NoReturn, ParamSpec, Protocol, TypeVar

from .error_documents import shown
from .errors import Cancelled, WorkflowDefinitionError


class Stop(BaseException):
    """What the runtime raises through a body to stop it (the classes below, a replay
    check's frontier): never a failure of the user code it passes through."""


class Halt(Stop):
    """The runtime cannot go on (lease lost, database error): stop; whoever claims the run
    next resumes it by replay. ``cause`` is what stopped it."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Suspended(Stop):
    """The run is parked (a sleep, a signal wait, a long retry backoff): nothing is kept in
    memory; the run is a row with a wake time (or none, until a signal)."""


class Reload(Stop):
    """Someone else wrote to the run (a signal, a cancellation) after its history was read:
    replay again from the fresh history instead of going on with a stale view."""


try:
    from greenlet import GreenletExit
except ImportError:  # without the ``async`` extra
    _STOPS: tuple[type[BaseException], ...] = (Stop, Cancelled)
else:
    _STOPS = (Stop, Cancelled, GreenletExit)


def interrupting(exc: BaseException) -> bool:
    """Whether ``exc`` (not an ``Exception``) stops a drive rather than fails the user code
    it came out of: the runtime's own stops, a cancellation, a greenlet's exit, and anything
    in the main thread, where a signal handler may have raised it (``KeyboardInterrupt``,
    ``SystemExit``, a handler's own): the run is given back, another drive resumes it.
    Anywhere else (a worker's threads, the async worker's loop) no signal raises anything: a
    ``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit`` or a ``BaseException`` of the
    user's own is that code's failure; so is an ``asyncio.CancelledError`` anywhere (an
    async body that cancelled itself). Given back instead, the
    run would be driven again at once, for ever; and asyncio lets the first two out of its
    loop, which then stops."""
    if isinstance(exc, (Exception, asyncio.CancelledError)):
        return False  # no signal raises a CancelledError (asyncio.run makes Ctrl-C one)
    if isinstance(exc, _STOPS):
        return True
    from .bridge import bridged

    return threading.current_thread() is threading.main_thread() and not bridged()


def stops_drive(exc: BaseException) -> bool:
    """Whether ``exc`` ends the drive rather than the body (:func:`interrupting`, less a
    cancellation: that one ends the run, through the body)."""
    return interrupting(exc) and not isinstance(exc, Cancelled)


class Latched(Protocol):
    """A workflow context: the stop a durable call of its raised, if one did."""

    _stopped: BaseException | None


L = TypeVar("L", bound=Latched)
P = ParamSpec("P")
T = TypeVar("T")


def latched(method: Callable[Concatenate[L, P], T]) -> Callable[Concatenate[L, P], T]:
    """A body's durable call: once one stopped the replay (the run parked, must be
    replayed again, or cannot go on; a replay check's frontier; an interrupt in the main
    thread, Ctrl-C in a step), every later one stops it again, and the runtime stops the
    body's outcome too (:func:`wf_persist.bodies.run_body`). A body that caught the stop
    (``asyncio.gather(..., return_exceptions=True)``, a bare ``except:``) would otherwise
    go on recording, or finish a run that is parked, or whose interrupted step it never
    recorded."""

    @functools.wraps(method)
    def call(self: L, /, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._stopped is not None:
            raise self._stopped.with_traceback(None)
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if stops_drive(exc):
                self._stopped = exc
            raise

    return call


def raisable(value: object) -> bool:
    """Whether ``raise value`` raises it: an exception, or an exception class (made with
    no arguments)."""
    return isinstance(value, BaseException) or (
        isinstance(value, type) and issubclass(value, BaseException)
    )


def fail_with(error: BaseException | type[BaseException]) -> NoReturn:
    """``ctx.fail``: raise ``error``; anything but an exception is misuse (Python's own
    ``TypeError`` would fail the run instead, naming nothing of ``ctx.fail``)."""
    if not raisable(error):
        raise WorkflowDefinitionError(
            f"ctx.fail() takes an exception, got {type(error).__name__} {shown(error)}"
        )
    raise error
