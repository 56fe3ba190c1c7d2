"""What a backend knows of its database and the engine it reaches it through.

:class:`Connections` is the half of a backend that is about connections, not runs: the engine
view wf_persist works through (a named schema, the isolation level its compare-and-sets need,
SQLite transaction control), how transactions begin, the checks made when an engine opens
(server version, value sizes, pool capacity), migration locking, and how a fast path's driver
errors are handled as SQLAlchemy would handle them. :class:`~.base.Backend` adds runs, claims
and fenced writes; each database's backend subclasses that.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, ClassVar, Final

import pydantic_core
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import URL, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import (
    AssertionPool,
    ConnectionPoolEntry,
    Pool,
    PoolProxiedConnection,
    QueuePool,
    StaticPool,
)

from ..errors import (
    ForkedRuntimeError,
    InvalidArgumentError,
    UnsupportedDatabaseError,
    ValueTooLargeError,
)
from ..json_text import json_text
from . import idle
from .migrations import Migrations

#: Types whose JSON text is a few dozen bytes whatever the value (no size check needed).
_BOUNDED: Final = (int, float, bool)


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE the driver's error behind ``exc`` carries (psycopg's; ``None`` for
    drivers that report none)."""
    return getattr(getattr(exc, "orig", exc), "sqlstate", None)


def dispose_pool(engine: Engine) -> None:
    """Dispose of an engine's pool so that every connection of it gets closed, also those
    checked out now: SQLAlchemy would put those back into the replaced pool when they are
    returned, to be garbage-collected open (psycopg warns of each)."""
    old = engine.pool
    engine.dispose()
    retire_pool(old)


def retire_pool(pool: Pool) -> None:
    """Close the connections of a pool its engine replaced (``Engine.dispose``): those in
    it now, and each one checked out now when it is given back. In an asyncio engine's
    pool, call it through ``greenlet_spawn``."""
    # The pool's own return step, replaced on this instance: a checkin listener added now
    # could race one running in another thread (SQLAlchemy iterates the listener deque
    # unlocked), and a host's listeners are copied into a side engine's pool.
    pool._do_return_conn = _close_returned  # type: ignore[method-assign]
    pool.dispose()  # those given back before


def _close_returned(record: ConnectionPoolEntry) -> None:
    record.close()


