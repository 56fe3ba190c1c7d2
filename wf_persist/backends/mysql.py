"""MySQL 8 / MariaDB 10.6+ (PyMySQL).

No UPDATE ... RETURNING here, so a claim's compare-and-set returns its new epoch through
``LAST_INSERT_ID(expr)``, which the server hands back with the statement's result (no extra
round trip); its affected-row count says whether the CAS won. Batch claims lock candidates
with ``FOR UPDATE SKIP LOCKED`` first. Dedupe inserts are plain INSERTs whose duplicate-key
error on the dedupe index is the "already there" answer: ``INSERT IGNORE`` would also turn a
too-long value into a silent truncation. Writes run in strict mode (own engines set it; a host
engine without it is refused), so nothing is ever truncated silently.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Final

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    event,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import ConnectionPoolEntry

from .. import clocks
from ..errors import LeaseLostError, UnsupportedDatabaseError, ValueTooLargeError
from ..events import NewEvent
from ..models import UniqueKey
from ..models import executions_table as ex
from . import sockets
from .base import Backend
from .clock import db_now
from .opening import connect
from .sql import (
    CLAIM_COLUMNS,
    INSERT_HISTORY,
    P_ID,
    Claim,
    Fenced,
    WriteShape,
    bump,
    claim_values,
    claims_read,
    due,
    held_at,
    history_row,
    pinned,
    renew_values,
)

#: A session with no database: every unqualified name of ours would name no table.
_NO_DATABASE: Final = (
    "this engine's connections use no database (the URL names none, as in "
    "mysql+pymysql://user@host/); name the database: mysql+pymysql://user@host/db"
)
#: The named lock an upgrade holds: named locks are the server's, so one per database.
MIGRATION_LOCK: Final = "CONCAT('wf_persist_migrate:', SHA1(COALESCE(DATABASE(), '')))"
#: Where an upgrade keeps its connection's sql_big_selects to put back.
_BIG_SELECTS: Final = "wf_persist_big_selects"
#: Statements and values over ``max_allowed_packet`` break the connection: values stay well
#: inside it (a step write carries its input and its result).
_PACKET_MARGIN: Final = 64 * 1024
#: Room a statement needs besides its JSON documents (SQL text, ids, names, times).
_STATEMENT_MARGIN: Final = 16 * 1024
_STRICT = ("STRICT_TRANS_TABLES", "STRICT_ALL_TABLES")
_DUPLICATE_KEY: Final = 1062
_NO_SUCH_TABLE: Final = 1146
_NO_SUCH_COLUMN: Final = 1054
_DEADLOCK: Final = 1213
_LOCK_WAIT_TIMEOUT: Final = 1205
#: ``sql_select_limit`` at DEFAULT: no limit.
_NO_SELECT_LIMIT: Final = 2**64 - 1
#: The server refusing the user (database access, password, a table's or a column's
#: privilege, a privilege the statement needs) or a write (a read-only server or
#: transaction, as a demoted primary is).
_REFUSED: Final = frozenset({1044, 1045, 1142, 1143, 1227, 1290, 1792, 1836})
#: The server out of reach: shutting down (1053), this connection killed (1927) or ended
#: idle (4031), none made (2002, 2003, 2005) or the one in use lost (2006, 2013, 2055).
_GONE: Final = frozenset({1053, 1927, 2002, 2003, 2005, 2006, 2013, 2055, 4031})
#: A statement cancelled: a lock wait timed out (1205), the query killed (1317), or past
#: MariaDB's max_statement_time (1969) or MySQL's max_execution_time (3024).
_CANCELLED: Final = frozenset({_LOCK_WAIT_TIMEOUT, 1317, 1969, 3024})
#: The server's status flag "a transaction is open" (PyMySQL keeps the last one it saw).
_SERVER_STATUS_IN_TRANS: Final = 1


def _code(exc: BaseException) -> Any:
    """The server's error number behind a driver or SQLAlchemy error, if any."""
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    return args[0] if args else None


