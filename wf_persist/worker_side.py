"""What a runtime does for its workers: claim due runs and say when the next is due
(the worker loop asks), check the engine's pool can serve a worker, and adopt a worker
loop run directly; and which claims of this process are under way, so that a drive
whose claim's answer was lost does not release one of them. The
:class:`~.runtime.Runtime` is one.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import clocks
from .backends import Backend, Claim
from .errors import PoolTooSmallError, WfPersistError
from .leases import LeaseKeeper
from .store import executions
from .wakeups import Wakeups

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("wf_persist.runtime")

#: A pool this large serves a worker of any concurrency without runs queueing for long.
COMFORTABLE_POOL = 10


class WorkerSide:
    """Claims for workers and the worker of this process (the state is the runtime's)."""

    backend: Backend
    owner: str
    closing: bool
    _lock: threading.RLock
    _driving: set[str]
    _dispatched: set[str]
    _keeper: LeaseKeeper | None
    #: Claim batches of the worker under way (sent, their runs not yet known).
    _claiming: int
    #: Runs claimed here that no drive or lease keeper holds yet, by id: being started
    #: claimed (execute(), or for the worker) until driven, dispatched or given back; or
    #: in a worker's claim batch just returned.
    _unheld: Counter[str]
    _worker: Worker | None

    # The runtime's, from its other parts (the registry, the notices, its leases).
    runnable_workflows: Callable[[], list[tuple[str, int]]]
    wakeups: Callable[[], Wakeups]
    keeper: Callable[[], LeaseKeeper]
    _ttl: Callable[[], float]
    _check_process: Callable[[], None]
    _check_open: Callable[[], None]

    def claim_due(self, limit: int) -> list[Claim]:
        """Claim up to ``limit`` due runs this runtime can drive (for workers)."""
        workflows = self.runnable_workflows()
        if not workflows or limit <= 0 or self.closing:
            return []
        self.wakeups()
        with self._lock:
            exclude = sorted(self._driving)
            self._claiming += 1  # until its claims are known (see claimed_here)
        claims: list[Claim] = []
        try:
            asked = clocks.elapsed()  # before the claim: see Lease.confirmed
            try:
                claims = self.backend.claim_batch(
                    self.owner, self._ttl(), limit, workflows, exclude
                )
            except Exception as exc:
                if not self.backend.contention(exc):
                    raise
                log.debug("claiming due runs ran into another claimer; trying again: %s", exc)
                return []  # rolled back: nothing was claimed
            finally:
                with self._lock:
                    self._claiming -= 1
                    self._unheld.update(claim.execution_id for claim in claims)
            keeper = self.keeper()
            for claim in claims:  # renewed from now on, also while it waits for a thread
                keeper.hold(claim.execution_id, claim.epoch, asked)
            return claims
        finally:
            for claim in claims:
                self.started_claimed(claim.execution_id)

    def starting_claimed(self, execution_id: str) -> None:
        """A start about to write ``execution_id`` claimed by this runtime's name."""
        with self._lock:
            self._unheld[execution_id] += 1

    def started_claimed(self, execution_id: str) -> None:
        """That start is over: its run is driven, dispatched, given back or not made (or a
        run a worker's claim batch returned is held)."""
        with self._lock:
            self._unheld[execution_id] -= 1
            if self._unheld[execution_id] <= 0:
                del self._unheld[execution_id]

    def claimed_here(self, execution_id: str) -> bool:
        """Whether a claim of this runtime other than a drive's own may hold the run (a
        worker's, a start's): its lease carries this runtime's name too, and is not a
        lost claim's to give up. Asked after reading a lease this runtime's name holds,
        a claim made later shows as a new epoch instead."""
        with self._lock:
            if self._claiming > 0 or self._unheld.get(execution_id, 0) > 0:
                return True
            if execution_id in self._dispatched:
                return True
            keeper = self._keeper  # not started here: only a running keeper holds leases
        return keeper is not None and execution_id in keeper.held()

    def seconds_to_next_wake(self) -> float | None:
        """Seconds until the earliest wake time of a run this runtime can drive (by the
        database's clock); ``None`` when nothing is scheduled."""
        workflows = self.runnable_workflows()
        if not workflows:
            return None
        with self.backend.read() as conn:
            due, now = self.backend.next_wake(conn, workflows)
        return None if due is None else (due - now).total_seconds()

    def due_backlog(self) -> int:
        """How many runs are due now and not claimed (any workflow: the metrics' gauge)."""
        with self.backend.read() as conn:
            return executions.due_count(conn)

    # workers ----------------------------------------------------------------------------

    def check_pool(self, concurrency: int) -> None:
        """Refuse a worker the engine's pool cannot serve; warn when runs would queue.

        A run being driven borrows a connection for each write and gives it back while its
        steps run, so any number of runs shares a small pool; the claim loop takes one, and
        a step under a database-wide concurrency limit holds one while it runs. Two is the
        least that works; below :data:`COMFORTABLE_POOL` (or ``concurrency + 1``) runs wait
        for a connection at their writes.
        """
        capacity = self.backend.capacity()
        if capacity is None:
            return
        needed = 2
        if capacity < needed:
            raise PoolTooSmallError(capacity, needed, concurrency)
        comfortable = min(concurrency + 1, COMFORTABLE_POOL)
        if capacity < comfortable:
            log.warning(
                "the engine's pool gives %d connections; a worker with concurrency %d runs "
                "best with %d (runs wait for a connection at each write, and steps under a "
                "database-wide concurrency limit hold one while they run)",
                capacity,
                concurrency,
                comfortable,
            )

    def attach(self, worker: Worker) -> None:
        """Make ``worker`` this runtime's (a worker loop run directly, as the CLI does): it is
        then woken by this process's starts, finished runs and notifications. A closed
        runtime refuses a loop of its own (it would poll on for good, on connections nothing
        closes); the one :meth:`start_worker` made is stopped by ``close()`` instead."""
        self._check_process()
        with self._lock:
            if self._worker is worker:
                return
            self._check_open()
            if self._worker is not None and not self._worker.stopping:
                # close() stops the worker it knows: a second loop would run on after it.
                raise WfPersistError(
                    "this runtime has a worker already: one loop per runtime (raise its "
                    "concurrency instead)"
                )
            self._worker = worker
