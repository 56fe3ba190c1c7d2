"""Executions: idempotent creation, lookup, cancellation, parking, keyset listing, purge.

Claims and lease renewal are the backend's (they differ per database); everything here is
plain SQL every backend runs the same way. Times that schedule work (``wake_at``) come from
the database's clock; times that only record (``created_at``) come from the caller.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import Row, delete, func, select, update

from .. import lifecycle
from ..backends.clock import db_now
from ..backends.sql import P_ID, Cataloged, Claim, Stale, due
from ..errors import CannotCancelError, IdempotencyConflictError, UnknownExecutionError
from ..events import NewEvent
from ..models import executions_table as ex
from ..models import history_table as hist
from ..wakeups import DUE, END
from . import Executor, connection_of, history, rowcount

if TYPE_CHECKING:
    from ..backends import Backend


#: Built once: a reused statement keeps its cache key.
_GET = select(ex, (ex.c.wake_at <= db_now()).label("due")).where(ex.c.id == P_ID)


class Created(NamedTuple):
    """What :func:`create` did: the run's id and version (an existing run's, for a start
    with an idempotency key already used), whether it is new, and the claim of a run created
    claimed (``lease``)."""

    execution_id: str
    version: int
    created: bool
    claim: Claim | None = None


def create(
    conn: Executor,
    backend: Backend,
    *,
    execution_id: str,
    workflow_name: str,
    workflow_version: int,
    payload: Any,
    idempotency_key: str | None,
    actor: str | None,
    started: NewEvent,
    now: dt.datetime,
    lease: tuple[str, float] | None = None,
    deadline: dt.datetime | None = None,
    parent_id: str | None = None,
    newest: Cataloged | None = None,
) -> Created | Stale:
    """Insert a run and its ``execution.started`` event (sequence 1) atomically.

    With an idempotency key the insert ignores a conflict on (workflow_name, key) and only
    that, so 20 threads or two processes starting with one key create exactly one run; the
    losers get the winner's id and record nothing. The run is due at once by the database's
    clock, or with ``lease=(owner, ttl)`` created claimed by ``owner`` and ready to drive
    (``workflow.started`` recorded: the starting process drives it itself). ``deadline``:
    when the run times out; ``parent_id``: the run starting it as its child. ``newest``
    (where the backend :attr:`~Backend.checks_newest`): the version's catalog entry as read;
    create nothing and return :data:`STALE` unless ``workflow_version`` is still the
    newest cataloged, that very entry (not one cataloged again since).
    """
    core = connection_of(conn)
    row = {
        "id": execution_id,
        "workflow_name": workflow_name,
        "workflow_version": workflow_version,
        "status": lifecycle.RUNNING.value,
        "input": payload,
        "idempotency_key": idempotency_key,
        "actor": actor,
        "next_seq": 2,
        "created_at": now,
        "updated_at": now,
        "deadline_at": deadline,
        "parent_id": parent_id,
    }
    inserted = backend.insert_run(core, row, started, lease=lease, newest=newest)
    if isinstance(inserted, Stale):
        return inserted
    if inserted is False:
        assert idempotency_key is not None  # the only conflict an insert ignores
        found = core.execute(
            select(ex.c.id, ex.c.workflow_version).where(
                ex.c.workflow_name == workflow_name, ex.c.idempotency_key == idempotency_key
            ),
            execution_options=backend.statement_options,
        ).one_or_none()
        if found is None:  # the winner is not visible to this transaction's snapshot
            raise IdempotencyConflictError(workflow_name, idempotency_key)
        return Created(str(found.id), int(found.workflow_version), False)
    if inserted is True:
        return Created(execution_id, workflow_version, True)
    trace = started.event.get("trace")  # its drive, here, continues the starter's trace
    claim = inserted if trace is None else inserted._replace(trace=trace)
    return Created(execution_id, workflow_version, True, claim)


def cancel(
    conn: Executor,
    backend: Backend,
    execution_id: str,
    *,
    cancelled: NewEvent,
    compensate: bool,
    error: dict[str, Any],
    now: dt.datetime,
    unwinding_too: bool = True,
) -> tuple[str, int] | None:
    """Record a cancellation: one transaction changes the status and records
    ``execution.cancelled``, so of two concurrent cancels exactly one is recorded.
    ``unwinding_too=False``: a run being compensated is not ended (a tree's cancel leaves a
    child's own unwind to run its course).

    With ``compensate`` the run moves to ``compensating`` and is woken (a parked run now; a
    running one learns it from its next write and replays to unwind). Without, it fails at
    once with ``error`` and its fencing token is bumped, so its driver's next write is
    refused: no further step is recorded (one it began meanwhile may have run).

    Returns:
        The run's (workflow name, version) if it ended now (without compensation: no drive
        ends it, so the caller counts it), else ``None``.

    Raises:
        UnknownExecutionError, CannotCancelError (see :func:`lifecycle.cancellable`).
    """
    core = connection_of(conn)
    found = core.execute(
        select(ex.c.status, ex.c.workflow_name, ex.c.workflow_version)
        .where(ex.c.id == execution_id)
        .with_for_update(),
        execution_options=backend.statement_options,
    ).one_or_none()
    if found is None:
        raise UnknownExecutionError(execution_id)
    status = found.status
    if not lifecycle.cancellable(str(status), compensate, unwinding_too):
        raise CannotCancelError(
            execution_id,
            str(status),
            without_compensation=lifecycle.cancellable(str(status), False, unwinding_too),
        )
    target = lifecycle.cancellation_status(compensate).value
    if compensate:
        history.append(core, backend, execution_id, [cancelled], now=now, force_status=target)
        wake(core, backend, execution_id)
        return None
    history.append(
        core,
        backend,
        execution_id,
        [cancelled],
        now=now,
        force_status=target,
        on_transition={
            "error": error,
            "finished_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "wake_at": None,
            "claim_epoch": ex.c.claim_epoch + 1,
        },
    )
    # It ended without a drive: tell the callers waiting for it, as a drive's end would.
    backend.announce(core, END + execution_id)
    return str(found.workflow_name), int(found.workflow_version)


def get(
    conn: Executor, execution_id: str, options: dict[str, Any] | None = None
) -> Row[Any] | None:
    """The execution row, or ``None``."""
    return _exactly(
        connection_of(conn)
        .execute(_GET, {"p_id": execution_id}, execution_options=options or {})
        .one_or_none(),
        execution_id,
    )


def _exactly(row: Row[Any] | None, execution_id: str) -> Row[Any] | None:
    """``row`` if its id is ``execution_id`` exactly: under a case-insensitive collation (ids
    keep MySQL's default) another spelling finds it, but names another id everywhere."""
    return row if row is None or row.id == execution_id else None


def lock(conn: Executor, execution_ids: Sequence[str]) -> None:
    """Lock these runs' rows (in id order) until the transaction ends."""
    connection_of(conn).execute(
        select(ex.c.id)
        .where(ex.c.id.in_(sorted(execution_ids)))
        .order_by(ex.c.id)
        .with_for_update()
    ).all()


def look(backend: Backend, execution_id: str) -> Row[Any] | None:
    """The execution row (or ``None``) read on its own, outside any transaction: a client's
    look at a run (its status, its outcome), by the backend's quickest read."""
    return _exactly(backend.read_one(_GET, {"p_id": execution_id}), execution_id)


def park(conn: Executor, execution_id: str, epoch: int, wake_at: dt.datetime | None) -> None:
    """Give up the lease (if ``epoch`` is still current); the run sleeps until ``wake_at``
    (NULL: until a signal)."""
    connection_of(conn).execute(
        update(ex)
        .where(ex.c.id == execution_id, ex.c.claim_epoch == epoch)
        .values(lease_owner=None, lease_expires_at=None, wake_at=wake_at)
    )


def count_failure(
    conn: Executor,
    backend: Backend,
    execution_id: str,
    epoch: int,
    count: int,
    values: dict[str, Any],
) -> bool:
    """Count the ``count``-th failed drive on the run's row alone (``values``), if ``epoch``
    is still current, the run unfinished and its count still ``count - 1`` (a record that
    seemed refused may have committed); whether it was counted."""
    done = connection_of(conn).execute(
        update(ex)
        .where(
            ex.c.id == execution_id,
            ex.c.claim_epoch == epoch,
            ex.c.drive_failures == count - 1,
            ex.c.status.not_in(sorted(lifecycle.TERMINAL)),
        )
        .values({"updated_at": db_now(), **values}),
        execution_options=backend.statement_options,
    )
    return bool(rowcount(done))


def wake(conn: Executor, backend: Backend, execution_id: str) -> None:
    """Make a parked run due now (a delivered signal) and tell listening workers; a leased
    run's driver sees the news at its next write, so it is left alone."""
    core = connection_of(conn)
    woken = core.execute(
        update(ex)
        .where(ex.c.id == execution_id, ex.c.lease_expires_at.is_(None))
        .values(wake_at=db_now()),
        execution_options=backend.statement_options,
    )
    if rowcount(woken):
        backend.announce(core, DUE)


def list_page(
    conn: Executor,
    backend: Backend,
    workflow_name: str | None,
    *,
    status: str | None,
    version: int | None,
    after: tuple[dt.datetime, str] | None,
    limit: int | None,
    created_after: dt.datetime | None = None,
    created_before: dt.datetime | None = None,
    actor: str | None = None,
) -> Sequence[Row[Any]]:
    """Runs of one workflow (or of all), oldest first, after a keyset position.

    The WHERE and ORDER BY match the ``([workflow_name, [status | version,]] created_at,
    id)`` indexes, so every page is an index range scan however deep the cursor is; a time
    range narrows the same range, and ``actor`` (or, across workflows, ``status``) filters
    rows inside it.
    """
    query = select(ex)
    if workflow_name is not None:
        query = query.where(ex.c.workflow_name == workflow_name)
    if status is not None:
        query = query.where(ex.c.status == status)
    if version is not None:
        query = query.where(ex.c.workflow_version == version)
    if created_after is not None:
        query = query.where(ex.c.created_at >= created_after)
    if created_before is not None:
        query = query.where(ex.c.created_at < created_before)
    if actor is not None:
        query = query.where(ex.c.actor == actor)
    if after is not None:
        query = query.where(backend.keyset_after(*after))
    query = query.order_by(ex.c.created_at, ex.c.id)
    if limit is not None:
        query = query.limit(limit)
    return connection_of(conn).execute(query).all()


def purge_batch(
    conn: Executor, *, finished_before: dt.datetime, statuses: Sequence[str], limit: int
) -> int:
    """Delete up to ``limit`` finished runs (and their history), oldest first.

    Only terminal statuses are ever matched: a running or suspended run is never touched.
    History is deleted explicitly (not by the foreign key's cascade), so it works whatever
    the connection's foreign-key setting.
    """
    wanted = [s for s in statuses if s in lifecycle.TERMINAL]
    if not wanted:
        return 0
    core = connection_of(conn)
    ids = list(
        core.execute(
            select(ex.c.id)
            .where(ex.c.status.in_(wanted), ex.c.finished_at < finished_before)
            .order_by(ex.c.finished_at)
            .limit(limit)
        ).scalars()
    )
    for at in range(0, len(ids), PURGE_CHUNK):
        chunk = ids[at : at + PURGE_CHUNK]
        core.execute(delete(hist).where(hist.c.execution_id.in_(chunk)))
        core.execute(delete(ex).where(ex.c.id.in_(chunk), ex.c.status.in_(wanted)))
    return len(ids)


#: Ids per DELETE of a purge batch: every id is a bound parameter, and a statement takes at
#: most 65,535 on PostgreSQL and 32,766 on SQLite.
PURGE_CHUNK = 5000


def due_count(conn: Executor) -> int:
    """How many runs are due now and not claimed (the unfinished-run index's range)."""
    query = select(func.count()).select_from(ex).where(due())
    return int(connection_of(conn).execute(query).scalar_one())
