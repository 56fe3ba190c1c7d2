"""Concurrency slots (``Limit``): which of a key's slots are held, and compare-and-set takes.

A slot is held while its row's ``expires_at`` is ahead of the database's clock. Every take
is one statement that succeeds for one taker only: an INSERT of a number nobody holds
(ignoring the conflict with a racing one), or an UPDATE of a lapsed row that checks in its
own WHERE that it has lapsed (a racer's take, or its holder's late renewal, makes it fail).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, case, delete, select, update

from ..backends.clock import db_later, db_now
from ..models import SLOT_KEY
from ..models import slots_table as sl
from . import rowcount

if TYPE_CHECKING:
    from ..backends import Backend


def free_slot(backend: Backend, conn: Connection, slot_key: str, limit: int) -> int | None:
    """The lowest slot number below ``limit`` that nobody holds (no row, or a lapsed one);
    None if all ``limit`` are held."""
    live = case((sl.c.expires_at > db_now(), 1), else_=0)
    rows = conn.execute(
        select(sl.c.slot, live)
        .where(sl.c.slot_key == slot_key, sl.c.slot < limit)
        .order_by(sl.c.slot),
        execution_options=backend.statement_options,
    ).all()
    held = {int(slot): bool(alive) for slot, alive in rows}
    return next((n for n in range(min(limit, len(held) + 1)) if not held.get(n, False)), None)


def take(backend: Backend, conn: Connection, row: Mapping[str, Any], ttl: float) -> bool:
    """Take slot ``row["slot"]`` of ``row["slot_key"]`` for ``row["holder"]`` until ``ttl``
    seconds from now: whether it was free (absent or lapsed) and is now this holder's."""
    times = {"taken_at": db_now(), "expires_at": db_later(ttl)}
    if backend.insert_once(conn, sl, row, SLOT_KEY, times):
        return True
    taken = conn.execute(
        update(sl)
        .where(
            sl.c.slot_key == row["slot_key"],
            sl.c.slot == row["slot"],
            sl.c.expires_at <= db_now(),
        )
        .values(
            holder=row["holder"],
            owner=row["owner"],
            execution_id=row["execution_id"],
            step_name=row["step_name"],
            **times,
        ),
        execution_options=backend.statement_options,
    )
    return rowcount(taken) == 1


def renew(backend: Backend, conn: Connection, holders: Collection[str], ttl: float) -> int:
    """Push the slots of these holdings ``ttl`` seconds past now; how many are still held
    (a lapsed one a racer took is not this holding's any more)."""
    result = conn.execute(
        update(sl).where(sl.c.holder.in_(list(holders))).values(expires_at=db_later(ttl)),
        execution_options=backend.statement_options,
    )
    return rowcount(result)


def give_back(backend: Backend, conn: Connection, holder: str) -> None:
    """Free this holding's slot (nothing if it lapsed and was taken meanwhile)."""
    conn.execute(
        delete(sl).where(sl.c.holder == holder), execution_options=backend.statement_options
    )


def sweep(backend: Backend, conn: Connection, lapsed_before: dt.datetime, limit: int) -> int:
    """Delete up to ``limit`` slot rows that lapsed before ``lapsed_before`` (left by
    holders that died: a step that ends deletes its own); how many. Lapsed is also asked
    of the database's clock (the cutoff is the caller's, which may run ahead of it), and
    the DELETE asks both again itself, so a row a racer took meanwhile stays."""
    lapsed = (sl.c.expires_at < lapsed_before, sl.c.expires_at <= db_now())
    holders = list(
        conn.execute(
            select(sl.c.holder).where(*lapsed).limit(limit),
            execution_options=backend.statement_options,
        ).scalars()
    )
    if holders:
        conn.execute(
            delete(sl).where(sl.c.holder.in_(holders), *lapsed),
            execution_options=backend.statement_options,
        )
    return len(holders)