@functools.lru_cache(maxsize=64)
def _cas_statement(workflows: tuple[tuple[str, int], ...] | None = None) -> Any:
    """A claim's compare-and-set, its new epoch handed back through ``LAST_INSERT_ID``."""
    values = claim_values()
    values["claim_epoch"] = func.last_insert_id(ex.c.claim_epoch + 1)
    stmt = update(ex).where(ex.c.id == P_ID, due())
    if workflows is not None:
        stmt = stmt.where(pinned(workflows))
    return stmt.values(values)


class MySQLBackend(Backend):
    names: ClassVar[tuple[str, ...]] = ("mysql", "mariadb")
    async_driver: ClassVar[str] = "aiomysql"
    extra: ClassVar[str | None] = "mysql"
    skip_locked: ClassVar[bool] = True
    #: ``\\u007f`` sent as an escaped literal: its backslash doubles.
    json_growth: ClassVar[int] = 7
    char_bytes: ClassVar[int] = 14
    transactional_ddl: ClassVar[bool] = False
    locking_reads_see_committed: ClassVar[bool] = True

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        with connect(engine) as conn:  # a failure to connect: DatabaseConnectError
            # MariaDB names the session's read-only setting tx_read_only, MySQL 8
            # transaction_read_only; the server's read_only refuses every writer without
            # the privilege to bypass it.
            mariadb = bool(getattr(conn.dialect, "is_mariadb", False))
            session_ro = "tx_read_only" if mariadb else "transaction_read_only"
            found = conn.execute(
                text(
                    "SELECT @@SESSION.sql_mode, @@max_allowed_packet,"
                    " @@SESSION.character_set_client, @@SESSION.character_set_connection,"
                    " @@SESSION.character_set_results, @@SESSION.sql_select_limit,"
                    f" @@SESSION.sql_big_selects, @@SESSION.{session_ro} OR @@GLOBAL.read_only,"
                    " DATABASE()"
                )
            ).one()
            mode, packet, client_set, connection_set, results_set, limit, big = found[:7]
            self._read_only = bool(found[7])
            # AUTOCOMMIT is a driver setting the isolation level does not report: such an
            # engine needs our level set too, or our transactions would not be transactions.
            raw: Any = conn.connection.dbapi_connection
            autocommit = conn.dialect.detect_autocommit_setting(raw)
            self._isolation = "AUTOCOMMIT" if autocommit else conn.get_isolation_level()
        super().__init__(engine, owned=owned, schema=schema)
        #: The database the connections use (None: the URL names none).
        self.database: str | None = found[8]
        self.sql_mode = str(mode)
        # Results in their columns' own character set (NULL) are utf8mb4 for our tables.
        results = "utf8mb4" if results_set is None else str(results_set)
        self.character_sets = (str(client_set), str(connection_set), results)
        self.packet_bytes = int(packet)
        self.select_limit = int(limit)
        self.big_selects = bool(big)
        self.max_value_bytes = (self.packet_bytes - _PACKET_MARGIN) // 2

    @classmethod
    def async_engine_kwargs(cls, url: URL) -> dict[str, Any]:
        # READ COMMITTED set once per connection: as an execution option SQLAlchemy sets it
        # at every checkout, a round trip, and a connection the server ended meanwhile
        # fails that SET with the driver's raw error (the connection leaked), never as a
        # connection to drop and read again on another.
        return {"isolation_level": "READ COMMITTED"}

    @classmethod
    def on_own_async_engine(cls, engine: Engine) -> None:
        @event.listens_for(engine, "connect")
        def _keep_alive(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
            # aiomysql's stream: the socket under its transport.
            writer = getattr(getattr(dbapi_connection, "driver_connection", None), "_writer", None)
            sock = None if writer is None else writer.get_extra_info("socket")
            if sock is not None:
                sockets.keep_alive(sock)

    @classmethod
    def configure_engine(cls, url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
        # What PostgreSQL does by default: each statement sees what committed before it.
        kwargs.setdefault("isolation_level", "READ COMMITTED")
        # A driver borrows a connection per write: the pool's ROLLBACK on every return would
        # be a round trip each time (PyMySQL always sends it). Our own engines roll back
        # only a connection the server says is inside a transaction (see on_own_engine).
        kwargs.setdefault("pool_reset_on_return", None)
        charset = url.query.get("charset")
        named = charset if isinstance(charset, str) else None
        if charset is not None and (named is None or named.lower() != "utf8mb4"):
            # Any other is refused once connected (see check_session); an unknown one
            # fails inside the driver first with an AttributeError.
            raise UnsupportedDatabaseError(
                f"the URL's charset={charset!r:.40} cannot hold every character (or is "
                "unknown); connect with utf8mb4, e.g. mysql+pymysql://user@host/db?charset=utf8mb4"
            )
        return url, kwargs

    def lock_wait_statements(self, seconds: float) -> list[str]:
        # Row locks (InnoDB's) and table and metadata locks (LOCK TABLES, a migration's
        # ALTER): whole seconds, at least one.
        whole = min(max(1, math.ceil(seconds)), 365 * 24 * 3600)  # lock_wait_timeout's most
        return [f"SET SESSION innodb_lock_wait_timeout = {whole}, lock_wait_timeout = {whole}"]

    def view_options(self) -> dict[str, Any]:
        # Claims and appends lock rows; at REPEATABLE READ (MySQL's default) gap locks make
        # concurrent claimers deadlock. wf_persist's transactions run at READ COMMITTED.
        options = super().view_options()
        if self._isolation != "READ COMMITTED":
            options["isolation_level"] = "READ COMMITTED"
        return options

    def contention(self, exc: BaseException) -> bool:
        code = _code(exc)
        return code in (_DEADLOCK, _LOCK_WAIT_TIMEOUT)

    @classmethod
    def on_own_engine(cls, engine: Engine) -> None:
        @event.listens_for(engine, "reset")
        def _reset(dbapi_connection: Any, _record: ConnectionPoolEntry, _state: Any) -> None:
            if getattr(dbapi_connection, "server_status", 1) & _SERVER_STATUS_IN_TRANS:
                dbapi_connection.rollback()

        @event.listens_for(engine, "connect")
        def _strict(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
            sock = getattr(dbapi_connection, "_sock", None)  # PyMySQL takes no such option
            if sock is not None:
                sockets.keep_alive(sock)
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(
                    "SET SESSION sql_mode = CONCAT_WS(',', @@SESSION.sql_mode, 'STRICT_ALL_TABLES')"
                )
            finally:
                cursor.close()

    def read_only(self) -> bool:
        return self._read_only

    def cut(self, raw: Any) -> None:
        sock = getattr(raw, "_sock", None)  # PyMySQL's socket; None once closed
        if sock is not None:
            sockets.shut(sock.fileno())

    @classmethod
    def deadlocked(cls, exc: BaseException) -> bool:
        return bool(_code(exc) == _DEADLOCK)

    @classmethod
    def missing_schema(cls, exc: BaseException) -> bool:
        return _code(exc) in (_NO_SUCH_TABLE, _NO_SUCH_COLUMN)

    @classmethod
    def refused(cls, exc: BaseException) -> bool:
        return _code(exc) in _REFUSED

    @classmethod
    def cancelled(cls, exc: BaseException) -> bool:
        return _code(exc) in _CANCELLED

    @classmethod
    def unreachable(cls, exc: BaseException) -> bool:
        return _code(exc) in _GONE or super().unreachable(exc)

    def requirement_problem(self, version: tuple[int, ...] | None) -> str | None:
        mariadb = bool(getattr(self.base_engine.dialect, "is_mariadb", False))
        found = "" if version is None else ".".join(str(p) for p in version)
        if mariadb and version is not None and version < (10, 6):
            return f"MariaDB >= 10.6 is needed (FOR UPDATE SKIP LOCKED); found {found}"
        if not mariadb and version is not None and version < (8, 0, 17):
            return (
                "MySQL >= 8.0.17 is needed (FOR UPDATE SKIP LOCKED, and the NO PAD binary "
                f"collation names and keys are compared in); found {found}"
            )
        return None

    def check(self) -> None:
        super().check()
        if self.database is None and not self.schema_map:
            raise UnsupportedDatabaseError(_NO_DATABASE)
        if not any(flag in self.sql_mode.split(",") for flag in _STRICT):
            raise UnsupportedDatabaseError(
                "this engine's connections are not in strict mode (sql_mode "
                f"'{self.sql_mode}'), so MySQL would truncate values silently; add "
                "STRICT_TRANS_TABLES, e.g. create_engine(url, connect_args={'init_command': "
                "\"SET SESSION sql_mode = CONCAT(@@sql_mode, ',STRICT_TRANS_TABLES')\"})"
            )
        if self.select_limit < _NO_SELECT_LIMIT:
            # Every SELECT would be cut short without a word: a run's history among them,
            # whose replay would then run its recorded steps again.
            raise UnsupportedDatabaseError(
                f"this engine's connections set sql_select_limit ({self.select_limit}), "
                "which cuts every read short silently (a run's history among them, and "
                "replaying it would run recorded steps again); leave it at DEFAULT"
            )
        if not self.big_selects:
            # max_join_size (which turns sql_big_selects off): any read the optimizer
            # expects to examine more rows fails, a worker's claim or a page of runs.
            raise UnsupportedDatabaseError(
                "this engine's connections set max_join_size (sql_big_selects is off), so "
                "the server refuses any read it expects to examine more rows, a worker's "
                "claim among them; leave max_join_size at its default or set "
                "sql_big_selects=1"
            )
        # Names, keys and values may hold any character: a narrower character set fails
        # them in the driver or the server (one with an emoji, say), or mangles them.
        narrower = sorted({found for found in self.character_sets if found != "utf8mb4"})
        if narrower:
            raise UnsupportedDatabaseError(
                f"this engine's connections use the character set {', '.join(narrower)}, "
                "which cannot hold every character; connect with utf8mb4, e.g. "
                "mysql+pymysql://user@host/db?charset=utf8mb4"
            )

    def value_size(self, text: str) -> int:
        # PyMySQL sends values as escaped literals: quotes and backslashes double.
        raw = text.encode("utf-8", "surrogatepass")
        return len(raw) + raw.count(b"\\") + raw.count(b"'") + raw.count(b'"')

    # dedupe ------------------------------------------------------------------------

    def insert_once(
        self,
        conn: Connection,
        table: Any,
        row: Mapping[str, Any],
        key: UniqueKey,
        sql_values: Mapping[str, Any] | None = None,
    ) -> bool:
        # MySQL names a primary key PRIMARY (MySQL 8 prefixes the table: 'wf_workflows.PRIMARY').
        name = "PRIMARY" if key.primary else key.name
        try:  # a failed INSERT rolls back only itself: the transaction goes on
            conn.execute(insert(table).values(**(sql_values or {})), dict(row))
        except IntegrityError as exc:
            args: tuple[Any, ...] = tuple(getattr(exc.orig, "args", ()))
            if not args or args[0] != _DUPLICATE_KEY:
                raise
            message = str(args[1]) if len(args) > 1 else ""
            if re.search(rf"for key '(?:[^']*\.)?{re.escape(name)}'", message):
                return False
            # Not in English (the session's lc_messages): ask the key itself, reading the
            # newest committed row as the failed INSERT did, whatever the isolation level.
            match = [table.c[column] == row[column] for column in key.columns]
            taken = select(literal(1)).select_from(table).where(*match).limit(1)
            if conn.execute(taken.with_for_update(read=True)).first() is not None:
                return False
            raise
        return True

    # claims ------------------------------------------------------------------------

    def _cas(
        self,
        conn: Connection,
        execution_id: str,
        owner: str,
        ttl: float,
        workflows: Sequence[tuple[str, int]] | None = None,
    ) -> int | None:
        params = {"p_id": execution_id, "p_owner": owner, "p_ttl": ttl}
        pins = None if workflows is None else tuple(workflows)
        result = conn.execute(_cas_statement(pins), params)
        return int(result.lastrowid) if result.rowcount == 1 else None

    def _claimed(self, conn: Connection, pairs: Sequence[tuple[str, int]]) -> list[Claim]:
        if not pairs:
            return []
        stmt: Any = select(*CLAIM_COLUMNS, db_now()).where(held_at(dict(pairs)))
        asked = clocks.elapsed()
        return claims_read(conn.execute(stmt).all(), asked)

    def claim(
        self,
        conn: Connection,
        execution_id: str,
        owner: str,
        ttl: float,
        workflows: Sequence[tuple[str, int]] | None = None,
    ) -> Claim | None:
        epoch = self._cas(conn, execution_id, owner, ttl, workflows)
        if epoch is None:
            return None
        found = self._claimed(conn, [(execution_id, epoch)])
        return found[0] if found else None

    def claim_due(
        self,
        conn: Connection,
        owner: str,
        ttl: float,
        limit: int,
        workflows: Sequence[tuple[str, int]],
        exclude: Sequence[str],
    ) -> list[Claim]:
        candidates = select(ex.c.id).where(due(), pinned(workflows))
        if exclude:
            candidates = candidates.where(ex.c.id.not_in(list(exclude)))
        ids = (
            conn.execute(
                candidates.order_by(ex.c.wake_at).limit(limit).with_for_update(skip_locked=True)
            )
            .scalars()
            .all()
        )
        won = []
        for execution_id in ids:
            epoch = self._cas(conn, str(execution_id), owner, ttl)
            if epoch is not None:
                won.append((str(execution_id), epoch))
        return self._claimed(conn, won)

    def keyset_after(self, created_at: dt.datetime, execution_id: str) -> Any:
        """MySQL and MariaDB do not plan a row-value comparison as an index range; the
        expanded form with a leading ``created_at >=`` bound is one range on the
        ``(..., created_at, id)`` indexes (the rest is checked within it)."""
        return and_(
            ex.c.created_at >= created_at,
            or_(ex.c.created_at > created_at, ex.c.id > execution_id),
        )

    def renew(
        self, conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
    ) -> set[str]:
        if not held:
            return set()
        conn.execute(update(ex).where(held_at(held)).values(renew_values(owner)), {"p_ttl": ttl})
        return {str(i) for i in conn.execute(select(ex.c.id).where(held_at(held))).scalars()}

    def renew_alone(
        self, conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
    ) -> set[str]:
        # Each statement commits on its own: the UPDATE's row locks are gone when it
        # returns, and the SELECT that follows reads without locking.
        with self._autocommit(conn):
            return self.renew(conn, held, ttl, owner)

    def renew_free(self, conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
        # An UPDATE cannot skip locked rows here: a locking read that skips them comes
        # first, its locks gone as it returns (autocommit, as in renew_alone). A row locked
        # in between is waited for, as by every renewal before.
        if not held:
            return set()
        with self._autocommit(conn):
            lockable = select(ex.c.id).where(held_at(held)).with_for_update(skip_locked=True)
            free = {str(i) for i in conn.execute(lockable).scalars()}
            if not free:
                return set()
            return free & self.renew(conn, {i: e for i, e in held.items() if i in free}, ttl)

    @contextlib.contextmanager
    def _autocommit(self, conn: Connection) -> Iterator[Connection]:
        """``conn`` with each statement committing on its own. It may be a drive's, kept
        for its next writes: its level is put back."""
        before = conn.get_execution_options().get("isolation_level")
        self._set_level(conn, "AUTOCOMMIT")
        try:
            with conn.begin():  # only SQLAlchemy's: the driver is in autocommit
                yield conn
        finally:
            if not conn.invalidated and not conn.closed:
                self._set_level(conn, before or conn.default_isolation_level)

    def _set_level(self, conn: Connection, level: Any) -> None:
        """``conn``'s isolation level. SQLAlchemy sends the SET outside its error handling:
        on a connection the server ended, the driver's own error came out, where a lost
        connection (to replace, and the renewal sent again) is meant."""
        try:
            conn.execution_options(isolation_level=level)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise self.raw_failure(conn, exc, f"SET {level}", None) from exc

    # fenced writes -----------------------------------------------------------------

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
        """Lock the row at the driver's epoch, bump it and insert: three statements in the
        caller's transaction (the lock makes the read of ``next_seq`` and the bump atomic)."""
        shape = WriteShape(len(events), tuple(sorted(values or ())), guard)
        locked = select(ex.c.next_seq, ex.c.status).where(
            ex.c.id == execution_id, ex.c.claim_epoch == epoch
        )
        if guard is not None:
            locked = locked.where(ex.c.status.in_(guard))
        top = conn.execute(locked.with_for_update()).one_or_none()
        if top is None:
            raise LeaseLostError(execution_id)
        self._check_packet(events, values)
        conn.execute(bump(shape), self._params(execution_id, epoch, now, values))
        base = int(top[0])
        if events:
            conn.execute(
                INSERT_HISTORY,
                [history_row(execution_id, base + i, e) for i, e in enumerate(events)],
            )
        # The status after the write, as RETURNING gives it on the other backends.
        status = (values or {}).get("status", top[1])
        return Fenced([base + i for i in range(shape.n)], str(status))

    def _check_packet(self, events: Sequence[NewEvent], values: Mapping[str, Any] | None) -> None:
        """A statement over ``max_allowed_packet`` breaks the connection; refuse it first.

        The events go in one INSERT and the run's columns in one UPDATE, so each must fit
        on its own; two values within ``max_value_bytes`` and their events always do.
        """
        limit = self.packet_bytes - _STATEMENT_MARGIN
        columns = [v for v in (values or {}).values() if isinstance(v, dict | list | str)]
        for docs in ([e.event for e in events], columns):
            total = sum(self.value_size(json.dumps(d)) for d in docs)
            if total > limit:
                raise ValueTooLargeError("one write", total, limit)

    @classmethod
    def session_problem(cls, conn: Connection) -> str | None:
        if conn.get_execution_options().get("schema_translate_map"):
            return None
        found = conn.exec_driver_sql("SELECT DATABASE()").scalar()
        return _NO_DATABASE if found is None else None

    @classmethod
    @contextlib.contextmanager
    def catalog_reads(cls, conn: Connection) -> Iterator[None]:
        # A host's max_join_size (sql_big_selects off) refuses even SHOW FULL TABLES.
        big = conn.execute(text("SELECT @@SESSION.sql_big_selects")).scalar_one()
        if int(big):
            yield
            return
        conn.execute(text("SET SESSION sql_big_selects = 1"))
        try:
            yield
        finally:
            conn.execute(text("SET SESSION sql_big_selects = 0"))

    @classmethod
    def mapped_database(cls, conn: Connection, schema: str) -> URL | None:
        return conn.engine.url.set(database=schema)

    @classmethod
    def migrating(cls, conn: Connection) -> bool:
        return conn.execute(text(f"SELECT IS_USED_LOCK({MIGRATION_LOCK})")).scalar() is not None

    @classmethod
    def foreign_table(
        cls, conn: Connection, name: str, schema: str | None, columns: frozenset[str]
    ) -> bool:
        # Read from information_schema, as the revisions' own checks are (migration_ops).
        found = conn.execute(
            text(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :name"
            ),
            {"schema": schema, "name": name},
        ).scalars()
        return {str(c) for c in found} != columns

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        got = conn.execute(text(f"SELECT GET_LOCK({MIGRATION_LOCK}, 600)")).scalar_one()
        if got != 1:
            raise UnsupportedDatabaseError("could not take the wf_persist migration lock")
        # A host's max_join_size (which turns sql_big_selects off) refuses the upgrade's
        # reads of information_schema: allowed for the upgrade, put back after.
        big = conn.execute(text("SELECT @@SESSION.sql_big_selects")).scalar_one()
        conn.info[_BIG_SELECTS] = int(big)
        conn.execute(text("SET SESSION sql_big_selects = 1"))

    @classmethod
    def migration_unlock(cls, conn: Connection) -> None:
        big = conn.info.pop(_BIG_SELECTS, None)
        if big is not None:
            conn.execute(text("SET SESSION sql_big_selects = :big"), {"big": big})
        conn.execute(text(f"SELECT RELEASE_LOCK({MIGRATION_LOCK})"))
