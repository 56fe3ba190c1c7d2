"""Lease renewal, and saying once (not every poll) that the database is unreachable.

The keeper renews every lease this runtime holds every quarter of the lease TTL, on an engine
with a pool of its own: runs that hold every pooled connection can never starve renewal. A
renewal is fenced like every other write (``(id, claim_epoch)``), so it only ever extends a
lease this runtime still holds; a run it finds taken (another worker claimed it after a
pause, or a cancellation revoked it) is reported to its driver, which stops before its next
step. If renewals keep failing for longer than the TTL, every driver is told its lease may be
gone: it stops before starting anything new, since another worker may be running it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from . import clocks, refusals
from .backends.connections import dispose_pool
from .error_documents import brief
from .errors import WfPersistError

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("wf_persist.leases")


class Outage:
    """Logs the first failure of an outage and its end, and backs off in between."""

    def __init__(self, logger: logging.Logger, what: str, base: float, cap: float = 10.0) -> None:
        self._log = logger
        self._what = what
        self._base = base
        self._cap = cap
        self.failures = 0
        self._since = 0.0

    def failed(self, exc: BaseException, detail: str = "") -> float:
        """Record a failure; returns how long to wait before trying again."""
        if self.failures == 0:
            self._since = clocks.elapsed()
            extra = f" ({detail})" if detail else ""
            self._log.error(
                "%s failed%s: %s; retrying with backoff, logged again when it recovers",
                self._what,
                extra,
                brief(exc),
            )
        self.failures += 1
        return float(min(self._cap, self._base * 2 ** min(self.failures - 1, 16)))

    def succeeded(self) -> None:
        if self.failures:
            self._log.warning(
                "%s works again after %d failure(s) over %.1fs",
                self._what,
                self.failures,
                clocks.elapsed() - self._since,
            )
        self.failures = 0


@dataclass(eq=False)
class Lease:
    """One held lease as its driver sees it."""

    execution_id: str
    epoch: int
    #: Set by the keeper: another runtime may drive the run now; stop before the next step.
    lost: bool = False
    #: When the lease was last confirmed (monotonic seconds): taken *before* the statement
    #: that confirmed it, so a pause between that statement and this record errs towards
    #: asking the database again, never towards trusting an expired lease.
    confirmed: float = -math.inf
    #: Renamed to the runtime's plain name (its presence lock was in doubt): only a lapsed
    #: lease frees the run from then on, whatever becomes of that lock.
    plain: bool = False
    #: When the drive's database call in progress began (monotonic; ``None`` between
    #: calls), set by its :class:`~wf_persist.lending.Lender`.
    busy_since: float | None = None
    #: Ends that call (set by the Lender): it fails as a lost connection, and the drive
    #: stops instead of holding its worker's slot for good.
    cut: Callable[[], None] | None = None


#: A drive's database call waiting longer than this (or than the lease TTL, if longer)
#: stops its lease's renewal. A connection a network fault cut without either end hearing
#: of it (a failover that black-holes the old primary, a proxy whose upstream died) waits
#: for an answer that never comes; renewed from another connection, the lease would keep
#: the run from every other worker for good. Unrenewed, it lapses and the run is taken
#: over; a call that was only slow ends to find its lease lost, and its drive stops before
#: anything new (its writes are fenced).
STALL_AFTER = 30.0


class LeaseKeeper(threading.Thread):
    """Renews this runtime's leases while it drives runs."""

    def __init__(self, backend: Backend, ttl: float) -> None:
        super().__init__(name="wf-persist-lease-keeper", daemon=True)
        self.backend = backend
        self.ttl = ttl
        self._engine: Engine | None = None
        self._held: dict[str, Lease] = {}
        self._lock = threading.RLock()  # release_all() may run in a signal handler (close())
        self._stop_event = threading.Event()
        self._outage = Outage(log, "renewing leases", ttl / 6)

    def hold(self, execution_id: str, epoch: int, asked: float | None = None) -> Lease:
        """Renew this claim from now on (the same Lease if it is already held). ``asked``
        is when the claim was sent (monotonic); unknown, the driver asks the database
        before its first step."""
        with self._lock:
            lease = self._held.get(execution_id)
            if lease is None or lease.epoch != epoch:
                lease = self._held[execution_id] = Lease(execution_id, epoch)
            if asked is not None:
                lease.confirmed = max(lease.confirmed, asked)
            return lease

    def forget(self, lease: Lease) -> None:
        self.forget_run(lease.execution_id, lease.epoch)

    def forget_run(self, execution_id: str, epoch: int) -> None:
        """Forget the run's lease at ``epoch``, if one is held (whoever holds the object)."""
        with self._lock:
            lease = self._held.get(execution_id)
            if lease is not None and lease.epoch == epoch:
                del self._held[execution_id]

    def held(self) -> dict[str, int]:
        with self._lock:
            return {i: lease.epoch for i, lease in self._held.items()}

    def engine(self) -> Engine:
        """The keeper's own engine. None is made once :meth:`stop` began: a renewal that
        outlived its wait would otherwise leave a pool open that nothing disposes of."""
        with self._lock:
            if self._stop_event.is_set():
                raise WfPersistError("the lease keeper has stopped")
            if self._engine is None:
                self._engine = self.backend.side_engine()
            return self._engine

    def warm(self) -> None:
        """Open the keeper's connection now (a worker starting up), not at the first
        renewal, when a slow connect would eat into the first lease."""
        try:
            with self.engine().connect():
                pass
        except Exception as exc:
            if not self._stop_event.is_set():  # else its runtime is closing: nothing to warm
                log.warning("the lease keeper cannot connect yet: %s", brief(exc))

    def run(self) -> None:
        interval = self.ttl / 4
        wait = interval
        while not self._stop_event.wait(wait):
            wait = interval
            with self._lock:  # a lease known lost is not asked about again
                leases = {i: lease for i, lease in self._held.items() if not lease.lost}
            leases = {i: lease for i, lease in leases.items() if not self._stalled(lease)}
            if not leases:
                continue
            started = clocks.elapsed()
            held = {i: lease.epoch for i, lease in leases.items()}

            def renew(held: dict[str, int] = held) -> set[str]:
                with self.engine().connect() as conn:
                    return self.backend.renew_free(conn, held, self.ttl)

            try:  # a renewal meets a drive's write in a deadlock now and then: sent again
                still = refusals.again_if_deadlocked(self.backend, renew)
            except Exception as exc:
                if self._stop_event.is_set():
                    return  # stopped meanwhile (its engine refused, or was disposed of)
                wait = min(interval, self._outage.failed(exc, f"runs {sorted(leases)}"))
                for lease in leases.values():
                    if clocks.elapsed() - lease.confirmed > self.ttl:
                        lease.lost = True
                continue
            self._outage.succeeded()
            for execution_id in still:
                lease = leases[execution_id]
                lease.confirmed = max(lease.confirmed, started)
            missing = {i: lease for i, lease in leases.items() if i not in still}
            lost = sorted(self._taken(missing)) if missing else []
            for execution_id in lost:
                leases[execution_id].lost = True
            if lost:
                log.warning(
                    "lost the lease on %d run(s), another runtime may drive them now: %s",
                    len(lost),
                    lost,
                )

    def _stalled(self, lease: Lease) -> bool:
        """Whether the lease's drive has waited on one database call past the bound (see
        :data:`STALL_AFTER`): then the lease is lost (never asked about again)."""
        since = lease.busy_since
        if since is None:
            return False
        waited = clocks.elapsed() - since
        if waited <= max(self.ttl, STALL_AFTER):
            return False
        # Not renewed from now on: its drive stops before anything new (whether or not the
        # call ends after all), and the run is taken over when the lease lapses.
        lease.lost = True
        log.warning(
            "run %s: its drive has waited %.0fs on one database call (a connection cut "
            "without a word?); the call is ended and the lease no longer renewed, so "
            "another runtime takes the run over when it lapses",
            lease.execution_id,
            waited,
        )
        if lease.cut is not None:
            try:
                lease.cut()
            except Exception as exc:  # the connection ended meanwhile, say
                log.debug("ending the stalled call of run %s: %s", lease.execution_id, exc)
        return True

    def _taken(self, missing: dict[str, Lease]) -> list[str]:
        """Of leases a renewal did not find, those another claim took (not the ones their
        driver released meanwhile by parking or finishing the run)."""
        with self._lock:
            current = {i: lease for i, lease in missing.items() if self._held.get(i) is lease}
        if not current:
            return []
        try:
            with self.engine().connect() as conn, self.backend.begin(conn):
                epochs = self.backend.epochs(conn, list(current))
        except Exception:
            return []  # said at the next renewal
        return [i for i, lease in current.items() if epochs.get(i) != lease.epoch]

    def release_all(self, keep: Collection[str] = ()) -> int:
        """Give up every held lease now but those of ``keep`` (the runs are due at once for
        other workers)."""
        held = {i: epoch for i, epoch in self.held().items() if i not in keep}
        if not held:
            return 0
        try:
            with self.engine().connect() as conn, self.backend.begin(conn):
                return self.backend.release(conn, held)
        except Exception as exc:
            log.warning("could not release the leases of %s on close: %s", sorted(held), brief(exc))
            return 0

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            dispose_pool(engine)