class Connections(Migrations):
    """The connection half of every backend (see the module's docstring)."""

    #: SQLAlchemy dialect names this backend serves.
    names: ClassVar[tuple[str, ...]] = ()
    #: The asyncio driver ``wp.AsyncClient`` reaches this database with.
    async_driver: ClassVar[str] = ""
    #: The package extra that installs this backend's default driver (None: built in).
    extra: ClassVar[str | None] = None
    #: Whether tables can live in a named schema (``Runtime(schema=...)``).
    supports_schemas: ClassVar[bool] = False
    #: Said after a connection's setup failed reading the server's answers: the likely
    #: cause on this database.
    setup_hint: ClassVar[str] = ""
    #: Seconds a write transaction of ours may sit idle before the server ends it (None:
    #: the backend cannot bound it; a paused process holds its locks until it resumes).
    idle_timeout: ClassVar[float | None] = None
    #: Whether migrations run in one transaction (DDL is transactional).
    transactional_ddl: ClassVar[bool] = True
    #: How many times :meth:`value_size` of ``json.dumps``' text can exceed the compact
    #: UTF-8 JSON of the same value (``check_size`` bounds with the cheaper compact form):
    #: DEL and other characters ``json.dumps`` escapes but compact JSON writes as one byte
    #: become six (``\\u007f``); a separator becomes two.
    json_growth: ClassVar[int] = 6
    #: The most :meth:`value_size` one character of a string can take in ``json.dumps``'
    #: text: an astral character is two escapes (``\\ud83d\\ude00``).
    char_bytes: ClassVar[int] = 12
    #: Whether Alembic must use batch mode (SQLite's limited ALTER TABLE).
    batch_migrations: ClassVar[bool] = False
    #: An embedded database (a file this process opens): a runtime that created its engine
    #: migrates it itself.
    embedded: ClassVar[bool] = False

    @classmethod
    def schema_problem(cls, schema: object) -> str | None:
        """Why ``schema`` cannot name the schema of our tables here (None: it can)."""
        return "a named schema needs PostgreSQL"

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        if schema is not None and not self.supports_schemas:
            raise UnsupportedDatabaseError(
                f"a named schema needs PostgreSQL, not {engine.dialect.name}"
            )
        problem = None if schema is None else self.schema_problem(schema)
        if problem is not None:
            raise InvalidArgumentError(f"schema {schema!r}: {problem}")
        self.base_engine = engine
        self.owned = owned
        #: The process this backend belongs to (see :meth:`check_process`).
        self.pid = os.getpid()
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
        mapped = self.schema_map.get(None) if self.schema_map and self.supports_schemas else None
        problem = None if mapped is None else self.schema_problem(mapped)
        if problem is not None:
            raise InvalidArgumentError(f"the engine's schema_translate_map: {mapped!r}: {problem}")
        if not self.embedded and (self.owned or self.engine.pool is not engine.pool):
            idle.watch(self.engine)  # never a host's pool: its engine is used as is
        #: The largest JSON value (bytes, as sent) one stored value may have.
        self.max_value_bytes = 256 * 1024 * 1024 - 64 * 1024
        #: The pool :meth:`pool_full` last read the capacity of, and that capacity.
        self._pool_capacity: tuple[Any, int | None] | None = None

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
    def async_engine_kwargs(cls, url: URL) -> dict[str, Any]:
        """Arguments of the asyncio engine ``wp.AsyncClient`` creates itself for ``url``."""
        return {}

    @classmethod
    def on_own_async_engine(cls, engine: Engine) -> None:
        """Listeners on the synchronous side of an asyncio engine wf_persist created."""

    @classmethod
    def on_own_engine(cls, engine: Engine) -> None:
        """Listeners on an engine wf_persist created (never on a host's)."""

    def settle(self) -> None:
        """Settings an engine of ours writes into a database once it is known to hold
        our schema at head (none here); a host's engine is never changed."""

    def lock_wait_statements(self, seconds: float) -> list[str]:
        """What a new connection sends so that a statement waits at most ``seconds`` for
        a lock another session holds (then the database cancels it)."""
        return []

    def bound_lock_waits(self, seconds: float) -> None:
        """Make every connection of this engine of ours (never a host's) wait at most
        ``seconds`` for a lock: a web view behind a migration's or an operator's lock
        answers that the database is busy rather than hang its requests."""
        if not self.owned:
            raise InvalidArgumentError("only an engine wf_persist made bounds its lock waits")
        statements = self.lock_wait_statements(seconds)

        @event.listens_for(self.base_engine, "connect")
        def _bound(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                for statement in statements:
                    cursor.execute(statement)
            finally:
                cursor.close()
            dbapi_connection.commit()  # a session setting, outside any transaction of ours

        self.base_engine.dispose()  # the connections made before it

    def view_options(self) -> dict[str, Any]:
        """Execution options of every connection wf_persist takes (a named schema)."""
        return dict(self.statement_options)

    def make_view(self, engine: Engine) -> Engine:
        """The engine wf_persist works through: same pool, our options; the host's engine
        object stays as it was."""
        options = self.view_options()
        view = engine.execution_options(**options) if options else engine
        level = options.get("isolation_level")
        if level is not None and "isolation_level" in engine.get_execution_options():
            # The host set its level with execution_options(): SQLAlchemy sets it at each
            # checkout after ours (a derived engine's listeners run first), so our
            # transactions would run at the host's level (a REPEATABLE READ compare-and-set
            # fails where ours re-checks). Ours is set again as each transaction begins;
            # the pool's reset puts the connection back as the host had it.
            dialect = engine.dialect

            @event.listens_for(view, "begin")
            def _our_level(conn: Connection) -> None:
                raw = conn.connection.dbapi_connection
                if raw is not None:
                    dialect.set_isolation_level(raw, level)

        return view

    @contextlib.contextmanager
    def begin(self, conn: Connection | None = None, *, ours: bool = True) -> Iterator[Connection]:
        """A write transaction, on ``conn`` (a drive's connection) or a pooled one;
        ``ours=False``: one an application runs its own statements in."""
        if conn is None:
            self.check_process()
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

    def check_process(self) -> None:
        """Before taking a pooled connection: refuse in a process forked after this backend
        was made, whose pool holds the parent's connections (their sockets shared: two
        processes talking over one corrupts both)."""
        if os.getpid() != self.pid:
            raise ForkedRuntimeError()

    def may_have_committed(self, exc: BaseException) -> bool:
        """Whether a store call made atomic by :meth:`atomic` may have committed although it
        raised ``exc``: anything but the database refusing it may have come after the
        commit (an interrupt, or an exception a signal handler raised, say a request's
        timeout), and a refusal whose connection was lost took the commit's answer with
        it."""
        return not isinstance(exc, DBAPIError) or bool(exc.connection_invalidated)

    def pool_would_wait(self) -> bool:
        """Whether taking a pooled connection now would queue (a ``QueuePool`` with none
        idle and no more allowed): a best-effort call skips rather than wait
        ``pool_timeout`` there, say after a request's deadline interrupted a wait for one."""
        pool = self.engine.pool
        if not isinstance(pool, QueuePool):
            return False  # NullPool, StaticPool and the like open or share: never queue
        limit = int(getattr(pool, "_max_overflow", -1))  # -1: unbounded
        return pool.checkedin() == 0 and 0 <= limit <= pool.overflow()

    @contextlib.contextmanager
    def read(self, conn: Connection | None = None) -> Iterator[Connection]:
        """A read-only transaction, on ``conn`` or a pooled connection."""
        if conn is not None:
            with conn.begin():
                yield conn
            return
        self.check_process()
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
            plain, kwargs = self.configure_engine(
                plain, {"pool_size": 2, "max_overflow": 2, "execution_options": options}
            )
            engine = create_engine(plain, **kwargs)
            self.on_own_engine(engine)
            return engine
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

    def read_only(self) -> bool:
        """Whether this engine's connections may not write (asked once, when it opens)."""
        return False

    @classmethod
    def refused(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is the server refusing this engine's user (a missing privilege,
        failed authentication, a SQLite authorizer): a caller gets it as
        :class:`~wf_persist.errors.UnsupportedDatabaseError` (see :mod:`wf_persist.refusals`);
        a worker backs off and tries again, as a grant may come."""
        return False

    @classmethod
    def patient(cls, conn: Connection) -> contextlib.AbstractContextManager[None]:
        """Around reads of wf_persist's outside its transactions (the schema's revision, read
        when a runtime opens and by the migration functions): wait for another
        connection's lock as its transactions do."""
        return contextlib.nullcontext()

    @classmethod
    def cancelled(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is a statement the database cancelled: a statement or lock-wait
        timeout ran out, or an operator cancelled it (a caller gets it as
        :class:`~wf_persist.errors.StatementCancelledError`)."""
        return False

    @classmethod
    def missing_schema(cls, exc: BaseException) -> bool:
        """Whether ``exc`` says a table or column the statement names is not there (not
        where the connection looks: another schema or database, dropped, or the schema
        taken down below this version's revision)."""
        return False

    @classmethod
    def deadlocked(cls, exc: BaseException) -> bool:
        """Whether ``exc`` says the database broke a deadlock by rolling this transaction
        back: nothing of it happened, and sent again it goes through."""
        return sqlstate(exc) == "40P01"

    @classmethod
    def serialization_failure(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is a serialization failure: a transaction at REPEATABLE READ or
        stricter met a row committed after its snapshot (SQLSTATE 40001)."""
        return sqlstate(exc) == "40001"

    @classmethod
    def aborted(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is a statement refused because its transaction had already failed
        (PostgreSQL's, until rolled back; elsewhere a failed statement leaves the rest of
        its transaction usable)."""
        return False

    @classmethod
    def unreachable(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is the database out of reach: the connection lost or not made
        (a caller gets it as :class:`~wf_persist.errors.DatabaseUnavailableError`)."""
        return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)

    def check(self) -> None:
        """Fail early, and say why, if this database or host engine cannot run wf_persist."""
        pool = self.base_engine.pool
        if isinstance(pool, StaticPool | AssertionPool):
            # Its threads (the lease keeper, timers, workers, callers) write at once: on
            # one shared connection their transactions would interleave and undo each other.
            raise UnsupportedDatabaseError(
                f"this engine's {type(pool).__name__} gives every thread one and the same "
                "connection, and wf_persist writes from several threads at once; use a pool "
                "that gives each its own (the default for a database file or server)"
            )
        problem = self.requirement_problem(self.server_version())
        if problem is not None:
            raise UnsupportedDatabaseError(problem)

    def value_size(self, text: str) -> int:
        """Bytes a JSON text takes on the wire."""
        return len(text.encode("utf-8", "surrogatepass"))

    def as_stored(self, doc: Any) -> Any:
        """``doc`` as this database gives it back: what a run sees of a value it just
        recorded must be what a replay reads (here: the same)."""
        return doc

    def check_size(self, what: str, value: Any) -> None:
        """Refuse a value larger than the backend can store (a typed error, never a retry).

        Measured as it is sent: every write serializes with ``json.dumps``' default
        separators, which make a list of small items half as large again as compact JSON.
        """
        if value is None or type(value) in _BOUNDED:
            return  # a number or a boolean: a few dozen bytes at most
        if type(value) is str and len(value) * self.char_bytes + 2 <= self.max_value_bytes:
            return  # even with every character escaped it fits
        try:  # a bound from compact JSON, several times cheaper to make than the text
            if len(pydantic_core.to_json(value)) * self.json_growth <= self.max_value_bytes:
                return
        except Exception:  # a value pydantic cannot write is measured below
            pass
        size = self.value_size(json_text(value))
        if size > self.max_value_bytes:
            raise ValueTooLargeError(what, size, self.max_value_bytes)

    def contention(self, exc: BaseException) -> bool:
        """Whether ``exc`` says another transaction was in the way (a deadlock, a lock
        timeout, a serialization failure): nothing happened, try again later."""
        return sqlstate(exc) in ("40001", "40P01", "55P03")

    def pool_full(self) -> bool:
        """Whether every connection the runs' pool can give is out (a checkout would wait).
        Asked whenever user code starts: a pool's capacity is read once per pool (an
        engine's ``dispose()`` makes a new one)."""
        pool = self.base_engine.pool
        known = self._pool_capacity
        if known is None or known[0] is not pool:
            known = self._pool_capacity = (pool, self.capacity())
        capacity = known[1]
        if capacity is None:
            return False
        checkedout = getattr(pool, "checkedout", None)
        return callable(checkedout) and checkedout() >= capacity

    def capacity(self) -> int | None:
        """Connections the runs' pool can hand out at once (None: unbounded)."""
        pool = self.base_engine.pool
        size = getattr(pool, "size", None)
        overflow = getattr(pool, "_max_overflow", None)
        if not callable(size) or overflow is None or overflow < 0:
            return None
        return int(size()) + int(overflow)

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
