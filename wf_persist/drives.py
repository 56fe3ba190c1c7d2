"""A whole drive of one claimed run: its start (history and ``workflow.started``), the
replay loop, and what happens when it stops (a failure counted, a lease handed over).

A drive that stops on an error other than a lost lease is counted on the run
(``drive_failures``, a ``drive.failed`` event) and the run is retried after a backoff; after
``max_drive_failures`` in a row it fails with :class:`DriveFailedError`, so a run that fails
the same way every time ends instead of being re-driven forever.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Float, literal, select

from . import bridge, clocks, drive_telemetry, events, lifecycle, telemetry
from .backends import Claim
from .backends.clock import db_later, db_now
from .bodies import run_body
from .bridge import off_loop
from .control import Halt, Reload, Suspended, interrupting
from .driver import DriveClock, RunDriver
from .error_documents import brief, driver_error, error_document
from .errors import DriveFailedError, LeaseLostError
from .leases import Lease
from .lending import Lender
from .logs import run_fields
from .models import executions_table as ex
from .replay import Journal
from .secrets import Redactor
from .store import executions, history
from .timeouts import run_deadline
from .wakeups import END

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("wf_persist.runtime")

#: The longest a failed run waits before its next drive.
MAX_FAILURE_BACKOFF = 60.0


def load_journal(conn: Connection, execution_id: str) -> tuple[Journal, int]:
    rows = history.load(conn, execution_id)
    return Journal.from_events([r.event for r in rows]), int(rows[-1].sequence) if rows else 0


def start_drive(
    runtime: Runtime,
    claim: Claim,
    traced: drive_telemetry.DriveTrace | drive_telemetry.NoDrive = drive_telemetry.NO_DRIVE,
) -> tuple[Journal, int]:
    """The journal of a claimed run and the last sequence read, its history read (and
    ``workflow.started`` recorded) by the claim itself or now (:meth:`Backend.open_claim`);
    ``traced``'s span starts then, continuing the trace stored with the run."""
    if claim.history is None:
        claim = off_loop(_open, runtime, claim)
    history = claim.history or ()
    takeover = bool(history) and _left_in_flight(claim, history[-1][1])
    if traced.wanted:
        traced.open(_stored_trace(runtime, claim, history), takeover)
    if takeover:
        drive_telemetry.took_over(claim.workflow_name)
        log.info(
            "run %s (%s): resuming a run an earlier driver left in flight (claim %d)",
            claim.execution_id,
            claim.workflow_name,
            claim.epoch,
            extra=run_fields(claim.execution_id, claim.workflow_name),
        )
    return Journal.from_events([e for _, e in history]), claim.next_seq - 1


def _stored_trace(
    runtime: Runtime, claim: Claim, history: tuple[tuple[int, dict[str, Any]], ...]
) -> Mapping[str, str] | None:
    """The trace context stored with the run: known when it was started here, in the
    history when the claim read its first event, else read (a run's first drive)."""
    if claim.trace is not None:
        return claim.trace
    if history and history[0][0] == 1:
        return telemetry.stored_trace(history[0][1])
    started = off_loop(_first_event, runtime, claim.execution_id)
    return None if started is None else telemetry.stored_trace(started)


def _first_event(runtime: Runtime, execution_id: str) -> dict[str, Any] | None:
    with runtime.backend.read() as conn:
        return history.first(conn, execution_id)


def _open(runtime: Runtime, claim: Claim) -> Claim:
    with runtime.backend.begin() as conn:
        return runtime.backend.open_claim(conn, claim)


def _left_in_flight(claim: Claim, last: Mapping[str, Any]) -> bool:
    """Whether the run's last driver stopped mid-drive (it died, was paused past its lease
    or handed the run over on shutdown): running, no failed drive, and the last event is
    neither a client's (a signal, a cancellation) nor a retry parked for later."""
    if claim.status != lifecycle.RUNNING.value or claim.drive_failures:
        return False
    if last["type"] == "execution.started":  # never driven before
        return False
    if last["type"] in events.CLIENT_EVENT_TYPES:
        return False
    return not (last["type"] == "step.failed" and not last.get("final", True))


