"""What every backend does the same way, and the hooks where backends differ.

A :class:`Backend` is chosen once, when a runtime opens its engine (:func:`open_backend`);
the rest of the code calls it and never asks which database it is on. It owns:

* the engine view wf_persist works through (a named schema, the isolation level its
  compare-and-sets need, SQLite transaction control) and how transactions begin;
* claims: one atomic compare-and-set per run that re-checks, in the UPDATE itself, that the run
  is due by the database's clock, bumps the run's fencing token (``claim_epoch``) and sets the
  lease from the database's clock;
* the fenced writes of a driver (every one conditional on ``(id, epoch)`` in the same
  statement), with the one-round-trip fast path where the backend has one;
* inserts that ignore a dedupe conflict and nothing else;
* concurrency slots, value-size limits, host-engine checks, migration locking.

Store functions take a connection and never commit; the backend's ``write`` is the one
exception by design: the driver's hot path commits its own single statement.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Final

from sqlalchemy import (
    Connection,
    Engine,
    func,
    select,
    tuple_,
    update,
)
from sqlalchemy.engine import URL, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection

from .. import events
from ..errors import LeaseLostError, UnsupportedDatabaseError, ValueTooLargeError
from ..events import NewEvent
from ..models import IDEMPOTENCY_KEY, UniqueKey
from ..models import executions_table as ex
from ..wakeups import DUE, NOT_AVAILABLE, Listener
from .clock import db_later, db_now
from .slots import Slots
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
    due,
    held_at,
    history_row,
    pinned,
)

#: Types whose JSON text is a few dozen bytes whatever the value (no size check needed).
_BOUNDED: Final = (int, float, bool)
#: The most bytes one character of a string takes in JSON text (an escape: ``\\uXXXX``).
_MAX_BYTES_PER_CHAR: Final = 6


class Changes:
    """Tells whether the database changed since the last look (see :meth:`Backend.changes`)."""

    def changed(self) -> bool:
        return True

    def close(self) -> None:
        return None


class Backend:
    """The generic implementation (UPDATE ... RETURNING); subclasses override what differs."""

    #: SQLAlchemy dialect names this backend serves.
    names: ClassVar[tuple[str, ...]] = ()
    #: The asyncio driver ``wp.AsyncClient`` reaches this database with.
    async_driver: ClassVar[str] = ""
    #: The package extra that installs this backend's default driver (None: built in).
    extra: ClassVar[str | None] = None
    #: Whether tables can live in a named schema (``Runtime(schema=...)``).
    supports_schemas: ClassVar[bool] = False
    #: Whether claims skip rows other claimers have locked (``FOR UPDATE SKIP LOCKED``).
    skip_locked: ClassVar[bool] = False
    #: Seconds a write transaction of ours may sit idle before the server ends it (None:
    #: the backend cannot bound it; a paused process holds its locks until it resumes).
    idle_timeout: ClassVar[float | None] = None
    #: Whether migrations run in one transaction (DDL is transactional).
    transactional_ddl: ClassVar[bool] = True
    #: Whether Alembic must use batch mode (SQLite's limited ALTER TABLE).
    batch_migrations: ClassVar[bool] = False
    #: An embedded database (a file this process opens): a runtime that created its engine
    #: migrates it itself.
    embedded: ClassVar[bool] = False
    #: Whether the database may notify listeners (confirmed when one connects:
    #: :meth:`listener`); without, workers poll.
    can_listen: ClassVar[bool] = False
    #: Whether a start can check in its own statement that the version it names is still
    #: the newest cataloged, the entry it was read from (``insert_run(newest=...)``):
    #: a thin client may then start from a catalog entry it read before instead of reading
    #: it again.
    checks_newest: ClassVar[bool] = False

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        if schema is not None and not self.supports_schemas:
            raise UnsupportedDatabaseError(
                f"a named schema needs PostgreSQL, not {engine.dialect.name}"
            )
        self.base_engine = engine
        self.owned = owned
        self.schema = schema
        #: Options of every statement wf_persist runs on a connection it did not open itself
        #: (a host's session): render our tables in the schema, nothing else.
        self.statement_options: dict[str, Any] = (
            {} if schema is None else {"schema_translate_map": {None: schema}}
        )
        self.engine = self.make_view(engine)
        #: The schema translation our statements get (a named schema's, or one the host's
        #: engine carries): SQL a fast path renders itself must render it too.
        found = self.engine.get_execution_options().get("schema_translate_map")
        self.schema_map: dict[str | None, str | None] | None = dict(found) if found else None
        self.slots = Slots(self.engine)
        #: The largest JSON value (bytes, as sent) one stored value may have.
        self.max_value_bytes = 256 * 1024 * 1024 - 64 * 1024

    # engines and transactions -------------------------------------------------------

    @classmethod
    def configure_engine(cls, url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
        """The URL and engine arguments of an engine wf_persist creates itself."""
        return url, kwargs

    @classmethod
    def async_url(cls, url: URL) -> URL:
        """The same database through this backend's asyncio driver (``wp.AsyncClient``)."""
        return url.set(drivername=f"{url.get_backend_name()}+{cls.async_driver}")

    @classmethod
    def async_engine_kwargs(cls) -> dict[str, Any]:
        """Arguments of the asyncio engine ``wp.AsyncClient`` creates itself."""
        return {}

    @classmethod
    def on_own_engine(cls, engine: Engine) -> None:
        """Listeners on an engine wf_persist created (never on a host's)."""

    def view_options(self) -> dict[str, Any]:
        """Execution options of every connection wf_persist takes (a named schema)."""
        return dict(self.statement_options)

    def make_view(self, engine: Engine) -> Engine:
        """The engine wf_persist works through: same pool, our options; the host's engine
        object stays as it was."""
        options = self.view_options()
        return engine.execution_options(**options) if options else engine

    @contextlib.contextmanager
    def begin(self, conn: Connection | None = None, *, ours: bool = True) -> Iterator[Connection]:
        """A write transaction, on ``conn`` (a drive's connection) or a pooled one;
        ``ours=False``: one an application runs its own statements in."""
        if conn is None:
            with self.engine.begin() as fresh:
                yield fresh
            return
        with conn.begin():
            yield conn

    @contextlib.contextmanager
    def atomic(self) -> Iterator[Connection]:
        """A connection for one store call the backend makes atomic on its own: a
        transaction, or where the call is one statement (PostgreSQL's start), autocommit."""
        with self.begin() as conn:
            yield conn

    def may_have_committed(self, exc: BaseException) -> bool:
        """Whether a store call made atomic by :meth:`atomic` may have committed although it
        raised ``exc``: if its connection was lost (and the commit's answer with it), or an
        interrupt (not an ``Exception``) may have come just after the commit."""
        if not isinstance(exc, Exception):
            return True
        return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)

    @contextlib.contextmanager
    def read(self, conn: Connection | None = None) -> Iterator[Connection]:
        """A read-only transaction, on ``conn`` or a pooled connection."""
        if conn is not None:
            with conn.begin():
                yield conn
            return
        with self.engine.connect() as fresh, fresh.begin():
            yield fresh

    def read_one(self, stmt: Any, params: dict[str, Any]) -> Row[Any] | None:
        """The one row (or None) of the read-only ``stmt``, read on its own: no caller's
        transaction, the quickest way the backend has (a run's status, awaited)."""
        with self.read() as conn:
            return conn.execute(stmt, params).one_or_none()

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection held for a whole drive."""
        with self.engine.connect() as conn:
            yield conn

    def side_engine(self) -> Engine:
        """An engine with a pool of its own (the lease keeper's): a busy runs' pool must not
        starve lease renewal. It connects as the host's engine does (same creator) and runs
        statements as it does (its execution options, a schema translation among them)."""
        from sqlalchemy import create_engine

        options = {**self.base_engine.get_execution_options(), **self.view_options()}
        if self.base_engine.dialect.is_async:
            # An asyncio engine's pool cannot serve a thread's plain connections (the
            # listener of ``wp.AsyncClient``): the same database through the synchronous
            # driver wf_persist uses, with a small pool of its own.
            from . import normalize_url

            url = self.base_engine.url
            plain = normalize_url(url.set(drivername=url.get_backend_name()))
            return create_engine(plain, pool_size=2, max_overflow=2, execution_options=options)
        pool = self.base_engine.pool.recreate()
        engine = create_engine(self.base_engine.url, pool=pool, execution_options=options)
        if self.owned:
            self.on_own_engine(engine)
        return engine

    # checks ------------------------------------------------------------------------

    def requirement_problem(self, version: tuple[int, ...] | None) -> str | None:
        """Why this database version cannot run wf_persist, or ``None``."""
        return None

    def server_version(self) -> tuple[int, ...] | None:
        with self.base_engine.connect() as conn:
            found = conn.dialect.server_version_info or ()
        return tuple(p for p in found if isinstance(p, int)) or None

    def check(self) -> None:
        """Fail early, and say why, if this database or host engine cannot run wf_persist."""
        problem = self.requirement_problem(self.server_version())
        if problem is not None:
            raise UnsupportedDatabaseError(problem)

    def value_size(self, text: str) -> int:
        """Bytes a JSON text takes on the wire."""
        return len(text.encode("utf-8", "surrogatepass"))

    def check_size(self, what: str, value: Any) -> None:
        """Refuse a value larger than the backend can store (a typed error, never a retry).

        Measured as it is sent: every write serializes with ``json.dumps``' default
        separators, which make a list of small items half as large again as compact JSON.
        """
        if value is None or type(value) in _BOUNDED:
            return  # a number or a boolean: a few dozen bytes at most
        if type(value) is str and len(value) * _MAX_BYTES_PER_CHAR + 2 <= self.max_value_bytes:
            return  # even with every character escaped it fits
        size = self.value_size(json.dumps(value))
        if size > self.max_value_bytes:
            raise ValueTooLargeError(what, size, self.max_value_bytes)

    def contention(self, exc: BaseException) -> bool:
        """Whether ``exc`` says another transaction was in the way (a deadlock, a lock
        timeout, a serialization failure): nothing happened, try again later."""
        orig = getattr(exc, "orig", exc)
        return getattr(orig, "sqlstate", None) in ("40001", "40P01", "55P03")

    def pool_full(self) -> bool:
        """Whether every connection the runs' pool can give is out (a checkout would wait)."""
        capacity = self.capacity()
        checkedout = getattr(self.base_engine.pool, "checkedout", None)
        return capacity is not None and callable(checkedout) and checkedout() >= capacity

    def capacity(self) -> int | None:
        """Connections the runs' pool can hand out at once (None: unbounded)."""
        pool = self.base_engine.pool
        size = getattr(pool, "size", None)
        overflow = getattr(pool, "_max_overflow", None)
        if not callable(size) or overflow is None or overflow < 0:
            return None
        return int(size()) + int(overflow)

    # wake-ups and presence (see :mod:`wf_persist.wakeups`) ------------------------------

    def listener(self, presence: str | None) -> Listener:
        """A listening connection of this process's own, holding the presence lock of
        ``presence`` (an owner) if the database has such locks."""
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
        conn.execute(INSERT_HISTORY, history_row(row["id"], 1, started), execution_options=options)
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
        row = conn.execute(claim_one(pins), params).one_or_none()
        return None if row is None else Claim(*row)

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
        history = tuple((int(r[0]), r[1]) for r in found)
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
            history = tuple((int(r[0]), r[1]) for r in found)
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
        return [Claim(*row) for row in conn.execute(stmt, {"p_ttl": ttl, "p_owner": owner})]

    def renew(self, conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
        """Extend the leases still held at these epochs; return the ids still held."""
        if not held:
            return set()
        stmt = (
            update(ex)
            .where(held_at(held))
            .values(lease_expires_at=db_later(P_TTL), wake_at=db_later(P_TTL))
            .returning(ex.c.id)
        )
        return {str(i) for i in conn.execute(stmt, {"p_ttl": ttl}).scalars()}

    def renew_alone(self, conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
        """:meth:`renew` as a write of its own on ``conn`` (not in a transaction). Where the
        backend can, it is one autocommitted statement: a process paused (SIGSTOP) between
        a renewal's UPDATE and its COMMIT would hold the runs' row locks, and every other
        worker's claim of them would wait until it resumed."""
        with self.begin(conn):
            return self.renew(conn, held, ttl)

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

    # migrations --------------------------------------------------------------------

    @classmethod
    def database_missing(cls, url: URL) -> bool:
        """Whether connecting to ``url`` would create a database (an embedded file that is
        not there): read-only commands must not."""
        return False

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        """Serialize concurrent upgrades (taken inside the migration transaction)."""

    @classmethod
    def migration_unlock(cls, conn: Connection) -> None:
        """Release what :meth:`migration_lock` took, if it outlives the transaction."""

    @classmethod
    def offline_lock_sql(cls) -> str | None:
        """The lock statement a rendered (``--sql``) upgrade script starts with."""
        return None

    # raw driver paths --------------------------------------------------------------

    def _invalidate_pool(self, conn: Connection | PoolProxiedConnection, exc: Exception) -> None:
        """As ``Connection._handle_dbapi_exception`` after a disconnect: the connections the
        same pool handed out before are replaced at their next checkout (the pool's own,
        private, mark; skipped if it moved). The pool is the connection's own (the lease
        keeper's, a host's), and an engine with ``handle_error`` listeners keeps its pool as
        it is: one of them may have opted out, and they never see a fast path's errors."""
        engine = conn.engine if isinstance(conn, Connection) else self.base_engine
        fairy = conn.connection if isinstance(conn, Connection) else conn
        if engine.dialect.dispatch.handle_error:
            return
        stale = getattr(engine.pool, "_invalidate", None)
        if stale is not None:
            with contextlib.suppress(Exception):
                stale(fairy, exc, _checkin=False)

    def raw_failure(
        self,
        conn: Connection | PoolProxiedConnection,
        exc: Exception,
        statement: str,
        cursor: Any,
    ) -> Exception:
        """A driver error from a raw fast path (on a Connection, or a pooled DBAPI
        connection), handled as SQLAlchemy would: a dead connection is invalidated (never
        reused), and so is every connection the pool handed out before (a server restart
        or failover ended them all: each would otherwise fail a call of its own), and the
        error is wrapped. (SQLAlchemy's execution events, ``handle_error`` among them, do
        not see a fast path's statements.)"""
        dialect = self.base_engine.dialect
        if isinstance(conn, Connection):
            raw = conn.connection.dbapi_connection
            invalidated = conn.invalidated
        else:
            raw = conn.dbapi_connection
            invalidated = not conn.is_valid
        dbapi = dialect.loaded_dbapi
        if not isinstance(exc, dbapi.Error):
            return exc
        disconnect = dialect.is_disconnect(exc, raw, cursor)
        if disconnect and not invalidated:
            self._invalidate_pool(conn, exc)
            conn.invalidate(exc)
        return self.wrapped(exc, statement, disconnect)

    def wrapped(self, exc: Exception, statement: str | None, disconnect: bool) -> Exception:
        """The driver's error ``exc`` as SQLAlchemy's own (parameters hidden)."""
        dialect = self.base_engine.dialect
        return DBAPIError.instance(
            statement,
            None,
            exc,
            dialect.loaded_dbapi.Error,
            hide_parameters=True,
            dialect=dialect,
            connection_invalidated=disconnect,
        )
