"""The wf_persist schema: workflow catalog, executions and append-only history.

Every table is prefixed ``wf_`` and registered on one private :data:`metadata` with a naming
convention, so constraint names are deterministic on every backend and a host application's
Alembic autogenerate can recognise (and ignore) our tables.

Time policy: all timestamps are timezone-aware UTC in Python (:class:`UTCDateTime` refuses
naive values). The database never supplies "now": every timestamp is bound from the runtime's
clock, so behaviour is the same on every backend and tests can control time.

JSON columns are JSONB on PostgreSQL and native JSON on MySQL/MariaDB. The columns people
filter on (event type, activity name, status) are plain columns, so common SQL needs no JSON
operators.

This module is the model of the schema; the schema itself is made only by the Alembic
revisions shipped with the package (see :mod:`wf_persist.migrate`).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

from .json_text import json_text
from .lifecycle import ACTIVE, STATUSES

NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s__%(column_0_N_name)s",
    "uq": "uq_%(table_name)s__%(column_0_N_name)s",
    "ck": "ck_%(table_name)s__%(constraint_name)s",
    "fk": "fk_%(table_name)s__%(column_0_N_name)s__%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Widths of the name and key columns. Names are checked against them where they are
#: declared (a definition, an argument), never left for the database to reject or truncate.
WORKFLOW_NAME_WIDTH: Final = 200
KEY_WIDTH: Final = 255
#: The longest name a step, sleep, signal or code block may have: its activity name
#: (``<name>#<n>``) and dedupe keys (``signal.delivered:<activity>``) must fit KEY_WIDTH.
CALL_NAME_WIDTH: Final = 200


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC timestamps in Python, whatever the database keeps.

    Naive values are refused (a naive time is a bug waiting for a timezone). PostgreSQL keeps
    the offset (``timestamptz``); where the column type has no offset (SQLite text, MySQL
    ``DATETIME(6)``) values are stored as naive UTC and read back marked UTC. Microseconds
    are kept: keyset pagination orders by them.
    """

    impl = (
        DateTime(timezone=True)
        .with_variant(DateTime(), "sqlite")
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
    )
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("wf_persist stores timezone-aware datetimes only")
        value = value.astimezone(dt.UTC)
        # In the dialect's copy of this type, impl_instance is the dialect's own column type.
        return (
            value if getattr(self.impl_instance, "timezone", False) else value.replace(tzinfo=None)
        )

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        assert isinstance(value, dt.datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


#: The timestamp type of every wf_ column and of every bound time.
UTC_DATETIME: Final = UTCDateTime()


class ExactJSONB(TypeDecorator[Any]):
    """JSONB whose documents psycopg sends as :func:`~wf_persist.json_text.json_text` writes
    them, whatever serializer the engine was given: a float of magnitude 1e16 or more
    written as ``1e+16`` (``json.dumps``' way) comes back from JSONB as an integer."""

    impl = postgresql.JSONB
    cache_ok = True
    render_bind_cast = True  # ``%(x)s::JSONB``, as JSONB's own binds under psycopg

    def bind_processor(self, dialect: Dialect) -> Any:
        if dialect.driver != "psycopg":
            return self.impl_instance.dialect_impl(dialect).bind_processor(dialect)
        from psycopg.types.json import Jsonb

        def process(value: Any) -> Any:
            return None if value is None else Jsonb(value, json_text)

        return process


def sqlite_json(value: Any) -> str | bytes:
    """A JSON column's value on SQLite, whose JSON columns have NUMERIC affinity: a text
    that is a number is converted, a whole one (``1.0``, ``1e16``'s digits and ``.0``,
    ``-0.0``) to an INTEGER, read back an int, and any other to a REAL by SQLite's own
    parsing, not exact at the far exponents (``-3.131546820234317e-307`` came back
    ``-3.1315468202343167e-307``). A float, the whole document, is bound as a BLOB of its
    text, which no affinity converts (read back as that text)."""
    text = json_text(value)
    return text.encode() if isinstance(value, float) else text


class OwnJSON(TypeDecorator[Any]):
    """JSON written by :func:`~wf_persist.json_text.json_text` and read by ``json.loads``,
    whatever ``json_serializer``/``json_deserializer`` a host gave its engine: one that
    sorts keys or reads numbers as ``Decimal`` would hand a replay another value than the
    run saw when it recorded it."""

    impl = JSON
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Any:
        write = sqlite_json if dialect.name == "sqlite" else json_text

        def process(value: Any) -> Any:
            return None if value is None else write(value)

        return process

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        def process(value: Any) -> Any:
            if isinstance(value, bytes | bytearray):
                value = value.decode("utf-8")
            # Not text: SQL NULL, or a number SQLite's NUMERIC affinity kept as one.
            return json.loads(value) if isinstance(value, str) else value

        return process


#: JSON that is JSONB on PostgreSQL; SQL NULL stands for "absent".
JSONDoc = OwnJSON(none_as_null=True).with_variant(ExactJSONB(none_as_null=True), "postgresql")


#: MySQL/MariaDB table options. Ids keep the database's default collation, so a host's
#: ``VARCHAR(36)`` column can reference ``wf_executions.id`` as it is.
MYSQL_TABLE_OPTIONS: Final[dict[str, str]] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


#: The NO PAD binary collation of names and keys on MySQL/MariaDB. ``utf8mb4_bin`` pads:
#: there ``'k' = 'k '`` holds (in lookups and unique keys), where SQLite and PostgreSQL keep
#: them apart. MySQL's is from 8.0.17, MariaDB's from 10.2.
MYSQL_KEY_COLLATION: Final = "utf8mb4_0900_bin"
MARIADB_KEY_COLLATION: Final = "utf8mb4_nopad_bin"


def key_collation(dialect: Dialect) -> str:
    """The key collation of a MySQL-family dialect. MariaDB reached through a ``mysql://``
    URL is still dialect ``mysql``: only ``is_mariadb`` (set on connect) tells them apart."""
    return MARIADB_KEY_COLLATION if getattr(dialect, "is_mariadb", False) else MYSQL_KEY_COLLATION


class KeyString(TypeDecorator[str]):
    """A name or key column: compared byte for byte everywhere ("Key" != "key", "k" !=
    "k "), which on MySQL/MariaDB takes a NO PAD binary collation, named per server."""

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            collation = key_collation(dialect)
            return dialect.type_descriptor(mysql.VARCHAR(self.length, collation=collation))
        return dialect.type_descriptor(String(self.length))


def key_string(length: int) -> KeyString:
    """A name or key column (see :class:`KeyString`)."""
    return KeyString(length)


class Base(DeclarativeBase):
    """Declarative base for wf_persist's own tables only (never a host's)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dt.datetime: UTC_DATETIME,
        dict[str, Any]: JSONDoc,
    }


metadata: Final = Base.metadata


class WorkflowVersion(Base):
    """The version catalog: first registration of (name, version) wins, forever.

    ``input_schema``/``output_schema`` are the JSON Schemas of the version's input and
    output, so a process without the workflow's code can validate a start and show what a
    run returns. NULL where none could be made (a type with no JSON Schema) or for versions
    cataloged before the columns existed, until the version is registered again.
    """

    __tablename__ = "wf_workflows"

    name: Mapped[str] = mapped_column(key_string(WORKFLOW_NAME_WIDTH), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_hash: Mapped[str] = mapped_column(String(64))
    registered_at: Mapped[dt.datetime]
    input_schema: Mapped[dict[str, Any] | None]
    output_schema: Mapped[dict[str, Any] | None]

    __table_args__ = (
        CheckConstraint("version >= 1", name="version_positive"),
        MYSQL_TABLE_OPTIONS,
    )


#: Unfinished runs, as SQL: the predicate of the partial claim index. The claim's own WHERE
#: spells the statuses the same way (sorted, inline), so every planner sees it implies this.
UNFINISHED: Final = text("status IN (" + ", ".join(f"'{s}'" for s in sorted(ACTIVE)) + ")")
#: Leased unfinished runs: the predicate of PostgreSQL's partial lease-owner index.
LEASED: Final = text(f"lease_owner IS NOT NULL AND {UNFINISHED.text}")
#: The key of an index's ``info`` naming the one dialect it exists on (migrations create it
#: there only; :func:`wf_persist.migrate.include_object_on` leaves it out of comparisons
#: elsewhere).
ONLY_ON: Final = "wf_persist.only_on"


class Execution(Base):
    """One run of a workflow, pinned to the catalog entry it started with.

    ``status`` is authoritative and changes in the same transaction as the history event that
    causes it. ``next_seq`` is the next history sequence number; it is bumped under the row
    lock, so concurrent appenders never collide.

    ``claim_epoch`` is the fencing token: every claim bumps it in the same compare-and-set that
    checks the run is due, and every write of a driver is conditional on the epoch it claimed,
    so a paused or partitioned driver can record nothing once anyone claimed after it.
    ``lease_owner``/``lease_expires_at`` say which runtime drives the run (for people; the
    epoch is what fences); ``wake_at`` is when the run next needs a driver (its timer, or its
    lease expiry while leased; NULL while it waits for a signal). Lease and wake times are the
    database's clock. ``drive_failures`` counts consecutive drives that stopped on an error.
    """

    __tablename__ = "wf_executions"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    workflow_name: Mapped[str] = mapped_column(key_string(WORKFLOW_NAME_WIDTH))
    workflow_version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    input: Mapped[dict[str, Any] | None]
    result: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    idempotency_key: Mapped[str | None] = mapped_column(key_string(KEY_WIDTH))
    actor: Mapped[str | None] = mapped_column(key_string(KEY_WIDTH))
    next_seq: Mapped[int] = mapped_column(BigInteger)
    wake_at: Mapped[dt.datetime | None]
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[dt.datetime | None]
    claim_epoch: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    drive_failures: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[dt.datetime]
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    updated_at: Mapped[dt.datetime]
    #: When the run times out (``@workflow(timeout=...)``, ``start(timeout=...)``).
    deadline_at: Mapped[dt.datetime | None]
    #: The run that started this one as its child (``ctx.start_child``).
    parent_id: Mapped[str | None] = mapped_column(String(36), index=True)

    __table_args__ = (
        ForeignKeyConstraint(
            ["workflow_name", "workflow_version"],
            ["wf_workflows.name", "wf_workflows.version"],
        ),
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
            name="status",
        ),
        # NULL keys never conflict on any backend, so a plain unique constraint is the
        # idempotency index everywhere (MySQL has no partial indexes).
        UniqueConstraint("workflow_name", "idempotency_key"),
        # Keyset listing: by workflow, optionally by version or status, oldest first.
        Index(None, "workflow_name", "created_at", "id"),
        Index(None, "workflow_name", "workflow_version", "created_at", "id"),
        Index(None, "workflow_name", "status", "created_at", "id"),
        # Keyset listing across workflows (operators, the CLI): every run, oldest first.
        Index(None, "created_at", "id"),
        # Finding runnable work: unfinished runs by wake time. Partial where the backend has
        # them (finished runs cost no entry and no claim ever reads past one); on MySQL and
        # MariaDB the leading ``status`` makes the claim's ``status IN (...) AND wake_at <=
        # now`` three ranges of unfinished runs' entries, as the partial index would.
        Index(None, "status", "wake_at", postgresql_where=UNFINISHED, sqlite_where=UNFINISHED),
        # Lease owners of unfinished runs, on PostgreSQL only: its reaper walks the distinct
        # owners (one index probe each, see ``pg_presence.REAP``) ten times a second per
        # worker, where reading every leased run made each look grow with the runs in
        # flight. No other backend reaps (no presence locks): the index would only cost
        # their claims and finishes an entry.
        Index(None, "lease_owner", postgresql_where=LEASED, info={ONLY_ON: "postgresql"}).ddl_if(
            dialect="postgresql"
        ),
        MYSQL_TABLE_OPTIONS,
    )


#: The predicate of the partial dedupe index (ON CONFLICT must repeat it to match the index).
DEDUPE_KEY_SET: Final = text("dedupe_key IS NOT NULL")
#: The predicate of the partial ``(type, created_at)`` index (PostgreSQL, SQLite): every event
#: but the two each step attempt writes (most of a history), which no query looks up by type.
NOT_STEP_EVENT: Final = text("type NOT IN ('step.completed', 'step.started')")


class HistoryEvent(Base):
    """Append-only history. ``event`` holds the whole event as JSON (SPEC section 2).

    ``dedupe_key`` is set for events that replay may emit again; the unique constraint plus an
    insert that ignores conflicts drops the duplicate without a read-before-write.
    """

    __tablename__ = "wf_history"

    execution_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    sequence: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    type: Mapped[str] = mapped_column(key_string(64))
    activity_name: Mapped[str | None] = mapped_column(key_string(KEY_WIDTH))
    dedupe_key: Mapped[str | None] = mapped_column(key_string(KEY_WIDTH))
    created_at: Mapped[dt.datetime]
    event: Mapped[dict[str, Any]]

    __table_args__ = (
        ForeignKeyConstraint(["execution_id"], ["wf_executions.id"], ondelete="CASCADE"),
        # Partial where the backend has them: step events (no key) cost no entry here.
        Index(
            "uq_wf_history__execution_id_dedupe_key",
            "execution_id",
            "dedupe_key",
            unique=True,
            postgresql_where=DEDUPE_KEY_SET,
            sqlite_where=DEDUPE_KEY_SET,
        ),
        # By type, for SQL over the history (signals, compensations, published events),
        # without step events: their entries cost a step's write about 12 % of its server
        # time on PostgreSQL (whose planner proves a query for any other type implies the
        # predicate) and 13 % of its commit on SQLite (whose planner needs the query to
        # repeat it). MySQL has no partial indexes and keeps every event.
        Index(
            None,
            "type",
            "created_at",
            postgresql_where=NOT_STEP_EVENT,
            sqlite_where=NOT_STEP_EVENT,
        ),
        MYSQL_TABLE_OPTIONS,
    )


class ConcurrencySlot(Base):
    """A held slot of a step's ``Limit``: slot number ``slot`` (0 to the limit - 1) of the
    (step, key) whose SHA-256 is ``slot_key``.

    A slot is a row, not a session lock, so it outlives what a session does not: a
    database restart, a failover, a killed session. It is held while ``expires_at`` (the
    database's clock) is ahead: the process holding it (``owner``, a runtime's lease owner)
    pushes it on every quarter of its lease TTL, and deletes the row when the step ends.
    A slot whose holder died or froze lapses with its lease; the next taker overwrites it.
    ``holder`` names one holding (a process may hold several slots of one key).
    """

    __tablename__ = "wf_slots"

    slot_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    holder: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str] = mapped_column(String(255))
    #: The run whose step holds it, and the step (for people: what holds a limit now).
    execution_id: Mapped[str] = mapped_column(String(36))
    step_name: Mapped[str] = mapped_column(String(KEY_WIDTH))
    taken_at: Mapped[dt.datetime]
    expires_at: Mapped[dt.datetime]

    __table_args__ = (
        CheckConstraint("slot >= 0", name="slot_non_negative"),
        # Renewals and releases name their holdings.
        Index(None, "holder", unique=True),
        MYSQL_TABLE_OPTIONS,
    )


workflows_table: Final = cast(Table, WorkflowVersion.__table__)
executions_table: Final = cast(Table, Execution.__table__)
history_table: Final = cast(Table, HistoryEvent.__table__)
slots_table: Final = cast(Table, ConcurrencySlot.__table__)


@dataclass(frozen=True)
class UniqueKey:
    """A unique key an insert may conflict on (and the only conflict it may ignore)."""

    name: str
    columns: tuple[str, ...]
    #: The predicate of a partial unique index (ON CONFLICT must repeat it).
    where: Any = None
    primary: bool = False


CATALOG_KEY: Final = UniqueKey("pk_wf_workflows", ("name", "version"), primary=True)
IDEMPOTENCY_KEY: Final = UniqueKey(
    "uq_wf_executions__workflow_name_idempotency_key", ("workflow_name", "idempotency_key")
)
SLOT_KEY: Final = UniqueKey("pk_wf_slots", ("slot_key", "slot"), primary=True)
DEDUPE_KEY: Final = UniqueKey(
    "uq_wf_history__execution_id_dedupe_key", ("execution_id", "dedupe_key"), DEDUPE_KEY_SET
)
