"""How a runtime hears of changes and passes them on to its own threads.

A runtime's listener (:class:`~.wakeups.Wakeups`, started before its first claim) holds the
presence lock that its lease owner name comes from, where the database has one, and brings
notifications: a run due, a run ended. These wake the runtime's worker and the callers
waiting here for a run to finish or park; this process's own starts, signals and finished
runs do the same without a round trip. The :class:`~.runtime.Runtime` is one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final

from .backends import Backend
from .wakeups import DUE_NOW, HEAR_DUE, HEAR_END, PRESENCE_GRACE, Wakeups

if TYPE_CHECKING:
    from .worker import Worker

#: Seconds a thread waits for another to settle this runtime's lease owner name (the
#: listener's start waits 5 s at most for its connection and the presence lock).
OWNER_SETTLE_WAIT = 10.0
#: Set by a worker thread while it drives a run: the run, and what frees the thread's slot.
#: Called as that drive ends, before its waiters hear of it: a start one of them makes on
#: hearing then finds the slot free and is started claimed by it, where a slot freed only
#: once the thread had returned made that start wait for a claim.
SLOT_ENDING: Final[ContextVar[tuple[str, Callable[[], None]] | None]] = ContextVar(
    "wf_persist_slot_ending", default=None
)


class Notices:
    """The listener, the presence name and the wake-ups of a runtime."""

    backend: Backend
    owner: str
    _base_owner: str
    _check_process: Callable[[], None]
    _lock: threading.RLock
    _closed: bool
    _wakeups: Wakeups | None
    _owner_settled: threading.Event
    _worker: Worker | None
    _changed: threading.Condition

    # wake-ups ---------------------------------------------------------------------------

    def wakeups(self) -> Wakeups:
        """This runtime's listener (started on first use, before its first claim: it holds
        the presence lock its claims are named after, where the database has one). It
        listens for runs due once this runtime has a worker, for ends once a caller here
        waits for a run driven elsewhere (see :meth:`hear_ends`)."""
        self._check_process()
        found = self._wakeups
        if found is not None and self._worker is not None and not self._closed:
            found.hear(HEAR_DUE)  # a worker attached since it started (cheap once asked)
        with self._lock:
            found = self._wakeups
            if found is None:
                mark = self.backend.owner_mark()
                found = Wakeups(
                    self.backend,
                    self._base_owner + mark if mark else None,
                    hear=(HEAR_DUE,) if self._worker is not None else (),
                )
                # A run due now needs no new look at the timers; a timer or a reconnection does.
                found.on_due(lambda at: self._wake_worker(timers=at != DUE_NOW))
                found.on_end(lambda _id: self._notify(worker=False))
                self._wakeups = found
                fresh = not self._closed  # a closed runtime starts no listener
                if not fresh:
                    self._owner_settled.set()
            else:
                fresh = False
        if not fresh:
            # Another thread is taking the presence lock: a claim made before it settles
            # would carry the plain name, which only a lapsed lease frees.
            self._owner_settled.wait(OWNER_SETTLE_WAIT)
            if self._worker is not None and not self._closed:
                found.hear(HEAR_DUE)  # attached while another thread made the listener
            return found
        try:
            if found.start() and found.present and found.presence is not None:
                self.owner = found.presence
        finally:
            self._owner_settled.set()
        return found

    @property
    def plain_owner(self) -> str:
        """This runtime's name without its presence mark: a lease named so is not taken
        over when the presence lock is found free, only once it lapses."""
        return self._base_owner

    def presence_since(self) -> float | None:
        """Since when (monotonic) this runtime's presence lock has been held without a break,
        as a recent heartbeat vouches (+inf otherwise, see :meth:`Wakeups.trusted_since`);
        ``None`` where its runs are not named after one (no such lock here): then only
        leases lapse."""
        found = self._wakeups
        if found is None or found.presence is None or self.owner != found.presence:
            return None
        return found.trusted_since()

    def listening(self) -> bool:
        """Whether this runtime's listening connection is up now."""
        found = self._wakeups
        return found is not None and found.listening

    def hears_due(self) -> bool:
        """Whether notifications of runs due reach this runtime now (else its worker polls)."""
        found = self._wakeups
        return found is not None and found.hears(HEAR_DUE)

    def hear_ends(self) -> None:
        """A caller here waits for a run driven elsewhere: its end wakes it from now on (the
        first such wait waits for the listener to listen, a round trip)."""
        self.wakeups().hear(HEAR_END)

    def timer_set(self) -> None:
        """A run driven here parked until a time: the worker learns its new next wake."""
        self._wake_worker()

    def _wake_worker(self, timers: bool = True) -> None:
        worker = self._worker
        if worker is not None:
            worker.wake(timers)

    def reap(self) -> list[str]:
        """Make runs whose owner's process is gone due now (see :meth:`Backend.reap`)."""
        return self.backend.reap(self.owner, PRESENCE_GRACE)

    # waiting for changes ----------------------------------------------------------------

    def _notify(self, worker: bool = True) -> None:
        """Something changed: wake the callers waiting here, and the worker when it may
        find new due work (a start, a signal, a cancellation from this process)."""
        with self._changed:
            self._changed.notify_all()
        found = self._worker
        if worker and found is not None:
            found.wake()

    def _drive_ended(self, execution_id: str) -> None:
        """A drive here ended: its worker slot is free (see :data:`SLOT_ENDING`), and the
        callers waiting here are told."""
        ending = SLOT_ENDING.get()
        if ending is not None and ending[0] == execution_id:
            ending[1]()
        self._notify(worker=False)  # the worker looks again once the slot is free

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds, or until this runtime finishes or parks a run."""
        with self._changed:
            self._changed.wait(timeout)
