"""What the clients return: run handles and records, outcomes, pages, pending signals and
catalog entries. Plain frozen dataclasses, the same for the embedded and the thin client."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from sqlalchemy import Row

from .errors import InvalidCursorError, WorkflowFailedError
from .values import unstorable

T = TypeVar("T")


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
    #: The stored input, result and error documents (``None`` until there is one).
    input: Any = field(default=None, repr=False)
    result: Any = field(default=None, repr=False)
    error: dict[str, Any] | None = field(default=None, repr=False)
    #: When the run next needs a worker (its timer, a retry, its lease's expiry), and who
    #: drives it now, if anyone.
    wake_at: dt.datetime | None = None
    lease_owner: str | None = None
    lease_expires_at: dt.datetime | None = None
    #: Consecutive drives that stopped on an error (see ``max_drive_failures``).
    drive_failures: int = 0
    #: When the run times out, if its start gave a timeout or its workflow has one.
    deadline_at: dt.datetime | None = None
    #: The run that started this one as its child (``ctx.start_child``), if any.
    parent_id: str | None = None

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
            input=row.input,
            result=row.result,
            error=row.error,
            wake_at=row.wake_at,
            lease_owner=row.lease_owner,
            lease_expires_at=row.lease_expires_at,
            drive_failures=int(row.drive_failures),
            deadline_at=row.deadline_at,
            parent_id=row.parent_id,
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

    @property
    def compensation_errors(self) -> list[dict[str, Any]]:
        """Errors of compensations that failed during the unwind (the run's error stays the
        original failure)."""
        return list(self.error.get("compensationErrors") or [])

    def matches(self, error_type: type[BaseException]) -> bool:
        """Whether the run failed with ``error_type`` (by class name and module)."""
        return (
            self.error.get("name") == error_type.__name__
            and self.error.get("module", error_type.__module__) == error_type.__module__
        )

    def unwrap(self) -> Any:
        raise WorkflowFailedError(self.execution_id, self.error)


Outcome = Completed[Any] | Failed


def encode_cursor(created_at: dt.datetime, execution_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), execution_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, execution_id = json.loads(raw)
        when = dt.datetime.fromisoformat(created)
        if when.tzinfo is None or not isinstance(execution_id, str) or unstorable(execution_id):
            raise ValueError(cursor)
        return when.astimezone(dt.UTC), execution_id
    # RecursionError: a forged cursor nesting JSON too deep to parse
    except (
        binascii.Error,
        ValueError,
        TypeError,
        UnicodeDecodeError,
        OverflowError,
        RecursionError,
    ) as exc:
        raise InvalidCursorError(cursor) from exc


@dataclass(frozen=True)
class PendingSignal:
    """A wait the run is parked on: what to send and what shape it must have."""

    name: str
    invocation: int
    activity_name: str
    timeout: float | None
    payload_schema: dict[str, Any] | None

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> PendingSignal:
        return cls(
            name=str(event["name"]),
            invocation=int(event["invocation"]),
            activity_name=str(event["activityName"]),
            timeout=event.get("timeout"),
            payload_schema=event.get("payloadSchema"),
        )


@dataclass(frozen=True)
class WorkflowEntry:
    """One cataloged workflow version: what any process may start by name."""

    name: str
    version: int
    source_hash: str
    registered_at: dt.datetime
    #: JSON Schema of the input (``None`` when the type has none or it predates schemas).
    input_schema: dict[str, Any] | None
    #: JSON Schema of the output, as stored in a completed run's result.
    output_schema: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> WorkflowEntry:
        return cls(
            name=row.name,
            version=int(row.version),
            source_hash=row.source_hash,
            registered_at=row.registered_at,
            input_schema=row.input_schema,
            output_schema=row.output_schema,
        )
