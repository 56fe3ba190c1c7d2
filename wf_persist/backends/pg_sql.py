"""PostgreSQL's statements of a start, a claim and a step, each ONE statement (one round
trip, atomic on its own, so it can run in autocommit), built with SQLAlchemy once per shape.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    String,
    all_,
    bindparam,
    case,
    exists,
    func,
    insert,
    literal_column,
    null,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql

from ..models import UTC_DATETIME, JSONDoc
from ..models import executions_table as ex
from ..models import history_table as hist
from ..models import workflows_table as wf
from .clock import db_later, db_now
from .sql import (
    CLAIM_COLUMNS,
    HOT_COLUMNS,
    P_ID,
    P_TTL,
    Claim,
    WriteShape,
    bump,
    claim_values,
    claims_read,
    due,
    pinned,
    renew_values,
)

P_LIMIT = bindparam("p_limit", type_=Integer())
#: Runs this process drives (an array: the statement text does not depend on how many).
P_EXCLUDE = bindparam("p_exclude", type_=postgresql.ARRAY(String()))


#: Leases to renew: run ids and the epochs they are held at, as two parallel arrays.
P_IDS = bindparam("p_ids", type_=postgresql.ARRAY(String()))
P_EPOCHS = bindparam("p_epochs", type_=postgresql.ARRAY(BigInteger()))


@functools.cache
def renew_statement(skip_locked: bool = False) -> Any:
    """Extend the leases still held at their epochs, in ONE statement (its text does not
    depend on how many); with ``skip_locked``, only those whose rows no other transaction
    holds locked (see ``Backend.renew_free``)."""
    held = select(func.unnest(P_IDS).label("id"), func.unnest(P_EPOCHS).label("epoch")).subquery()
    still = (
        ex.c.id == held.c.id,
        ex.c.claim_epoch == held.c.epoch,
        ex.c.lease_expires_at.is_not(None),
    )
    stmt = update(ex).where(*still)
    if skip_locked:
        free = ex.alias("wf_free")
        # FOR NO KEY UPDATE, the UPDATE's own lock: a history row's foreign-key check in
        # an open transaction (KEY SHARE) holds up neither.
        lockable = (
            select(free.c.id)
            .where(free.c.id == held.c.id)
            .with_for_update(skip_locked=True, key_share=True)
        )
        stmt = stmt.where(ex.c.id.in_(lockable))
    return stmt.values(renew_values()).returning(ex.c.id)


def _text(value: str) -> Any:
    return literal_column(f"'{value}'", String())


@functools.lru_cache(maxsize=64)
def claim_statement(
    workflows: tuple[tuple[str, int], ...] | None, batch: bool, exclude: bool
) -> Any:
    """Claims that also make their runs ready to drive, in ONE statement: the
    compare-and-set (one run, or a batch locked with ``SKIP LOCKED``), ``workflow.started``
    for runs never driven, and each run's history as ``(sequence, event)`` pairs.

    ``workflow.started`` takes the next sequence only where ``started_at`` was NULL: the
    INSERT aims at sequence ``next_seq - 1`` (after the claim's bump) and does nothing on a
    conflict there, which is exactly the case of a run already started (that sequence is
    its last event's). The history is read in the statement's snapshot, which may predate a
    write the claim waited for: :func:`_claims` checks that every sequence is there.
    """
    values = {
        **claim_values(),
        "next_seq": ex.c.next_seq + case((ex.c.started_at.is_(None), 1), else_=0),
    }
    stmt = update(ex)
    if batch:
        candidates = select(ex.c.id).where(due())
        if workflows is not None:
            candidates = candidates.where(pinned(workflows))
        if exclude:
            candidates = candidates.where(ex.c.id != all_(P_EXCLUDE))
        chosen = (
            candidates.order_by(ex.c.wake_at)
            .limit(P_LIMIT)
            .with_for_update(skip_locked=True)
            .cte("wf_claimable")
            .prefix_with("MATERIALIZED")
        )
        stmt = stmt.where(ex.c.id == chosen.c.id, due())
    else:
        stmt = stmt.where(ex.c.id == P_ID, due())
        if workflows is not None:
            stmt = stmt.where(pinned(workflows))
    claimed = stmt.values(values).returning(*CLAIM_COLUMNS).cte("wf_claimed")
    c = claimed.c
    event = _started_event(c)
    started = (
        postgresql.insert(hist)
        .from_select(
            list(HOT_COLUMNS),
            select(
                c.id,
                c.next_seq - 1,
                _text("workflow.started"),
                null(),
                _text("workflow.started"),
                db_now(),
                event,
            ),
        )
        .on_conflict_do_nothing(index_elements=[hist.c.execution_id, hist.c.sequence])
        .returning(hist.c.execution_id)
        .cte("wf_started")
    )
    began = exists().where(started.c.execution_id == c.id)
    h = hist.alias("h")
    pairs = func.json_agg(
        postgresql.aggregate_order_by(func.json_build_array(h.c.sequence, h.c.event), h.c.sequence)
    )
    read = select(pairs).where(h.c.execution_id == c.id).scalar_subquery()
    before = c.next_seq - case((began, 1), else_=0)  # the run's next_seq before the claim
    return select(
        *(c[col.name] for col in CLAIM_COLUMNS),
        db_now(),
        began.label("began"),
        case((before > 2, read), else_=None).label("history"),
    ).add_cte(started)


#: The columns of a new run a start binds (the rest are SQL or defaults).
RUN_COLUMNS = (
    "id",
    "workflow_name",
    "workflow_version",
    "status",
    "input",
    "idempotency_key",
    "actor",
    "created_at",
    "updated_at",
    "deadline_at",
    "parent_id",
)
P_CHANNEL = bindparam("p_channel", type_=String())
P_PAYLOAD = bindparam("p_payload", type_=String())


def _started_event(c: Any) -> Any:
    """``workflow.started`` as :func:`wf_persist.events.workflow_started` writes it."""
    return func.jsonb_build_object(
        _text("type"),
        _text("workflow.started"),
        _text("executionId"),
        c.id,
        _text("workflowName"),
        c.workflow_name,
        _text("version"),
        c.workflow_version,
    )


@functools.lru_cache(maxsize=32)
def start_statement(idempotent: bool, leased: bool, notify: bool, newest: bool = False) -> Any:
    """A start in ONE statement: the run, its ``execution.started`` and, for a run its
    starter drives (``leased``), the claim and ``workflow.started``; ``notify`` tells
    listening workers a run is due. An idempotency key already taken inserts nothing and
    returns no row; so does, with ``newest``, a version that is no longer the newest
    cataloged of its workflow, or no longer the entry read (``p_source_hash`` and
    ``p_registered_at``: the tables were made again, the version cataloged anew)."""
    values: dict[str, Any] = {c: bindparam(f"r_{c}", type_=ex.c[c].type) for c in RUN_COLUMNS}
    if leased:
        values.update(
            claim_epoch=literal_column("1"),
            lease_owner=bindparam("p_owner", type_=String()),
            lease_expires_at=db_later(P_TTL),
            wake_at=db_later(P_TTL),
            started_at=db_now(),
            next_seq=literal_column("3"),
        )
    else:
        values.update(wake_at=db_now(), next_seq=literal_column("2"))
    created = postgresql.insert(ex)
    if newest:
        name, version = values["workflow_name"], values["workflow_version"]
        newer = exists().where(wf.c.name == name, wf.c.version > version)
        same = exists().where(
            wf.c.name == name,
            wf.c.version == version,
            wf.c.source_hash == bindparam("p_source_hash", type_=String()),
            wf.c.registered_at == bindparam("p_registered_at", type_=UTC_DATETIME),
        )
        names = list(values)
        created = created.from_select(
            names, select(*(values[n].label(n) for n in names)).where(same, ~newer)
        )
    else:
        created = created.values(values)
    if idempotent:
        created = created.on_conflict_do_nothing(
            index_elements=[ex.c.workflow_name, ex.c.idempotency_key]
        )
    run = created.returning(*CLAIM_COLUMNS).cte("wf_created")
    c = run.c
    source: Any = select(
        c.id,
        literal_column("1"),
        _text("execution.started"),
        null(),
        null(),
        bindparam("p_at", type_=UTC_DATETIME),
        bindparam("p_event", type_=JSONDoc),
    )
    if leased:
        source = union_all(
            source,
            select(
                c.id,
                literal_column("2"),
                _text("workflow.started"),
                null(),
                _text("workflow.started"),
                db_now(),
                _started_event(c),
            ),
        )
    begun = (
        insert(hist)
        .from_select(list(HOT_COLUMNS), source)
        .returning(hist.c.sequence)
        .cte("wf_begun")
    )
    columns: list[Any] = [
        # A run not claimed here needs no input back: it would be decoded by the loaders
        # of a host's connection where the start runs in the host's transaction.
        *(c[col.name] if leased or col is not ex.c.input else null() for col in CLAIM_COLUMNS),
        db_now(),
        literal_column("true").label("began"),
        null().label("history"),
    ]
    if notify:
        columns.append(func.pg_notify(P_CHANNEL, P_PAYLOAD))
    return select(*columns).add_cte(begun)


def claims_of(rows: Sequence[Any], asked_at: float) -> list[Claim]:
    claims = []
    n = len(CLAIM_COLUMNS) + 1  # and the database's time
    read = claims_read((row[:n] for row in rows), asked_at)
    for row, claim in zip(rows, read, strict=True):
        began, found = row[n], row[n + 1]
        claim = claim._replace(db_now=claim.db_now.astimezone(dt.UTC))
        pairs = () if found is None else tuple((int(q), e) for q, e in found)
        # Complete: sequences 1 .. next_seq - 1, less the workflow.started just recorded
        # (invisible to the statement) and the execution.started of a run never driven
        # (not read).
        expected = claim.next_seq - 1 - (1 if began else 0) - (1 if found is None else 0)
        complete = len(pairs) == expected and all(q == i + 1 for i, (q, _) in enumerate(pairs))
        claims.append(claim._replace(history=pairs) if complete else claim)
    return claims


def write_statement(shape: WriteShape) -> Any:
    """A driver's write as ONE statement: ``WITH bump AS (UPDATE ... WHERE id = $1 AND
    claim_epoch = $2 RETURNING next_seq, status) INSERT INTO wf_history SELECT ... FROM
    bump`` (and the notification, if the shape has one)."""
    top = bump(shape).returning(ex.c.next_seq.label("top"), ex.c.status).cte("bump")
    selects = [
        select(
            bindparam("p_eid", type_=String(36)),
            (top.c.top - literal_column(str(shape.n - i))).label("sequence"),
            bindparam(f"type{i}", type_=String(64)),
            bindparam(f"act{i}", type_=String(255)),
            bindparam(f"dk{i}", type_=String(255)),
            bindparam(f"at{i}", type_=UTC_DATETIME),
            bindparam(f"ev{i}", type_=JSONDoc),
        ).select_from(top)
        for i in range(shape.n)
    ]
    source = selects[0] if shape.n == 1 else union_all(*selects)
    returned: list[Any] = [hist.c.sequence, select(top.c.status).scalar_subquery()]
    if shape.note:  # one per returned row: identical notifications are sent once
        returned.append(func.pg_notify(P_CHANNEL, bindparam("p_note", type_=String())))
    return insert(hist).from_select(list(HOT_COLUMNS), source).add_cte(top).returning(*returned)
