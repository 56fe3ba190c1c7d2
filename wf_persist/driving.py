"""What a run's context needs from whoever drives the run: the :class:`Driver` protocol.

The runtime's :class:`~.driver.RunDriver` writes to the database; the replay checker's
driver writes nothing and runs no step. The context and the step runner see only this.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, TypeVar

from .authoring import Step, Workflow
from .events import Activity, NewEvent
from .secrets import Redactor, SecretResolver

T = TypeVar("T")


class ChildStart(NamedTuple):
    """A child run about to be started, checked (nothing written yet): the version it is
    pinned to; where this process serves that version, its definition (which decodes the
    child's result), else None (the result comes back as JSON); the input's stored form;
    the child's timeout from now (None: its own driver applies its workflow's)."""

    name: str
    version: int
    definition: Workflow[Any, Any] | None
    stored: Any
    timeout: float | None


class Driver(Protocol):
    """What the runtime provides to a context for the run it drives."""

    #: Seconds after which a running attempt's start is recorded on its own (None: never).
    record_start_after: float | None
    #: Set when a fenced write saw a status this replay did not expect (a cancellation).
    news: bool
    #: The name of the workflow the run belongs to (for logs).
    workflow: str
    #: When the run times out (None: never); a park never outlasts it.
    deadline: dt.datetime | None
    #: The secrets resolved in this drive, scrubbed from every error it stores.
    redactor: Redactor

    def clock(self) -> dt.datetime:
        """The database's time (measured from the claim), never the worker's own clock."""

    def record(self, events: Sequence[NewEvent]) -> None:
        """Append events in one fenced write (the hot path)."""

    def defer(self, events: Sequence[NewEvent]) -> None:
        """Append events with the next write (a finished step's: the next call's write, the
        park or the outcome), at the latest when :meth:`flush` is called."""

    def flush(self) -> None:
        """Write the deferred events now: something new is about to start."""

    def record_checked(self, events: Sequence[NewEvent]) -> None:
        """Append under the row lock; :class:`Reload` if news arrived first."""

    def suspend(self, events: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        """Append, release the lease and park the run until ``wake_at`` (or a signal)."""

    def check_lease(self) -> None:
        """Halt before a new step if the lease was lost or the runtime is closing."""

    def check_size(self, what: str, value: Any) -> None:
        """Refuse a value this database cannot store."""

    def as_stored(self, doc: Any) -> Any:
        """A recorded document as a replay will read it back from this database."""

    def secret_resolver(self) -> SecretResolver | None:
        """The resolver of the process running the step."""

    def concurrency_slot(
        self, step: Step[Any], key: str
    ) -> AbstractContextManager[Callable[[], None]]:
        """Hold one of the step's concurrency slots while it runs; yields the check to make
        right before the step's own code (it raises if the slot is no longer this run's)."""

    def prepare_child(
        self, workflow: Workflow[Any, Any] | str, version: int | None, payload: Any
    ) -> ChildStart:
        """Check a new child's start: the version registered here, else (by name) the one
        cataloged in the database; raises the typed error of a refusal, writes nothing."""

    def start_child(
        self, child_id: str, child: ChildStart, who: Activity, cancel_with_parent: bool
    ) -> None:
        """Create the child run and record ``child.started`` in one transaction."""

    def child_definition(self, name: str, version: int) -> Workflow[Any, Any] | None:
        """The definition of a child's pinned version, where this process has it."""

    def after(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` after ``delay`` seconds, off the caller's thread and off any thread
        other timers need (it may wait for the database); returns a cancel."""

    def pause(self, seconds: float) -> None:
        """Wait in this thread (a short retry backoff); the test kit skips the time."""

    def user_code(self) -> AbstractContextManager[None]:
        """Around user code (a step, a code block, a compensation): the drive's
        connection may go back to the pool meanwhile."""

    def step_function(self, step: Step[Any]) -> Callable[..., Any]:
        """The function an attempt of ``step`` calls (the test kit may stand in for it)."""

    def code_function(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        """The function code block ``name`` calls (the replay checker runs none)."""
