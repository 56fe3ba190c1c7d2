"""What the web view shows, read through a thin client (it never runs workflow code).

Every page and every API response is built here from the client's reads and the SQL view
``wf_execution_waits``: the HTML and the JSON show the same data. A run's step attempts are
paired from the history it reads anyway, as ``wf_step_attempts`` pairs them (that view
pairs them in a join quadratic in the run's history: minutes for a run of 10,000 steps).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, MetaData, Table, select
from sqlalchemy.exc import DBAPIError

from .. import refusals
from ..cli.output import plain
from ..client import Client
from ..errors import InvalidArgumentError
from ..records import ExecutionInfo, HistoryRecord

#: A page of runs at most (and by default).
MAX_LIMIT = 200
DEFAULT_LIMIT = 50

# A Table, not a bare table(): the client's schema translation (a named schema, or one a
# host's engine carries) renders only Tables in their schema.
_WAITS = Table(
    "wf_execution_waits",
    MetaData(),
    *(Column(c) for c in ("execution_id", "waiting_kind", "waiting_for", "wake_at")),
)


@dataclass(frozen=True)
class RunFilter:
    """The runs list's filters, as the query string gives them."""

    workflow: str | None = None
    status: str | None = None
    version: int | None = None
    actor: str | None = None
    created_after: dt.datetime | None = None
    created_before: dt.datetime | None = None
    limit: int = DEFAULT_LIMIT
    cursor: str | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> RunFilter:
        """From a query string; a malformed value raises :class:`InvalidArgumentError`."""

        def text(key: str) -> str | None:
            value = query.get(key, "").strip()
            return value or None

        def number(key: str) -> int | None:
            value = text(key)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise InvalidArgumentError(f"{key} must be an integer, got {value!r}") from None

        def moment(key: str) -> dt.datetime | None:
            value = text(key)
            if value is None:
                return None
            try:
                found = dt.datetime.fromisoformat(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"{key} must be an ISO-8601 time, got {value!r}"
                ) from None
            found = found if found.tzinfo is not None else found.replace(tzinfo=dt.UTC)
            try:  # named as the query string names it, not as the client's argument
                return found.astimezone(dt.UTC)
            except OverflowError:
                raise InvalidArgumentError(f"{key} is out of range: {value!r:.60}") from None

        limit = number("limit")
        limit = DEFAULT_LIMIT if limit is None else limit
        if not 0 < limit <= MAX_LIMIT:
            raise InvalidArgumentError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
        return cls(
            workflow=text("workflow"),
            status=text("status"),
            version=number("version"),
            actor=text("actor"),
            created_after=moment("after"),
            created_before=moment("before"),
            limit=limit,
            cursor=text("cursor"),
        )

    def query(self, cursor: str) -> dict[str, str]:
        """The query string of the page after this one (``cursor``): every filter kept."""
        moments = {"after": self.created_after, "before": self.created_before}
        return {
            "workflow": self.workflow or "",
            "status": self.status or "",
            "version": "" if self.version is None else str(self.version),
            "actor": self.actor or "",
            **{key: "" if at is None else at.isoformat() for key, at in moments.items()},
            "limit": str(self.limit),
            "cursor": cursor,
        }


def run_row(info: ExecutionInfo) -> dict[str, Any]:
    """One run as the list shows it."""
    return {
        "id": info.execution_id,
        "workflow": info.workflow_name,
        "version": info.version,
        "status": info.status,
        "actor": info.actor,
        "createdAt": plain(info.created_at),
        "startedAt": plain(info.started_at),
        "finishedAt": plain(info.finished_at),
        "wakeAt": plain(info.wake_at),
        "parentId": info.parent_id,
    }


def runs(client: Client, where: RunFilter) -> dict[str, Any]:
    page = client.list(
        where.workflow,
        status=where.status,
        version=where.version,
        limit=where.limit,
        cursor=where.cursor,
        created_after=where.created_after,
        created_before=where.created_before,
        actor=where.actor,
    )
    return {"runs": [run_row(i) for i in page.items], "nextCursor": page.next_cursor}


