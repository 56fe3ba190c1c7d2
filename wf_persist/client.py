"""The client: start runs, wait for results, inspect status, list and read history."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from jsonschema import Draft202012Validator
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from sqlalchemy import Connection, Row
from sqlalchemy.orm import Session

from . import events, lifecycle
from .authoring import Workflow, adapter_for
from .errors import (
    Cancelled,
    InvalidArgumentError,
    InvalidCursorError,
    ResultTimeoutError,
    SignalPayloadError,
    UnknownExecutionError,
    WorkflowFailedError,
    error_document,
)
from .models import KEY_WIDTH, WORKFLOW_NAME_WIDTH
from .runtime import NOT_DRIVEN
from .store import Executor, executions, history, signals
from .values import non_finite, resolve_type_reference, unstorable

if TYPE_CHECKING:
    from .runtime import Runtime

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


def _encode_cursor(created_at: dt.datetime, execution_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), execution_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, execution_id = json.loads(raw)
        when = dt.datetime.fromisoformat(created)
        if when.tzinfo is None or not isinstance(execution_id, str) or unstorable(execution_id):
            raise ValueError(cursor)
        return when.astimezone(dt.UTC), execution_id
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, OverflowError) as exc:
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


def _validate_signal(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    """The payload's stored JSON form, validated by the wait's type or recorded schema."""
    if non_finite(payload):
        problem: str | None = "it contains NaN or an infinity, which JSON cannot hold"
    else:
        stored = _signal_document(execution_id, name, wait, payload)
        problem = unstorable(stored)
    if problem is not None:
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}])
    return stored


def _signal_document(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    tp = resolve_type_reference(wait.get("payloadType"))
    if tp is not None and isinstance(payload, tp):
        try:
            return adapter_for(tp).dump_python(payload, mode="json")
        except (PydanticSerializationError, UnicodeDecodeError) as exc:  # bytes not UTF-8
            raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": str(exc)}]) from exc
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": str(exc)}]) from exc
    if tp is not None:
        # Strict JSON validation: the payload must already have the declared shape ("yes" is
        # not a boolean), as the recorded JSON Schema would judge it.
        adapter = adapter_for(tp)
        try:
            return adapter.dump_python(adapter.validate_json(text, strict=True), mode="json")
        except ValidationError as exc:
            errors = [dict(e) for e in exc.errors(include_url=False)]
            raise SignalPayloadError(execution_id, name, errors) from exc
    doc = json.loads(text)
    schema = wait.get("payloadSchema")
    if schema:
        found = sorted(
            Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path)
        )
        if found:
            errors = [{"loc": tuple(e.absolute_path), "msg": e.message} for e in found]
            raise SignalPayloadError(execution_id, name, errors)
    return doc


def _utc(value: object, what: str) -> dt.datetime:
    """An aware datetime as UTC (the form it is stored and compared in)."""
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise InvalidArgumentError(f"{what} must be an aware datetime, got {value!r:.80}")
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidArgumentError(f"{what} is out of range in UTC: {value!r}") from None


def _check_text(what: str, value: str | None) -> None:
    if value is not None and (
        not isinstance(value, str) or not value or len(value) > KEY_WIDTH or unstorable(value)
    ):
        raise InvalidArgumentError(
            f"{what} must be a non-empty string of at most {KEY_WIDTH} characters without "
            f"NUL or invalid UTF-8, got {value!r:.80}"
        )


def _check_id(execution_id: object) -> str:
    if (
        not isinstance(execution_id, str)
        or not execution_id
        or len(execution_id) > 36
        or unstorable(execution_id)
    ):
        raise InvalidArgumentError(
            "an execution id is a string of 36 characters without NUL or invalid UTF-8, "
            f"got {execution_id!r:.80}"
        )
    return execution_id


def _workflow_name(workflow: object) -> str:
    if isinstance(workflow, Workflow):
        return workflow.name
    if (
        not isinstance(workflow, str)
        or not workflow
        or len(workflow) > WORKFLOW_NAME_WIDTH
        or unstorable(workflow)
    ):
        raise InvalidArgumentError(
            f"expected a workflow or its name (a non-empty string of at most "
            f"{WORKFLOW_NAME_WIDTH} characters without NUL or invalid UTF-8), got {workflow!r:.80}"
        )
    return workflow


class WorkflowClient:
    """Starts and observes runs. Get one from :meth:`Runtime.client`."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self.runtime.backend.read() as conn:
            yield conn

    def _row(self, conn: Executor, execution_id: str) -> Row[Any]:
        row = executions.get(conn, _check_id(execution_id))
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
        rt = self.runtime
        wf = rt.choose(workflow, version)
        stored = rt.validate_input(wf, payload)  # before anything is written, the catalog too
        if isinstance(workflow, Workflow):
            # In a host transaction, even cataloging a new workflow goes into that
            # transaction: a second write transaction of our own would wait on the host's lock.
            rt.ensure_registered(workflow, session=session)
        now = rt.clock()
        execution_id = str(uuid.uuid4())
        started = events.execution_started(execution_id, wf.name, wf.version, stored, actor, now)

        def write(conn: Executor) -> tuple[str, int, bool]:
            return executions.create(
                conn,
                rt.backend,
                execution_id=execution_id,
                workflow_name=wf.name,
                workflow_version=wf.version,
                payload=stored,
                idempotency_key=idempotency_key,
                actor=actor,
                started=started,
                now=now,
            )

        if session is not None:
            found = write(session)
        else:
            with rt.backend.begin() as conn:
                found = write(conn)
            rt._notify()
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

        A due run nobody holds is driven in this thread (embedded mode); otherwise this waits
        for its timer, a signal, or the runtime holding it, without spinning: it sleeps until
        the run's wake time or a change made by this runtime, re-reading at most every
        ``poll_interval``. Requires the run's pinned version to be registered here unless the
        run has already finished.

        Raises:
            UnknownExecutionError, MissingWorkflowVersionError, ResultTimeoutError.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout != timeout
        ):
            raise InvalidArgumentError(f"timeout must be a number of seconds, got {timeout!r:.80}")
        rt = self.runtime
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.002
        while True:
            with self._reading() as conn:
                row = self._row(conn, execution_id)
            if row.status in lifecycle.TERMINAL:
                return self._outcome(row)
            rt.definition(row.workflow_name, row.workflow_version)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeoutError(execution_id, float(timeout or 0))
            if row.due:
                drove = rt.drive_for_outcome(execution_id)
                if isinstance(drove, tuple):  # finished here: no need to read it back
                    ok, value = drove
                    if not ok:
                        return Failed(execution_id, dict(value or {}))
                    definition = rt.definition(row.workflow_name, row.workflow_version)
                    return Completed(execution_id, definition.output_adapter.validate_python(value))
                if drove is not NOT_DRIVEN:
                    delay = 0.002
                    continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeoutError(execution_id, float(timeout or 0))
            wait = min(delay, rt.poll_interval)
            rt.wait_for_change(wait if remaining is None else min(wait, remaining))
            delay = min(delay * 2, rt.poll_interval)

    def cancel(
        self, execution_id: str, *, compensate: bool = True, actor: str | None = None
    ) -> None:
        """Cancel a running or suspended run, from any process.

        With ``compensate`` (default) the run moves to ``compensating``, wakes at its
        suspension point (or at its next step boundary if it is running), unwinds its
        compensations and ends ``failed`` with a ``Cancelled`` error. Without, it ends
        ``failed`` at once (``Cancelled``, ``compensate: false``) and no further step of it
        starts. Records ``execution.cancelled`` in the same transaction as the status claim.

        Raises:
            CannotCancelError: the run is not running or suspended ("Cannot cancel completed
                execution ..."); of two concurrent cancels, the second.
            UnknownExecutionError.
        """
        _check_text("actor", actor)
        rt = self.runtime
        with self._reading() as conn:
            self._row(conn, execution_id)
        error = error_document(Cancelled(compensate, actor))
        now = rt.clock()
        with rt.backend.begin() as conn:
            executions.cancel(
                conn,
                rt.backend,
                execution_id,
                cancelled=events.execution_cancelled(execution_id, compensate, actor, now),
                compensate=compensate,
                error=error,
                now=now,
            )
        rt._notify()

    def pending_signals(self, execution_id: str) -> list[PendingSignal]:
        """The waits the run is parked on (or about to be), oldest first."""
        with self._reading() as conn:
            waits = signals.pending(conn, _check_id(execution_id))
            if not waits:
                self._row(conn, execution_id)
        return [PendingSignal.from_event(w) for w in waits]

    def signal(
        self, execution_id: str, name: str, payload: Any, *, actor: str | None = None
    ) -> None:
        """Deliver a signal to the run's latest pending wait on ``name``.

        The payload is validated against the waiting call's type before anything is
        persisted: with the type itself when this process has it, else with the JSON Schema
        the wait recorded (so a process that never ran the workflow validates too). A bad
        payload raises :class:`SignalPayloadError` and the run keeps waiting.

        Raises:
            SignalNotWaitingError: no pending wait on ``name`` (nothing is recorded).
            SignalPayloadError: the payload does not fit; nothing is recorded.
            SignalAlreadyDeliveredError: a concurrent delivery to the same wait won.
        """
        _check_text("actor", actor)
        _check_text("signal name", name)
        rt = self.runtime
        with self._reading() as conn:
            self._row(conn, execution_id)

        def validate(wait: Mapping[str, Any]) -> Any:
            stored = _validate_signal(execution_id, name, wait, payload)
            rt.backend.check_size(f"payload of signal {name}", stored)
            return stored

        with rt.backend.begin() as conn:
            signals.deliver(conn, rt.backend, execution_id, name, validate, actor, rt.clock())
        rt._notify()

    def list(
        self,
        workflow: Workflow[Any, Any] | str,
        *,
        status: str | None = None,
        version: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
        actor: str | None = None,
    ) -> Page:
        """Runs of one workflow, oldest first, ``limit`` at a time (keyset pagination).

        Filters: ``status``, ``version``, creation time in ``[created_after,
        created_before)`` (timezone-aware) and ``actor``.
        """
        if created_after is not None:
            created_after = _utc(created_after, "created_after")
        if created_before is not None:
            created_before = _utc(created_before, "created_before")
        name = _workflow_name(workflow)
        _check_text("actor", actor)
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, int) or version < 1
        ):
            raise InvalidArgumentError(f"version must be a positive integer, got {version!r}")
        if status is not None and status not in lifecycle.STATUSES:
            raise InvalidArgumentError(
                f"unknown status {status!r}; expected one of {lifecycle.STATUSES}"
            )
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0
        ):
            raise InvalidArgumentError(f"limit must be a positive integer, got {limit!r}")
        after = None if cursor is None else _decode_cursor(cursor)
        with self._reading() as conn:
            rows = executions.list_page(
                conn,
                self.runtime.backend,
                name,
                status=status,
                version=version,
                after=after,
                limit=None if limit is None else limit + 1,
                created_after=created_after,
                created_before=created_before,
                actor=actor,
            )
        items = [ExecutionInfo.from_row(r) for r in rows[: limit if limit is not None else None]]
        more = limit is not None and len(rows) > limit
        next_cursor = _encode_cursor(items[-1].created_at, items[-1].execution_id) if more else None
        return Page(items, next_cursor)

    def purge(
        self,
        *,
        older_than: dt.timedelta | dt.datetime,
        statuses: Sequence[str] = ("completed", "failed"),
        batch_size: int = 1000,
    ) -> int:
        """Delete finished runs (and their history) that finished before a cutoff.

        Works in batches of ``batch_size`` runs, one short transaction each, so it never
        holds locks for long. Running, suspended and compensating runs are never touched.

        Args:
            older_than: an age (``timedelta``) or an aware cutoff time.
            statuses: which finished runs to delete (``completed``, ``failed``).

        Returns:
            How many runs were deleted.
        """
        if isinstance(older_than, dt.timedelta):
            try:
                cutoff = self.runtime.clock() - older_than
            except OverflowError:
                raise InvalidArgumentError(f"older_than is out of range: {older_than!r}") from None
        elif isinstance(older_than, dt.datetime):
            cutoff = _utc(older_than, "older_than")
        else:
            raise InvalidArgumentError("older_than must be a timedelta or an aware datetime")
        if (
            not isinstance(statuses, Sequence)
            or isinstance(statuses, str | bytes)
            or not statuses
            or any(not isinstance(s, str) or s not in lifecycle.TERMINAL for s in statuses)
        ):
            raise InvalidArgumentError(
                f"purge deletes finished runs only (completed, failed); got {statuses!r:.80}"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        total = 0
        while True:
            with self.runtime.backend.begin() as conn:
                deleted = executions.purge_batch(
                    conn, finished_before=cutoff, statuses=statuses, limit=batch_size
                )
            total += deleted
            if deleted < batch_size:
                return total

    def history(self, execution_id: str) -> Sequence[HistoryRecord]:
        """Every event of the run in sequence order."""
        with self._reading() as conn:
            rows = history.load(conn, _check_id(execution_id))
            if not rows:
                self._row(conn, execution_id)
        return [HistoryRecord(int(r.sequence), r.created_at, dict(r.event)) for r in rows]
