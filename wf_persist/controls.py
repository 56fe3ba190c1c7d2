"""Operating runs that exist: cancel one (and the children that go with it), deliver a
signal, purge finished runs. What :class:`~wf_persist.Client` (and so the embedded client)
does to a run besides starting and awaiting it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from . import arguments, events, lifecycle, refusals, telemetry
from .database import READ_ONLY
from .error_documents import error_document
from .errors import Cancelled, InvalidArgumentError, UnsupportedDatabaseError
from .models import CALL_NAME_WIDTH
from .reading import RunReader
from .store import children, executions, signals, slots

log = logging.getLogger("wf_persist.client")

#: Tries of a cancellation that met a concurrent transaction (a deadlock with a child ending).
CANCEL_ATTEMPTS: Final = 5
#: Most ``Limit`` slot rows a purge deletes per transaction (two bound values each).
SLOT_SWEEP_BATCH: Final = 1000


class RunControls(RunReader):
    """Cancel, signal and purge (the client's state and clock are :class:`Client`'s)."""

    #: Whether the engine's connections may not write (a thin client on a read-only one).
    _read_only: bool = False

    def _writable(self) -> None:
        """Before a write: one typed error, not the driver's, where nothing can be written."""
        if self._read_only:
            raise UnsupportedDatabaseError(READ_ONLY)

    def _now(self) -> dt.datetime:
        """The time to record (the client's clock)."""
        raise NotImplementedError

    def _notify(self) -> None:
        """A run changed (the client's hook)."""
        raise NotImplementedError

    @refusals.typed
    def cancel(
        self, execution_id: str, *, compensate: bool = True, actor: str | None = None
    ) -> None:
        """Cancel a running or suspended run, from any process (or, without
        ``compensate``, a run being compensated: it ends at once).

        With ``compensate`` (default) the run moves to ``compensating``, wakes at its
        suspension point (or at its next step boundary if it is running), unwinds its
        compensations and ends ``failed`` with a ``Cancelled`` error. Without, it ends
        ``failed`` at once (``Cancelled``, ``compensate: false``) and no further step of it
        is recorded (a drive in flight stops at its next write). Records
        ``execution.cancelled`` in the same transaction as the status claim.
        Its unfinished children (``ctx.start_child``) are cancelled the same way, theirs in
        turn, unless started with ``cancel_with_parent=False``: in the same transaction.

        Raises:
            CannotCancelError: the run is not running or suspended, or compensating for a
                cancel without ``compensate`` ("Cannot cancel completed execution ..."); of
                two concurrent cancels, the second.
            UnknownExecutionError.
        """
        actor = arguments.check_text("actor", actor)
        if not isinstance(compensate, bool):
            raise InvalidArgumentError(f"compensate must be True or False, got {compensate!r:.80}")
        with self._reading() as conn:
            self._row(conn, execution_id)
        self._writable()
        now = self._now()
        ended: list[tuple[str, int]] = []  # runs the cancel ended (no drive counts them)
        for attempt in range(CANCEL_ATTEMPTS):
            ended.clear()
            try:
                with self.backend.begin() as conn:
                    children.lock_tree(conn, execution_id)
                    self._cancel_run(conn, execution_id, compensate, actor, now, ended)
                    # Its children (theirs in turn) in the same transaction: a cancel cut off
                    # after its commit would leave them running, and once the run has ended
                    # no cancel could reach them. (A run unwinding with compensation cancels
                    # them itself too, before its outcome.)
                    children.cancel_descendants(
                        conn,
                        self.backend,
                        execution_id,
                        compensate=compensate,
                        actor=actor,
                        now=now,
                        ended=ended,
                    )
                break
            except Exception as exc:
                # A tree that kept growing, or a deadlock all the same: nothing was written.
                grew = isinstance(exc, children.TreeGrew)
                if not grew and not self.backend.contention(exc):
                    raise
                # A lock waited for past the engine's timeout is not waited for again (the
                # timeout is the bound its owner chose: a web view's request, say): the
                # runs its holder is not in the way of are cancelled one by one at once.
                if self.backend.cancelled(exc) or attempt + 1 >= CANCEL_ATTEMPTS:
                    # Each in a transaction of its own, top down (as before the one
                    # transaction): never a lock cycle, but a crash midway leaves the rest.
                    ended.clear()
                    self._cancel_one_by_one(execution_id, compensate, actor, now, ended)
                    break
                time.sleep(0.05 * 2**attempt)
        self._notify()
        for name, version in ended:
            telemetry.run_ended(name, version, ok=False)

    def _cancel_run(
        self,
        conn: Connection,
        execution_id: str,
        compensate: bool,
        actor: str | None,
        now: dt.datetime,
        ended: list[tuple[str, int]],
    ) -> None:
        """The run's own cancellation (``execution.cancelled`` and its status), in ``conn``."""
        finished = executions.cancel(
            conn,
            self.backend,
            execution_id,
            cancelled=events.execution_cancelled(execution_id, compensate, actor, now),
            compensate=compensate,
            error=error_document(Cancelled(compensate, actor)),
            now=now,
        )
        if finished is not None:
            ended.append(finished)

    def _cancel_one_by_one(
        self,
        execution_id: str,
        compensate: bool,
        actor: str | None,
        now: dt.datetime,
        ended: list[tuple[str, int]],
    ) -> None:
        """The run's cancellation, then each child's (theirs in turn) in its own transaction."""
        with self.backend.begin() as conn:
            self._cancel_run(conn, execution_id, compensate, actor, now, ended)
        pending = [execution_id]
        while pending:
            with self._reading() as conn:
                below = children.cancelled_with(conn, pending.pop())
            for child_id in below:
                with self.backend.begin() as conn:
                    if children.cancel(
                        conn,
                        self.backend,
                        child_id,
                        compensate=compensate,
                        actor=actor,
                        now=now,
                        ended=ended,
                    ):
                        pending.append(child_id)

    @refusals.typed
    def signal(
        self,
        execution_id: str,
        name: str,
        payload: Any,
        *,
        actor: str | None = None,
        buffer: bool = False,
    ) -> Literal["delivered", "buffered"]:
        """Deliver a signal to the run's latest pending wait on ``name``.

        The payload is validated against the waiting call's type before anything is
        persisted: with the type itself when this process has it, else with the JSON Schema
        the wait recorded (so a process that never ran the workflow validates too). A bad
        payload raises :class:`SignalPayloadError` and the run keeps waiting.

        With ``buffer=True`` a run not waiting on ``name`` yet keeps the signal durably; its
        next ``ctx.wait_for_signal(name)`` takes the oldest one without suspending. It is
        validated now by the latest earlier wait on ``name`` if the run had one, else by the
        wait that takes it, which records a misfit as ``signal.rejected`` and keeps waiting.

        Returns:
            ``"delivered"`` (to a pending wait) or ``"buffered"``.

        Raises:
            SignalNotWaitingError: no pending wait on ``name`` and no ``buffer``, or the run
                has finished (``.status``); nothing is recorded.
            SignalPayloadError: the payload does not fit; nothing is recorded.
            SignalAlreadyDeliveredError: a concurrent delivery to the same wait won (or,
                to a wait that refused its delivery, the one signal sent on for it is in).
        """
        actor = arguments.check_text("actor", actor)
        # No wait takes a longer name (``ctx.wait_for_signal`` refuses it): none is buffered.
        name = arguments.required_text("signal name", name, CALL_NAME_WIDTH)
        if not isinstance(buffer, bool):
            raise InvalidArgumentError(f"buffer must be True or False, got {buffer!r:.80}")
        with self._reading() as conn:
            self._row(conn, execution_id)
        self._writable()

        def validate(wait: Mapping[str, Any]) -> Any:
            stored = arguments.validate_signal(execution_id, name, wait, payload)
            self.backend.check_size(f"payload of signal {name}", stored)
            return stored

        now = self._now()
        attributes = {"wf.execution.id": execution_id, "wf.signal.name": name}
        with telemetry.operation("wf.signal", attributes) as span:
            with self.backend.begin() as conn:
                buffered = signals.deliver(
                    conn, self.backend, execution_id, name, validate, actor, now, buffer=buffer
                )
            if span is not None:
                outcome = "buffered" if buffered else "delivered"
                telemetry.quietly(
                    "set an attribute", span.set_attribute, "wf.signal.outcome", outcome
                )
        self._notify()
        return "buffered" if buffered else "delivered"

    @refusals.typed
    def purge(
        self,
        *,
        older_than: dt.timedelta | dt.datetime,
        statuses: Sequence[str] = ("completed", "failed"),
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Delete finished runs (and their history) that finished before a cutoff.

        Works in batches of ``batch_size`` runs, one short transaction each, so it never
        holds locks for long. Running, suspended and compensating runs are never touched.
        ``Limit`` slots left by workers that died and lapsed before the cutoff go too.

        Args:
            older_than: an age (a ``timedelta``, not negative) or an aware cutoff time (not
                in the future).
            statuses: which finished runs to delete (``completed``, ``failed``).
            on_batch: called with the number of runs each committed batch deleted (a
                progress display, for a purge that takes long).

        Returns:
            How many runs were deleted.
        """
        if isinstance(older_than, dt.timedelta):
            if older_than < dt.timedelta(0):  # a cutoff in the future: every finished run
                raise InvalidArgumentError(f"older_than must not be negative, got {older_than!r}")
            try:
                cutoff = self._now() - older_than
            except OverflowError:
                raise InvalidArgumentError(f"older_than is out of range: {older_than!r}") from None
        elif isinstance(older_than, dt.datetime):
            cutoff = arguments.utc(older_than, "older_than")
            if cutoff > self._now():  # as a negative age: runs that ended a moment ago too
                raise InvalidArgumentError(f"older_than must not be in the future: {cutoff}")
        else:
            raise InvalidArgumentError("older_than must be a timedelta or an aware datetime")
        if (
            not isinstance(statuses, Sequence)
            or isinstance(statuses, str | bytes)
            or not statuses
            or any(not isinstance(s, str) or s not in lifecycle.TERMINAL for s in statuses)
        ):
            raise InvalidArgumentError(
                f"purge deletes finished runs only (completed, failed); got {statuses!r:.80}"
            )
        # Below 2**31: the batch size is bound as a database integer.
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int)
            or not 1 <= batch_size < 2**31
        ):
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._writable()
        total = 0
        while True:
            with self.backend.begin() as conn:
                deleted = executions.purge_batch(
                    conn, finished_before=cutoff, statuses=statuses, limit=batch_size
                )
            total += deleted
            if on_batch is not None:
                on_batch(deleted)
            if deleted < batch_size:
                break
        # Slots of Limit steps whose holders died lapse but stay (a step that ends deletes
        # its own): those that lapsed before the cutoff go too, in the same short batches.
        sweep = min(batch_size, SLOT_SWEEP_BATCH)
        try:
            while True:
                with self.backend.begin() as conn:
                    if slots.sweep(self.backend, conn, cutoff, sweep) < sweep:
                        return total
        except DBAPIError as exc:
            if not self.backend.refused(exc):
                raise
            # A retention role granted what purging runs needs before wf_slots existed:
            # its runs are purged; the slots wait for a grant (or another purger).
            log.warning(
                "purge deleted %d runs but no lapsed Limit slots: the database refused "
                "(%s); grant SELECT and DELETE on wf_slots to this engine's user",
                total,
                str(getattr(exc, "orig", exc)).strip().splitlines()[0][:200],
            )
            return total