#: A claim whose answer took longer than this (seconds, from sending it to reading it: a
#: pause of the process, a slow link) leaves its database time in doubt by as much: the
#: drive reads the time again (at most CLOCK_READS times) before anything is timed by it.
CLOCK_DOUBT = 0.25
CLOCK_READS = 3


def _drive_clock(runtime: Runtime, claim: Claim) -> DriveClock:
    """The drive's clock: the claim's database time, or one read again while that time was
    in doubt (a sleep set on a clock left behind by a pause would end early)."""
    now, asked, read = claim.db_now, claim.asked_at, claim.read_at
    for _ in range(CLOCK_READS):
        if asked is None or read is None or read - asked <= CLOCK_DOUBT:
            break
        asked = clocks.elapsed()
        now = off_loop(_database_time, runtime)
        read = clocks.elapsed()
    return DriveClock(now, runtime.time_shift, read)


def _database_time(runtime: Runtime) -> Any:
    with runtime.backend.read() as conn:
        return conn.execute(select(db_now())).scalar_one()


def drive(
    runtime: Runtime,
    claim: Claim,
    lease: Lease,
    loaded: tuple[Journal, int],
    until: float | None = None,
) -> Any:
    """Drive a claimed run until it finishes, parks or loses its lease (or, at a step
    boundary once ``until`` (monotonic) passed, hand it over: due again at once).

    Returns ``(ok, stored value)`` if it finished here, else ``None``.
    """
    wf = runtime.definition(claim.workflow_name, claim.workflow_version)
    deadline = run_deadline(claim, wf.timeout)
    lender = Lender(runtime.backend, runtime.timers, keep=not bridge.bridged(), lease=lease)
    driver: RunDriver | None = None
    redactor = Redactor()  # what a failed drive stores is scrubbed of the drive's secrets
    try:
        try:  # a read that fails is counted as the drive's failure, as a reload's is
            clock = _drive_clock(runtime, claim)
        except Exception as exc:
            raise Halt(exc) from exc
        while True:
            journal, seen = loaded
            cancel_known = journal.cancelled is not None
            driver = RunDriver(
                runtime, claim, lease, clock, seen, cancel_known, lender, redactor, until, deadline
            )
            try:
                run_body(driver, wf, claim.input, journal)
            except Reload:
                driver.flush()  # a finished step's events, before the history is read again
                try:
                    loaded = off_loop(_reload, runtime, lender, claim.execution_id)
                except Exception as exc:
                    raise Halt(exc) from exc
                continue
            except Suspended:
                pass
            return driver.finished
    except Halt as halt:
        off_loop(lender.release)  # what follows takes a connection of its own
        if isinstance(halt.cause, LeaseLostError):
            if driver is not None and driver.handing_over and not lease.lost:
                # Stopped by close() or a caller's deadline, not by a takeover: hand the run
                # over now (its lease is forgotten below, so close() would not release it).
                drive_telemetry.drive_outcome("handed_over")
                release(runtime, claim, driver.hand_over_delay)
            else:
                drive_telemetry.drive_outcome("lease_lost")
                log.warning(
                    "run %s (%s): lease lost, stopped (another runtime may drive it)",
                    claim.execution_id,
                    claim.workflow_name,
                    extra=run_fields(claim.execution_id, claim.workflow_name),
                )
        else:
            failed(runtime, claim, halt.cause, redactor)
    except Exception as exc:  # a defect in replay itself: count it like any failed drive
        off_loop(lender.release)
        failed(runtime, claim, exc, redactor)
    except BaseException as exc:
        if not interrupting(exc):  # user code's own KeyboardInterrupt, say: a failed drive
            off_loop(lender.release)
            failed(runtime, claim, exc, redactor)
            return None
        if driver is not None:  # interrupted (shutdown): keep what finished, if we still can
            with contextlib.suppress(Exception, Halt):
                driver.flush()
        off_loop(lender.release)
        raise  # Runtime._drive gives the run back: due again at once elsewhere
    finally:
        off_loop(lender.release)
        runtime.keeper().forget(lease)
    return None