def workflows(client: Client) -> list[dict[str, Any]]:
    return [
        {
            "name": w.name,
            "version": w.version,
            "sourceHash": w.source_hash,
            "registeredAt": plain(w.registered_at),
            "inputSchema": w.input_schema,
            "outputSchema": w.output_schema,
        }
        for w in client.workflows()
    ]


def events(client: Client, execution_id: str) -> dict[str, Any]:
    """The seed's ``/api/runs/<id>/events``: the run and its history."""
    info = client.describe(execution_id)
    return {"run": run_row(info), "events": [_event(r) for r in client.history(execution_id)]}


def _event(record: HistoryRecord) -> dict[str, Any]:
    return {"sequence": record.sequence, "at": plain(record.created_at), **record.event}


def run(client: Client, execution_id: str) -> dict[str, Any]:
    """A run's page: the run, its input and outcome, what it waits for, its timeline."""
    info = client.describe(execution_id)
    history = client.history(execution_id)
    pending = [
        {
            "name": p.name,
            "activityName": p.activity_name,
            "timeout": p.timeout,
            "schema": p.payload_schema,
        }
        for p in client.pending_signals(execution_id)
    ]
    return {
        "run": {
            **run_row(info),
            "input": info.input,
            "result": info.result,
            "error": info.error,
            "deadlineAt": plain(info.deadline_at),
            "leaseOwner": info.lease_owner,
            "driveFailures": info.drive_failures,
        },
        "pendingSignals": pending,
        "wait": _wait(client, execution_id),
        "timeline": timeline(client, execution_id, history, info.status),
    }


def _wait(client: Client, execution_id: str) -> dict[str, Any] | None:
    try:
        with client.backend.read() as conn:
            row = (
                conn.execute(
                    select(_WAITS.c.waiting_kind, _WAITS.c.waiting_for, _WAITS.c.wake_at)
                    .select_from(_WAITS)
                    .where(_WAITS.c.execution_id == execution_id),
                )
                .mappings()
                .first()
            )
    except DBAPIError as exc:  # a user granted the tables but not the view, say
        refusals.translate(client.backend, exc)
        raise
    if row is None or row["waiting_kind"] is None:
        return None
    wake = row["wake_at"]
    return {
        "kind": row["waiting_kind"],
        "for": row["waiting_for"],
        "wakeAt": None if wake is None else _aware(wake).isoformat(),
    }


def _attempts(history: list[HistoryRecord] | Any, status: str | None) -> list[dict[str, Any]]:
    """The run's step attempts as ``wf_step_attempts`` has them, paired in one pass: each
    ``step.started`` with the ``step.completed``/``step.failed`` of its attempt after it."""
    started: list[tuple[HistoryRecord, str, Any]] = []
    ends: dict[tuple[str, Any], list[HistoryRecord]] = {}
    later_start: dict[str, int] = {}
    for record in history:
        kind, activity = record.event.get("type"), record.event.get("activityName")
        if not isinstance(activity, str):
            continue
        attempt = record.event.get("attempt")
        if kind == "step.started":
            started.append((record, activity, attempt))
            later_start[activity] = record.sequence
        elif kind in ("step.completed", "step.failed"):
            ends.setdefault((activity, attempt), []).append(record)
    found = []
    for s, activity, attempt in started:
        f = next((r for r in ends.get((activity, attempt), ()) if r.sequence > s.sequence), None)
        if f is not None:
            outcome = "completed" if f.event["type"] == "step.completed" else "failed"
        elif status in ("completed", "failed") or later_start[activity] > s.sequence:
            outcome = "abandoned"
        else:
            outcome = "running"
        found.append(
            {
                "activity_name": activity,
                "attempt": attempt,
                "started_at": s.created_at,
                "finished_at": None if f is None else f.created_at,
                "outcome": outcome,
                "duration_ms": None
                if f is None
                else (_aware(f.created_at) - _aware(s.created_at)).total_seconds() * 1000,
            }
        )
    return found


