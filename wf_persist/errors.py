"""Errors. One root, :class:`WfPersistError`; subclasses carry the data callers act on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout


class WfPersistError(Exception):
    """Root of every error wf_persist raises on purpose."""


class InvalidArgumentError(WfPersistError, ValueError):
    """An argument to a public API is out of range or malformed."""


class InvalidCursorError(InvalidArgumentError):
    """A pagination cursor was not produced by :meth:`WorkflowClient.list`."""

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor
        super().__init__(f"Malformed pagination cursor: {cursor!r}")


class InvalidPayloadError(WfPersistError, ValueError):
    """A payload failed validation against its declared type; nothing was written.

    Attributes:
        errors: pydantic's list of problems (``loc``, ``msg``, ``type``).
    """

    def __init__(self, what: str, errors: list[dict[str, Any]]) -> None:
        self.what = what
        self.errors = errors
        details = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or '<root>'}: {e.get('msg')}"
            for e in errors
        )
        super().__init__(f"Invalid {what}: {details}")


class NotSerializableError(WfPersistError, TypeError):
    """A value that must be recorded cannot be turned into JSON."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        super().__init__(f"{what} is not JSON-serializable: {detail}")


class UnknownExecutionError(WfPersistError, LookupError):
    """No execution has this id."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        super().__init__(f"Unknown workflow execution: {execution_id}")


class UnknownWorkflowError(WfPersistError, LookupError):
    """No workflow of this name is registered in this runtime (or, for a
    :class:`~wf_persist.Client`, in the database's catalog)."""

    def __init__(self, name: str, *, cataloged: bool = False) -> None:
        self.workflow_name = name
        where = "cataloged in this database" if cataloged else "registered in this runtime"
        super().__init__(f"Workflow {name} is not {where}")


class MissingWorkflowVersionError(WfPersistError):
    """The (name, version) asked for is not registered in this runtime (or, for a
    :class:`~wf_persist.Client`, not in the database's catalog)."""

    def __init__(self, name: str, version: int, *, cataloged: bool = False) -> None:
        self.workflow_name = name
        self.version = version
        if cataloged:
            message = (
                f"Workflow {name}@v{version} is not cataloged in this database; a runtime "
                "registers a version when it starts serving it"
            )
        else:
            message = (
                f"Workflow {name}@v{version} is not registered in this runtime; "
                "re-register that exact version before resuming this execution"
            )
        super().__init__(message)


class WorkflowVersionConflictError(WfPersistError):
    """(name, version) is already cataloged with a different source hash."""

    def __init__(self, name: str, version: int, cataloged_hash: str, new_hash: str) -> None:
        self.workflow_name = name
        self.version = version
        self.cataloged_hash = cataloged_hash
        self.new_hash = new_hash
        super().__init__(
            f"Workflow {name}@v{version} is already cataloged with different source; "
            "register a new version instead"
        )


class WorkflowDefinitionError(WfPersistError, TypeError):
    """A workflow or step definition is unusable (bad signature, no source, bad option)."""


class UnsupportedDatabaseError(WfPersistError):
    """The database, its version, its driver or the engine's configuration lacks something
    wf_persist needs; the message says what and how to fix it."""


class _DriverFailure(WfPersistError, OperationalError):
    """A failure the driver reported, typed: also SQLAlchemy's ``OperationalError``, as
    such failures were before, so code that retries on that keeps working.

    Attributes:
        orig: the driver's exception.
    """

    def __init__(
        self, message: str, orig: BaseException | None = None, invalidated: bool = False
    ) -> None:
        OperationalError.__init__(
            self, None, None, orig or Exception(message), connection_invalidated=invalidated
        )
        self.message = message
        self.args = (message,)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.orig, self.connection_invalidated))


class DatabaseUnavailableError(_DriverFailure):
    """The database could not be reached during a call: its connection was lost (a server
    restart or failover, a network cut) or a new one could not be made. A write the call
    made committed whole or not at all; only a loss during its commit leaves which one
    unknown (a start with an idempotency key can be repeated to find out). Also
    SQLAlchemy's ``OperationalError``; ``orig`` is the driver's exception.
    """


class StatementCancelledError(_DriverFailure):
    """The database cancelled a statement of the call: a statement or lock-wait timeout of
    the engine's settings ran out (PostgreSQL's ``statement_timeout`` or ``lock_timeout``,
    MySQL's ``max_execution_time``, MariaDB's ``max_statement_time``,
    ``innodb_lock_wait_timeout``, SQLite's busy timeout), an operator cancelled it, or (on
    PostgreSQL) an application's transaction at REPEATABLE READ or stricter met a
    concurrent change (a serialization failure: retry in a new transaction). A
    transaction of wf_persist's own that it was part of rolled back whole; in an
    application's transaction (``session=``) the application decides (PostgreSQL aborted
    it; MySQL, MariaDB and SQLite undid the statement only). A call made of several
    transactions (a cancel of a run with children, a purge in batches) keeps those that
    committed before it. Also SQLAlchemy's ``OperationalError``; ``orig`` is the driver's
    exception.
    """


