"""Executions: idempotent creation, lookup, leases, keyset listing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Row,
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)

from .. import _dialect
from ..errors import CannotCancelError, UnknownExecutionError
from ..models import TERMINAL_STATUSES, UTCDateTime
from ..models import executions_table as ex
from ..models import history_table as hist
from . import Executor, dialect_of, history, rowcount
from .history import NewEvent

_insert_execution = insert(ex)
_insert_history = insert(hist)


def create(
    conn: Executor,
    *,
    execution_id: str,
    workflow_name: str,
    workflow_version: int,
    payload: dict[str, Any] | None,
    idempotency_key: str | None,
    actor: str | None,
    started: NewEvent,
    now: dt.datetime,
) -> tuple[str, int, bool]:
    """Insert a run and its ``execution.started`` event (sequence 1) atomically.

    With an idempotency key the insert ignores a conflict on (workflow_name, key), so 20
    threads or two processes starting with one key create exactly one run; the losers get the
    winner's id and record nothing.

    Returns:
        ``(execution_id, version, created)`` where ``created`` is false for an existing run.
    """
    row = {
        "id": execution_id,
        "workflow_name": workflow_name,
        "workflow_version": workflow_version,
        "status": "running",
        "input": payload,
        "idempotency_key": idempotency_key,
        "actor": actor,
        "next_seq": 2,
        "wake_at": now,
        "created_at": now,
        "updated_at": now,
    }
    dialect = dialect_of(conn)
    if idempotency_key is None:
        conn.execute(_insert_execution, row)
    else:
        stmt = _dialect.insert_ignoring(dialect, ex, ["workflow_name", "idempotency_key"])
        if rowcount(conn.execute(stmt, row)) != 1:
            found = conn.execute(
                select(ex.c.id, ex.c.workflow_version).where(
                    ex.c.workflow_name == workflow_name, ex.c.idempotency_key == idempotency_key
                )
            ).one()
            return str(found.id), int(found.workflow_version), False
    conn.execute(
        _insert_history,
        {
            "execution_id": execution_id,
            "sequence": 1,
            "type": started.type,
            "activity_name": None,
            "dedupe_key": None,
            "created_at": started.created_at,
            "event": started.event,
        },
    )
    return execution_id, workflow_version, True


def cancel(
    conn: Executor,
    execution_id: str,
    *,
    compensate: bool,
    actor: str | None,
    error: dict[str, Any],
    now: dt.datetime,
) -> None:
    """Claim a cancellation: one transaction changes the status and records
    ``execution.cancelled``, so of two concurrent cancels exactly one is recorded.

    With ``compensate`` the run moves to ``compensating`` and is woken (a parked run now; a
    running one learns it at its next step write) to unwind. Without, it fails at once with
    ``error``, and its lease is revoked so the driver's next write is refused: no further
    step starts.

    Raises:
        UnknownExecutionError, CannotCancelError (status not running/suspended).
    """
    status = conn.execute(
        select(ex.c.status).where(ex.c.id == execution_id).with_for_update()
    ).scalar_one_or_none()
    if status is None:
        raise UnknownExecutionError(execution_id)
    if status not in ("running", "suspended"):
        raise CannotCancelError(execution_id, str(status))
    event = NewEvent(
        {
            "type": "execution.cancelled",
            "executionId": execution_id,
            "compensate": compensate,
            "actor": actor,
        },
        now,
    )
    if compensate:
        history.append(conn, execution_id, [event], now=now, force_status="compensating")
        wake(conn, execution_id, now)
        return
    history.append(
        conn,
        execution_id,
        [event],
        now=now,
        force_status="failed",
        on_transition={
            "error": error,
            "finished_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "wake_at": None,
        },
    )


def get(conn: Executor, execution_id: str) -> Row[Any] | None:
    """The execution row, or ``None``."""
    return conn.execute(select(ex).where(ex.c.id == execution_id)).one_or_none()


def _runnable(now: Any) -> Any:
    """Non-terminal and due. ``wake_at`` is when a run next needs a driver: its timer for a
    parked run, its lease expiry for a leased one, NULL while it waits for a signal."""
    return and_(
        ex.c.status.not_in(TERMINAL_STATUSES), ex.c.wake_at.is_not(None), ex.c.wake_at <= now
    )


_CLAIMED = (ex.c.workflow_name, ex.c.workflow_version, ex.c.input, ex.c.next_seq, ex.c.status)


def claim(
    conn: Executor,
    execution_id: str,
    owner: str,
    now: dt.datetime,
    lease_until: dt.datetime,
) -> Row[Any, Any, Any, Any, Any] | None:
    """Take (or renew) the lease on a run that is due, or that ``owner`` already holds.

    A conditional UPDATE, so two claimers never both win: the row lock serializes them and
    the loser's WHERE no longer matches.

    Returns:
        ``(workflow_name, workflow_version, input, next_seq, status)``, or ``None``.
    """
    params = {"p_id": execution_id, "p_owner": owner, "p_now": now, "p_until": lease_until}
    if dialect_of(conn).update_returning:
        return conn.execute(_claim_returning, params).one_or_none()
    if rowcount(conn.execute(_claim, params)) != 1:
        return None
    return conn.execute(select(*_CLAIMED).where(ex.c.id == execution_id)).one()


_claim = (
    update(ex)
    .where(
        ex.c.id == bindparam("p_id"),
        or_(
            _runnable(bindparam("p_now", type_=UTCDateTime())),
            and_(ex.c.lease_owner == bindparam("p_owner"), ex.c.status.not_in(TERMINAL_STATUSES)),
        ),
    )
    .values(
        lease_owner=bindparam("p_owner"),
        lease_expires_at=bindparam("p_until", type_=UTCDateTime()),
        wake_at=bindparam("p_until", type_=UTCDateTime()),
        updated_at=bindparam("p_now", type_=UTCDateTime()),
        started_at=func.coalesce(ex.c.started_at, bindparam("p_now", type_=UTCDateTime())),
    )
)
_claim_returning = _claim.returning(*_CLAIMED)


def claim_due(
    conn: Executor,
    owner: str,
    now: dt.datetime,
    lease_until: dt.datetime,
    limit: int,
    workflows: Sequence[tuple[str, int]],
) -> list[str]:
    """Lease up to ``limit`` due runs of the given (name, version)s, oldest wake time first.

    PostgreSQL (and MySQL) skip rows another worker is claiming (``FOR UPDATE SKIP LOCKED``),
    so workers never queue behind each other; SQLite serializes claimers on its write lock.
    """
    if not workflows or limit <= 0:
        return []
    pinned = _pinned(workflows)
    ids = list(
        conn.execute(
            select(ex.c.id)
            .where(_runnable(now), pinned)
            .order_by(ex.c.wake_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if ids:
        conn.execute(
            update(ex)
            .where(ex.c.id.in_(ids))
            .values(
                lease_owner=owner, lease_expires_at=lease_until, wake_at=lease_until, updated_at=now
            )
        )
    return [str(i) for i in ids]


def _pinned(workflows: Sequence[tuple[str, int]]) -> Any:
    return or_(*(and_(ex.c.workflow_name == n, ex.c.workflow_version == v) for n, v in workflows))


def next_wake(
    conn: Executor, workflows: Sequence[tuple[str, int]], after: dt.datetime
) -> dt.datetime | None:
    """The earliest future wake time among runs of these workflows (an index probe)."""
    if not workflows:
        return None
    found = conn.execute(
        select(func.min(ex.c.wake_at)).where(
            ex.c.status.not_in(TERMINAL_STATUSES), ex.c.wake_at > after, _pinned(workflows)
        )
    ).scalar_one_or_none()
    return found if isinstance(found, dt.datetime) else None


def park(conn: Executor, execution_id: str, owner: str, wake_at: dt.datetime | None) -> None:
    """Give up the lease; the run sleeps until ``wake_at`` (NULL: until a signal)."""
    conn.execute(
        update(ex)
        .where(ex.c.id == execution_id, ex.c.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None, wake_at=wake_at)
    )


def wake(conn: Executor, execution_id: str, now: dt.datetime) -> None:
    """Make a parked run due now (a delivered signal); a leased run's driver sees the news."""
    conn.execute(
        update(ex).where(ex.c.id == execution_id, ex.c.lease_owner.is_(None)).values(wake_at=now)
    )


