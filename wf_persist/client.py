"""The thin client: :class:`Client` operates runs from any process without the workflows'
code and never executes a step (the embedded one, which may drive runs, is
:class:`~wf_persist.embedded.WorkflowClient`).
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, Row
from sqlalchemy.engine import URL

from . import arguments, clocks, events, refusals, telemetry
from .authoring import Workflow
from .awaiting import RunAwaiter
from .backends import Backend, Cataloged, Stale
from .controls import RunControls
from .database import Database
from .errors import (
    ClosedError,
    IdempotencyConflictError,
    InvalidPayloadError,
    MissingWorkflowVersionError,
    UnknownWorkflowError,
)
from .records import (
    Completed,
    ExecutionHandle,
    ExecutionInfo,
    Failed,
    HistoryRecord,
    Outcome,
    Page,
    PendingSignal,
    WorkflowEntry,
)
from .runtime import Clock, utc_now
from .store import Executor, catalog, executions
from .timeouts import duration_seconds, positive
from .values import cataloged_document
from .wakeups import Ends, Wakeups

__all__ = [
    "Client",
    "Completed",
    "ExecutionHandle",
    "ExecutionInfo",
    "Failed",
    "HistoryRecord",
    "Outcome",
    "Page",
    "PendingSignal",
    "WorkflowEntry",
]


#: How many times a start in its own transaction tries again after the run holding its
#: idempotency key was not to be seen (see :class:`IdempotencyConflictError`).
UNSEEN_TRIES = 3


class Client(RunAwaiter, RunControls):
    """Starts, signals, cancels, awaits and inspects runs; never runs workflow code.

    Needs only the database: start a workflow by its cataloged name (the input is validated
    against the JSON Schema its version recorded), and wait for results that workers
    elsewhere produce. Nothing here imports or executes a step.

    Args:
        bind: a database URL or an existing ``Engine`` (see :class:`~wf_persist.Runtime`).
        schema: a PostgreSQL schema holding the wf_ tables.
        auto_migrate: as for a runtime (default: only an embedded SQLite file it creates).
        poll_interval: the longest pause between two looks at a run :meth:`result` waits
            for (it starts at 2 ms and doubles).
        clock: the source of the times this client records (``created_at`` of a run).
    """

    def __init__(
        self,
        bind: str | URL | Engine | None = None,
        *,
        schema: str | None = None,
        auto_migrate: bool | None = None,
        poll_interval: float = 0.25,
        clock: Clock = utc_now,
    ) -> None:
        poll_seconds = positive(poll_interval, "poll_interval")
        telemetry.configure()
        self._database: Database | None = Database(
            bind, auto_migrate=auto_migrate, schema=schema, writes=False
        )
        self._read_only = self._database.read_only
        self.backend: Backend = self._database.backend
        #: The engine this client works through.
        self.engine = self._database.engine
        self._clock = clock
        self._poll_interval = poll_seconds
        self._ended = threading.Condition()
        self._wakeups: Wakeups | None = None
        self._ends = Ends()
        #: The newest cataloged version of each workflow started by name, as last read.
        self._newest: dict[str, Row[Any]] = {}

    # hooks the embedded client overrides ------------------------------------------------

    def _now(self) -> dt.datetime:
        return self._clock()

    def _check_open(self) -> None:
        if self._database is None:
            raise ClosedError("Client")

    def _notify(self) -> None:
        """A run changed (embedded: wake this process's worker and waiters)."""

    def _prepare_start(
        self,
        workflow: Workflow[Any, Any] | str,
        version: int | None,
        payload: Any,
        session: Executor | None,
    ) -> tuple[str, int, Any, Cataloged | None]:
        """The (name, version) to start and the payload's stored form, from the catalog;
        and, if the entry came from this client's memory, the entry as read: the start must
        check it is still the newest version, that very entry."""
        name = arguments.workflow_name(workflow)
        version = arguments.check_version(version)
        what = f"input of workflow {name}"
        # The newest version read before, where the start itself checks it still is (a
        # cataloged version never changes; only a newer one can appear).
        remembered: Cataloged | None = None
        cached = version is None and session is None and self.backend.checks_newest
        entry = self._newest.get(name) if cached else None
        if entry is not None:
            try:
                stored = cataloged_document(what, payload, entry.input_schema)
            except InvalidPayloadError:
                # Perhaps valid for a version cataloged since: judged by the catalog as is.
                self._newest.pop(name, None)
                entry = None
            else:
                remembered = Cataloged(str(entry.source_hash), entry.registered_at)
        if entry is None:
            if session is not None:
                # In the host's transaction: no second connection from a pool its requests
                # may all hold, and the entry its snapshot sees (the run's row refers to it).
                entry = catalog.entry_seen(session, self.backend, name, version)
            else:
                with self._reading() as conn:
                    entry = catalog.entry(conn, self.backend, name, version)
            if entry is None:
                if version is None:
                    raise UnknownWorkflowError(name, cataloged=True)
                raise MissingWorkflowVersionError(name, version, cataloged=True)
            if cached and entry.input_schema is not None:
                # (A version cataloged without schemas gets them at its next registration:
                # such an entry is read again each time.)
                self._newest[name] = entry
            stored = cataloged_document(what, payload, entry.input_schema)
        self.backend.check_size(what, stored)
        return name, int(entry.version), stored, remembered

    def _workflow_timeout(self, name: str, version: int) -> float | None:
        """The workflow's own timeout, where this client has its definition (a thin client
        does not: the run's driver applies it from the run's creation)."""
        return None

    def _lease(self, execution_id: str) -> tuple[str, float] | None:
        """``(owner, ttl)`` to create the run ``execution_id`` claimed by, when this process
        drives it itself at once (the embedded client with a worker); ``None`` to create
        it due."""
        return None

    def _lease_settled(self, execution_id: str) -> None:
        """The start of a run :meth:`_lease` claimed is over (written or not, handed on
        or given back)."""

    def _started(self, created: executions.Created, leased: bool, asked: float) -> None:
        """A start of this client's own committed (not one in a host's transaction)."""
        self._notify()

    def _abandoned(self, execution_id: str, workflow: str) -> None:
        """A start created claimed (:meth:`_lease`) failed after it may have committed (its
        answer lost, an interrupt): the run, if it exists, must not wait out the lease."""

    def _recorded(self, found: executions.Created | Stale, asked: float) -> None:
        """A start created claimed (:meth:`_lease`) was written, not yet committed: what
        must be known at once if an interrupt comes between its commit and
        :meth:`_started`."""

    def _interrupted(self, execution_id: str, workflow: str) -> None:
        """A start created claimed committed, and was interrupted before :meth:`_started`
        handed the run on: the run must not wait out the lease."""

    def _expect(self, execution_id: str) -> bool:
        """Before a start of this client's own is sent: while ends are announced, the run's
        end will be heard whenever it comes, so a wait for it needs no first look."""
        if not self._announced():
            return False
        self._ends.expect(execution_id)
        return True

    def close(self) -> None:
        """Dispose of the engine if this client created it. Idempotent."""
        if self._wakeups is not None:
            self._wakeups.stop()
        database, self._database = self._database, None
        if database is not None:
            database.dispose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # operations -------------------------------------------------------------------------

    @refusals.typed
    def start(
        self,
        workflow: Workflow[Any, Any] | str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        actor: str | None = None,
        version: int | None = None,
        session: Executor | None = None,
        timeout: dt.timedelta | float | None = None,
    ) -> ExecutionHandle:
        """Start a run (durably) and return its handle.

        The payload is validated first (an invalid one raises :class:`InvalidPayloadError`
        and writes nothing): by this client against the JSON Schema the version recorded in
        the catalog; by the embedded client with the workflow's own types. The same
        (workflow name, idempotency key) always returns the same handle and records nothing
        new.

        Args:
            workflow: a workflow's name (or its definition, which names it).
            version: the version to pin (default: the highest cataloged, or for the embedded
                client the highest registered).
            session: a host session or connection to write in; the run then exists only if
                the host commits.
            timeout: seconds (or a ``timedelta``) the run may take from now, overriding its
                workflow's ``timeout``: past it the run is cancelled with compensation and
                fails with ``WorkflowTimeoutError`` (see :mod:`wf_persist.timeouts`).

        Raises:
            UnknownWorkflowError, MissingWorkflowVersionError, InvalidPayloadError,
            NotSerializableError, ValueTooLargeError, IdempotencyConflictError.
        """
        arguments.check_session(session)
        idempotency_key = arguments.check_text("idempotency_key", idempotency_key)
        actor = arguments.check_text("actor", actor)
        limit = None if timeout is None else duration_seconds(timeout, "timeout", positive=True)
        self._writable()
        unseen = 0  # starts that met a run with the key their transaction could not see
        while True:
            name, pinned, stored, newest = self._prepare_start(workflow, version, payload, session)
            now = self._now()
            seconds = self._workflow_timeout(name, pinned) if limit is None else limit
            deadline = None if seconds is None else now + dt.timedelta(seconds=seconds)
            execution_id = str(uuid.uuid4())
            attributes = _run_attributes(execution_id, name, pinned)
            with telemetry.operation("wf.start", attributes) as span:
                try:
                    found = self._create(
                        execution_id,
                        name,
                        pinned,
                        stored,
                        idempotency_key,
                        actor,
                        now,
                        deadline,
                        session,
                        newest,
                    )
                except IdempotencyConflictError:
                    # The run holding the key was not visible to this transaction (a
                    # snapshot older than its commit), or was purged between the insert
                    # and the look: a transaction of this client's own tries again.
                    unseen += 1
                    if session is not None or unseen > UNSEEN_TRIES:
                        raise
                    continue
                if isinstance(found, Stale):
                    # A newer version was cataloged since this client read the catalog:
                    # nothing was written; read it again (and validate against it).
                    if span is not None:
                        attributes = {"wf.start.created": False, "wf.start.stale_catalog": True}
                        telemetry.quietly("set attributes", span.set_attributes, attributes)
                    self._newest.pop(name, None)
                    continue
                if span is not None and not found.created:  # the run an earlier start made
                    attributes = {"wf.execution.id": found.execution_id, "wf.start.created": False}
                    telemetry.quietly("set attributes", span.set_attributes, attributes)
            break
        if found.created:
            telemetry.run_started(name, found.version)
        return ExecutionHandle(found.execution_id, name, found.version, created=found.created)

    def _create(
        self,
        execution_id: str,
        name: str,
        pinned: int,
        stored: Any,
        idempotency_key: str | None,
        actor: str | None,
        now: dt.datetime,
        deadline: dt.datetime | None,
        session: Executor | None,
        newest: Cataloged | None = None,
    ) -> executions.Created | Stale:
        """Write the run (in ``session``, else in a transaction of its own) with the
        caller's trace context, which its drives continue; ``newest``: only if ``pinned``
        is still the newest version cataloged, the entry as read (else :data:`STALE`,
        nothing written)."""
        started = events.execution_started(
            execution_id, name, pinned, stored, actor, now, telemetry.carrier()
        )

        def write(
            conn: Executor, lease: tuple[str, float] | None = None
        ) -> executions.Created | Stale:
            return executions.create(
                conn,
                self.backend,
                execution_id=execution_id,
                workflow_name=name,
                workflow_version=pinned,
                payload=stored,
                idempotency_key=idempotency_key,
                actor=actor,
                started=started,
                now=now,
                lease=lease,
                deadline=deadline,
                newest=newest,
            )

        if session is not None:
            return write(session)
        expected = self._expect(execution_id)
        lease = self._lease(execution_id)  # a worker slot may be promised from here: see except
        try:
            return self._write_own(write, execution_id, name, pinned, expected, lease)
        finally:
            if lease is not None:
                self._lease_settled(execution_id)

    def _write_own(
        self,
        write: Callable[[Executor, tuple[str, float] | None], executions.Created | Stale],
        execution_id: str,
        name: str,
        pinned: int,
        expected: bool,
        lease: tuple[str, float] | None,
    ) -> executions.Created | Stale:
        """Write a start in a transaction of this client's own, created claimed by ``lease``
        if given: such a run is handed on (or given back) whatever happens."""
        asked = clocks.elapsed()  # before the claim: see Lease.confirmed
        sent = False
        try:
            with self.backend.atomic() as conn:
                sent = True
                found = write(conn, lease)
                if lease is not None:
                    self._recorded(found, asked)
        except BaseException as exc:
            if expected:
                self._ends.unexpect(execution_id)
            if lease is not None:
                self._started(executions.Created(execution_id, pinned, False), True, asked)
                # Not sent (no connection from the pool, say): nothing can have committed.
                if sent and self.backend.may_have_committed(exc):
                    self._abandoned(execution_id, name)
                else:  # refused: nothing was written, nothing to give back
                    self._recorded(executions.Created(execution_id, pinned, False), asked)
            raise
        try:
            if expected and (isinstance(found, Stale) or not found.created):
                self._ends.unexpect(execution_id)
            if isinstance(found, Stale):
                if lease is not None:
                    self._started(executions.Created(execution_id, pinned, False), True, asked)
                return found
            self._started(found, lease is not None, asked)
        except BaseException:
            if lease is not None:  # committed claimed, then interrupted before handed on
                self._interrupted(execution_id, name)
            raise
        return found


def _run_attributes(execution_id: str, name: str, version: int) -> dict[str, Any]:
    return {
        "wf.execution.id": execution_id,
        "wf.workflow.name": name,
        "wf.workflow.version": version,
    }