class PoolExhaustedError(DatabaseUnavailableError, PoolTimeout):
    """No connection of the engine's pool was free within its ``pool_timeout``: the
    application holds them all, or more calls run at once than the pool holds. Nothing was
    written. Also SQLAlchemy's pool ``TimeoutError``; ``orig`` is that error."""


class DatabaseConnectError(DatabaseUnavailableError):
    """A connection to the database could not be made when a runtime or client opened it
    (a server down or unreachable, a database, role or password it does not know, a file
    that cannot be opened); nothing was written. Also SQLAlchemy's ``OperationalError``.
    """


class PoolTooSmallError(InvalidArgumentError):
    """A worker would need more connections at once than the engine's pool can give.

    Attributes:
        capacity: ``pool_size + max_overflow`` of the engine.
        needed: what the worker's concurrency needs.
    """

    def __init__(self, capacity: int, needed: int, concurrency: int) -> None:
        self.capacity = capacity
        self.needed = needed
        self.concurrency = concurrency
        super().__init__(
            f"a worker (concurrency {concurrency}) needs {needed} connections at once, but "
            f"the engine's pool gives at most {capacity} (pool_size + max_overflow): raise "
            "max_overflow or pool_size"
        )


class ValueTooLargeError(WfPersistError, ValueError):
    """A value is larger than the database can store in one write; nothing was written.

    Attributes:
        what: which value (``result of step charge``, ``input of workflow order``, ...).
        size: its size in bytes, as it would be sent.
        limit: the largest size this database takes.
    """

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} is {size} bytes as JSON; this database takes at most {limit} bytes per "
            "value (store large payloads elsewhere and record a reference)"
        )


class IdempotencyConflictError(WfPersistError):
    """A run with this idempotency key was created concurrently but is not visible to the
    calling transaction (a host transaction at REPEATABLE READ or stricter); retry it in a
    new transaction to get the existing run."""

    def __init__(self, workflow_name: str, idempotency_key: str) -> None:
        self.workflow_name = workflow_name
        self.idempotency_key = idempotency_key
        super().__init__(
            f"a run of {workflow_name} with idempotency key {idempotency_key!r} was started "
            "concurrently and is not visible to this transaction; retry in a new transaction"
        )


class DriveFailedError(WfPersistError):
    """The run failed because driving it failed the same way too many times in a row.

    Attributes:
        failures: how many consecutive drives stopped on an error.
        cause: the error document of the last of them.
    """

    def __init__(self, failures: int, cause: dict[str, Any]) -> None:
        self.failures = failures
        self.cause = cause
        super().__init__(
            f"driving this run failed {failures} times in a row; last error: "
            f"{cause.get('name')}: {cause.get('message')}"
        )


class SchemaVersionError(WfPersistError):
    """The database schema is not at the revision this wf_persist needs.

    Attributes:
        current: the revision found (``None`` when the schema was never migrated).
        head: the revision this version of wf_persist needs.
        command: the command that brings the database to head.
    """

    def __init__(self, current: str | None, head: str, command: str) -> None:
        self.current = current
        self.head = head
        self.command = command
        state = "is not migrated" if current is None else f"is at revision {current}"
        super().__init__(
            f"The wf_persist schema {state}; this version needs {head}. Run: {command}"
        )


class NonDeterminismError(WfPersistError):
    """A replay made a different call than the one recorded at the same position."""

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"Non-deterministic workflow replay: expected {expected} but saw {actual}")


class CancelledCallError(NonDeterminismError):
    """An ``async def`` body cancelled one of its durable calls, or ended while one was
    still under way: a wall-clock event that history does not hold, so a replay could make
    other calls. Every later durable call raises it and the run fails with it, unless the
    body ends by raising an error of its own (a ``TaskGroup`` whose task failed): the run
    fails with that one."""

    def __init__(self, call: str, how: str) -> None:
        self.call = call
        self.expected = f"{call} to run to its end"
        self.actual = f"the body {how}"
        WfPersistError.__init__(
            self,
            f"{call}: the workflow body {how} (asyncio.wait_for, asyncio.timeout, "
            "task.cancel, a TaskGroup, a task it never awaited); no replay can repeat a "
            "wall-clock cancel. Bound a step with timeout=, wait with ctx.sleep or a signal's "
            "timeout=, and await every durable call.",
        )


class StepExecutionError(WfPersistError):
    """A step failed (its exception is the ``cause``)."""

    def __init__(self, step_name: str, cause: dict[str, Any]) -> None:
        self.step_name = step_name
        self.cause = cause
        super().__init__(f"Step {step_name} failed: {cause.get('message', '')}")


