"""Waiting for a run's outcome (:meth:`Client.result`): looking at the run when its end is
heard, or by polling where nothing is announced; the embedded client may also drive the
run meanwhile."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Row

from . import arguments, clocks, lifecycle, refusals
from .errors import ResultTimeoutError
from .reading import RunReader
from .records import Completed, Failed, Outcome
from .wakeups import HEAR_END, Ends, Wakeups

#: The longest wait for the end of a run this client started before it looks at the run.
UNREAD_WAIT = 0.1
#: What :meth:`RunAwaiter._try_drive` returns to look at the run again at once (it was
#: driven here) or to wait (nothing was due).
_AGAIN, _WAIT = True, False


class RunAwaiter(RunReader):
    """The waiting side of a client (see :meth:`result`)."""

    _ends: Ends
    _wakeups: Wakeups | None
    #: Notified when ends are heard (waits that poll between looks).
    _ended: threading.Condition

    def _try_drive(self, row: Row[Any], deadline: float | None) -> Outcome | bool:
        """While :meth:`result` waits (until ``deadline``, monotonic): the outcome if this
        call finished the run, ``_AGAIN`` to look at the run again at once, ``_WAIT`` to
        wait. A thin client only waits."""
        return _WAIT

    def _known(self, execution_id: str) -> Outcome | None:
        """An outcome known without reading the database (the embedded client: a run
        finished here)."""
        return None

    def _busy(self, execution_id: str) -> bool:
        """Whether this process drives the run now: wait for it without reading."""
        return False

    def _outcome(self, row: Row[Any]) -> Outcome:
        if row.status == "failed":
            return Failed(row.id, dict(row.error or {}))
        return Completed(row.id, row.result)

    def _listen(self) -> None:
        """Hear of runs ending at once where the database notifies (started on the first
        wait for a result)."""
        if self._wakeups is not None or not self.backend.can_listen:
            return
        with self._ended:  # two first waits at once start one listener
            if self._wakeups is not None:
                return
            found = Wakeups(self.backend, hear=(HEAR_END,))
            found.on_end(self._ends.heard)
            found.on_end(lambda _id: self._wake_waiters())
            self._wakeups = found
        found.start()

    def _announced(self) -> bool:
        """Whether ends of runs reach this client as notifications now (then a wait looks
        again when its run's end is heard, else after each poll delay)."""
        return self._wakeups is not None and self._wakeups.hears(HEAR_END)

    def _hear_ends(self) -> None:
        """Before a wait that polls: ends heard from now on wake it (the embedded client's
        runtime listens for them only once a caller waits for a run driven elsewhere)."""

    def _wake_waiters(self) -> None:
        with self._ended:
            self._ended.notify_all()

    def _wait(self, seconds: float) -> None:
        with self._ended:
            self._ended.wait(seconds)

    @refusals.typed
    def result(self, execution_id: str, timeout: float | None = None) -> Outcome:
        """Wait for the run to finish and return its outcome.

        This client only waits (workers drive the run): it looks at the run after 2 ms,
        then twice as long each time, at most every ``poll_interval``. Where the database
        announces ends (PostgreSQL) it looks again when the run's end is heard, and every
        ``poll_interval`` (a run a runtime started and drives itself announces nothing); a
        run this client started while listening is not looked at before its end is heard.
        The value of a :class:`Completed` is the stored JSON document (the embedded client
        validates it into the workflow's output type when it has the definition).

        Raises:
            UnknownExecutionError, ResultTimeoutError; for the embedded client also
            MissingWorkflowVersionError (see :meth:`WorkflowClient.result`).
        """
        execution_id = arguments.check_id(execution_id)
        timeout = arguments.check_timeout(timeout)
        deadline = None if timeout is None else clocks.elapsed() + timeout
        return self._await_outcome(execution_id, deadline, timeout)

    def _await_outcome(
        self, execution_id: str, deadline: float | None, timeout: float | None
    ) -> Outcome:
        """:meth:`result`'s wait, until ``deadline``; ``timeout`` is what the caller asked
        for (the error says that, not what was left of it)."""
        delay = 0.002
        self._listen()
        with self._ends.watching(execution_id):
            # A run this client started while ends were announced: nothing to read until
            # its end is heard (or the listener reconnects, or the time is up).
            unread = self._ends.unread(execution_id)
            while True:
                self._check_open()  # closed meanwhile: each look would take a new pool's
                known = self._known(execution_id)
                if known is not None:
                    return known
                if self._busy(execution_id):
                    # Driven in this process, which says when that drive ends; another
                    # process may end the run meanwhile (a cancellation): it is read every
                    # poll interval.
                    remaining = None if deadline is None else deadline - clocks.elapsed()
                    wait = self._poll()
                    self._wait(wait if remaining is None else max(0.0, min(wait, remaining)))
                    known = self._known(execution_id)
                    if known is not None:
                        return known
                first_wait = None
                if unread is not None and (deadline is None or clocks.elapsed() < deadline):
                    mark, unread = unread, None
                    # An end nobody announces (a worker of an older version, a lost
                    # notification) costs at most this, not a poll interval.
                    first_wait = UNREAD_WAIT
                else:
                    unread = None
                    mark = self._ends.mark(execution_id)
                    row = self._look(execution_id)
                    if row.status in lifecycle.TERMINAL:
                        return self._outcome(row)
                    drove = (
                        self._try_drive(row, deadline)
                        if deadline is None or clocks.elapsed() < deadline
                        else _WAIT
                    )
                    if not isinstance(drove, bool):
                        return drove
                    if drove is _AGAIN:
                        delay = 0.002
                        continue
                remaining = None if deadline is None else deadline - clocks.elapsed()
                if remaining is not None and remaining <= 0:
                    raise ResultTimeoutError(execution_id, float(timeout or 0))
                if self._announced():
                    # Its end will be heard: look again then (or after a reconnection), and
                    # every poll interval for an end nobody announces.
                    wait = self._poll() if first_wait is None else min(first_wait, self._poll())
                    self._ends.wait(
                        execution_id, mark, wait if remaining is None else min(wait, remaining)
                    )
                    continue
                self._hear_ends()
                wait = min(delay, self._poll())
                self._wait(wait if remaining is None else min(wait, remaining))
                delay = min(delay * 2, self._poll())

    @refusals.typed
    def outcome(self, execution_id: str) -> Outcome | None:
        """The run's outcome if it has ended, else ``None``: one read, never a wait."""
        row = self._look(execution_id)
        return self._outcome(row) if row.status in lifecycle.TERMINAL else None
