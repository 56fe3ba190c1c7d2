"""SQLite: the embedded default.

Transactions. Python's sqlite3 module begins transactions itself, lazily and DEFERRED (its
legacy mode: not before a SELECT), or keeps one always open (``autocommit=False``, Python
3.12+). Neither gives the atomic read-then-write wf_persist's appends need. So every
transaction wf_persist runs takes the driver's transaction control for its duration
(``isolation_level = None``, legacy control), sends ``BEGIN IMMEDIATE`` itself (writers
queue on the database lock instead of failing a read-to-write upgrade) and gives the
connection back as it found it. This holds for a host's plain ``create_engine`` as well as
for engines wf_persist creates, which also get WAL, ``synchronous=FULL``, foreign keys and a
busy timeout.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sqlite3
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Engine, bindparam, event
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.pool import ConnectionPoolEntry

from ..errors import LeaseLostError, UnsupportedDatabaseError
from ..events import NewEvent
from ..json_text import json_text
from ..models import executions_table as ex
from ..models import sqlite_json
from . import sqlite_files as files
from . import sqlite_waits as waits
from .base import Backend, Changes
from .connections import dispose_pool
from .opening import connect
from .sql import HOT_COLUMNS, INSERT_HISTORY, Fenced, WriteShape, bump

#: How long a SQLite writer waits for the lock before failing (milliseconds).
BUSY_TIMEOUT_MS: Final = 30_000
_BEGIN_WRITE: Final = "BEGIN IMMEDIATE"
#: SQLite refusing the engine: SQLITE_READONLY (a file this process may not write),
#: SQLITE_READONLY_DIRECTORY (nor its directory), SQLITE_AUTH (a host's authorizer). Not
#: the other READONLY codes (a file moved, a hot journal): no grant would help those.
_REFUSED: Final = frozenset({8, 8 | 6 << 8, 23})
#: Room a row needs besides its values (SQLite's length limit is per row too).
_ROW_MARGIN: Final = 64 * 1024


def _value_limit(length_limit: int) -> int:
    """The largest value stored under SQLite's ``length_limit``, which bounds a whole row:
    a run's row holds its input and its result (or error) together."""
    return (length_limit - _ROW_MARGIN) // 2


#: Execution option: this transaction only reads (a deferred BEGIN).
READONLY: Final = "wf_persist_readonly"
#: Execution option of wf_persist's own connections: it sends BEGIN itself.
MANUAL_BEGIN: Final = "wf_persist_manual_begin"

_JSON_COLUMNS = frozenset({"event", "result", "error", "input"})
_TIME_COLUMNS = frozenset(
    {"created_at", "updated_at", "finished_at", "wake_at", "lease_expires_at", "deadline_at"}
)


#: The driver's legacy transaction control (Python 3.12+; always so before).
_LEGACY: Final = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", None)


def _take_control(raw: Any) -> tuple[Any, Any]:
    """Put the driver in legacy mode with no implicit BEGIN; return what to restore."""
    autocommit = getattr(raw, "autocommit", _LEGACY)
    if autocommit != _LEGACY:
        raw.autocommit = _LEGACY  # Python 3.12+: ends the implicit transaction it keeps open
    level = raw.isolation_level
    if level is not None:
        if raw.in_transaction:
            raw.rollback()
        raw.isolation_level = None
    return autocommit, level


def _restore(raw: Any, saved: tuple[Any, Any]) -> None:
    autocommit, level = saved
    if raw.isolation_level != level:
        raw.isolation_level = level
    if getattr(raw, "autocommit", autocommit) != autocommit:
        raw.autocommit = autocommit


def _ts(value: dt.datetime | None) -> str | None:
    """A time as SQLAlchemy's SQLite type binds it (naive UTC, microseconds)."""
    if value is None:
        return None
    if value.tzinfo is not dt.UTC:
        value = value.astimezone(dt.UTC)
    # isoformat is several times cheaper than strftime, and pads the year as SQLAlchemy does.
    return value.replace(tzinfo=None).isoformat(" ", "microseconds")


#: Engines wf_persist made (``wp.create_engine``, a runtime's own), whose connections
#: :meth:`SQLiteBackend.settle` may turn a database's journal into WAL through.
_OWN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