class ChildWorkflowError(WfPersistError):
    """A child run (``ctx.start_child``) failed; ``error`` is its stored error document
    (a cancelled or timed-out child's too)."""

    def __init__(self, execution_id: str, workflow_name: str, error: dict[str, Any]) -> None:
        self.execution_id = execution_id
        self.workflow_name = workflow_name
        self.error = error
        super().__init__(
            f"Child workflow {workflow_name} ({execution_id}) failed: "
            f"{error.get('name')}: {error.get('message')}"
        )


class StepTimeoutError(WfPersistError, TimeoutError):
    """A step attempt ran longer than its ``timeout``: a transient failure, retried per the
    step's policy (declare it in ``errors=`` to make it terminal). The attempt's thread is
    not stopped; whatever it returns later is never recorded."""

    def __init__(self, step_name: str, timeout: float) -> None:
        self.step_name = step_name
        self.timeout = timeout
        super().__init__(f"Step {step_name} did not finish within its timeout of {timeout:g}s")


class CodeExecutionError(WfPersistError):
    """A ``ctx.code`` block raised (its exception is the ``cause``)."""

    def __init__(self, name: str, cause: dict[str, Any]) -> None:
        self.code_name = name
        self.cause = cause
        super().__init__(f"Code block {name} failed: {cause.get('message', '')}")


class Cancelled(BaseException):
    """The run was cancelled. Raised inside the workflow at its next durable call.

    A ``BaseException``: a workflow's ``except Exception`` must not swallow it. The run ends
    ``failed`` with this error (``compensate`` says whether the saga was unwound).
    """

    def __init__(self, compensate: bool = True, actor: str | None = None) -> None:
        self.compensate = compensate
        self.actor = actor
        super().__init__("Workflow execution cancelled")


class WorkflowTimeoutError(Cancelled):
    """The run's deadline (its workflow's or its start's ``timeout``) passed. Raised inside
    the workflow at its next durable call, like a cancellation with compensation: the saga
    unwinds and the run fails with this error, recorded in its history
    (``workflow.timed_out``)."""

    def __init__(self, workflow: str, deadline: str) -> None:
        super().__init__(compensate=True)
        self.workflow = workflow
        self.deadline = deadline
        self.args = (f"Workflow {workflow} timed out: its deadline {deadline} passed",)


class CannotCancelError(WfPersistError):
    """Only running or suspended runs can be cancelled (and compensating ones without
    compensation); nothing was recorded."""

    def __init__(self, execution_id: str, status: str, without_compensation: bool = False) -> None:
        self.execution_id = execution_id
        self.status = status
        hint = (
            " (cancel it with compensate=False to end it at once)" if without_compensation else ""
        )
        super().__init__(f"Cannot cancel {status} execution {execution_id}{hint}")


class WorkflowFailedError(WfPersistError):
    """Raised by :meth:`Failed.unwrap`; carries the stored error document."""

    def __init__(self, execution_id: str, error: dict[str, Any]) -> None:
        self.execution_id = execution_id
        self.error = error
        super().__init__(
            f"Execution {execution_id} failed: {error.get('name')}: {error.get('message')}"
        )


class ForkedRuntimeError(WfPersistError):
    """A runtime (or a client) was used in a process forked after it was made. Its pooled
    connections, its threads (lease keeper, listener, worker), the leases they hold and
    the name its claims carry belong to the parent: a child using them would share the
    parent's sockets, or free a sibling's live claim."""

    def __init__(self) -> None:
        super().__init__(
            "this Runtime or Client was made in another process (this one was forked after "
            "it): make it in each process, after the fork (say, in gunicorn's post_fork "
            "hook, or without --preload)"
        )