def timeline(
    client: Client,
    execution_id: str,
    history: list[HistoryRecord] | Any,
    status: str | None = None,
) -> list[dict[str, Any]]:
    """The run's story in order: step attempts (as ``wf_step_attempts`` has them: retries, and
    attempts a crashed or paused driver left, taken over by the next), sleeps, signal
    waits, children, compensations, cancellations, failed drives, the outcome."""
    rows: list[tuple[Any, int, dict[str, Any]]] = []
    if status is None:
        status = client.describe(execution_id).status
    attempts = _attempts(history, status)
    latest: dict[str, int] = {}
    for a in attempts:
        latest[a["activity_name"]] = max(latest.get(a["activity_name"], 0), int(a["attempt"]))
    for a in attempts:
        outcome = str(a["outcome"])
        if outcome == "running" and int(a["attempt"]) < latest[a["activity_name"]]:
            outcome = "abandoned"  # its driver died or was paused; another took over
        rows.append(
            (
                a["started_at"],
                0,
                {
                    "at": _aware(a["started_at"]).isoformat(),
                    "kind": "step",
                    "label": f"{a['activity_name']} attempt {a['attempt']}",
                    "outcome": outcome,
                    "durationMs": None if a["duration_ms"] is None else float(a["duration_ms"]),
                    "detail": "",
                },
            )
        )
    for record in history:
        entry = _story(record.event)
        if entry is not None:
            at = _aware(record.created_at)
            rows.append((at, record.sequence, {"at": at.isoformat(), **entry}))
    rows.sort(key=lambda r: (_aware(r[0]), r[1]))
    return [r[2] for r in rows]


def _aware(moment: Any) -> dt.datetime:
    if isinstance(moment, str):
        moment = dt.datetime.fromisoformat(moment)
    assert isinstance(moment, dt.datetime)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


_PLAIN: dict[str, tuple[str, str]] = {
    "workflow.started": ("drive", "first driven"),
    "sleep.started": ("sleep", "sleeps"),
    "sleep.completed": ("sleep", "woke"),
    "signal.waiting": ("wait", "waits for signal"),
    "signal.received": ("wait", "received signal"),
    "signal.timeout": ("wait", "signal wait timed out"),
    "signal.delivered": ("signal", "signal delivered"),
    "signal.buffered": ("signal", "signal buffered"),
    "signal.rejected": ("signal", "signal rejected"),
    "child.started": ("child", "started child"),
    "child.finished": ("child", "child finished"),
    "compensation.started": ("compensation", "compensating"),
    "compensation.completed": ("compensation", "compensated"),
    "compensation.failed": ("compensation", "compensation failed"),
    "execution.cancelled": ("cancel", "cancelled"),
    "workflow.timed_out": ("cancel", "timed out"),
    "drive.failed": ("drive", "drive failed"),
    "workflow.completed": ("outcome", "completed"),
    "workflow.failed": ("outcome", "failed"),
    "code.completed": ("code", "code recorded"),
    "all.started": ("all", "parallel steps"),
}


def _story(event: Mapping[str, Any]) -> dict[str, Any] | None:
    kind_label = _PLAIN.get(str(event.get("type")))
    if kind_label is None:
        return None
    kind, label = kind_label
    what = event.get("activityName") or event.get("childExecutionId") or ""
    detail = ""
    if event["type"] == "sleep.started":
        detail = f"until {event.get('wakeAt', '')}"
    elif event["type"] in ("drive.failed", "workflow.failed"):
        detail = str((event.get("error") or {}).get("message", ""))
    elif event["type"] == "child.started":
        what = f"{event.get('workflowName', '')} {event.get('childExecutionId', '')}"
    return {
        "kind": kind,
        "label": f"{label} {what}".strip(),
        "outcome": None,
        "durationMs": None,
        "detail": detail,
    }
