"""Child runs as their parent sees them: which children a run started, and cancelling one
with its parent.

A child's outcome reaches its parent through :func:`wf_persist.store.history.append` (every
way a run ends appends there), in the transaction that ends the child.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from sqlalchemy import select

from .. import events
from ..backends.sql import active, due
from ..error_documents import error_document
from ..errors import Cancelled, CannotCancelError, UnknownExecutionError
from ..models import executions_table as ex
from ..models import history_table as hist
from . import Executor, connection_of, executions

if TYPE_CHECKING:
    from ..backends import Backend


def cancelled_with(conn: Executor, parent_id: str) -> list[str]:
    """The children ``parent_id`` started that are cancelled with it (``cancel_with_parent``
    was not turned off), oldest first."""
    rows = connection_of(conn).execute(
        select(hist.c.event)
        .where(hist.c.execution_id == parent_id, hist.c.type == "child.started")
        .order_by(hist.c.sequence)
    )
    return [
        str(r.event["childExecutionId"])
        for r in rows
        if r.event.get("cancelWithParent", True) is not False
    ]


#: How far below a run :func:`due_descendants` looks, and how many parents one query takes.
_DEPTH, _WIDTH = 64, 500


def due_descendants(conn: Executor, root_id: str) -> list[str]:
    """The runs below ``root_id`` (its children, theirs in turn) due now, of the first level
    that has any: what a caller waiting for ``root_id`` drives when its run waits for them
    (no worker need be running). Each level is read a slice of parents at a time."""
    level = [root_id]
    for _ in range(_DEPTH):
        below: list[str] = []
        for start in range(0, len(level), _WIDTH):
            parents = ex.c.parent_id.in_(level[start : start + _WIDTH])
            found = connection_of(conn).execute(
                select(ex.c.id).where(parents, due()).order_by(ex.c.created_at, ex.c.id)
            )
            ready = [str(i) for i in found.scalars()]
            if ready:
                return ready
            below += [
                str(i)
                for i in connection_of(conn)
                .execute(select(ex.c.id).where(parents, active()))
                .scalars()
            ]
        if not below:
            return []
        level = below
    return []


class TreeGrew(Exception):
    """A run of the tree started a child between the tree's read and its locks."""


def _levels(conn: Executor, root_id: str) -> list[list[str]]:
    """The runs cancelled with ``root_id``, level by level (its children, theirs, ...)."""
    levels: list[list[str]] = []
    seen = {root_id}
    current = [root_id]
    while current:
        below = [c for p in current for c in cancelled_with(conn, p) if c not in seen]
        seen.update(below)
        if below:
            levels.append(below)
        current = below
    return levels


def lock_tree(conn: Executor, root_id: str) -> None:
    """Lock the rows of the runs cancelled with ``root_id`` (its children, theirs in turn),
    deepest first, before ``root_id``'s own: a run ending locks itself, then its parent (to
    record its outcome there), so taking a tree's locks from the leaves up never waits in a
    cycle with one (from the root down, a cancel and a finishing child each held what the
    other wanted). :class:`TreeGrew` if a run of it started a child meanwhile (locking that
    one now would be the other order): the caller tries again."""
    levels = _levels(conn, root_id)
    for level in reversed(levels):
        executions.lock(conn, level)
    locked = {run for level in levels for run in level}
    if any(run not in locked for level in _levels(conn, root_id) for run in level):
        raise TreeGrew(root_id)


def cancel_descendants(
    conn: Executor,
    backend: Backend,
    parent_id: str,
    *,
    compensate: bool,
    actor: str | None,
    now: dt.datetime,
    ended: list[tuple[str, int]] | None = None,
) -> int:
    """Cancel the unfinished children ``parent_id`` started to be cancelled with it, and
    theirs in turn, in the caller's transaction (:func:`cancel` each); how many."""
    count = 0
    pending = [parent_id]
    while pending:
        for child_id in cancelled_with(conn, pending.pop()):
            if cancel(
                conn, backend, child_id, compensate=compensate, actor=actor, now=now, ended=ended
            ):
                count += 1
                pending.append(child_id)
    return count


def cancel(
    conn: Executor,
    backend: Backend,
    child_id: str,
    *,
    compensate: bool,
    actor: str | None,
    now: dt.datetime,
    ended: list[tuple[str, int]] | None = None,
) -> bool:
    """Cancel one child as its parent was (same ``compensate``), in the caller's
    transaction; False if it had ended already (or is gone). ``ended`` gets its (workflow
    name, version) if it ended now."""
    try:
        finished = executions.cancel(
            conn,
            backend,
            child_id,
            cancelled=events.execution_cancelled(child_id, compensate, actor, now),
            compensate=compensate,
            error=error_document(Cancelled(compensate, actor)),
            now=now,
            unwinding_too=False,
        )
    except (CannotCancelError, UnknownExecutionError):
        return False
    if finished is not None and ended is not None:
        ended.append(finished)
    return True