class ClosedError(WfPersistError):
    """A call on a runtime or client after its ``close()``: its connections are given
    back, and a call would open a pool that nobody closes."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} has been closed")


class ResultTimeoutError(WfPersistError, TimeoutError):
    """The run did not finish within the time the caller was willing to wait."""

    def __init__(self, execution_id: str, timeout: float) -> None:
        self.execution_id = execution_id
        self.timeout = timeout
        super().__init__(f"Execution {execution_id} did not finish within {timeout}s")


class SignalDeliveryError(WfPersistError):
    """A signal could not be delivered; nothing was recorded."""


class SignalNotWaitingError(SignalDeliveryError, LookupError):
    """The run has no pending wait for this signal name."""

    def __init__(self, execution_id: str, name: str, *, status: str | None = None) -> None:
        self.execution_id = execution_id
        self.signal_name = name
        #: The run's status when it cannot take signals at all (finished, compensating).
        self.status = status
        why = "" if status is None else f" (it is {status})"
        super().__init__(f"Execution {execution_id} is not waiting for signal {name}{why}")


class EventNotSetError(WfPersistError, LookupError):
    """``get_event``: the run never published the key (it ended, or the wait timed out)."""

    def __init__(self, execution_id: str, key: str, *, finished: bool) -> None:
        self.execution_id = execution_id
        self.key = key
        #: True when the run ended without setting it; False when the timeout passed.
        self.finished = finished
        why = "ended without setting it" if finished else "has not set it yet"
        super().__init__(f"Execution {execution_id} {why}: event {key}")


class SignalAlreadyDeliveredError(SignalDeliveryError):
    """Another delivery to the same wait won the race."""

    def __init__(self, execution_id: str, name: str) -> None:
        self.execution_id = execution_id
        self.signal_name = name
        super().__init__(f"Signal {name} has already been delivered to execution {execution_id}")


class SignalPayloadError(SignalDeliveryError, InvalidPayloadError):
    """The payload does not match the waiting call's type; the run keeps waiting."""

    def __init__(self, execution_id: str, name: str, errors: list[dict[str, Any]]) -> None:
        self.execution_id = execution_id
        self.signal_name = name
        InvalidPayloadError.__init__(self, f"signal {name} payload", errors)
        self.args = (f"Signal payload failed schema validation: {self},",)

    def __str__(self) -> str:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or '<root>'}: {e.get('msg')}"
            for e in self.errors
        )
        return f"Signal payload failed schema validation: {details}"


class StaleHistoryError(WfPersistError):
    """Events arrived from outside (a signal, a cancellation) since the driver read the
    history; it must re-read before parking or deciding a race."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        super().__init__(f"Execution {execution_id} has new events")


class LeaseLostError(WfPersistError):
    """This runtime no longer owns the run's lease; another worker drives it now."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        super().__init__(f"Lost the lease on execution {execution_id}")


class SchemaTooNewError(SchemaVersionError):
    """A newer wf_persist migrated this database: upgrade wf_persist, not the schema.

    ``current`` is a revision this wf_persist does not ship (or one after its head); running
    its migrations there could only fail or undo the newer ones.
    """

    def __init__(self, current: str, head: str) -> None:
        super().__init__(current, head, "pip install --upgrade wf-persist")
        self.args = (
            f"This database is at {current}, this wf_persist knows up to {head}: "
            f"upgrade wf_persist ({self.command})",
        )


class MergedSchemaVersionError(SchemaVersionError):
    """wf_persist's revisions live in the host's own Alembic chain (merged mode).

    Only the host's Alembic may move them: ``wf-persist db`` would start a second record in
    its own version table and fork the bookkeeping. ``command`` is the host's command.

    Attributes:
        version_table: the host's version table holding our revisions.
    """

    def __init__(self, current: str, head: str, command: str, version_table: str) -> None:
        super().__init__(current, head, command)
        self.version_table = version_table
        # At head (a downgrade refused): nothing this version needs is missing.
        needs = "" if current == head else f"; this version needs {head}"
        self.args = (
            f"The wf_persist schema is at revision {current}, recorded in your application's "
            f"{version_table} (merged mode){needs}. wf-persist db does not migrate a merged "
            f"database; run your application's Alembic: {command}",
        )


class SchemaNamesTakenError(SchemaVersionError):
    """Tables or views named as wf_persist's are in a database where no wf_persist revision
    is recorded: the application's own, or ours with their record lost. The first revision
    would fail on them (where DDL is not transactional, halfway), so nothing is run.

    Attributes:
        names: the names found.
    """

    def __init__(self, names: Sequence[str], head: str, command: str) -> None:
        super().__init__(None, head, command)
        self.names = tuple(names)
        self.args = (
            f"This database already has {', '.join(self.names)}, named as wf_persist's tables "
            "and views, but no wf_persist revision is recorded in it: rename or drop them, or "
            "give wf_persist a database (or PostgreSQL schema) of its own, then run: "
            f"{command}. If they are wf_persist's own tables whose version record was lost, "
            "restore that record instead of migrating again",
        )


class SchemaVersionConflictError(SchemaVersionError):
    """Both version tables record wf_persist revisions; which one is true is unknown.

    A database uses one mode; both records usually mean ``wf-persist db upgrade`` ran on a
    merged database. ``current`` is ``None``.

    Attributes:
        standalone: the revision in wf_persist's own version table.
        merged: the wf_ revision in the host's version table.
    """

    def __init__(self, standalone: str, merged: str, head: str, command: str) -> None:
        super().__init__(None, head, command)
        self.standalone = standalone
        self.merged = merged
        self.args = (
            f"wf_persist's revisions are recorded twice: {standalone} in its own version "
            f"table and {merged} in your application's (merged mode); keep one: {command}",
        )