def _reload(runtime: Runtime, lender: Lender, execution_id: str) -> tuple[Journal, int]:
    # On the drive's own connection: a drive never holds one connection while it waits
    # for a second (drives would wait on each other).
    with lender.connection() as own, runtime.backend.read(own) as conn:
        return load_journal(conn, execution_id)


def failed(
    runtime: Runtime, claim: Claim, exc: BaseException, redactor: Redactor | None = None
) -> None:
    """Count a failed drive on the run; past the limit, fail the run. Fenced by the epoch
    (a run someone else claimed meanwhile is theirs), on a fresh connection. ``redactor``:
    the drive's secrets (its traceback holds what was being handled when it failed: a
    step's error, say)."""
    redactor = redactor or Redactor()
    drive_telemetry.drive_outcome("drive_failed", exc, redactor.scrub)
    off_loop(_failed, runtime, claim, exc, redactor)


def _failed(runtime: Runtime, claim: Claim, exc: BaseException, redactor: Redactor) -> None:
    execution_id = claim.execution_id
    # The driver's words, not the whole statement.
    doc = redactor.scrub(error_document(driver_error(exc), redactor.scrub))
    counted: list[tuple[int, dict[str, Any]]] = []  # what the last try read and would write
    refusals: list[Exception] = []
    for _ in range(2):  # a passing error (a lost connection, a deadlock) gets another try
        try:
            if not _record_failure(runtime, claim, doc, counted):
                return  # someone else's now, or ended
            break
        except Exception as error:
            refusals.append(error)
    else:  # refused twice
        if not counted or not _counted_anyway(runtime, claim, *counted[-1]):
            log.error(
                "run %s (%s): drive failed (%s) and recording that failed too (%s); it is "
                "retried when its lease expires",
                execution_id,
                claim.workflow_name,
                brief(exc),
                brief(refusals[-1]),
                extra=run_fields(execution_id, claim.workflow_name),
            )
            return
        log.error(
            "run %s (%s): the database refused the record of a failed drive twice (%s): "
            "counted on the run's row, without its history events",
            execution_id,
            claim.workflow_name,
            brief(refusals[-1]),
            extra=run_fields(execution_id, claim.workflow_name),
        )
    count, values = counted[-1]
    ended = "error" in values
    if ended:
        telemetry.run_ended(claim.workflow_name, claim.workflow_version, False)
    else:
        runtime.timer_set()  # due again after the backoff: this worker's next wake
    log.error(
        "run %s (%s): drive %d of at most %d failed: %s%s",
        execution_id,
        claim.workflow_name,
        count,
        runtime.max_drive_failures,
        brief(exc),
        "; the run is failed (DriveFailedError)" if ended else "",
        extra=run_fields(execution_id, claim.workflow_name),
    )


def _record_failure(
    runtime: Runtime, claim: Claim, doc: Any, counted: list[tuple[int, dict[str, Any]]]
) -> bool:
    """Count the failed drive with its history (``drive.failed``; at the limit the run's
    failure, its parent told), in one transaction; False if the run is no longer this
    drive's. What it read and would write is put in ``counted`` first."""
    execution_id = claim.execution_id
    backend = runtime.backend
    with backend.begin() as conn:
        row = conn.execute(
            select(ex.c.drive_failures, ex.c.claim_epoch, ex.c.status, db_now())
            .where(ex.c.id == execution_id)
            .with_for_update()
        ).one_or_none()
        if row is None or int(row.claim_epoch) != claim.epoch or row.status in lifecycle.TERMINAL:
            return False
        count = int(row.drive_failures) + 1
        now = row[3]
        evs = [events.drive_failed(execution_id, doc, count, now)]
        values = _failure_values(runtime, count, doc, now)
        counted.append((count, values))
        if "error" in values:
            evs.append(
                events.workflow_finished(
                    execution_id, claim.workflow_name, False, values["error"], now
                )
            )
        history.append(conn, backend, execution_id, evs, now=now, epoch=claim.epoch, values=values)
        if "error" in values:  # callers waiting elsewhere hear of it as of any end
            backend.announce(conn, END + execution_id)
    return True


