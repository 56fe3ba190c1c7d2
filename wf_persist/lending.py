"""A drive's connection: kept while the drive runs wf_persist's own code, lent back to the
pool while user code runs.

Taking a pooled connection for every write would cost a checkout and a reset each time,
about as much CPU as the rest of a short step. Holding one for a whole drive would make a
run that sleeps in a step (slow I/O, a rate-limited API) hold a connection for nothing, so
one process could drive only as many runs as its pool has connections. So a drive keeps
the connection it took for its last write while it goes on to its next one, and gives it
back when user code (a step, a code block, a compensation, a retry's backoff) runs: at
once if the pool has no idle connection left for others, else once that code has run for
:data:`RELEASE_AFTER` seconds. A short step then costs no checkout at all, and hundreds of
runs whose steps wait on I/O share a pool of 10 to 20.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from . import clocks

if TYPE_CHECKING:
    from .backends import Backend
    from .leases import Lease
    from .timers import Timers

#: How long user code may run before its drive's connection goes back to the pool.
RELEASE_AFTER = 0.05


class Lender:
    """The connection of one drive (shared by its replays, ``ctx.all`` branches and its
    start-record timer, one statement at a time under :attr:`lock`)."""

    def __init__(
        self, backend: Backend, timers: Timers, *, keep: bool = True, lease: Lease | None = None
    ) -> None:
        self.backend = backend
        self.timers = timers
        #: The drive's lease, told when a database call begins and ends (a call that never
        #: ends stops its renewal: see :data:`wf_persist.leases.STALL_AFTER`).
        self.lease = lease
        if lease is not None:
            lease.cut = self.cut
        #: Whether a connection is kept from one write to the next (a drive on a thread
        #: goes from its write straight to its next call); False on the async worker's
        #: loop, where hundreds of runs wait their turn between writes.
        self.keep = keep
        #: Held while a connection is in use (and while it is taken or given back).
        self.lock = threading.RLock()
        self._conn: Connection | None = None
        #: Borrows in progress (nested ones on the thread holding :attr:`lock`).
        self.depth = 0
        self._was_cut = False
        #: How many pieces of user code of this drive run now (``ctx.all`` branches, an
        #: attempt whose start a timer records): a write made meanwhile gives its
        #: connection back, which would otherwise sit idle until they end (a server
        #: ending idle sessions would end it under the next write).
        self.running = 0
        self._counting = threading.Lock()

    def connection(self) -> AbstractContextManager[Connection]:
        """The drive's connection for one write (taken from the pool if it has none). A
        write that fails gives it back: a connection the error left in doubt is not kept."""
        return _Borrowed(self)

    def release(self) -> None:
        """Give the connection back to the pool (the next write takes one again); one
        :meth:`cut` shut down is dropped from the pool instead."""
        with self.lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                if self._was_cut:
                    self._was_cut = False
                    conn.invalidate()
                conn.close()

    def cut(self) -> None:
        """End the database call in progress from another thread (see
        :meth:`Backend.cut <wf_persist.backends.base.Backend.cut>`); the connection is
        dropped from the pool when it is given back (it may be shut down even if the call
        ended meanwhile)."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated or not self.depth:
            return
        self._was_cut = True
        raw = conn.connection.driver_connection
        if raw is not None:
            self.backend.cut(raw)

    def _release_unless_busy(self) -> None:
        """The timer's release: a write in progress (of a ``ctx.all`` sibling, say) keeps
        the connection, and the timer thread, which serves every timer, never waits."""
        if self.lock.acquire(blocking=False):
            try:
                self.release()
            finally:
                self.lock.release()

    def lent(self) -> AbstractContextManager[None]:
        """User code runs: the connection goes back to the pool at once if the pool is at
        its capacity (others may be waiting), else if the code runs longer than
        :data:`RELEASE_AFTER`."""
        return _Lent(self)


class _Borrowed:
    """:meth:`Lender.connection` (classes, not generators: entered for every write and
    around every step, where a generator's cost shows)."""

    __slots__ = ("_lender",)

    def __init__(self, lender: Lender) -> None:
        self._lender = lender

    def __enter__(self) -> Connection:
        lender = self._lender
        lender.lock.acquire()
        lender.depth += 1
        try:
            conn = lender._conn
            if conn is None or conn.closed or conn.invalidated:
                conn = lender._conn = lender.backend.engine.connect()
        except BaseException:
            self._done(lender)
            raise
        lease = lender.lease
        if lease is not None and lender.depth == 1:
            # From when the call has its connection: a wait for one from the pool is the
            # pool's to bound (pool_timeout), and there is no connection yet to cut.
            lease.busy_since = clocks.elapsed()
        return conn

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        lender = self._lender
        try:
            if kind is not None or not lender.keep or lender.running:
                lender.release()
        finally:
            self._done(lender)

    @staticmethod
    def _done(lender: Lender) -> None:
        lender.depth -= 1
        if lender.lease is not None and lender.depth == 0:  # the outermost borrow ended
            lender.lease.busy_since = None
        lender.lock.release()


class _Lent:
    """:meth:`Lender.lent`."""

    __slots__ = ("_cancel", "_lender")

    def __init__(self, lender: Lender) -> None:
        self._lender = lender
        self._cancel: Callable[[], None] | None = None

    def __enter__(self) -> None:
        lender = self._lender
        with lender._counting:
            lender.running += 1
        if lender._conn is not None and lender.backend.pool_full():
            lender._release_unless_busy()
        self._cancel = lender.timers.after(RELEASE_AFTER, lender._release_unless_busy)

    def __exit__(self, *exc: object) -> None:
        lender = self._lender
        with lender._counting:
            lender.running -= 1
        if self._cancel is not None:
            self._cancel()
