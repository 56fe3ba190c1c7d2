"""What every backend does the same way with runs, and the hooks where backends differ.

A :class:`Backend` is chosen once, when a runtime opens its engine (:func:`open_backend`);
the rest of the code calls it and never asks which database it is on. Its connection half
(engine view, transactions, checks, migration locking, driver errors) is
:class:`~.connections.Connections`; here are:

* claims: one atomic compare-and-set per run that re-checks, in the UPDATE itself, that the run
  is due by the database's clock, bumps the run's fencing token (``claim_epoch``) and sets the
  lease from the database's clock;
* the fenced writes of a driver (every one conditional on ``(id, epoch)`` in the same
  statement), with the one-round-trip fast path where the backend has one;
* inserts that ignore a dedupe conflict and nothing else;
* wake-ups and presence (notifications, reaping the runs of a process that is gone).

Store functions take a connection and never commit; the backend's ``write`` is the one
exception by design: the driver's hot path commits its own single statement.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy import Connection, delete, func, select, tuple_, update

from .. import clocks, events
from ..errors import LeaseLostError, UnsupportedDatabaseError
from ..events import NewEvent
from ..models import IDEMPOTENCY_KEY, UniqueKey
from ..models import executions_table as ex
from ..wakeups import DUE, NOT_AVAILABLE, Hearing, Listener
from .clock import db_later, db_now
from .connections import Connections
from .sql import (
    CLAIM_COLUMNS,
    CREATE_RUN,
    INSERT_HISTORY,
    LOAD_HISTORY,
    LOCK_RUN,
    P_TTL,
    Cataloged,
    Claim,
    Fenced,
    Stale,
    WriteShape,
    active,
    bump_returning,
    claim_one,
    claim_values,
    claims_read,
    due,
    held_at,
    history_row,
    pinned,
    renew_values,
)


def complete(execution_id: str, found: Sequence[Any], next_seq: int) -> tuple[tuple[int, Any], ...]:
    """The ``(sequence, event)`` rows read of a run's history, if they hold every event
    before ``next_seq`` (and any appended since, a signal or a child's end, after them):
    replaying a history cut short (a host session's row limit, say) would run recorded
    steps again, so the drive fails instead."""
    history = tuple((int(r[0]), r[1]) for r in found)
    sequences = [s for s, _ in history]
    # A start through a host's engine in AUTOCOMMIT is two commits on SQLite and MySQL: a
    # process that died between them left the run without its ``execution.started`` (the
    # run row holds all it says); a read cut short loses the end, never the start.
    first = 2 if sequences[:1] == [2] else 1
    if next_seq > 2 and (
        len(sequences) < next_seq - first or sequences != list(range(first, first + len(sequences)))
    ):
        raise UnsupportedDatabaseError(
            f"run {execution_id}: reading its history gave {len(history)} of "
            f"{next_seq - 1} events; a setting of this engine's sessions may cut reads "
            "short (MySQL's sql_select_limit)"
        )
    return history


class Changes:
    """Tells whether the database changed since the last look (see :meth:`Backend.changes`)."""

    def changed(self) -> bool:
        return True

    def close(self) -> None:
        return None


class Backend(Connections):
    """The generic implementation (UPDATE ... RETURNING); subclasses override what differs."""

    #: Whether claims skip rows other claimers have locked (``FOR UPDATE SKIP LOCKED``).
    skip_locked: ClassVar[bool] = False
    #: Whether the database may notify listeners (confirmed when one connects:
    #: :meth:`listener`); without, workers poll.
    can_listen: ClassVar[bool] = False
    #: Whether a start can check in its own statement that the version it names is still
    #: the newest cataloged, the entry it was read from (``insert_run(newest=...)``):
    #: a thin client may then start from a catalog entry it read before instead of reading
    #: it again.
    checks_newest: ClassVar[bool] = False
    #: Whether a locking read in a host's transaction reads what is committed, where a
    #: plain read keeps the transaction's snapshot (InnoDB at REPEATABLE READ); elsewhere
    #: a locking read sees no more (PostgreSQL) or nothing stale was ever read (SQLite).
    locking_reads_see_committed: ClassVar[bool] = False

    # wake-ups and presence (see :mod:`wf_persist.wakeups`) ------------------------------

    def listener(self, presence: str | None, hear: frozenset[Hearing]) -> Listener:
        """A listening connection of this process's own, listening for ``hear`` and
        holding the presence lock of ``presence`` (an owner) if the database has such
        locks."""
        return NOT_AVAILABLE

    def announce(self, conn: Connection, payload: str) -> None:
        """Notify listeners when ``conn``'s transaction commits (nothing where nobody can
        listen: workers poll)."""

    def reap(self, owner: str, grace: float) -> list[str]:
        """Make the runs of owners whose process is gone (their presence lock is free) due
        ``grace`` seconds from now; the ids. Where there are no presence locks, leases
        lapse instead."""
        return []

    def owner_mark(self) -> str:
        """What a runtime holding its presence lock appends to its owner name."""
        return ""

    def changes(self) -> Changes | None:
        """A cheap way to tell that another connection committed something (a worker's
        poll then skips its queries when nothing changed); ``None`` where there is none."""
        return None

    def cut(self, raw: Any) -> None:
        """End the statement another thread waits on with the driver connection ``raw``
        (it fails there as a lost connection): its answer will never come (see
        :data:`wf_persist.leases.STALL_AFTER`). Nothing where the driver has no way."""

    # dedupe ------------------------------------------------------------------------

    #: The dialect's INSERT with ``ON CONFLICT (...) DO NOTHING`` (PostgreSQL, SQLite), which
    #: names the one unique key a conflict may be ignored on; None where there is none.
    insert_ignoring: ClassVar[Any] = None

    def insert_once(
        self,
        conn: Connection,
        table: Any,
        row: Mapping[str, Any],
        key: UniqueKey,
        sql_values: Mapping[str, Any] | None = None,
    ) -> bool:
        """Insert ``row`` unless it conflicts on ``key``; any other error (another unique
        key, a value too long, a NUL byte) raises. Returns whether it went in."""
        stmt = (
            self.insert_ignoring(table)
            .values(**(sql_values or {}))
            .on_conflict_do_nothing(index_elements=list(key.columns), index_where=key.where)
            .execution_options(preserve_rowcount=True)
        )
        result = conn.execute(stmt, dict(row), execution_options=self.statement_options)
        return int(result.rowcount) == 1

    # runs --------------------------------------------------------------------------

    def insert_run(
        self,
        conn: Connection,
        row: Mapping[str, Any],
        started: NewEvent,
        *,
        lease: tuple[str, float] | None = None,
        newest: Cataloged | None = None,
    ) -> Claim | bool | Stale:
        """Insert a run due now and its ``execution.started`` (sequence 1), in the caller's
        transaction. ``False``: its (workflow, idempotency key) is taken (that conflict and
        no other is ignored). With ``lease=(owner, ttl)`` the run is claimed by ``owner``
        and opened (:meth:`open_claim`) in the same transaction: the :class:`Claim`.
        ``newest`` (only where :attr:`checks_newest`): the version's catalog entry as read;
        insert only if it is still the newest of its workflow, that very entry, else
        :data:`STALE`."""
        options = self.statement_options
        if row["idempotency_key"] is None:
            conn.execute(CREATE_RUN, dict(row), execution_options=options)
        elif not self.insert_once(conn, ex, row, IDEMPOTENCY_KEY, {"wake_at": db_now()}):
            return False
        try:
            conn.execute(
                INSERT_HISTORY, history_row(row["id"], 1, started), execution_options=options
            )
        except Exception:
            # MySQL undoes a failed statement only (a lock wait timeout, say) and a host's
            # transaction may go on to commit: the run must not stay without its first event.
            # (In a transaction the failure aborted, this fails as well: nothing to undo.)
            # Only while nobody took it: on a host's engine in AUTOCOMMIT the run committed
            # on its own and a worker may have claimed or driven it already.
            untouched = delete(ex).where(
                ex.c.id == row["id"],
                ex.c.claim_epoch == 0,
                ex.c.next_seq == row["next_seq"],
                ex.c.lease_owner.is_(None),
            )
            with contextlib.suppress(Exception):
                conn.execute(untouched, execution_options=options)
            raise
        if lease is None:
            self.announce(conn, DUE)
            return True
        owner, ttl = lease
        claim = self.claim(conn, row["id"], owner, ttl)
        assert claim is not None  # created due, in this transaction
        return self.open_claim(conn, claim)._replace(started_here=True)

    # claims ------------------------------------------------------------------------

    def claim(
        self,
        conn: Connection,
        execution_id: str,
        owner: str,
        ttl: float,
        workflows: Sequence[tuple[str, int]] | None = None,
    ) -> Claim | None:
        """Claim one run if it is due (and of one of ``workflows``, if given): one
        compare-and-set."""
        params = {"p_id": execution_id, "p_owner": owner, "p_ttl": ttl}
        pins = None if workflows is None else tuple(workflows)
        asked = clocks.elapsed()
        row = conn.execute(claim_one(pins), params).one_or_none()
        return None if row is None else claims_read([row], asked)[0]

    def open_claim(self, conn: Connection, claim: Claim) -> Claim:
        """The claim with its run's history read, after recording ``workflow.started`` the
        first time (in ``conn``'s transaction, which must be one). Reading after the claim
        means every write of a previous holder is visible, so a recorded step is never run
        again. A run whose history holds only its ``execution.started`` (``next_seq`` 2) has
        nothing to read."""
        if claim.history is not None:
            return claim
        found = (
            ()
            if claim.next_seq <= 2
            else conn.execute(LOAD_HISTORY, {"p_id": claim.execution_id}).all()
        )
        history = complete(claim.execution_id, found, claim.next_seq)
        if any(e["type"] == "workflow.started" for _, e in history):
            return claim._replace(history=history)
        started = events.workflow_started(
            claim.execution_id, claim.workflow_name, claim.workflow_version, claim.db_now
        )
        # The claim just fenced the run at this epoch: the fenced write (no row lock and
        # re-read first) is enough, in the claim's transaction.
        fenced = self.fenced(conn, claim.execution_id, claim.epoch, [started], now=claim.db_now)
        if fenced.sequences[-1] != claim.next_seq:
            # Something was appended after the claim (opened in a transaction of its own: a
            # worker's batch claim), e.g. a cancellation: the drive counts everything up to
            # its workflow.started as read, so read it all now, under the row lock the
            # write holds (READ COMMITTED: this read sees every commit before it).
            found = conn.execute(LOAD_HISTORY, {"p_id": claim.execution_id}).all()
            history = complete(claim.execution_id, found, fenced.sequences[-1] + 1)
        return claim._replace(history=history, next_seq=fenced.sequences[-1] + 1)

    def claim_to_drive(
        self, execution_id: str, owner: str, ttl: float, workflows: Sequence[tuple[str, int]]
    ) -> Claim | None:
        """Claim one run of ``workflows`` if it is due and open it (:meth:`open_claim`),
        in one transaction of its own."""
        with self.begin() as conn:
            claim = self.claim(conn, execution_id, owner, ttl, workflows)
            return None if claim is None else self.open_claim(conn, claim)

    def claim_batch(
        self,
        owner: str,
        ttl: float,
        limit: int,
        workflows: Sequence[tuple[str, int]],
        exclude: Sequence[str],
    ) -> list[Claim]:
        """:meth:`claim_due` in a transaction of its own."""
        with self.begin() as conn:
            return self.claim_due(conn, owner, ttl, limit, workflows, exclude)

    def claim_due(
        self,
        conn: Connection,
        owner: str,
        ttl: float,
        limit: int,
        workflows: Sequence[tuple[str, int]],
        exclude: Sequence[str],
    ) -> list[Claim]:
        """Claim up to ``limit`` due runs of these workflows, oldest wake time first, never
        one in ``exclude`` (runs this process is still driving)."""
        candidates = select(ex.c.id).where(due(), pinned(workflows))
        if exclude:
            candidates = candidates.where(ex.c.id.not_in(list(exclude)))
        candidates = candidates.order_by(ex.c.wake_at).limit(limit)
        if self.skip_locked:
            candidates = candidates.with_for_update(skip_locked=True)
        # A materialized CTE runs once: an IN (subquery) may be re-run per row, and then
        # hands out more runs than ``limit`` (each is still claimed once, but by a worker
        # that cannot start it before its lease ends).
        chosen = candidates.cte("wf_claimable").prefix_with("MATERIALIZED")
        stmt = (
            update(ex)
            .where(ex.c.id == chosen.c.id, due())
            .values(claim_values())
            .returning(*CLAIM_COLUMNS, db_now())
        )
        asked = clocks.elapsed()
        return claims_read(conn.execute(stmt, {"p_ttl": ttl, "p_owner": owner}).all(), asked)

    def renew(
        self, conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
    ) -> set[str]:
        """Extend the leases still held at these epochs; return the ids still held. With
        ``owner``, the leases are named after it from now on."""
        if not held:
            return set()
        stmt = update(ex).where(held_at(held)).values(renew_values(owner)).returning(ex.c.id)
        return {str(i) for i in conn.execute(stmt, {"p_ttl": ttl}).scalars()}

    def renew_alone(
        self, conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
    ) -> set[str]:
        """:meth:`renew` as a write of its own on ``conn`` (not in a transaction). Where the
        backend can, it is one autocommitted statement: a process paused (SIGSTOP) between
        a renewal's UPDATE and its COMMIT would hold the runs' row locks, and every other
        worker's claim of them would wait until it resumed."""
        with self.begin(conn):
            return self.renew(conn, held, ttl, owner)

    def renew_free(self, conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
        """:meth:`renew_alone` of the leases whose rows no other transaction holds locked;
        returns the ids renewed. The lease keeper renews every lease of its process at
        once: waiting for one run's row (an application's long transaction holding it, say)
        would let every other lease lapse meanwhile. A skipped lease is renewed at the next
        turn, or by its own drive before its next step. Without row-level locks to skip,
        :meth:`renew_alone`."""
        if not held or not self.skip_locked:
            return self.renew_alone(conn, held, ttl)
        free = ex.alias("wf_free")
        # ``key_share``: FOR NO KEY UPDATE where the database has it (the UPDATE's own
        # lock, which a foreign-key check's KEY SHARE does not hold up).
        lockable = (
            select(free.c.id)
            .where(held_at(held, free))
            .with_for_update(skip_locked=True, key_share=True)
        )
        stmt = (
            update(ex)
            .where(held_at(held), ex.c.id.in_(lockable))
            .values(renew_values())
            .returning(ex.c.id)
        )
        with self.begin(conn):
            return {str(i) for i in conn.execute(stmt, {"p_ttl": ttl}).scalars()}

    def epochs(self, conn: Connection, execution_ids: Sequence[str]) -> dict[str, int]:
        """The current claim epoch of each run (a run that is gone is left out)."""
        rows = conn.execute(
            select(ex.c.id, ex.c.claim_epoch).where(ex.c.id.in_(list(execution_ids)))
        )
        return {str(r[0]): int(r[1]) for r in rows}

    def release(self, conn: Connection, held: Mapping[str, int], delay: float = 0.0) -> int:
        """Give up leases (due again after ``delay`` seconds); returns how many."""
        if not held:
            return 0
        stmt = (
            update(ex)
            .where(held_at(held))
            .values(lease_owner=None, lease_expires_at=None, wake_at=db_later(P_TTL))
        )
        released = int(conn.execute(stmt, {"p_ttl": delay}).rowcount)
        if released and delay == 0:
            self.announce(conn, DUE)
        return released

    def next_wake(
        self, conn: Connection, workflows: Sequence[tuple[str, int]]
    ) -> tuple[dt.datetime | None, dt.datetime]:
        """The earliest wake time of these workflows' active runs, and the database's now."""
        row = conn.execute(
            select(func.min(ex.c.wake_at), db_now()).where(
                active(), ex.c.wake_at.is_not(None), pinned(workflows)
            )
        ).one()
        return row[0], row[1]

    # fenced writes -----------------------------------------------------------------

    def lock_run(self, conn: Connection, execution_id: str) -> Any:
        """Lock the run's row for the rest of the transaction; returns
        ``(next_seq, status, claim_epoch, parent_id)`` or ``None``."""
        return conn.execute(LOCK_RUN, {"p_id": execution_id}).one_or_none()

    def fenced(
        self,
        conn: Connection,
        execution_id: str,
        epoch: int,
        events: Sequence[NewEvent],
        *,
        now: dt.datetime,
        values: Mapping[str, Any] | None = None,
        guard: tuple[str, ...] | None = None,
        note: str | None = None,
    ) -> Fenced:
        """Append events and update the run if ``epoch`` is current, in the caller's
        transaction: an UPDATE ... RETURNING (the compare-and-set) and one INSERT; ``note``
        is announced (:meth:`announce`) with the commit."""
        shape = WriteShape(len(events), tuple(sorted(values or ())), guard)
        params = self._params(execution_id, epoch, now, values)
        top = conn.execute(bump_returning(shape), params).one_or_none()
        if top is None:
            raise LeaseLostError(execution_id)
        base = int(top[0]) - shape.n
        if events:
            conn.execute(
                INSERT_HISTORY,
                [history_row(execution_id, base + i, e) for i, e in enumerate(events)],
            )
        if note is not None:
            self.announce(conn, note)
        return Fenced([base + i for i in range(shape.n)], str(top[1]))

    def write(
        self,
        conn: Connection,
        execution_id: str,
        epoch: int,
        events: Sequence[NewEvent],
        *,
        now: dt.datetime,
        values: Mapping[str, Any] | None = None,
        guard: tuple[str, ...] | None = None,
        note: str | None = None,
    ) -> Fenced:
        """:meth:`fenced` as a write of its own, committed when it returns (the hot path)."""
        with self.begin(conn):
            return self.fenced(
                conn, execution_id, epoch, events, now=now, values=values, guard=guard, note=note
            )

    @staticmethod
    def _params(
        execution_id: str, epoch: int, now: dt.datetime, values: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"p_eid": execution_id, "p_epoch": epoch, "p_now": now}
        for column, value in (values or {}).items():
            params[f"v_{column}"] = value
        return params

    # listing -----------------------------------------------------------------------

    def keyset_after(self, created_at: dt.datetime, execution_id: str) -> Any:
        """Rows after ``(created_at, id)`` in ``(created_at, id)`` order: a row-value
        comparison, which PostgreSQL and SQLite (3.15+) plan as one range of the
        ``(..., created_at, id)`` indexes (the OR spelled out is a union of scans to them)."""
        return tuple_(ex.c.created_at, ex.c.id) > tuple_(created_at, execution_id)