def _failure_values(runtime: Runtime, count: int, doc: Any, now: Any) -> dict[str, Any]:
    """The run's columns after its ``count``-th failed drive in a row: due again after a
    backoff, or failed with :class:`DriveFailedError` at the limit."""
    if count >= runtime.max_drive_failures:
        return {
            "drive_failures": count,
            "status": lifecycle.FAILED.value,
            "error": error_document(DriveFailedError(count, doc)),
            "finished_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "wake_at": None,
        }
    backoff = min(MAX_FAILURE_BACKOFF, 2.0 ** (count - 1))
    return {
        "drive_failures": count,
        "lease_owner": None,
        "lease_expires_at": None,
        "wake_at": db_later(literal(backoff, Float())),
    }


def _counted_anyway(runtime: Runtime, claim: Claim, count: int, values: dict[str, Any]) -> bool:
    """Count a failed drive whose record the database refused twice (a history insert
    refused every time, say by a trigger): on the run's row, so the limit is still reached
    and the step in flight is not run again at every lease expiry for ever. Only if no try
    committed after all (the count is still one less). A run failed this way has no
    ``workflow.failed`` event; its parent is told in the same transaction, or, if that is
    refused too (its history takes the same refusal), not at all."""
    backend = runtime.backend
    tell = "error" in values and claim.parent_id is not None
    for telling in (True, False) if tell else (False,):
        try:
            with backend.begin() as conn:
                if not executions.count_failure(
                    conn, backend, claim.execution_id, claim.epoch, count, values
                ):
                    return False
                if telling:
                    history.tell_parent(
                        conn,
                        backend,
                        str(claim.parent_id),
                        claim.execution_id,
                        lifecycle.FAILED.value,
                        values,
                        values["finished_at"],
                    )
                if "error" in values:
                    backend.announce(conn, END + claim.execution_id)
            return True
        except Exception:
            continue
    return False


def release(runtime: Runtime, claim: Claim, delay: float = 0.0) -> None:
    """Give the run's lease up at once, due again after ``delay`` seconds (best effort)."""
    release_run(runtime, claim.execution_id, claim.epoch, claim.workflow_name, delay)


def release_run(
    runtime: Runtime, execution_id: str, epoch: int, workflow: str, delay: float = 0.0
) -> None:
    """Give the run's lease up at once, if ``epoch`` is still its own (best effort)."""
    off_loop(_release, runtime, execution_id, epoch, workflow, delay)


def release_if_held(runtime: Runtime, execution_id: str, owner: str) -> None:
    """Give the run's lease up if ``owner`` holds it: a claim whose answer was lost (an
    interrupt as it returned) left it so, at an epoch only the database knows."""
    off_loop(_release_if_held, runtime, execution_id, owner)


def _release_if_held(runtime: Runtime, execution_id: str, owner: str) -> None:
    if runtime.backend.pool_would_wait():
        # The interrupt most likely came while the claim waited for a connection (nothing
        # sent): the caller's deadline is not held up by a pool timeout for a look.
        log.warning("run %s: no free connection to check its lease: left to lapse", execution_id)
        return
    try:
        row = executions.look(runtime.backend, execution_id)
    except Exception as exc:
        log.warning("run %s: could not read its lease: %s", execution_id, brief(exc))
        return
    if row is None or row.lease_owner != owner or row.lease_expires_at is None:
        return
    # Asked after the read: a claim the worker made before it is seen here, and one it
    # makes after it bumped the epoch, which the release below then does not match.
    if not runtime.claimed_here(execution_id):
        _release(runtime, execution_id, int(row.claim_epoch), str(row.workflow_name))


def _release(
    runtime: Runtime, execution_id: str, epoch: int, workflow: str, delay: float = 0.0
) -> None:
    try:
        with runtime.backend.begin() as conn:
            runtime.backend.release(conn, {execution_id: epoch}, delay)
    except Exception as exc:
        log.warning(
            "run %s (%s): could not release its lease: %s",
            execution_id,
            workflow,
            brief(exc),
            extra=run_fields(execution_id, workflow),
        )
