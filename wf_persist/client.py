"""The client: start runs, wait for results, inspect status, list and read history."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from sqlalchemy import Connection, Row
from sqlalchemy.orm import Session

from .authoring import Workflow
from .errors import (
    InvalidArgumentError,
    InvalidCursorError,
    ResultTimeoutError,
    UnknownExecutionError,
    WorkflowFailedError,
)
from .models import STATUSES, TERMINAL_STATUSES
from .store import Executor, executions, history
from .store.history import NewEvent

if TYPE_CHECKING:
    from .runtime import Runtime

T = TypeVar("T")
_MAX_TEXT = 255


@dataclass(frozen=True)
class ExecutionHandle:
    """What ``start`` returns. Equal handles name the same run."""

    execution_id: str
    workflow_name: str
    version: int
    #: False when an idempotency key matched an existing run (nothing new was recorded).
    created: bool = field(default=True, compare=False)


@dataclass(frozen=True)
class ExecutionInfo:
    """A run as stored: identity, pinned version, status and timestamps."""

    execution_id: str
    workflow_name: str
    version: int
    status: str
    actor: str | None
    idempotency_key: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    updated_at: dt.datetime

    @classmethod
    def from_row(cls, row: Row[Any]) -> ExecutionInfo:
        return cls(
            execution_id=row.id,
            workflow_name=row.workflow_name,
            version=row.workflow_version,
            status=row.status,
            actor=row.actor,
            idempotency_key=row.idempotency_key,
            created_at=row.created_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            updated_at=row.updated_at,
        )


@dataclass(frozen=True)
class HistoryRecord:
    """One history event: its per-run sequence, when it was recorded, and the event."""

    sequence: int
    created_at: dt.datetime
    event: dict[str, Any]


@dataclass(frozen=True)
class Page:
    """One page of :meth:`WorkflowClient.list`; pass ``next_cursor`` to get the next."""

    items: list[ExecutionInfo]
    next_cursor: str | None


@dataclass(frozen=True)
class Completed(Generic[T]):
    """A run that returned ``value`` (validated into the workflow's output type)."""

    execution_id: str
    value: T
    status: Literal["completed"] = "completed"

    def unwrap(self) -> T:
        return self.value


@dataclass(frozen=True)
class Failed:
    """A run that failed. ``error`` is the stored error document (name, message, fields)."""

    execution_id: str
    error: dict[str, Any]
    status: Literal["failed"] = "failed"

    @property
    def error_type(self) -> str:
        return str(self.error.get("name"))

    @property
    def message(self) -> str:
        return str(self.error.get("message"))

    def unwrap(self) -> Any:
        raise WorkflowFailedError(self.execution_id, self.error)


Outcome = Completed[Any] | Failed


def _encode_cursor(created_at: dt.datetime, execution_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), execution_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, execution_id = json.loads(raw)
        when = dt.datetime.fromisoformat(created)
        if when.tzinfo is None or not isinstance(execution_id, str):
            raise ValueError(cursor)
        return when, execution_id
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidCursorError(cursor) from exc


def _check_text(what: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value or len(value) > _MAX_TEXT):
        raise InvalidArgumentError(
            f"{what} must be a non-empty string of at most {_MAX_TEXT} chars"
        )


class WorkflowClient:
    """Starts and observes runs. Get one from :meth:`Runtime.client`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self.runtime.engine.connect() as conn:
            conn = conn.execution_options(wf_persist_readonly=True)
            with conn.begin():
                yield conn

    def _row(self, conn: Executor, execution_id: str) -> Row[Any]:
        row = executions.get(conn, execution_id)
        if row is None:
            raise UnknownExecutionError(execution_id)
        return row

    def start(
        self,
        workflow: Workflow[Any, Any] | str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        actor: str | None = None,
        version: int | None = None,
        session: Session | Connection | None = None,
    ) -> ExecutionHandle:
        """Start a run (durably) and return its handle.

        The payload is validated against the workflow's input type first; an invalid payload
        raises :class:`InvalidPayloadError` and writes nothing. The same (workflow name,
        idempotency key) always returns the same handle and records nothing new.

        Args:
            workflow: a workflow definition or a registered name.
            version: the version to pin (default: the highest registered).
            session: a host session or connection to write in; the run then exists only if
                the host commits.
        """
        _check_text("idempotency_key", idempotency_key)
        _check_text("actor", actor)
        wf = self.runtime.resolve(workflow, version)
        stored = self.runtime.validate_input(wf, payload)
        now = self.runtime.clock()
        execution_id = str(uuid.uuid4())
        started = {
            "type": "execution.started",
            "executionId": execution_id,
            "workflowName": wf.name,
            "version": wf.version,
            "payload": stored,
            "actor": actor,
        }

        def write(conn: Executor) -> tuple[str, int, bool]:
            return executions.create(
                conn,
                execution_id=execution_id,
                workflow_name=wf.name,
                workflow_version=wf.version,
                payload=stored,
                idempotency_key=idempotency_key,
                actor=actor,
                started=NewEvent(started, now),
                now=now,
            )

        if session is not None:
            found = write(session)
        else:
            with self.runtime.engine.begin() as conn:
                found = write(conn)
        return ExecutionHandle(found[0], wf.name, found[1], created=found[2])

    def describe(self, execution_id: str) -> ExecutionInfo:
        """The stored record of a run."""
        with self._reading() as conn:
            return ExecutionInfo.from_row(self._row(conn, execution_id))

    def status(self, execution_id: str) -> str:
        """The run's status: running, suspended, compensating, completed or failed."""
        return self.describe(execution_id).status

    def _outcome(self, row: Row[Any]) -> Outcome:
        if row.status == "failed":
            return Failed(row.id, dict(row.error or {}))
        value = row.result
        definition = self.runtime._registry.get((row.workflow_name, row.workflow_version))
        if definition is not None:
            value = definition.output_adapter.validate_python(value)
        return Completed(row.id, value)

    def result(self, execution_id: str, timeout: float | None = None) -> Outcome:
        """Wait for the run to finish and return its outcome.

        An unfinished run is driven in this thread when no other runtime holds it; otherwise
        this waits (polling with backoff) for whoever does. Requires the run's pinned version
        to be registered here unless the run has already finished.

        Raises:
            UnknownExecutionError, MissingWorkflowVersionError, ResultTimeoutError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            with self._reading() as conn:
                row = self._row(conn, execution_id)
            if row.status in TERMINAL_STATUSES:
                return self._outcome(row)
            self.runtime.definition(row.workflow_name, row.workflow_version)
            if self.runtime.drive(execution_id):
                delay = 0.005
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeoutError(execution_id, float(timeout or 0))
            time.sleep(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 2, 0.25)

    def list(
        self,
        workflow: Workflow[Any, Any] | str,
        *,
        status: str | None = None,
        version: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page:
        """Runs of one workflow, oldest first, ``limit`` at a time (keyset pagination)."""
        name = workflow if isinstance(workflow, str) else workflow.name
        if status is not None and status not in STATUSES:
            raise InvalidArgumentError(f"unknown status {status!r}; expected one of {STATUSES}")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0
        ):
            raise InvalidArgumentError(f"limit must be a positive integer, got {limit!r}")
        after = None if cursor is None else _decode_cursor(cursor)
        with self._reading() as conn:
            rows = executions.list_page(
                conn,
                name,
                status=status,
                version=version,
                after=after,
                limit=None if limit is None else limit + 1,
            )
        items = [ExecutionInfo.from_row(r) for r in rows[: limit if limit is not None else None]]
        more = limit is not None and len(rows) > limit
        next_cursor = _encode_cursor(items[-1].created_at, items[-1].execution_id) if more else None
        return Page(items, next_cursor)

    def history(self, execution_id: str) -> Sequence[HistoryRecord]:
        """Every event of the run in sequence order."""
        with self._reading() as conn:
            rows = history.load(conn, execution_id)
            if not rows:
                self._row(conn, execution_id)
        return [HistoryRecord(int(r.sequence), r.created_at, dict(r.event)) for r in rows]
