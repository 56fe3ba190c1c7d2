"""PostgreSQL (psycopg 3): production, many workers on many machines.

A driver's write is ONE statement: ``WITH bump AS (UPDATE ... WHERE id = $1 AND claim_epoch =
$2 RETURNING next_seq, status) INSERT INTO wf_history SELECT ... FROM bump``, sent in
autocommit: one round trip and one WAL flush per step, and atomic on its own. Claims skip
rows other workers are claiming (``FOR UPDATE SKIP LOCKED``). wf_persist's transactions run
at READ COMMITTED whatever the host engine's default, because its compare-and-sets rely on
an UPDATE re-checking its WHERE against the newest row version (REPEATABLE READ would raise
serialization failures instead).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar, Final

from sqlalchemy import (
    Connection,
    Engine,
    event,
    func,
    select,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from .. import clocks
from ..errors import LeaseLostError, UnsupportedDatabaseError
from ..events import NewEvent
from ..json_text import as_jsonb, json_text
from ..models import executions_table as ex
from ..models import workflows_table as wf
from ..wakeups import DUE, END, NOT_AVAILABLE, Hearing, Listener
from . import pg_json, sockets
from .connections import sqlstate
from .opening import connect
from .pg_presence import PRESENT_MARK, REAP, UNSUPPORTED, PGListener, advisory_locks_work
from .pg_raw import RawPath, as_created
from .pg_settings import SETTINGS
from .pg_sql import (
    P_CHANNEL,
    P_PAYLOAD,
    RUN_COLUMNS,
    claim_statement,
    claims_of,
    renew_statement,
    start_statement,
    write_statement,
)
from .sql import (
    STALE,
    Cataloged,
    Claim,
    Fenced,
    RowShape,
    Stale,
    WriteShape,
)

log = logging.getLogger("wf_persist.worker")
#: The largest value (bytes of JSON, as sent) one write stores. JSONB holds up to 256 MiB,
#: but the server parses a document into a node of 32 bytes per element, in one array of at
#: most 1 GiB: an array of small numbers past about 32 MiB of text failed the write with
#: "invalid memory alloc request size". 16 MiB (less room for the event around it) is
#: below that for any document.
MAX_JSONB_VALUE: Final = 16 * 1024 * 1024 - 64 * 1024

#: The longest name (a schema's, a channel's) PostgreSQL keeps whole is one byte short of this.
NAMEDATALEN: Final = 64
#: Key of the advisory lock that serializes concurrent migrations.
MIGRATION_LOCK_KEY: Final = 0x77665F70657273  # "wf_pers"
_JSON_COLUMNS = frozenset({"event", "result", "error", "input"})
#: SQLSTATEs of the server refusing the user (insufficient_privilege, invalid
#: authorization, invalid password) or a write (read_only_sql_transaction: a standby, a
#: demoted primary).
_REFUSED = frozenset({"42501", "28000", "28P01", "25006"})
#: The server going away: shutting down (fast, immediate) or not yet accepting connections.
_GONE = frozenset({"57P01", "57P02", "57P03"})
#: A statement cancelled: query_canceled (statement_timeout, pg_cancel_backend) and
#: lock_not_available (lock_timeout, NOWAIT).
_CANCELLED = frozenset({"57014", "55P03"})
#: program_limit_exceeded (a value past 1 GB) and out_of_memory: a history too big to
#: gather into one value.
_TOO_BIG: Final = frozenset({"54000", "53200"})


class PostgreSQLBackend(RawPath):
    can_listen: ClassVar[bool] = True
    checks_newest: ClassVar[bool] = True
    names: ClassVar[tuple[str, ...]] = ("postgresql",)
    async_driver: ClassVar[str] = "psycopg"
    extra: ClassVar[str | None] = "postgresql"
    insert_ignoring: ClassVar[Any] = staticmethod(postgresql.insert)
    supports_schemas: ClassVar[bool] = True
    skip_locked: ClassVar[bool] = True
    idle_timeout: ClassVar[float | None] = 15.0
    setup_hint: ClassVar[str] = (
        "; a client_encoding of SQL_ASCII (a database's or role's setting) hands text "
        "over as bytes: use UTF8, e.g. ALTER DATABASE ... SET client_encoding = 'UTF8'"
    )

    def __init__(self, engine: Engine, *, owned: bool, schema: str | None = None) -> None:
        # Whether every connection of the pool is at READ COMMITTED by construction: an
        # engine of our own (made with that level, see configure_engine) sets it on each
        # new connection; its pool puts back a level chosen through SQLAlchemy, and
        # as_created (at each checkout, attribute reads only) one an application left on
        # a connection it borrowed raw. Then the view needs no per-checkout isolation
        # level, which costs a listener, a set and a reset at every connection taken. A
        # host's engine keeps the per-checkout level.
        with connect(engine) as conn:  # a failure to connect: DatabaseConnectError
            found = conn.exec_driver_sql(SETTINGS).one()
            default, self.date_style, client_encoding, server_encoding = found[:4]
            #: Where unqualified names resolve (None: the search path names no schema
            #: that exists) and the path itself, for saying so.
            self.current_schema, self.search_path = found[4], str(found[5])
            # A read-only default for transactions (a host's setting), or a standby.
            self._read_only = bool(found[6])
            #: A function, operator or type of PostgreSQL's own that a schema searched
            #: before ``pg_catalog`` has one of the same name of (None: nothing shadowed).
            self.shadowed: str | None = found[7]
            self.encodings = (str(client_encoding), str(server_encoding))
            level = conn.get_isolation_level()  # AUTOCOMMIT is a driver setting it omits
            raw: Any = conn.connection.dbapi_connection
            autocommit = conn.dialect.detect_autocommit_setting(raw)
        self._pool_level_ours = (
            owned
            and engine.dialect.driver == "psycopg"
            and level == "READ COMMITTED"
            and not autocommit
        )
        if self._pool_level_ours:
            event.listen(engine, "checkout", as_created())
        self._channel: str | None = None
        self._end_channel: str | None = None
        super().__init__(engine, owned=owned, schema=schema)
        self.max_value_bytes = MAX_JSONB_VALUE
        self._sql: dict[WriteShape, str] = {}
        # The one-statement write runs in autocommit, at the sessions' default isolation
        # (the host's connect options or the database's setting may raise it): above READ
        # COMMITTED its compare-and-set fails on any concurrent update of the run instead of
        # re-checking it, so it is used only where that default is READ COMMITTED.
        self.autocommit_writes = default == "read committed"
        #: Statements may go straight to psycopg (not through an asyncio engine's
        #: connections, which ``wp.AsyncClient`` uses: SQLAlchemy's execution there).
        self.raw_ok = not engine.dialect.is_async
        #: libpq itself for a statement on an idle connection (psycopg 3 only, imported
        #: here: the driver is an extra).
        self.wire: ModuleType | None = None
        if self.raw_ok and engine.dialect.driver == "psycopg":
            from . import pg_wire

            self.wire = pg_wire
        if engine.dialect.driver == "psycopg" and (owned or self.engine is not engine):
            # Our statements read JSON with json.loads whatever loaders the host set
            # (pg_json); the host's own statements keep theirs.
            event.listen(self.engine, "before_cursor_execute", pg_json.cursor_loads)
        self._rendered: dict[Any, tuple[str, dict[str, Any]]] = {}
        self._shapes: dict[Any, RowShape] = {}
        idle_ms = int((self.idle_timeout or 0) * 1000)
        self._idle_sql = f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
        #: Capabilities, known once the first listener connected (None: not known yet).
        self._listen_ok: bool | None = None
        self._presence_ok: bool | None = None

    @classmethod
    def async_engine_kwargs(cls, url: URL) -> dict[str, Any]:
        # psycopg's asyncio connections take libpq's options as the others do.
        return {} if set(url.query) & set(sockets.LIBPQ) else {"connect_args": {**sockets.LIBPQ}}

    @classmethod
    def configure_engine(cls, url: URL, kwargs: dict[str, Any]) -> tuple[URL, dict[str, Any]]:
        # wf_persist's level on every connection once, when it connects (see view_options).
        kwargs.setdefault("isolation_level", "READ COMMITTED")
        given = {**url.query, **kwargs.get("connect_args", {})}
        if url.get_driver_name() == "psycopg" and not set(given) & set(sockets.LIBPQ):
            # A dead server noticed in seconds, not hours (a URL's own choice is kept).
            kwargs["connect_args"] = {**sockets.LIBPQ, **kwargs.get("connect_args", {})}
        return url, kwargs

    def lock_wait_statements(self, seconds: float) -> list[str]:
        return [f"SET lock_timeout = {min(max(1, round(seconds * 1000)), 2**31 - 1)}"]

    def view_options(self) -> dict[str, Any]:
        options = super().view_options()
        if not self._pool_level_ours:
            options["isolation_level"] = "READ COMMITTED"
        return options

    def read_only(self) -> bool:
        return self._read_only

    def as_stored(self, doc: Any) -> Any:
        return as_jsonb(doc)

    def cut(self, raw: Any) -> None:
        sockets.shut(raw.pgconn.socket)

    @classmethod
    def refused(cls, exc: BaseException) -> bool:
        return sqlstate(exc) in _REFUSED

    @classmethod
    def cancelled(cls, exc: BaseException) -> bool:
        return sqlstate(exc) in _CANCELLED

    @classmethod
    def missing_schema(cls, exc: BaseException) -> bool:
        return sqlstate(exc) in ("42P01", "42703")  # undefined table, undefined column

    @classmethod
    def aborted(cls, exc: BaseException) -> bool:
        return sqlstate(exc) == "25P02"

    @classmethod
    def unreachable(cls, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", exc)
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if state is None and any(k.__name__ == "OperationalError" for k in type(orig).__mro__):
            # The driver's own: no connection made (no statement sent yet), or one that
            # SQLAlchemy found broken; not a statement the driver refused to send (too
            # many parameters, say), which would fail again whenever it is sent.
            sent = isinstance(exc, DBAPIError) and exc.statement is not None
            return not sent or super().unreachable(exc)
        return str(state).startswith("08") or state in _GONE or super().unreachable(exc)

    @classmethod
    def schema_problem(cls, schema: object) -> str | None:
        if not isinstance(schema, str) or not schema:
            return "a schema name is a non-empty string"
        if "\x00" in schema:
            return "PostgreSQL names cannot hold NUL"
        if len(schema.encode()) >= NAMEDATALEN:
            return "longer than 63 bytes: PostgreSQL would cut it"
        if schema.startswith("pg_"):  # as the server reserves it: "PG_x" is a name
            return "names starting with pg_ are PostgreSQL's own schemas"
        if "[" in schema or "]" in schema:  # SQLAlchemy's schema translation refuses them
            return "square brackets cannot be in a schema name wf_persist's statements use"
        return None

    def requirement_problem(self, version: tuple[int, ...] | None) -> str | None:
        if version is not None and version < (12,):
            return "PostgreSQL >= 12 is needed; found " + ".".join(str(p) for p in version)
        return None

    def check(self) -> None:
        super().check()
        # psycopg reads times sent as text only in the ISO style: any other would fail
        # reading what a statement returns, after the statement has committed.
        if not self.date_style.upper().startswith("ISO"):
            raise UnsupportedDatabaseError(
                f"this engine's connections use DateStyle '{self.date_style}', whose times "
                "psycopg cannot read; use ISO, e.g. create_engine(url, connect_args="
                "{'options': '-c DateStyle=ISO'})"
            )
        # Names, keys and JSON documents hold any Unicode text: a narrower encoding fails
        # on some values (a raw encoding error), or on reading back what was committed.
        client_encoding, server_encoding = self.encodings
        if server_encoding.upper() != "UTF8":
            raise UnsupportedDatabaseError(
                f"this database's encoding is '{server_encoding}', which cannot hold every "
                "Unicode text wf_persist stores; use a database created with ENCODING 'UTF8'"
            )
        if self.current_schema is None and not self.schema_map:
            # Every name of wf_persist's would resolve nowhere: "not migrated", wrongly.
            raise UnsupportedDatabaseError(
                f"this engine's connections have search_path '{self.search_path}', which "
                "names no schema that exists, so wf_persist's tables cannot be found; set "
                "one (connect_args={'options': '-c search_path=public'}) or pass schema="
            )
        if self.shadowed is not None:
            # Our statements call PostgreSQL's functions and operators unqualified: a
            # clock of the host's that does not move would leave every timer never due.
            raise UnsupportedDatabaseError(
                f"this engine's search_path ('{self.search_path}') finds {self.shadowed} "
                "before PostgreSQL's own, which wf_persist's statements use (its clock, "
                "comparisons, JSON functions); put pg_catalog first in search_path, or leave "
                "it out (PostgreSQL then searches it first)"
            )
        if client_encoding.upper() != "UTF8":
            raise UnsupportedDatabaseError(
                f"this engine's connections use client_encoding '{client_encoding}', which "
                "cannot carry every Unicode text wf_persist stores; use UTF8, e.g. "
                "create_engine(url, connect_args={'client_encoding': 'utf8'})"
            )

    # wake-ups and presence ----------------------------------------------------------

    def listener(self, presence: str | None, hear: frozenset[Hearing]) -> Listener:
        if self._listen_ok is False:
            return NOT_AVAILABLE
        try:
            found = PGListener(self, presence, hear)
        except Exception as exc:
            orig = getattr(exc, "orig", exc)
            if getattr(orig, "sqlstate", None) not in UNSUPPORTED:
                raise
            self._listen_ok = False
            log.warning("this database cannot LISTEN (%s): workers poll", orig)
            return NOT_AVAILABLE
        self._listen_ok = True
        return found

    def presence_ok(self, engine: Engine, raw: Any) -> bool:
        """Whether presence locks work here (probed once, on a listener's connection
        ``raw`` and its ``engine``, never the runs' pool)."""
        if self._presence_ok is None:
            self._presence_ok = advisory_locks_work(engine, raw)
            if not self._presence_ok:
                log.warning(
                    "advisory locks do not lock here: the runs of a worker that died are "
                    "taken over when their leases lapse"
                )
        return self._presence_ok

    def announce(self, conn: Connection, payload: str) -> None:
        if self._listen_ok is not False:
            conn.execute(
                select(func.pg_notify(P_CHANNEL, P_PAYLOAD)),
                {"p_channel": self.channel_of(payload), "p_payload": payload},
            )

    def reap(self, owner: str, grace: float) -> list[str]:
        if not self._presence_ok:
            return []
        mapped = self.schema_map.get(None) if self.schema_map else None
        quote = self.base_engine.dialect.identifier_preparer.quote_identifier
        # Quoted for psycopg's %(name)s parameters too (a % in the name doubled).
        table = ex.name if mapped is None else f"{quote(mapped)}.{ex.name}"
        return [
            str(r[0])
            for r in self._send_raw(REAP.format(table=table), {"me": owner, "grace": grace})
        ]

    def owner_mark(self) -> str:
        return PRESENT_MARK

    # runs and claims ---------------------------------------------------------------

    def channel(self) -> str:
        """The channel of this database's runs due (see :data:`~.wakeups.HEAR_DUE`): one
        per schema holding the tables, however it is named (``schema=``, or a host
        engine's translation)."""
        if self._channel is None:  # fixed once the engine is open; sent with every start
            self._channel = self._channel_named("wf_persist")
        return self._channel

    def end_channel(self) -> str:
        """The channel of this database's runs ended (see :data:`~.wakeups.HEAR_END`)."""
        if self._end_channel is None:
            self._end_channel = self._channel_named("wf_persist_end")
        return self._end_channel

    def channel_of(self, payload: str) -> str:
        return self.end_channel() if payload.startswith(END) else self.channel()

    def _channel_named(self, prefix: str) -> str:
        schema = self.schema
        if schema is None and self.schema_map:
            schema = self.schema_map.get(None)
        channel = prefix if schema is None else f"{prefix}.{schema}"
        if schema is not None and len(channel.encode()) >= NAMEDATALEN:
            # The server refuses longer names.
            channel = f"{prefix}.{hashlib.sha256(schema.encode()).hexdigest()[:32]}"
        return channel

    def insert_run(
        self,
        conn: Connection,
        row: Mapping[str, Any],
        started: NewEvent,
        *,
        lease: tuple[str, float] | None = None,
        newest: Cataloged | None = None,
    ) -> Claim | bool | Stale:
        """One statement (see :func:`start_statement`), atomic on its own: in a host's
        transaction through SQLAlchemy, else sent straight to psycopg in autocommit. A
        start with ``newest`` that inserted nothing asks the catalog why (rare: a key
        already taken, or a new version cataloged since the client read it)."""
        notify = lease is None and self._listen_ok is not False
        idempotent = row["idempotency_key"] is not None
        stmt = start_statement(idempotent, lease is not None, notify, newest is not None)
        params: dict[str, Any] = {f"r_{c}": row[c] for c in RUN_COLUMNS}
        params["p_at"] = started.created_at
        if notify:
            params["p_channel"] = self.channel()
            params["p_payload"] = DUE
        if lease is not None:
            params["p_owner"], params["p_ttl"] = lease
        if newest is not None:
            params["p_source_hash"], params["p_registered_at"] = newest
        asked = clocks.elapsed()
        if conn.in_transaction() or not self.raw_ok:
            params["p_event"] = started.event
            found = conn.execute(stmt, params, execution_options=self.statement_options).all()
        else:
            params["p_event"] = json_text(started.event)
            params["r_input"] = json_text(row["input"]) if row["input"] is not None else None
            found = self._raw(stmt, params, conn)
        if not found:
            if newest is not None and not self._still_newest(conn, row, newest):
                return STALE
            return False
        return True if lease is None else claims_of(found, asked)[0]._replace(started_here=True)

    def _still_newest(self, conn: Connection, row: Mapping[str, Any], read: Cataloged) -> bool:
        latest = conn.execute(
            select(wf.c.version, wf.c.source_hash, wf.c.registered_at)
            .where(wf.c.name == row["workflow_name"])
            .order_by(wf.c.version.desc())
            .limit(1),
            execution_options=self.statement_options,
        ).one_or_none()
        return latest is not None and tuple(latest) == (row["workflow_version"], *read)

    @contextlib.contextmanager
    def begin(self, conn: Connection | None = None, *, ours: bool = True) -> Iterator[Connection]:
        """A write transaction the server ends if its session idles in it longer than
        :attr:`idle_timeout` (ours never wait on anything but the database): a process
        paused mid-transaction (SIGSTOP) would otherwise hold its rows' locks, and stall
        every worker's claim of them, for as long as it stays paused. ``SET LOCAL``: the
        session's own setting (a host's engine) is left as it was. An application's own
        transaction (``ours=False``) may wait on what it likes."""
        with super().begin(conn) as inside:
            if ours:
                inside.exec_driver_sql(self._idle_sql)
            yield inside

    @contextlib.contextmanager
    def atomic(self) -> Iterator[Connection]:
        # A start's one statement runs in autocommit on the raw connection (insert_run).
        self.check_process()
        if not self.raw_ok:
            with self.base_engine.begin() as conn:
                yield conn
            return
        with self.base_engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self, conn: Connection | None = None) -> Iterator[Connection]:
        """At READ COMMITTED (wf_persist's level here) every statement reads its own
        snapshot, in a transaction or not: a read of our own needs no BEGIN/COMMIT."""
        if conn is not None:
            with conn.begin():
                yield conn
            return
        self.check_process()
        with self.engine.connect() as fresh:
            yield fresh.execution_options(isolation_level="AUTOCOMMIT")

    def renew_alone(
        self, conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
    ) -> set[str]:
        if not held or not self.raw_ok or owner is not None:  # renaming: rare, not hot
            return super().renew_alone(conn, held, ttl, owner)
        return self._renew_raw(conn, held, ttl, skip_locked=False)

    def renew_free(self, conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
        if not held or not self.raw_ok:
            return super().renew_free(conn, held, ttl)
        return self._renew_raw(conn, held, ttl, skip_locked=True)

    def _renew_raw(
        self, conn: Connection, held: Mapping[str, int], ttl: float, *, skip_locked: bool
    ) -> set[str]:
        """The renewal as one autocommitted statement through libpq."""
        params = {"p_ids": list(held), "p_epochs": list(held.values()), "p_ttl": ttl}
        return {str(row[0]) for row in self._raw(renew_statement(skip_locked), params, conn)}

    def claim_to_drive(
        self, execution_id: str, owner: str, ttl: float, workflows: Sequence[tuple[str, int]]
    ) -> Claim | None:
        """One round trip: the claim, ``workflow.started`` and the history read.

        A history too big to gather into one value (past PostgreSQL's 1 GB, or its memory)
        fails the whole statement at every try: then the run is claimed and its history
        read row by row."""
        params = {"p_id": execution_id, "p_owner": owner, "p_ttl": ttl}
        try:
            found = self._auto(claim_statement(tuple(workflows), False, False), params)
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) not in _TOO_BIG:
                raise
            log.debug("claiming with the run's history failed (%s); claiming alone", exc.orig)
            return super().claim_to_drive(execution_id, owner, ttl, workflows)
        return found[0] if found else None

    def claim_batch(
        self,
        owner: str,
        ttl: float,
        limit: int,
        workflows: Sequence[tuple[str, int]],
        exclude: Sequence[str],
    ) -> list[Claim]:
        """One round trip: the claims, their ``workflow.started`` and history reads.

        One run whose ``workflow.started`` the database refuses would fail the whole
        statement at every look: then the claims are made alone, and that run's own start
        fails its drive (counted, and in the end failed) without holding up the others.
        """
        stmt = claim_statement(tuple(workflows), True, bool(exclude))
        params: dict[str, Any] = {"p_owner": owner, "p_ttl": ttl, "p_limit": limit}
        if exclude:
            params["p_exclude"] = list(exclude)
        try:
            return self._auto(stmt, params)
        except DBAPIError as exc:
            if self.contention(exc):
                raise
            log.debug("claiming with the runs' start failed (%s); claiming alone", exc.orig)
        return super().claim_batch(owner, ttl, limit, workflows, exclude)

    @classmethod
    def migration_lock(cls, conn: Connection) -> None:
        # Wait for a concurrent upgrade, but not forever: fail closed, never go on unlocked.
        conn.execute(text("SET LOCAL lock_timeout = '300s'"))
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})

    @classmethod
    def offline_lock_sql(cls) -> str | None:
        return f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"

    # the hot path ------------------------------------------------------------------

    def _statement(self, shape: WriteShape) -> str:
        found = self._sql.get(shape)
        if found is None:
            schema_map = self.schema_map
            translate: dict[str, Any] = (
                {"schema_translate_map": schema_map, "render_schema_translate": True}
                if schema_map
                else {}
            )
            compiled = write_statement(shape).compile(dialect=self.base_engine.dialect, **translate)
            found = self._sql[shape] = str(compiled)
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
        """The one-statement write, straight to psycopg in autocommit with SQL rendered
        once by SQLAlchemy (psycopg prepares it server-side after a few runs); a ``note``
        is sent by the same statement."""
        if not events or conn.in_transaction() or not self.autocommit_writes:
            return super().write(
                conn, execution_id, epoch, events, now=now, values=values, guard=guard, note=note
            )
        n = len(events)
        shape = WriteShape(n, tuple(sorted(values or ())), guard, note is not None)
        sql = self._statement(shape)
        params: dict[str, Any] = {"p_eid": execution_id, "p_epoch": epoch, "p_now": now}
        if note is not None:
            params["p_channel"], params["p_note"] = self.channel_of(note), note
        for column, value in (values or {}).items():
            params[f"v_{column}"] = (
                json_text(value) if column in _JSON_COLUMNS and value is not None else value
            )
        for i, ev in enumerate(events):
            params[f"type{i}"] = ev.type
            params[f"act{i}"] = ev.activity_name
            params[f"dk{i}"] = ev.dedupe_key
            params[f"at{i}"] = ev.created_at
            params[f"ev{i}"] = json_text(ev.event)
        rows = self._send_raw(sql, params, conn)
        if len(rows) != n:
            raise LeaseLostError(execution_id)
        return Fenced(sorted(int(r[0]) for r in rows), str(rows[0][1]))
