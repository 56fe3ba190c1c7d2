"""The runtime: the database binding, the workflow registry, and the entry points that
drive runs (see :mod:`.driver` for what a drive is, :mod:`.leases` for lease renewal).

Driving a run is: claim it (one compare-and-set that bumps its fencing token), read its
history and record ``workflow.started`` the first time (one transaction), replay the body,
write each new step as one fenced write, and finish with one fenced write that records the
outcome and releases the lease. A process never claims a run it is still driving.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import TimeoutError as PoolTimeout

from . import clocks, drive_telemetry, drives, gate, refusals, telemetry
from .authoring import Step
from .backends import Claim
from .bridge import off_loop
from .database import Database
from .error_documents import shown
from .errors import (
    ClosedError,
    InvalidArgumentError,
)
from .leases import LeaseKeeper
from .notices import Notices
from .registry import Registry
from .secrets import SecretResolver
from .slots import Slots
from .timeouts import plain_number, positive
from .timers import Timers
from .wakeups import Wakeups
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from .embedded import WorkflowClient
    from .worker import Reservation, Worker

log = logging.getLogger("wf_persist.runtime")

Clock = Callable[[], dt.datetime]

#: Returned by :meth:`Runtime.drive_for_outcome` when the run could not be claimed.
NOT_DRIVEN: Any = object()
#: How many outcomes of runs finished here a runtime keeps for its waiters.
FINISHED_KEPT = 4096
#: The run the code running now belongs to: set for a drive, and inherited by its step
#: threads and ``ctx.all`` branches (their contexts are copies).
DRIVING_RUN: Final[ContextVar[str | None]] = ContextVar("wf_persist_driving_run", default=None)


def utc_now() -> dt.datetime:
    """The default clock."""
    return dt.datetime.now(dt.UTC)


class Runtime(Registry, Notices, WorkerSide):
    """Holds the database binding and the registered workflows; drives runs.

    Args:
        bind: a database URL, or an existing SQLAlchemy ``Engine`` (used as is, never
            reconfigured). Default: ``$WF_PERSIST_DATABASE_URL``, else ``wf_persist.sqlite3``
            in the working directory. ``sqlite://`` (or ``sqlite:///:memory:``) is a private
            database: a temporary file, removed by :meth:`close`.
        auto_migrate: upgrade the schema on open. Default: only for an embedded SQLite
            database this runtime created; any other database must be migrated beforehand
            (``wf-persist db upgrade``) and opening it otherwise raises
            :class:`~wf_persist.errors.SchemaVersionError`.
        lease_ttl: seconds a claim lasts without renewal. A runtime renews its leases every
            quarter of this while it works; if it dies, any other runtime may take its runs over
            after the lease ran out (by the database's clock).
        poll_interval: seconds between looks for due work (timers, signals, expired leases)
            when nothing in this process announced it; a timer fires at most this late.
        clock: the source of the times a client records (``created_at`` of a run). Leases,
            timers and every time inside a drive come from the database's clock.
        secret_resolver: resolves ``secret:<name>`` references in step arguments inside the
            step (e.g. :func:`wf_persist.env_secret_resolver`).
        schema: a PostgreSQL schema holding the wf_ tables (migrate it with the same schema).
        record_start_after: seconds after which a running step attempt's start is recorded
            on its own (so an attempt cut short by a crash shows in history); ``0`` records
            every start before the step runs (two writes per step), ``None`` never separately.
        max_drive_failures: consecutive failed drives (errors other than a lost lease) after
            which a run is failed with :class:`~wf_persist.errors.DriveFailedError`.
    """

    def __init__(
        self,
        bind: str | URL | Engine | None = None,
        *,
        auto_migrate: bool | None = None,
        lease_ttl: float = 30.0,
        poll_interval: float = 0.25,
        clock: Clock = utc_now,
        secret_resolver: SecretResolver | None = None,
        schema: str | None = None,
        record_start_after: float | None = 1.0,
        max_drive_failures: int = 10,
    ) -> None:
        lease_seconds = positive(lease_ttl, "lease_ttl")
        poll_seconds = positive(poll_interval, "poll_interval")
        start_after = plain_number(record_start_after)
        if record_start_after is not None and (
            start_after is None or not 0 <= start_after < float("inf")
        ):
            raise InvalidArgumentError(
                "record_start_after must be a non-negative number or None, "
                f"got {shown(record_start_after)}"
            )
        failures = plain_number(max_drive_failures)
        if not isinstance(failures, int) or failures < 1:
            raise InvalidArgumentError(
                f"max_drive_failures must be a positive integer, got {shown(max_drive_failures)}"
            )
        telemetry.configure()
        self.catalogs = not gate.gating()
        self.database = Database(bind, auto_migrate=auto_migrate, schema=schema)
        self.backend = self.database.backend
        self.schema = schema
        #: The engine wf_persist works through (same pool as ``bind``, our options).
        self.engine = self.database.engine
        self.clock = clock
        self.lease_ttl = dt.timedelta(seconds=lease_seconds)
        self.poll_interval = poll_seconds
        self.secret_resolver = secret_resolver
        self.record_start_after = start_after
        self.max_drive_failures = failures
        self._base_owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The name this runtime's claims carry (``lease_owner``); it ends with the
        #: backend's mark once the runtime holds its presence lock (see :mod:`.wakeups`).
        self.owner = self._base_owner
        #: The step concurrency slots (``Limit``) this runtime's drives hold.
        self.slots = Slots(
            self.backend, lambda: self.owner, lease_seconds, lambda: self.keeper().engine()
        )
        self._wakeups: Wakeups | None = None
        self.timers = Timers()
        #: Set by :meth:`close`: drivers stop before their next step.
        self.closing = False
        self._registry = {}
        self._latest = {}
        self._uncataloged = set()
        self._overruled = {}
        self._lock = threading.RLock()  # close() may come from a signal handler in a locked section
        #: Runs driven in this process now.
        self._driving: set[str] = set()
        #: Set once :attr:`owner` is what it will be (the presence lock taken, or not).
        self._owner_settled = threading.Event()
        #: Runs started claimed here and handed to the worker, not yet being driven.
        self._dispatched: set[str] = set()
        self._claiming = 0
        self._unheld: Counter[str] = Counter()
        #: Outcomes of runs finished here lately: ``(name, version, ok, stored value)``.
        self._finished: OrderedDict[str, tuple[str, int, bool, Any]] = OrderedDict()
        self._keeper: LeaseKeeper | None = None
        self._worker: Worker | None = None
        self._changed = threading.Condition()
        self._closed = False
        self._disposed = False
        #: Stand-ins for step functions, by step (the test kit's ``mock_step``).
        self.step_overrides: dict[Step[Any], Callable[..., Any]] = {}

    # driving --------------------------------------------------------------------------

    def client(self) -> WorkflowClient:
        """A client bound to this runtime (it may drive runs in the calling thread)."""
        from .embedded import WorkflowClient

        self._check_process()
        return WorkflowClient(self)

    @refusals.typed
    def drive(self, execution_id: str) -> bool:
        """Drive ``execution_id`` until it finishes or parks, if this runtime can claim it.

        Returns False when the run is finished, not due, or held by another runtime (or
        thread); True when this call drove it.
        """
        return self.drive_for_outcome(execution_id) is not NOT_DRIVEN

    @contextmanager
    def _driving_run(self, execution_id: str, wait: float) -> Iterator[bool]:
        """Mark the run as driven by this process (False: another thread here drives it).
        Unmarked whatever interrupts it once marked (else this process would never drive
        the run again)."""
        deadline = clocks.elapsed() + wait
        added = False
        try:
            while True:
                with self._lock:
                    if execution_id not in self._driving:
                        added = True
                        self._driving.add(execution_id)
                        break
                remaining = deadline - clocks.elapsed()
                if remaining <= 0:
                    yield False
                    return
                off_loop(self.wait_for_change, min(0.05, remaining))
            token = DRIVING_RUN.set(execution_id)
            try:
                yield True
            finally:
                DRIVING_RUN.reset(token)
        finally:
            if added:
                with self._lock:
                    self._driving.discard(execution_id)
                    last = self._closed and not self._driving
                self._drive_ended(execution_id)
                if last:  # close() left the engine to the drives still in flight
                    self._dispose()

    def drive_for_outcome(self, execution_id: str, until: float | None = None) -> Any:
        """Like :meth:`drive`; returns ``(ok, stored value)`` if the run finished here,
        ``None`` if it parked or stopped, ``NOT_DRIVEN`` if it could not be claimed.
        ``until`` (monotonic): from then on, stop at the next step and hand the run over
        (a step in flight is not interrupted)."""
        self._check_open()
        # Another thread here may be just leaving this run (after parking it, say) while a
        # worker claimed it again: wait a moment rather than leave it due and idle.
        with self._driving_run(execution_id, 0.5) as ours:
            if not ours:
                return NOT_DRIVEN
            workflows = self.runnable_workflows()
            if not workflows:
                return NOT_DRIVEN
            self.wakeups()
            owner = self.owner
            asked = clocks.elapsed()  # before the claim: see Lease.confirmed
            claim: Claim | None = None
            try:
                claim = self.backend.claim_to_drive(execution_id, owner, self._ttl(), workflows)
                if claim is None:
                    return NOT_DRIVEN
                return self._drive(claim, asked, until)
            except BaseException as exc:
                # Interrupted (a signal handler's exception, say) once the claim may have
                # committed: the run is given back, not left leased by nobody's drive until
                # the lease lapses. (A drive that began gave it back itself: a no-op again.)
                # A claim that got no connection from the pool was never sent.
                if claim is not None:
                    self.keeper().forget_run(claim.execution_id, claim.epoch)
                    self.give_back(claim)
                elif self.backend.may_have_committed(exc) and not isinstance(exc, PoolTimeout):
                    drives.release_if_held(self, execution_id, owner)
                raise

    def drive_started(self, claim: Claim, asked: float) -> Any:
        """Drive, in this thread, a run this thread just started claimed (see
        :meth:`WorkflowClient.execute`); as :meth:`drive_for_outcome` returns."""
        with self._driving_run(claim.execution_id, 0.5) as ours:
            # Closing (close() waits for the runs marked as driven here, so this is seen
            # in time), or another thread here holds it: due again at once.
            if not ours or self.closing:
                self.give_back(claim)
                return NOT_DRIVEN
            return self._drive(claim, asked)

    def give_back(self, claim: Claim) -> None:
        """Release a claim this process will not drive after all: due again at once."""
        drives.release(self, claim)

    def give_back_started(self, execution_id: str, workflow: str) -> None:
        """Release a run a start of this process created claimed (epoch 1), if it exists and
        is still so: a start that failed after it may have committed."""
        drives.release_run(self, execution_id, 1, workflow)

    def drive_claim(self, claim: Claim) -> Any:
        """Drive a run a worker claimed (see :meth:`claim_due`)."""
        # Claims exclude runs this process drives, but a caller's ``result()`` may be just
        # trying (and failing) to claim this one: it leaves within a moment.
        with self._driving_run(claim.execution_id, 0.5) as ours:
            with self._lock:
                self._dispatched.discard(claim.execution_id)
            if not ours:
                self.give_back(claim)
                return NOT_DRIVEN
            return self._drive(claim)

    def _drive(self, claim: Claim, asked: float | None = None, until: float | None = None) -> Any:
        try:
            keeper = self.keeper()
            lease = keeper.hold(claim.execution_id, claim.epoch, asked)
            with drive_telemetry.drive(claim) as traced:
                try:
                    self.definition(claim.workflow_name, claim.workflow_version)
                    loaded = drives.start_drive(self, claim, traced)
                except Exception as exc:
                    keeper.forget(lease)
                    drives.failed(self, claim, exc)
                    return None
                finished = drives.drive(self, claim, lease, loaded, until)
                traced.finished(finished)
        except BaseException:
            # Interrupted anywhere (the drive gives its run back itself, and again here is
            # a no-op): the lease is not held on, renewed for nobody's drive, and the run is
            # due again at once.
            self.keeper().forget_run(claim.execution_id, claim.epoch)
            self.give_back(claim)
            raise
        if finished is not None:
            with self._lock:
                self._finished[claim.execution_id] = (
                    claim.workflow_name,
                    claim.workflow_version,
                    *finished,
                )
                while len(self._finished) > FINISHED_KEPT:
                    self._finished.popitem(last=False)
        return finished

    def finished_here(self, execution_id: str) -> tuple[str, int, bool, Any] | None:
        """The outcome of a run this runtime finished lately (a finished run never changes:
        a waiter here needs no read)."""
        with self._lock:
            return self._finished.get(execution_id)

    def busy_here(self, execution_id: str) -> bool:
        """Whether this process drives the run now (or is about to)."""
        with self._lock:
            return execution_id in self._driving or execution_id in self._dispatched

    # runs started claimed -------------------------------------------------------------

    def reserve_drive(self) -> Reservation | None:
        """A slot of this runtime's worker for a run about to be started here claimed and
        driven by that worker at once (see :meth:`dispatch`); None: start it due."""
        worker = self._worker
        if worker is None or self.closing:
            return None
        self.wakeups()
        return worker.reserve()

    def dispatch(self, claim: Claim | None, asked: float, reservation: Reservation) -> None:
        """Hand a run started claimed (``claim``; ``None``: nothing was created) to the
        worker slot :meth:`reserve_drive` promised."""
        worker = self._worker
        assert worker is not None
        if claim is None:
            worker.unreserve(reservation)
            return
        keeper = self.keeper()
        lease = keeper.hold(claim.execution_id, claim.epoch, asked)
        with self._lock:
            self._dispatched.add(claim.execution_id)
        if not worker.submit(claim, reservation):  # stopping: due again at once elsewhere
            with self._lock:
                self._dispatched.discard(claim.execution_id)
            keeper.forget(lease)
            self.give_back(claim)

    def undispatch(self, execution_id: str, workflow: str, reservation: Reservation) -> None:
        """A run started claimed for the worker was interrupted after its commit, before
        :meth:`dispatch` handed it over: the slot is freed, the lease not renewed and the
        run due again at once. One the worker took is left to it."""
        if reservation.submitted:
            return
        worker = self._worker
        if worker is not None:
            worker.unreserve(reservation)
        with self._lock:
            self._dispatched.discard(execution_id)
        self.keeper().forget_run(execution_id, 1)
        self.give_back_started(execution_id, workflow)

    def _ttl(self) -> float:
        return self.lease_ttl.total_seconds()

    def keeper(self) -> LeaseKeeper:
        """The lease keeper (started on first use, again if it died; never after close)."""
        self._check_process()
        with self._lock:
            found = self._keeper
            if found is not None and (found.is_alive() or self._closed):
                return found  # running; or stopped by close(), after which nothing renews
            found = self._keeper = LeaseKeeper(self.backend, self._ttl())
            if self._closed:
                found.stop()  # it makes no engine either (nothing would dispose of it)
            else:
                found.start()
            return found

    # time ---------------------------------------------------------------------------

    def time_shift(self) -> float:
        """Seconds the clock of this runtime's database was moved ahead (only the test kit's
        virtual clock moves; see :mod:`wf_persist.testing`)."""
        return 0.0

    def pause(self, seconds: float) -> None:
        """Wait in the calling thread (a short in-thread retry backoff)."""
        time.sleep(seconds)

    # workers ----------------------------------------------------------------------------

    def start_worker(
        self,
        *,
        concurrency: int = 4,
        poll_interval: float | None = None,
        event_loop: bool = False,
    ) -> Worker:
        """Run a worker in background threads of this process (embedded mode);
        ``event_loop``: ``async def`` workflows' runs on one event loop (see
        :class:`~wf_persist.worker.Worker`)."""
        from .worker import Worker

        self._check_open()
        with self._lock:
            if self._worker is not None:
                return self._worker
        worker = Worker(
            self, concurrency=concurrency, poll_interval=poll_interval, event_loop=event_loop
        )
        with self._lock:
            # A close() from now on sees this worker and stops it (a loop stopped before
            # it began ends at once); one before it leaves nothing to start.
            self._check_open()
            if self._worker is not None:
                return self._worker
            self._worker = worker
        return worker.start()

    # lifecycle ------------------------------------------------------------------------

    def _check_process(self) -> None:
        """Refuse use in a process forked after this runtime was made (asked before any of
        its locks, which the fork may have copied held)."""
        self.backend.check_process()  # the backend was made with this runtime

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise ClosedError("Workflow runtime")

    def _check_clients_open(self) -> None:
        """For this runtime's clients: refused once its engine is let go of, not while it
        closes (a step still running then may use them, as a run it drives does)."""
        self._check_process()
        if self._disposed:
            raise ClosedError("Workflow runtime")

    def drives_in_flight(self) -> int:
        """Runs being driven in this process now (after :meth:`close`: steps that outlived
        its wait, their leases released)."""
        with self._lock:
            return len(self._driving)

    def close(self, timeout: float = 30.0) -> None:
        """Stop this runtime's worker, let runs in flight stop at their next step (waiting up
        to ``timeout`` seconds), then release every lease still held so other workers take
        those runs at once, and dispose of an engine this runtime created. Idempotent.

        In a process forked after the runtime was made, it only forgets the runtime:
        threads, leases and connections are the parent's (an engine it created is dropped
        without closing the parent's connections)."""
        if os.getpid() != self.backend.pid:
            self._closed = self.closing = True
            if self.database.owns_engine:
                self.database.base_engine.dispose(close=False)
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.closing = True
            worker, keeper = self._worker, self._keeper
        # A close() from inside a run (its step, a ctx.all branch, a signal handler in the
        # thread driving it) cannot see that run stop before it returns: the run is neither
        # waited for nor released; it hands itself over at its next step.
        mine = DRIVING_RUN.get()
        deadline = clocks.elapsed() + timeout
        if worker is not None:
            worker.stop(timeout, join=mine is None)
        # Runs driven in callers' threads (result(), execute()) stop at their next step too.
        while clocks.elapsed() < deadline:
            with self._lock:
                if self._driving <= {mine}:
                    break
            self.wait_for_change(0.05)
        if keeper is not None:
            keeper.release_all(keep=() if mine is None else (mine,))
            keeper.stop()
        self.timers.stop()
        if self._wakeups is not None:
            self._wakeups.stop()
        with self._lock:
            in_flight = bool(self._driving)
        if not in_flight:  # else the last drive to stop disposes of it
            self._dispose()

    def _dispose(self) -> None:
        with self._lock:
            if self._disposed:
                return
            self._disposed = True
        self.database.dispose()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A write transaction on this runtime's engine."""
        with self.backend.begin(ours=False) as conn:
            yield conn
