"""Control flow between a workflow body and the runtime driving it.

All three are ``BaseException`` subclasses so that a workflow's ``except Exception`` cannot
swallow them: the body must stop where it is and the runtime decides what happens next.
"""

from __future__ import annotations


class Halt(BaseException):
    """The runtime cannot go on (lease lost, database error): stop; whoever claims the run
    next resumes it by replay. ``cause`` is what stopped it."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Suspended(BaseException):
    """The run is parked (a sleep, a signal wait, a long retry backoff): nothing is kept in
    memory; the run is a row with a wake time (or none, until a signal)."""


class Reload(BaseException):
    """Someone else wrote to the run (a signal, a cancellation) after its history was read:
    replay again from the fresh history instead of going on with a stale view."""