def renew_leases(
    conn: Executor, owner: str, execution_ids: Sequence[str], until: dt.datetime
) -> int:
    """Extend every lease ``owner`` still holds among ``execution_ids``; return how many."""
    if not execution_ids:
        return 0
    return rowcount(
        conn.execute(
            update(ex)
            .where(ex.c.id.in_(list(execution_ids)), ex.c.lease_owner == owner)
            .values(lease_expires_at=until, wake_at=until)
        )
    )


def list_page(
    conn: Executor,
    workflow_name: str,
    *,
    status: str | None,
    version: int | None,
    after: tuple[dt.datetime, str] | None,
    limit: int | None,
    created_after: dt.datetime | None = None,
    created_before: dt.datetime | None = None,
    actor: str | None = None,
) -> Sequence[Row[Any]]:
    """Runs of one workflow, oldest first, after a keyset position.

    The WHERE and ORDER BY match the ``(workflow_name, [status | version,] created_at, id)``
    indexes, so every page is an index range scan however deep the cursor is; a time range
    narrows the same range, and ``actor`` filters rows inside it.
    """
    query = select(ex).where(ex.c.workflow_name == workflow_name)
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
        created_at, last_id = after
        if dialect_of(conn).name == "postgresql":
            query = query.where(tuple_(ex.c.created_at, ex.c.id) > tuple_(created_at, last_id))
        else:
            query = query.where(
                or_(
                    ex.c.created_at > created_at,
                    and_(ex.c.created_at == created_at, ex.c.id > last_id),
                )
            )
    query = query.order_by(ex.c.created_at, ex.c.id)
    if limit is not None:
        query = query.limit(limit)
    return conn.execute(query).all()


def purge_batch(
    conn: Executor, *, finished_before: dt.datetime, statuses: Sequence[str], limit: int
) -> int:
    """Delete up to ``limit`` finished runs (and their history), oldest first.

    Only terminal statuses are ever matched: a running or suspended run is never touched.
    History is deleted explicitly (not by the foreign key's cascade), so it works whatever
    the connection's foreign-key setting.
    """
    wanted = [s for s in statuses if s in TERMINAL_STATUSES]
    if not wanted:
        return 0
    ids = list(
        conn.execute(
            select(ex.c.id)
            .where(ex.c.status.in_(wanted), ex.c.finished_at < finished_before)
            .order_by(ex.c.finished_at)
            .limit(limit)
        ).scalars()
    )
    if ids:
        conn.execute(delete(hist).where(hist.c.execution_id.in_(ids)))
        conn.execute(delete(ex).where(ex.c.id.in_(ids), ex.c.status.in_(wanted)))
    return len(ids)
