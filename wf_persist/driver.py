"""One replay of a claimed run: the body run against history, what is new written, the
outcome recorded (the whole drive, its start and its failures are :mod:`.drives`').

Every write is fenced by the claim's epoch (a fencing token): a driver whose run was claimed
by someone else since (after a pause, a partition, a lost lease) writes nothing and stops.
Time inside a drive is the database's: the claim reads it, and the drive measures from it
with a monotonic clock, so a worker whose own clock is off neither wakes timers early nor
takes over live runs.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import select

from . import bridge, clocks, drive_telemetry, events, lifecycle, refusals, telemetry
from .authoring import Step, Workflow
from .backends import Claim, Fenced
from .bridge import off_loop
from .control import Halt, Reload
from .driver_children import ChildDriving
from .errors import (
    LeaseLostError,
    StaleHistoryError,
    ValueTooLargeError,
)
from .events import NewEvent
from .lease_checks import (
    CONFIRM_TRIES,
    LATE_HAND_OVER_DELAY,
    found_good,
    kept_word,
    settled,
    timely,
)
from .leases import Lease
from .lending import Lender
from .logs import run_fields
from .models import executions_table as ex
from .secrets import Redactor, SecretResolver
from .store import executions, history
from .wakeups import END, NOTIFIED_POLL_INTERVAL, WAKE

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("wf_persist.runtime")

T = TypeVar("T")


class DriveClock:
    """The database's time at the claim, advanced by this process's monotonic clock since
    ``read_at`` (when the claim's answer arrived; default now), and by the time the test kit
    skips meanwhile (see :meth:`Runtime.time_shift`)."""

    def __init__(
        self, db_now: dt.datetime, shift: Callable[[], float], read_at: float | None = None
    ) -> None:
        self._base = db_now
        self._shift = shift
        self._t0 = (clocks.elapsed() if read_at is None else read_at) + shift()

    def __call__(self) -> dt.datetime:
        return self._base + dt.timedelta(seconds=clocks.elapsed() + self._shift() - self._t0)


class RunDriver(ChildDriving):
    """Writes for one replay of one run, fenced by its epoch.

    Each write borrows a pooled connection and gives it back at once: a run holds none
    while its steps (or the workflow's own code) run, so one process drives hundreds of runs
    on a small pool. A step's outcome is not written on its own when nothing else is new: it
    goes out with the next write (the next call's, the park or the run's outcome), and always
    before anything else starts (:meth:`flush`), so a 3-step run ends with one write holding
    its last step and its outcome.

    ``seen`` is the last sequence read; a client event after it (a signal, a cancellation)
    makes parking or deciding a race stale, so the body replays from fresh history. Database
    failures unwind the body as :class:`Halt`, which user code cannot catch.
    """

    def __init__(
        self,
        runtime: Runtime,
        claim: Claim,
        lease: Lease,
        clock: DriveClock,
        seen: int,
        cancel_known: bool,
        lender: Lender,
        redactor: Redactor,
        until: float | None = None,
        deadline: dt.datetime | None = None,
    ) -> None:
        self.runtime = runtime
        #: One per drive (a reload makes a new driver, not a new redactor).
        self.redactor = redactor
        self.lender = lender
        self.backend = runtime.backend
        self.execution_id = claim.execution_id
        self.workflow = claim.workflow_name
        self.epoch = claim.epoch
        #: Whether the outcome is announced to callers waiting in other processes (a run
        #: started here is awaited here: no notification needed).
        self._announce_end = self.backend.can_listen and not claim.started_here
        self.lease = lease
        self.clock = clock
        self.seen = seen
        self._cancel_known = cancel_known
        self.record_start_after = runtime.record_start_after
        self.news = False
        #: Serializes the writes of the body, ctx.all branches and the start-record timer.
        self.conn_lock = lender.lock
        #: Events written with the next write (a finished step's), see :meth:`defer`.
        self._deferred: list[NewEvent] = []
        #: Columns the first write also sets (a timeout the start did not store).
        self._reset: dict[str, Any] = {}
        #: Whether the run's count of failed drives is still to be reset (see
        #: :meth:`_unfailing`).
        self._failing = bool(claim.drive_failures)
        #: ``(ok, stored value)`` once this driver recorded the run's outcome.
        self.finished: tuple[bool, Any] | None = None
        #: Set once this driver parked the run or recorded its outcome: its drive is over,
        #: and a write from a thread the body left behind is refused (see :meth:`_open`).
        self.over = False
        #: When (monotonic) a caller driving the run while it waits for the result stops
        #: driving at the next step and hands the run over (its ``result(timeout=...)``).
        self.until = until
        #: Whether the drive stopped to hand the run over (closing, or ``until`` passed).
        self.handing_over = False
        #: Seconds until a run handed over is due again.
        self.hand_over_delay = 0.0
        #: When the run times out (None: never): a park never outlasts it.
        self.deadline = deadline
        #: The run that started this one as its child: told of its outcome.
        self.parent_id = claim.parent_id
        if deadline is not None and claim.deadline_at is None:
            # Its workflow's timeout (a start that did not know it): stored for SQL readers.
            self._reset["deadline_at"] = deadline

    def _values(self, progressed: bool, values: dict[str, Any] | None) -> dict[str, Any] | None:
        """The columns a fenced write sets: ``values``, what the first write stores, and
        the reset of the failed drives' count if the write is the first progress (see
        :meth:`_unfailing`)."""
        reset = (self._unfailing() or {}) if progressed else {}
        return {**self._reset, **reset, **(values or {})} or None

    def _open(self) -> None:
        """Refuse a write once the drive is over (the run parked or ended): its claim
        epoch is unchanged until someone claims the run, so the fence alone would let a
        thread the body left behind record after the run's park or outcome."""
        if self.over:
            raise Halt(LeaseLostError(self.execution_id))

    def _unfailing(self) -> dict[str, Any] | None:
        """The reset of the run's count of failed drives, while one is due: made by the
        first write that is progress, or by a park. Not by any write: an attempt's
        ``step.started``, or a keyed event a replay records again (dropped as a
        duplicate), is written at every drive, so a run whose next write the database
        refuses every time would repeat its step, branch or compensation for ever."""
        return {"drive_failures": 0} if self._failing else None

    def _written(self, progressed: bool) -> None:
        self._reset = {}
        if progressed:
            self._failing = False

    # the Driver protocol -------------------------------------------------------------

    def _write(
        self,
        evs: Sequence[NewEvent],
        values: dict[str, Any] | None = None,
        guard: tuple[str, ...] | None = None,
        note: str | None = None,
    ) -> Fenced:
        return off_loop(self._write_now, evs, values, guard, note)

    def _write_now(
        self,
        evs: Sequence[NewEvent],
        values: dict[str, Any] | None,
        guard: tuple[str, ...] | None,
        note: str | None,
    ) -> Fenced:
        with self.conn_lock:
            self._open()
            deferred = self._deferred
            if deferred:
                try:
                    fenced = self._send([*deferred, *evs], values, guard, note)
                except Halt as halt:
                    if not isinstance(halt.cause, ValueTooLargeError):
                        raise
                    # Too large as one statement (MySQL's packet): the deferred events alone.
                    self._send(deferred, None, None)
                    deferred.clear()
                    return self._send(evs, values, guard, note)
                deferred.clear()
                return fenced
            return self._send(evs, values, guard, note)

    def _send(
        self,
        evs: Sequence[NewEvent],
        values: dict[str, Any] | None,
        guard: tuple[str, ...] | None,
        note: str | None = None,
    ) -> Fenced:
        # Every event of a fenced write is new: progress is what it sends.
        progressed = self._failing and events.progress(evs)

        def send() -> Fenced:
            with self.lender.connection() as conn:
                return self.backend.write(
                    conn,
                    self.execution_id,
                    self.epoch,
                    evs,
                    now=self.clock(),
                    values=self._values(progressed, values),
                    guard=guard,
                    note=note,
                )

        try:
            fenced = refusals.again_if_deadlocked(self.backend, send)
        except Exception as exc:
            raise Halt(exc) from exc
        self._written(progressed)
        if fenced.status == lifecycle.COMPENSATING and not self._cancel_known:
            self.news = True  # cancelled meanwhile: the next call replays to unwind
        return fenced

    def record(self, evs: Sequence[NewEvent]) -> None:
        self._write(evs)

    def _near(self, wake_at: dt.datetime) -> bool:
        """Whether a timer is due before a listening worker's safety-net poll would see it
        (only then is it worth a notification)."""
        if not self.backend.can_listen:
            return False
        return (wake_at - self.clock()).total_seconds() <= NOTIFIED_POLL_INTERVAL

    def defer(self, evs: Sequence[NewEvent]) -> None:
        """Write ``evs`` with the next write, at the latest by :meth:`flush`."""
        # conn_lock is held through writes (the timer thread's start record, a ctx.all
        # branch's): waited for on a thread when bridged, never on the loop thread.
        off_loop(self._defer_now, evs)

    def _defer_now(self, evs: Sequence[NewEvent]) -> None:
        with self.conn_lock:
            self._deferred.extend(evs)

    def flush(self) -> None:
        """Write the deferred events now (before something new starts)."""
        off_loop(self._flush_now)

    def _flush_now(self) -> None:
        with self.conn_lock:
            if self._deferred:
                self._write([])

    def _locked(
        self,
        evs: Sequence[NewEvent],
        park: bool,
        wake_at: dt.datetime | None,
        values: dict[str, Any] | None = None,
        note: str | None = None,
    ) -> None:
        off_loop(self._locked_now, evs, park, wake_at, values, note)

    def _locked_now(
        self,
        evs: Sequence[NewEvent],
        park: bool,
        wake_at: dt.datetime | None,
        values: dict[str, Any] | None,
        note: str | None,
    ) -> None:
        with self.conn_lock:
            self._open()
            evs = [*self._deferred, *evs]
            try:
                # A park ends the drive cleanly: the run is not failing, whatever it adds.
                unfailing = self._unfailing()
                merged = {**self._reset, **(unfailing or {} if park else {}), **(values or {})}

                def append() -> history.AppendResult:
                    with self.lender.connection() as conn, self.backend.begin(conn):
                        appended = self._append(conn, evs, self.clock(), merged or None, unfailing)
                        if note is not None:
                            self.backend.announce(conn, note)
                        if park:
                            executions.park(conn, self.execution_id, self.epoch, wake_at)
                            if wake_at is not None and self._near(wake_at):
                                self.backend.announce(conn, WAKE + wake_at.isoformat())
                        return appended

                appended = refusals.again_if_deadlocked(self.backend, append)
            except StaleHistoryError:
                raise Reload from None
            except Exception as exc:
                raise Halt(exc) from exc
            self._deferred.clear()
            self._written(park or appended.progressed)

    def record_checked(self, evs: Sequence[NewEvent]) -> None:
        self._locked(evs, False, None)

    def suspend(self, evs: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        if self.deadline is not None and (wake_at is None or wake_at > self.deadline):
            wake_at = self.deadline  # woken to time out, whoever is alive then
        self._locked(evs, True, wake_at)
        self.over = True
        drive_telemetry.parked(evs, wake_at)
        if wake_at is not None:  # this process's worker fires the timer on time
            self.runtime.timer_set()

    def check_lease(self) -> None:
        """Before anything new starts: is the run still ours? The keeper says so every
        quarter of the TTL; if its word is older than half the TTL (the keeper lags, or this
        process was paused), or this process's presence lock was lost since, ask the
        database now, fenced by the epoch."""
        lease = self.lease
        if lease.lost:
            raise Halt(LeaseLostError(self.execution_id))
        self._stop_if_leaving()
        ttl = self.runtime.lease_ttl.total_seconds()
        found_at = time.time()  # before the finding: see lease_checked_at()
        if kept_word(lease.confirmed, ttl, settled(self._presence)):
            found_good(found_at)
            return
        for _ in range(CONFIRM_TRIES):
            # While the presence lock is in doubt, others may take runs named after it soon
            # after they find it free: the renewal names the lease after this runtime's
            # plain name, which only a lapsed lease frees, so the answer is as good as it
            # is young, however slow the link.
            rename = (
                None if lease.plain or self._presence() != math.inf else self.runtime.plain_owner
            )
            asked = clocks.elapsed()
            try:
                still = off_loop(self._renew, ttl, rename)
            except Exception as exc:
                raise Halt(exc) from exc
            if self.execution_id not in still:
                lease.lost = True
                raise Halt(LeaseLostError(self.execution_id))
            lease.confirmed = max(lease.confirmed, asked)
            lease.plain = lease.plain or rename is not None
            found_at = time.time()
            if timely(asked, ttl, self._presence()):
                found_good(found_at)
                return
            self._stop_if_leaving()
        self.flush()  # keep what finished; due again after a pause, no failure counted
        log.warning(
            "run %s: the database confirmed its lease late %d times in a row; handing it "
            "over for now",
            self.execution_id,
            CONFIRM_TRIES,
            extra=run_fields(self.execution_id, self.workflow),
        )
        self.handing_over = True
        self.hand_over_delay = LATE_HAND_OVER_DELAY
        raise Halt(LeaseLostError(self.execution_id))

    def _presence(self) -> float | None:
        """See :meth:`Runtime.presence_since`; ``None`` once this lease is not named after
        the presence lock."""
        return None if self.lease.plain else self.runtime.presence_since()

    def _stop_if_leaving(self) -> None:
        if self.runtime.closing or (self.until is not None and clocks.elapsed() >= self.until):
            self.flush()  # what finished is kept; the run is handed over from there
            self.handing_over = True
            self.hand_over_delay = 0.0
            raise Halt(LeaseLostError(self.execution_id))

    def check_size(self, what: str, value: Any) -> None:
        self.backend.check_size(what, value)

    def as_stored(self, doc: Any) -> Any:
        """A recorded document as a replay will read it back (see ``Backend.as_stored``)."""
        return self.backend.as_stored(doc)

    def secret_resolver(self) -> SecretResolver | None:
        return self.runtime.secret_resolver

    def _renew(self, ttl: float, owner: str | None) -> set[str]:
        # On the drive's connection: never one held while waiting for a second. Once more
        # on a fresh one if the server ended it (kept across a pause, say): fenced by the
        # epoch, a renewal may be sent twice.
        def renew() -> set[str]:
            with self.lender.connection() as conn:
                held = {self.execution_id: self.epoch}
                return self.backend.renew_alone(conn, held, ttl, owner)

        return refusals.again_if_reset(self.backend, renew)

    def after(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        return self.runtime.timers.after(delay, fn, blocking=True)

    def pause(self, seconds: float) -> None:
        with self.lender.lent():
            bridge.pause(seconds, self.runtime.pause)

    def user_code(self) -> AbstractContextManager[None]:
        return self.lender.lent()

    def step_function(self, step: Step[Any]) -> Callable[..., Any]:
        return self.runtime.step_overrides.get(step, step.fn)

    def code_function(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        return fn

    @contextmanager
    def concurrency_slot(self, step: Step[Any], key: str) -> Iterator[Callable[[], None]]:
        """Hold one of ``step``'s slots for ``key``, checking meanwhile that the run is
        still ours (a run cancelled while it queues never starts the step). When bridged,
        each try and the slot's taking and giving back are short calls on an ``io`` thread
        and the pauses between tries are on the loop: a queued run holds no thread (runs
        queueing by the hundred would otherwise take every thread, the holder's release
        among them). Yields the check to make right before the step's own code (the slot
        still this run's)."""
        limit = step.concurrency
        assert limit is not None
        last_check = clocks.elapsed()
        delay = 0.002
        held = self.runtime.slots.slot(step.name, key, limit.limit, self.execution_id)
        acquire = off_loop(held.__enter__)
        try:
            waited = False
            while not off_loop(_or_halt, acquire):
                waited = True
                if clocks.elapsed() - last_check > 0.2:
                    last_check = clocks.elapsed()
                    self._check_queued()
                bridge.pause(delay, time.sleep)
                delay = min(delay * 2, 0.05)
            if waited:  # a cancel since the last look must not see the step start now
                self._check_queued()

            def still_held() -> None:
                # Right before the step's own code: a slot that lapsed while this process
                # was kept from running (a thread to be had, renewals late) may be another
                # run's now; this one queues again (read again, it starts the step anew).
                try:
                    fresh = off_loop(acquire.fresh)
                except Exception as exc:
                    raise Halt(exc) from exc
                if not fresh:
                    raise Reload

            yield still_held
        except BaseException:
            off_loop(held.__exit__, *sys.exc_info())
            raise
        else:
            off_loop(held.__exit__, None, None, None)

    def _check_queued(self) -> None:
        """While a step queues for a slot: the run still ours, not cancelled, and its
        deadline not passed (then the run is read again: its replay times out before the
        step, which never starts)."""
        self.check_lease()
        self.check_run()
        if self.deadline is not None and self.clock() >= self.deadline:
            raise Reload

    def check_run(self) -> None:
        """Is the run still ours, and not cancelled meanwhile? (A read, not a write.)"""
        off_loop(self._check_run_now)

    def _check_run_now(self) -> None:
        try:
            with self.backend.read() as conn:
                row = conn.execute(
                    select(ex.c.status, ex.c.claim_epoch).where(ex.c.id == self.execution_id)
                ).one_or_none()
        except Exception as exc:
            raise Halt(exc) from exc
        if row is None or int(row.claim_epoch) != self.epoch:
            raise Halt(LeaseLostError(self.execution_id))
        if row.status == lifecycle.COMPENSATING and not self._cancel_known:
            raise Reload

    # the outcome ------------------------------------------------------------------

    def finish(self, wf: Workflow[Any, Any], *, ok: bool, value: Any) -> None:
        """Record the outcome and release the lease: one fenced write."""
        now = self.clock()
        kind = lifecycle.COMPLETED if ok else lifecycle.FAILED
        values: dict[str, Any] = {
            "status": kind.value,
            "result" if ok else "error": value,
            "finished_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "wake_at": None,
        }
        guard = lifecycle.COMPLETABLE if ok else lifecycle.FAILABLE
        event = events.workflow_finished(self.execution_id, wf.name, ok, value, now)
        note = END + self.execution_id if self._announce_end else None
        try:
            if self.parent_id is None:
                self._write([event], values, tuple(sorted(guard)), note)
            else:
                # Under the row lock, with the parent told in the same transaction (the
                # client events this drive has not read, a cancellation, make it Reload).
                self._locked([event], False, None, values, note)
        except Halt as halt:
            # A cancellation can land between the last call and the outcome: the guard then
            # refuses a completion. Replay from the fresh history to unwind instead.
            if isinstance(halt.cause, LeaseLostError):
                self.check_run()
            raise
        # As any other process reads the outcome back (JSONB's key order on PostgreSQL).
        self.finished = (ok, self.as_stored(value))
        self.over = True
        telemetry.run_ended(wf.name, wf.version, ok)


def _or_halt(acquire: Callable[[], bool]) -> bool:
    """Taking a slot is the runtime's business: its database errors are not step failures."""
    try:
        return acquire()
    except Exception as exc:
        raise Halt(exc) from exc
