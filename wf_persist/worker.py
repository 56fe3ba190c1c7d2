"""Workers: claim due runs with a lease and drive them on a thread pool.

A run is *due* when it is new, its timer passed, a signal was delivered, or the lease of the
runtime driving it expired (that runtime died or stalled), all by the database's clock.
Claims are one compare-and-set per run (``FOR UPDATE SKIP LOCKED`` where the database has
it), so many workers on many machines share one database without queueing behind each other
and two never drive a run at once; a worker never claims a run its own process still drives.

The same loop serves the embedded mode (:meth:`Runtime.start_worker`) and the separate worker
process (``wf-persist worker --app module:runtime``). When the database is unreachable the
loop backs off and says so once, and once more when it is back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Final

from . import clocks, telemetry
from .async_worker import EventLoopDriver, check_available
from .error_documents import shown
from .errors import InvalidArgumentError
from .leases import Outage
from .notices import SLOT_ENDING
from .timeouts import plain_number, positive
from .wakeups import NOTIFIED_POLL_INTERVAL

if TYPE_CHECKING:
    from .backends import Claim
    from .backends.base import Changes
    from .runtime import Runtime

log = logging.getLogger("wf_persist.worker")

#: How often a worker looks for runs of workers whose process is gone (presence locks).
REAP_INTERVAL = 0.1

#: How often a worker that hears no notifications (SQLite) reads its database's change
#: counter while it waits (``PRAGMA data_version``: a read of shared memory, no disk access):
#: a commit by another process (a start, a signal) ends the wait, so a separate worker picks
#: a run up within milliseconds rather than a poll interval.
CHANGE_PROBE: Final = 0.01

#: The most runs one worker drives at once: far above what a process drives well (a
#: thread each, or an event loop's share), and a claim's batch size fits every database.
MAX_CONCURRENCY: Final = 100_000


class Reservation:
    """A worker slot promised to one run about to be started claimed (:meth:`Worker.reserve`):
    ``open`` while the slot is held for it, ``submitted`` once the worker has the run."""

    __slots__ = ("open", "submitted")

    def __init__(self) -> None:
        self.open = True
        self.submitted = False


class _Unknown:
    """The next wake was not asked (or the database could not say)."""


UNKNOWN: Final = _Unknown()


class _Full:
    """A claim took every free slot (more may be due)."""


FULL: Final = _Full()


class Worker:
    """Drives due runs of the workflows registered in ``runtime``.

    Args:
        runtime: the runtime whose registered workflow versions this worker runs.
        concurrency: runs driven at once (threads). They borrow connections only for their
            writes: the engine's pool must give at least 2
            (:class:`~wf_persist.errors.PoolTooSmallError`), ``concurrency + 1`` (at most
            10) to never make runs wait for one.
        poll_interval: seconds between looks for due work when nothing announced any.
            Timers known to this worker fire on time; others within one interval. Where
            notifications reach the worker (PostgreSQL) it looks at most every
            :data:`~wf_persist.wakeups.NOTIFIED_POLL_INTERVAL` seconds as a safety net. On
            SQLite it also reads the database's change counter every :data:`CHANGE_PROBE`
            seconds while it waits, and looks at once when another process committed.
            Defaults to the runtime's ``poll_interval`` (0.25 s).
        event_loop: drive the runs of ``async def`` workflows on one event loop instead of
            a thread each (:mod:`wf_persist.async_worker`): ``concurrency`` can then be in
            the hundreds or thousands (runs whose steps await I/O). Needs the ``async``
            extra.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        concurrency: int = 4,
        poll_interval: float | None = None,
        event_loop: bool = False,
    ) -> None:
        count = plain_number(concurrency)
        if not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(
                f"concurrency must be a positive integer, got {shown(concurrency)}"
            )
        if count > MAX_CONCURRENCY:
            raise InvalidArgumentError(
                f"concurrency must be at most {MAX_CONCURRENCY}, got {shown(concurrency)}"
            )
        interval = positive(
            runtime.poll_interval if poll_interval is None else poll_interval, "poll_interval"
        )
        if event_loop:
            check_available()
        runtime.check_pool(count)
        self.runtime = runtime
        self.concurrency = count
        self.poll_interval = interval
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: How long the loop waits, once stopped, for the runs in flight (None: until done).
        self._drain: float | None = None
        #: Runs outlived that wait: a thread of their own closes what they use.
        self._finishing = False
        #: The change probe's interval (see :meth:`_rest`), the runs claimed so far, and
        #: how many had been when a change last ended a rest (None: none did since).
        self._probe = CHANGE_PROBE
        self._claimed_total = 0
        self._woke_at_claims: int | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[Future[Any]] = set()
        #: Slots promised to runs this process starts claimed (see :meth:`reserve`).
        self._reserved = 0
        #: Slots of drives that ended their run and are returning (see _drive).
        self._ending: set[Future[Any]] = set()
        #: When the next timer known at the last look is due (monotonic).
        self._timer_at = 0.0
        #: Whether timers may have changed since the loop last asked for the next one (set
        #: by :meth:`wake`, cleared by :meth:`_next_wake` just before it asks).
        self._timers_stale = True
        #: Whether the last look filled every free slot (more may be due: a run ending
        #: then wakes the loop).
        self._saturated = False
        #: Whether a wake since the last look was news (:meth:`wake`), not a freed slot's
        #: "maybe" (then the look asks first whether anything is due, one read, and claims,
        #: a write, only if so).
        self._told = False
        self._lock = threading.Lock()
        self._outage = Outage(log, "claiming due runs", self.poll_interval)
        self._event_loop = event_loop
        self._loop: EventLoopDriver | None = None

    def wake(self, timers: bool = True) -> None:
        """Look for work now (a run finished or parked here, a signal was sent from here).
        ``timers=False``: only runs due now are news (a notified start or signal), so a
        look that claims one keeps the next timer it knew."""
        if timers:
            self._timers_stale = True
        self._told = True
        self._wake.set()

    def start(self) -> Worker:
        """Run the loop in a background thread."""
        self._thread = threading.Thread(target=self.run, name="wf-persist-worker", daemon=True)
        self._thread.start()
        return self

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (its loop ends, or has ended)."""
        return self._stopping.is_set()

    def stop(self, timeout: float | None = 30, *, join: bool = True) -> None:
        """Stop claiming; wait up to ``timeout`` for runs in flight (they stop at their next
        step once the runtime closes; their leases are released or lapse). ``join=False``:
        do not wait (a run in flight is asking, which its loop would wait for)."""
        self._drain = timeout
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        # A thread not started yet (a close() racing start_worker()) sees the stop when it
        # starts, and ends at once: there is nothing to wait for.
        if (
            join
            and thread is not None
            and thread.ident is not None
            and thread is not threading.current_thread()
        ):
            thread.join(timeout)

    def reserve(self) -> Reservation | None:
        """Promise a slot to a run about to be started claimed by this process (its drive
        then begins at once, without a claim or a poll); None when every slot is busy."""
        with self._lock:
            if self._pool is None or self._stopping.is_set():
                return None
            if self._free() <= 0:
                return None
            self._reserved += 1
            return Reservation()

    def unreserve(self, reservation: Reservation) -> None:
        """Give a promised slot back (once, whoever asks again: an interrupted start)."""
        with self._lock:
            if reservation.open:
                reservation.open = False
                self._reserved -= 1

    def submit(self, claim: Claim, reservation: Reservation) -> bool:
        """Drive a claimed run in its reserved slot; False if the worker is stopping."""
        with self._lock:
            if reservation.open:
                reservation.open = False
                self._reserved -= 1
            pool = self._pool
            if pool is None or self._stopping.is_set():
                return False
            fut = self._dispatch(pool, claim)
            reservation.submitted = True
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return True

    def _free(self) -> int:
        """Slots free now (under the lock): a drive that ended its run counts as free."""
        busy = len(self._inflight) - len(self._ending)
        return self.concurrency - busy - self._reserved

    def _dispatch(self, pool: ThreadPoolExecutor, claim: Claim) -> Future[Any]:
        """Drive ``claim``: on the event loop if it is an ``async def`` workflow's and this
        worker has one, else on a thread. Called under the lock."""
        if self._loop is not None:
            found = self.runtime._registry.get((claim.workflow_name, claim.workflow_version))
            if found is not None and found.is_async:
                return self._loop.submit(self.runtime.drive_claim, claim)
        holder: list[Future[Any]] = []  # read under the lock, held until it is filled
        fut = pool.submit(self._drive, claim, holder)
        holder.append(fut)
        return fut

    def _drive(self, claim: Claim, holder: list[Future[Any]]) -> Any:
        """Drive a claimed run on this thread; its slot is free as soon as the drive ends
        (the pool may queue the next run behind this thread's last moments). Nothing here
        waits for the future: one never filled in (an interrupt in between) frees its slot
        only when the thread returns, as any drive did."""

        def ending() -> None:
            with self._lock:
                if holder and holder[0] in self._inflight:
                    self._ending.add(holder[0])
            if self._saturated:
                self.wake(timers=False)

        token = SLOT_ENDING.set((claim.execution_id, ending))
        try:
            return self.runtime.drive_claim(claim)
        finally:
            SLOT_ENDING.reset(token)

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)
            self._ending.discard(fut)
            saturated = self._saturated
        exc = fut.exception()
        if exc is not None:
            log.error("driving a run failed unexpectedly", exc_info=exc)
        # Look again now if the last look left due runs for want of a slot, or if nothing
        # announces new work (no notifications): a freed slot is then the moment to look.
        # Where notifications arrive, a look now would find only what they announce.
        if saturated:
            self.wake(timers=False)
        elif not self.runtime.hears_due():
            self._wake.set()  # a "maybe": the look asks what is due before it claims

    def run(self) -> None:
        """Claim and drive due runs until :meth:`stop` is called.

        The loop looks for due runs when told (a notification, a run ending here, a start
        or signal from this process) or when its idle wait ends (the next known timer, at
        most one poll interval); where presence locks exist it also looks, every
        :data:`REAP_INTERVAL`, for runs whose worker is gone (one small query).
        """
        rt = self.runtime
        rt.attach(self)
        if self._stopping.is_set():
            return  # stopped before it began: a close() racing start_worker()
        telemetry.watch_backlog(rt)
        rt.keeper().warm()
        rt.wakeups()
        if self._event_loop:
            self._loop = EventLoopDriver()
        try:
            self._serve()
        finally:
            if self._loop is not None and not self._finishing:
                self._loop.close()

    def _serve(self) -> None:
        rt = self.runtime
        changes = rt.backend.changes()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="wf-persist-run")
        try:
            with self._lock:
                self._pool = pool
            look_at = reap_at = 0.0
            while not self._stopping.is_set():
                # Cleared only when set: a wake landing between the two is this look's too.
                told = self._wake.is_set()
                if told:
                    self._wake.clear()
                news, self._told = self._told, False
                peek = told and not news
                try:
                    if self._reaping() and clocks.elapsed() >= reap_at:
                        reap_at = clocks.elapsed() + REAP_INTERVAL
                        found = rt.reap()
                        if found:
                            told = True
                            log.warning(
                                "taking over %d run(s) whose worker is gone: %s", len(found), found
                            )
                    now = clocks.elapsed()
                    if told or now >= look_at:
                        # Nothing committed since the last look and no known timer due:
                        # the look would find what it found then (SQLite's data_version).
                        quiet = (
                            not told
                            and changes is not None
                            and now < self._timer_at
                            and not changes.changed()
                        )
                        until: float | _Unknown | None = UNKNOWN
                        if not quiet:
                            if changes is not None:
                                changes.changed()  # what this look is about to see
                            if peek or (changes is None and not told):
                                # A freed slot's look, or a poll without a change signal:
                                # first ask when the next run is due (one index read);
                                # the claim, a write, only if one is.
                                until = self._next_wake()
                            if self._claim_due(until):
                                claimed = self._claim(pool)
                                if claimed is FULL:
                                    continue  # every free slot filled: maybe more is due
                                if (
                                    claimed
                                    and told
                                    and not self._timers_stale
                                    and now < look_at
                                    and rt.hears_due()
                                ):
                                    # Told of runs due now, and took them: the next timer
                                    # and safety-net look known before still hold (asking
                                    # again would only hold up the drives just begun).
                                    continue
                        look_at = clocks.elapsed() + self._idle_wait(quiet, until)
                except Exception as exc:
                    self._wake.wait(self._outage.failed(exc))
                    look_at = 0.0
                    continue
                self._outage.succeeded()
                self._rest(look_at if not self._reaping() else min(look_at, reap_at), changes)
        finally:
            with self._lock:
                self._pool = None
                inflight = list(self._inflight)
            if changes is not None:
                changes.close()
            self._wake.set()
            # The runs on the event loop too, as long as stop() said: a step may never end
            # (the runtime's close() then releases its lease, and the process may exit).
            _, pending = wait(inflight, self._drain)
            if pending:  # their threads and event loop are closed once they end
                self._finishing = True
                threading.Thread(
                    target=self._finish, args=(pending, pool), name="wf-persist-finish", daemon=True
                ).start()
            else:
                pool.shutdown()

    def _finish(self, pending: set[Future[Any]], pool: ThreadPoolExecutor) -> None:
        wait(pending)
        pool.shutdown()
        if self._loop is not None:
            self._loop.close()

    def _rest(self, until: float, changes: Changes | None) -> None:
        """Wait until ``until`` (monotonic) or a wake. Where the database has a change
        counter and no notifications (SQLite), it is read every :data:`CHANGE_PROBE`
        meanwhile while a slot is free: a commit ends the wait as a "maybe" (the look asks
        what is due before it claims). Commits that bring nothing to claim (this process's
        own drives, another application's writes) double the interval, up to the poll
        interval; a probe that finds none sets it back. A probe that fails leaves the rest
        of the wait to the poll interval (the look then meets the failure, if it lasts)."""
        if self._woke_at_claims is not None:
            took = self._claimed_total > self._woke_at_claims
            self._probe = CHANGE_PROBE if took else min(2 * self._probe, self.poll_interval)
            self._woke_at_claims = None
        probe = min(self._probe, self.poll_interval)
        while True:
            left = until - clocks.elapsed()
            if changes is None or self._saturated or self.runtime.hears_due():
                self._wake.wait(max(0.0, left))
                return
            if left <= 0 or self._wake.wait(min(left, probe)):
                return
            try:
                moved = changes.changed()
            except Exception:
                changes = None
                continue
            if moved:
                self._woke_at_claims = self._claimed_total
                self._wake.set()
                return
            self._probe = CHANGE_PROBE  # quiet: the next commit is news
            probe = min(CHANGE_PROBE, self.poll_interval)

    def _claim(self, pool: ThreadPoolExecutor) -> int | _Full:
        """Claim due runs for the free slots and start them: how many, or :data:`FULL` if
        they took every slot."""
        with self._lock:
            free = self._free()
            self._saturated = free <= 0
        if free <= 0:
            return 0
        claimed = self.runtime.claim_due(free)
        self._claimed_total += len(claimed)
        with self._lock:
            self._saturated = bool(claimed) and len(claimed) == free
        for claim in claimed:
            with self._lock:
                fut = self._dispatch(pool, claim)
                self._inflight.add(fut)
            fut.add_done_callback(self._done)
        if claimed:
            # Hand the interpreter to the drives now: this loop's own bookkeeping (the next
            # timer's query) would otherwise hold it for a millisecond or two first.
            time.sleep(0)
        return FULL if claimed and len(claimed) == free else len(claimed)

    def _reaping(self) -> bool:
        mark = self.runtime.backend.owner_mark()
        return bool(mark) and self.runtime.owner.endswith(mark)

    def _next_wake(self) -> float | _Unknown | None:
        """Seconds until the next run this worker can drive is due (None: none scheduled;
        :data:`UNKNOWN` if the database could not say)."""
        # What this asks covers every timer set so far; one set from now on says so again.
        self._timers_stale = False
        try:
            return self.runtime.seconds_to_next_wake()
        except Exception:
            self._timers_stale = True  # not asked after all
            return UNKNOWN

    @staticmethod
    def _claim_due(until: float | _Unknown | None) -> bool:
        """Whether a claim may find something, given a next wake asked just before."""
        return isinstance(until, _Unknown) or (until is not None and until <= 0)

    def _idle_wait(self, quiet: bool = False, until: float | _Unknown | None = UNKNOWN) -> float:
        """Until the next known timer, at most one poll interval (a longer one while
        notifications arrive: polling is then only the safety net). ``quiet``: nothing
        changed since the last look, whose timer still holds. ``until``: the next wake as
        asked before a claim that was then not needed (else it is asked now)."""
        rt = self.runtime
        interval = self.poll_interval
        if rt.hears_due():
            interval = max(interval, NOTIFIED_POLL_INTERVAL)
        now = clocks.elapsed()
        if quiet:
            return max(0.005, min(interval, self._timer_at - now))
        if self._claim_due(until):
            until = self._next_wake()  # not asked, or claimed meanwhile: ask now
        if isinstance(until, _Unknown):
            self._timer_at = now
            return self.poll_interval
        self._timer_at = math.inf if until is None else now + until
        if until is None:
            return interval
        return max(0.005, min(interval, until))