class DataVersion(Changes):
    """``PRAGMA data_version`` on a connection of its own that never writes: it moves when
    any other connection (any process) commits, and costs no disk access to read. The
    connection is the driver's, out of the pool and without transactions (a transaction
    left open would hold a snapshot, or on a host engine a lock)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._raw: Any = None
        self._last: int | None = None

    def changed(self) -> bool:
        if self._raw is None:
            fairy = self._engine.raw_connection()
            raw = fairy.driver_connection
            fairy.detach()
            _take_control(raw)
            self._raw = raw
        try:
            version = int(self._raw.execute("PRAGMA data_version").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                # A writer commits under a rollback journal, and a host's busy timeout of
                # 0 failed the read at once: something changes, look.
                return True
            self.close()
            raise
        except Exception:
            self.close()
            raise
        moved = version != self._last
        self._last = version
        return moved

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        dispose_pool(self._engine)


_COUNT_CHANGES: Final = (
    "this engine's SQLite connections set the deprecated PRAGMA count_changes, under which "
    "every write returns a row of its count where wf_persist reads what it wrote; leave it off"
)


class SQLiteBackend(Backend):
    names: ClassVar[tuple[str, ...]] = ("sqlite",)
    async_driver: ClassVar[str] = "aiosqlite"
    insert_ignoring: ClassVar[Any] = staticmethod(sqlite.insert)
    batch_migrations: ClassVar[bool] = True
    embedded: ClassVar[bool] = True

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        super().__init__(engine, owned=owned, schema=schema)
        self._sql: dict[WriteShape, tuple[str, tuple[str, ...], str] | None] = {}
        #: wf_persist's write transactions in this process queue here before BEGIN
        #: IMMEDIATE, see :meth:`_queued`.
        self._writers = threading.RLock()
        self.max_value_bytes = _value_limit(self._length_limit())

    @staticmethod
    def _length_limit() -> int:
        """SQLite's compile-time limit on one value (read from a throwaway in-memory
        connection: opening the database itself could create its file)."""
        probe = sqlite3.connect(":memory:")
        try:
            getlimit = getattr(probe, "getlimit", None)
            return int(getlimit(sqlite3.SQLITE_LIMIT_LENGTH)) if getlimit else 1_000_000_000
        finally:
            probe.close()

    # engines -----------------------------------------------------------------------

    @classmethod
    def async_engine_kwargs(cls, url: URL) -> dict[str, Any]:
        # Waits for another writer's lock as wf_persist's own engines do (aiosqlite: 5 s).
        return {"connect_args": {"timeout": 30.0}}

    @classmethod
    def configure_engine(cls, url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
        if url.query.get("mode") == "memory" or files.in_memory(url):
            # An in-memory database is one connection, which threads would have to take turns
            # on: a private file in a temporary directory, removed with the engine, behaves
            # the same to its user and lets every thread have its own connection.
            directory = tempfile.mkdtemp(prefix="wf_persist_memory_")
            url = url.set(database=os.path.join(directory, "memory.sqlite3"), query={})
            kwargs = {**kwargs, "wf_persist_tempdir": directory}
        return url, kwargs

    @classmethod
    def on_own_engine(cls, engine: Engine) -> None:
        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
            dbapi_connection.isolation_level = None  # BEGIN is ours to send
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                cursor.execute("PRAGMA synchronous = FULL")
                cursor.execute("PRAGMA foreign_keys = ON")
                # WAL is a property of the file, written into it: a new database gets it
                # here, one that holds our schema when it is opened (settle). Another
                # application's file, named by a mistyped URL, keeps its mode: nothing is
                # written before the schema check refuses it.
                files.to_wal(cursor, only_new=True)
            finally:
                cursor.close()

        _OWN_ENGINES.add(engine)

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # An application's own sessions on an engine from wf_persist.create_engine get
            # BEGIN IMMEDIATE too; wf_persist's own transactions send theirs themselves.
            options = conn.get_execution_options()
            if not options.get(MANUAL_BEGIN):
                conn.exec_driver_sql("BEGIN" if options.get(READONLY) else "BEGIN IMMEDIATE")

    def lock_wait_statements(self, seconds: float) -> list[str]:
        return [f"PRAGMA busy_timeout = {min(max(1, round(seconds * 1000)), 2**31 - 1)}"]

    def settle(self) -> None:
        """An engine of ours puts a database that holds our schema in WAL (readers never
        wait for the writer): one migrated by a script, say, or made before by a host.
        Any engine's connections tell their limit on one value (a host's may lower it)."""
        own = self.base_engine in _OWN_ENGINES
        with connect(self.base_engine) as conn:
            raw: Any = conn.connection.driver_connection
            getlimit = getattr(raw, "getlimit", None)  # Python 3.11+
            if getlimit is not None:
                limit = _value_limit(int(getlimit(sqlite3.SQLITE_LIMIT_LENGTH)))
                self.max_value_bytes = max(0, min(self.max_value_bytes, limit))
            if not own:
                return  # a host's engine: its file, its journal mode
            cursor = raw.cursor()
            try:
                files.to_wal(cursor, only_new=False)
            except sqlite3.Error as exc:
                raise self.raw_failure(conn, exc, "PRAGMA journal_mode = WAL", cursor) from exc
            finally:
                cursor.close()

    @contextlib.contextmanager
    def _controlled(self, conn: Connection) -> Iterator[Connection]:
        raw: Any = conn.connection.driver_connection
        saved = _take_control(raw)
        try:
            yield conn
        finally:
            if not conn.invalidated:
                _restore(raw, saved)

    @staticmethod
    def _ours(raw: Any) -> bool:
        """Whether the driver connection already leaves BEGIN to us (wf_persist's own
        engines, always): nothing to take over and give back around a write."""
        return raw.isolation_level is None and getattr(raw, "autocommit", _LEGACY) == _LEGACY

    @classmethod
    def patient(cls, conn: Connection) -> contextlib.AbstractContextManager[None]:
        return waits.patient(conn)

    def _queued(self, conn: Connection, turn: bool) -> contextlib.AbstractContextManager[None]:
        """This process's turn to write (``turn``) and SQLite's lock waited for as
        :func:`.sqlite_waits.queued` says."""
        return waits.queued(conn, self._writers, turn, self.raw_failure)

    @contextlib.contextmanager
    def _transaction(
        self, conn: Connection, begin: str, *, queue: bool = False
    ) -> Iterator[Connection]:
        if conn.in_transaction():  # nested in a transaction of ours: it already holds the lock
            with conn.begin_nested():
                yield conn
            return
        conn.execution_options(**{MANUAL_BEGIN: True})  # this Connection object only
        with self._queued(conn, queue), self._controlled(conn), conn.begin():
            conn.exec_driver_sql(begin)
            yield conn

    @contextlib.contextmanager
    def begin(self, conn: Connection | None = None, *, ours: bool = True) -> Iterator[Connection]:
        if conn is not None:
            with self._transaction(conn, _BEGIN_WRITE, queue=ours):
                yield conn
            return
        self.check_process()
        with self.engine.connect() as fresh, self._transaction(fresh, _BEGIN_WRITE, queue=ours):
            yield fresh

    @contextlib.contextmanager
    def read(self, conn: Connection | None = None) -> Iterator[Connection]:
        if conn is not None:
            with self._transaction(conn, "BEGIN"):
                yield conn
            return
        self.check_process()
        with self.engine.connect() as fresh, self._transaction(fresh, "BEGIN"):
            yield fresh

    def contention(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig)

    def changes(self) -> Changes | None:
        return DataVersion(self.side_engine())

    @classmethod
    def mapped_database(cls, conn: Connection, schema: str) -> URL | None:
        # The file attached under that name, if it is attached (and is a file).
        for _, name, path in conn.exec_driver_sql("PRAGMA database_list").all():
            if name == schema and path:
                return conn.engine.url.set(database=str(path), query={})
        return None

    @classmethod
    def database_missing(cls, url: URL) -> bool:
        # An empty file holds no database yet either (unless its write-ahead log holds
        # one): an engine of ours reading it as one would write SQLite's header into it.
        return files.empty(url)

    # checks ------------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        if self._private_to_each_connection():
            # wf_persist's own engines keep such a database in a private file instead.
            raise UnsupportedDatabaseError(
                "this engine's SQLite database is in memory, where each connection has its "
                "own (a worker's would have no tables); wf_persist uses several at once: "
                "pass wf_persist the URL (it keeps the database in a private file) or use a "
                "file"
            )
        options = files.uri_options(self.base_engine.url)
        if options.get("cache") == "shared" or options.get("nolock") == "1":
            # Shared cache: connections lock tables, and one that meets a lock fails at once
            # (SQLITE_LOCKED, no busy timeout); nolock: nothing keeps two writers apart.
            raise UnsupportedDatabaseError(
                "this engine's SQLite URI opens the database with "
                + ("cache=shared" if options.get("cache") == "shared" else "nolock=1")
                + ", under which wf_persist's connections (it writes from several at once) "
                "fail each other instead of waiting; open the file without it"
            )
        if files.absent(self.base_engine.url):
            return  # not created by asking
        with connect(self.base_engine) as conn:
            mode = str(conn.exec_driver_sql("PRAGMA locking_mode").scalar()).lower()
            # No row where SQLite was built without its deprecated pragmas.
            counting = conn.exec_driver_sql("PRAGMA count_changes").scalar()
            elsewhere = _usable_from_another_thread(conn.connection.driver_connection)
        if not elsewhere:
            raise UnsupportedDatabaseError(
                "this engine's SQLite connections refuse every thread but the one that opened "
                "them (check_same_thread=True), and a pooled connection serves wf_persist's "
                "threads in turn (callers, workers, the lease keeper); leave check_same_thread "
                "out (SQLAlchemy turns it off for a database file)"
            )
        if counting:
            # Every INSERT, UPDATE and DELETE returns a row of its count: a write's rows are
            # read as what RETURNING gave, and a run's drives fail forever.
            raise UnsupportedDatabaseError(_COUNT_CHANGES)
        if mode == "exclusive":
            # The first connection to write keeps the lock until it closes.
            raise UnsupportedDatabaseError(
                "this engine's SQLite connections use locking_mode EXCLUSIVE: the first to "
                "write keeps the lock, and wf_persist writes from several (a worker's, the "
                "lease keeper's) that would wait for it forever; use NORMAL"
            )

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        # The upgrade's transaction is the lock (BEGIN IMMEDIATE); Alembic's bookkeeping
        # counts the rows its UPDATE changed, which count_changes hides.
        if conn.exec_driver_sql("PRAGMA count_changes").scalar():
            raise UnsupportedDatabaseError(_COUNT_CHANGES)
        raw: Any = conn.connection.driver_connection
        if not raw.in_transaction and getattr(raw, "autocommit", None) is not True:
            # A host's engine may leave the sqlite3 module's own transaction handling on,
            # which begins no transaction before DDL: each statement of the upgrade would
            # commit alone (one interrupted left half a revision; two at once interleaved).
            # (Python 3.12's autocommit=True would never commit it: left as it is.)
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    def _private_to_each_connection(self) -> bool:
        """Whether each connection has a database of its own: the URL names one in memory
        and a connection confirms it has no file (a ``creator`` may open a file under
        ``sqlite://``), unless the URL shares it through SQLite's shared cache. A URL that
        names a file is taken at its word: connecting would create a missing one."""
        if not files.in_memory(self.base_engine.url):
            return False
        with self.base_engine.connect() as conn:
            rows = conn.exec_driver_sql("PRAGMA database_list").all()
        if any(row[1] == "main" and row[2] for row in rows):
            return False
        url = self.base_engine.url
        return url.query.get("cache") != "shared" and "cache=shared" not in (url.database or "")

    def server_version(self) -> tuple[int, ...] | None:
        return tuple(sqlite3.sqlite_version_info)

    def read_only(self) -> bool:
        url = self.base_engine.url
        options = files.uri_options(url)  # a URI filename opened read-only
        if options.get("mode") == "ro" or options.get("immutable") == "1":
            return True
        if files.absent(url):
            return False  # not created by asking (a host's query_only would refuse that too)
        with self.base_engine.connect() as conn:
            return bool(conn.exec_driver_sql("PRAGMA query_only").scalar())

    def cut(self, raw: Any) -> None:
        raw.interrupt()  # a lock wait or a statement: SQLITE_INTERRUPT where it runs

    @classmethod
    def missing_schema(cls, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        said = str(orig)
        # An INSERT naming a column the table lacks says "table t has no column named c".
        return isinstance(orig, sqlite3.OperationalError) and (
            "no such table" in said or "no such column" in said or "has no column named" in said
        )

    @classmethod
    def refused(cls, exc: BaseException) -> bool:
        code = getattr(getattr(exc, "orig", exc), "sqlite_errorcode", None)
        return code in _REFUSED

    @classmethod
    def cancelled(cls, exc: BaseException) -> bool:
        # SQLITE_BUSY, SQLITE_LOCKED (the busy timeout ran out), SQLITE_INTERRUPT: their
        # extended codes too (the low byte is the primary code).
        code = getattr(getattr(exc, "orig", exc), "sqlite_errorcode", None)
        return isinstance(code, int) and code & 0xFF in (5, 6, 9)

    def requirement_problem(self, version: tuple[int, ...] | None) -> str | None:
        if version is not None and version < (3, 35):
            found = ".".join(str(p) for p in version)
            return f"SQLite >= 3.35 is needed (UPDATE ... RETURNING); found {found}"
        return None

    # the hot path ------------------------------------------------------------------

    def _statements(self, shape: WriteShape) -> tuple[str, tuple[str, ...], str] | None:
        """The write's SQL and the order of its parameters, or None where the engine's
        parameter style is not positional (``paramstyle="named"``): such a write goes
        through SQLAlchemy."""
        if shape in self._sql:
            return self._sql[shape]
        dialect = self.base_engine.dialect
        update = bump(shape).returning(ex.c.next_seq, ex.c.status).compile(dialect=dialect)
        ins = INSERT_HISTORY.values({c: bindparam(c) for c in HOT_COLUMNS}).compile(dialect=dialect)
        # The rows are built in HOT_COLUMNS' order.
        positional = dialect.positional and tuple(ins.positiontup or ()) == HOT_COLUMNS
        found = (str(update), tuple(update.positiontup or ()), str(ins)) if positional else None
        self._sql[shape] = found
        return found

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
        """BEGIN IMMEDIATE, the compare-and-set UPDATE ... RETURNING, one INSERT, COMMIT,
        sent straight to the driver with SQL rendered once by SQLAlchemy: skipping
        SQLAlchemy's per-execution work halves a step's CPU, most of its cost next to the
        commit. Errors are handled as SQLAlchemy would (a dead connection is invalidated)."""
        n = len(events)
        shape = WriteShape(n, tuple(sorted(values or ())), guard)
        sql = None if conn.in_transaction() or self.schema_map else self._statements(shape)
        if sql is None:
            return super().write(
                conn, execution_id, epoch, events, now=now, values=values, guard=guard, note=note
            )
        update_sql, update_order, insert_sql = sql
        params: dict[str, Any] = {"p_eid": execution_id, "p_epoch": epoch, "p_now": _ts(now)}
        for column, value in (values or {}).items():
            params[f"v_{column}"] = (
                sqlite_json(value)
                if column in _JSON_COLUMNS and value is not None
                else _ts(value)
                if column in _TIME_COLUMNS
                else value
            )
        stamp = params["p_now"]
        # Rows in the statement's column order (HOT_COLUMNS', checked when it was rendered);
        # the sequences are filled in once the UPDATE returned the run's.
        rows = [
            [
                execution_id,
                0,
                ev.type,
                ev.activity_name,
                ev.dedupe_key,
                stamp if ev.created_at is now else _ts(ev.created_at),
                json_text(ev.event),
            ]
            for ev in events
        ]
        raw: Any = conn.connection.driver_connection
        cursor = None
        statement = update_sql
        try:  # a connection closed under us fails at its first touch: the cursor, say
            controlled = contextlib.nullcontext() if self._ours(raw) else self._controlled(conn)
            with self._queued(conn, True), controlled:
                cursor = raw.cursor()
                cursor.execute(_BEGIN_WRITE)
                try:
                    cursor.execute(update_sql, [params[k] for k in update_order])
                    top = cursor.fetchone()
                    if top is None:
                        raise LeaseLostError(execution_id)
                    base, status = int(top[0]) - n, str(top[1])
                    if rows:
                        statement = insert_sql
                        for i, row in enumerate(rows):
                            row[1] = base + i
                        cursor.executemany(insert_sql, rows)
                    raw.commit()
                except BaseException:
                    if raw.in_transaction:
                        raw.rollback()
                    raise
        except sqlite3.Error as exc:
            raise self.raw_failure(conn, exc, statement, cursor) from exc
        finally:
            if cursor is not None:
                cursor.close()
        return Fenced([base + i for i in range(n)], status)


def _usable_from_another_thread(raw: Any) -> bool:
    """Whether the driver connection ``raw`` takes a statement from another thread."""
    if not isinstance(raw, sqlite3.Connection):
        return True  # another driver: its own rules
    found: list[bool] = []

    def probe() -> None:
        try:
            raw.execute("SELECT 1").close()
            found.append(True)
        except sqlite3.ProgrammingError:
            found.append(False)
        except sqlite3.Error:
            found.append(True)  # another matter, met where it matters

    thread = threading.Thread(target=probe, name="wf-persist-thread-check")
    thread.start()
    thread.join()
    return found == [True]
