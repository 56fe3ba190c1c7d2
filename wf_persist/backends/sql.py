"""The SQL every backend shares: what a claim hands back, what a fenced write does, and the
statement pieces (due runs, pinned workflows, the claim's SET, the compare-and-set UPDATE)
the backends put together. Statements are built once (``functools`` caches): a statement
object reused keeps its compiled form and cache key.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, cast

from sqlalchemy import (
    Float,
    String,
    and_,
    bindparam,
    false,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import IteratorResult, Row
from sqlalchemy.engine.result import SimpleResultMetaData

from .. import clocks
from ..events import NewEvent
from ..lifecycle import ACTIVE
from ..models import UTC_DATETIME, JSONDoc
from ..models import executions_table as ex
from ..models import history_table as hist
from .clock import db_later, db_now


class Stale:
    """A start refused because its version is no longer the newest cataloged (see
    :meth:`Backend.insert_run`)."""


STALE: Final = Stale()


class Cataloged(NamedTuple):
    """A catalog entry as a client read it: what a start checks is still there, the newest
    of its workflow (a version cataloged again, after the tables were made anew, differs
    in one or the other)."""

    source_hash: str
    registered_at: dt.datetime


class Claim(NamedTuple):
    """A run this runtime now drives, fenced by ``epoch``; ``db_now`` is the database's time
    at the claim (drives measure time from it, not from the worker's clock)."""

    execution_id: str
    epoch: int
    workflow_name: str
    workflow_version: int
    input: Any
    status: str
    drive_failures: int
    #: The run's next sequence number after the claim: 2 means its history holds only its
    #: ``execution.started`` (nothing to read before driving it).
    next_seq: int
    created_at: dt.datetime
    #: When the run times out, as started (see :func:`wf_persist.timeouts.run_deadline`).
    deadline_at: dt.datetime | None
    #: The run that started this one as its child, which hears of its outcome.
    parent_id: str | None
    db_now: dt.datetime
    #: The run's history as ``(sequence, event)`` pairs when the claim read it too (then
    #: ``workflow.started`` is recorded as well); ``None``: the driver reads it.
    history: tuple[tuple[int, dict[str, Any]], ...] | None = None
    #: Created claimed by the process that drives it (its starter waits for it there).
    started_here: bool = False
    #: The trace context its starter stored, when known without a read (started here).
    trace: Mapping[str, str] | None = None
    #: When (monotonic) the claim's answer, ``db_now`` with it, reached this process: the
    #: drive's clock runs from then, not from when the drive began (a long history read or
    #: a pause in between would otherwise put every time of the drive early).
    read_at: float | None = None
    #: When (monotonic) the statement that read ``db_now`` was sent: ``db_now`` is the
    #: database's time at some moment between the two.
    asked_at: float | None = None


class Fenced(NamedTuple):
    """What a fenced write did: the new events' sequence numbers and the run's status."""

    sequences: list[int]
    status: str


def claims_read(rows: Iterable[Sequence[Any]], asked_at: float) -> list[Claim]:
    """Claims from their rows (:data:`CLAIM_COLUMNS` and the database's time), read by a
    statement sent at ``asked_at`` (monotonic), stamped with when their answer arrived
    (now)."""
    read_at = clocks.elapsed()
    return [Claim(*row)._replace(read_at=read_at, asked_at=asked_at) for row in rows]


@dataclass(frozen=True)
class WriteShape:
    """One fenced write: ``n`` events, the execution columns it sets, the statuses it needs."""

    n: int
    columns: tuple[str, ...]
    guard: tuple[str, ...] | None
    #: Whether the write also sends a notification (:meth:`Backend.announce`).
    note: bool = False


#: Row columns a claim hands back.
CLAIM_COLUMNS = (
    ex.c.id,
    ex.c.claim_epoch,
    ex.c.workflow_name,
    ex.c.workflow_version,
    ex.c.input,
    ex.c.status,
    ex.c.drive_failures,
    ex.c.next_seq,
    ex.c.created_at,
    ex.c.deadline_at,
    ex.c.parent_id,
)
HOT_COLUMNS = (
    "execution_id",
    "sequence",
    "type",
    "activity_name",
    "dedupe_key",
    "created_at",
    "event",
)
INSERT_HISTORY = insert(hist)
CREATE_RUN = insert(ex).values(wake_at=db_now())
P_TTL = bindparam("p_ttl", type_=Float())


def active() -> Any:
    """An active run (running, suspended, compensating): the statuses are spelled in the SQL
    (one statement text whatever the values; a partial index's predicate can match it)."""
    return ex.c.status.in_([literal_column(f"'{s}'") for s in sorted(ACTIVE)])


def due() -> Any:
    """Active and due by the database's clock. ``wake_at`` is a parked run's timer, a leased
    run's lease expiry, and NULL while it waits for a signal."""
    return and_(active(), ex.c.wake_at.is_not(None), ex.c.wake_at <= db_now())


def pinned(workflows: Sequence[tuple[str, int]]) -> Any:
    """Runs of these (name, version) pairs (none: no run)."""
    return or_(
        false(), *(and_(ex.c.workflow_name == n, ex.c.workflow_version == v) for n, v in workflows)
    )


#: A claim's parameters: the run (single claims), the claiming runtime.
P_ID = bindparam("p_id", type_=String(36))
P_OWNER = bindparam("p_owner", type_=String(255))


def claim_values() -> dict[str, Any]:
    """The SET of a claim: a new epoch and a lease measured by the database's clock."""
    return {
        "claim_epoch": ex.c.claim_epoch + 1,
        "lease_owner": P_OWNER,
        "lease_expires_at": db_later(P_TTL),
        "wake_at": db_later(P_TTL),
        "updated_at": db_now(),
        "started_at": func.coalesce(ex.c.started_at, db_now()),
    }


def renew_values(owner: str | None = None) -> dict[str, Any]:
    """The SET of a renewal: the lease measured again by the database's clock, named after
    ``owner`` if given."""
    values: dict[str, Any] = {"lease_expires_at": db_later(P_TTL), "wake_at": db_later(P_TTL)}
    if owner is not None:
        values["lease_owner"] = owner
    return values


def history_row(execution_id: str, seq: int, ev: NewEvent) -> dict[str, Any]:
    return {
        "execution_id": execution_id,
        "sequence": seq,
        "type": ev.type,
        "activity_name": ev.activity_name,
        "dedupe_key": ev.dedupe_key,
        "created_at": ev.created_at,
        "event": ev.event,
    }


@functools.lru_cache(maxsize=256)
def bump(shape: WriteShape) -> Any:
    """UPDATE the run if the driver's epoch is current (and its status is in the guard)."""
    stmt = update(ex).where(
        ex.c.id == bindparam("p_eid", type_=String(36)), ex.c.claim_epoch == bindparam("p_epoch")
    )
    if shape.guard is not None:
        stmt = stmt.where(ex.c.status.in_([literal_column(f"'{s}'") for s in shape.guard]))
    values: dict[str, Any] = {
        # Constants inline: one statement per shape, no anonymous parameters.
        "next_seq": ex.c.next_seq + literal_column(str(int(shape.n))),
        "updated_at": bindparam("p_now", type_=UTC_DATETIME),
    }
    for column in shape.columns:
        values[column] = bindparam(f"v_{column}", type_=ex.c[column].type)
    return stmt.values(values)


@functools.lru_cache(maxsize=256)
def bump_returning(shape: WriteShape) -> Any:
    return bump(shape).returning(ex.c.next_seq, ex.c.status)


LOCK_RUN = (
    select(ex.c.next_seq, ex.c.status, ex.c.claim_epoch, ex.c.parent_id)
    .where(ex.c.id == P_ID)
    .with_for_update()
)


@functools.lru_cache(maxsize=64)
def claim_one(workflows: tuple[tuple[str, int], ...] | None) -> Any:
    """Built once per set of workflows: a statement object reused keeps its cache key."""
    stmt = update(ex).where(ex.c.id == P_ID, due())
    if workflows is not None:
        stmt = stmt.where(pinned(workflows))
    return stmt.values(claim_values()).returning(*CLAIM_COLUMNS, db_now())


#: A run's history as ``(sequence, event)`` pairs, in order.
LOAD_HISTORY = (
    select(hist.c.sequence, hist.c.event)
    .where(hist.c.execution_id == P_ID)
    .order_by(hist.c.sequence)
)


def held_at(held: Mapping[str, int], table: Any = ex) -> Any:
    """Runs still leased at the given epochs (a parked run is never renewed); ``table``:
    the runs table or an alias of it."""
    return and_(
        tuple_(table.c.id, table.c.claim_epoch).in_(list(held.items())),
        table.c.lease_expires_at.is_not(None),
    )


#: JSON column type for raw statements rendered by SQLAlchemy.
JSON_TYPE = JSONDoc


class RowShape:
    """What SQLAlchemy's execution makes of a statement's rows (column keys, each type's
    result processor for the dialect), for rows a fast path read straight from the driver:
    the same ``Row`` objects, with the same values, as ``conn.execute(stmt)`` gives."""

    def __init__(self, stmt: Any, dialect: Any) -> None:
        columns = list(stmt.selected_columns)
        self._meta = SimpleResultMetaData([c.key for c in columns])
        self._processors = [
            c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns
        ]

    def one(self, rows: Sequence[Sequence[Any]]) -> Row[Any] | None:
        """The one row of ``rows`` (None if none; more than one is an error, as
        ``one_or_none``)."""
        processors = self._processors
        converted = [
            tuple(v if p is None else p(v) for p, v in zip(processors, row, strict=True))
            for row in rows
        ]
        result: Any = IteratorResult(self._meta, iter(converted))
        return cast("Row[Any] | None", result.one_or_none())
