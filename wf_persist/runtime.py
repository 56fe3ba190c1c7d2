"""The runtime: workflow registry, leases and the replay loop.

Driving a run is: claim its lease (one transaction that also records ``workflow.started`` and
reads the whole history), replay the workflow function against that history, write each new
step as one fenced append, and finish with one transaction that records the outcome and
releases the lease. A runtime that loses its lease stops writing at once; whoever claimed the
run replays it from the database.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from . import _dialect, migrate
from .authoring import Step, Workflow
from .context import Context, Halt, Journal, Reload, Suspended, _to_json
from .errors import (
    Cancelled,
    InvalidArgumentError,
    InvalidPayloadError,
    LeaseLostError,
    MissingWorkflowVersionError,
    StaleHistoryError,
    UnknownWorkflowError,
    WfPersistError,
    WorkflowVersionConflictError,
    error_document,
)
from .limits import ConcurrencyLimits
from .secrets import SecretResolver
from .store import catalog, executions, history
from .store.history import NewEvent

if TYPE_CHECKING:
    from sqlalchemy import Row

    from .client import WorkflowClient
    from .worker import Worker

Clock = Callable[[], dt.datetime]


def utc_now() -> dt.datetime:
    """The default clock."""
    return dt.datetime.now(dt.UTC)


class Runtime:
    """Holds the database binding and the registered workflows; drives runs.

    Args:
        bind: a database URL, or an existing SQLAlchemy ``Engine`` (used as is, never
            reconfigured). Default: ``$WF_PERSIST_DATABASE_URL``, else ``wf_persist.sqlite3``
            in the working directory.
        auto_migrate: upgrade the schema on open. Default: only for an embedded SQLite
            database this runtime created; any other database must be migrated beforehand
            (``wf-persist db upgrade``) and opening it otherwise raises
            :class:`~wf_persist.errors.SchemaVersionError`.
        lease_ttl: seconds a claim lasts without renewal. A runtime renews its leases every
            third of this while it works; if it dies, any other runtime may take its runs over
            after the lease ran out.
        poll_interval: seconds between looks for due work (timers, signals, expired leases)
            when nothing in this process announced it; a timer fires at most this late.
        clock: the source of "now" (UTC, timezone-aware).
        secret_resolver: resolves ``secret:<name>`` references in step arguments inside the
            step (e.g. :func:`wf_persist.env_secret_resolver`).
        schema: a PostgreSQL schema holding the wf_ tables (migrate it with the same schema).
    """

    def __init__(
        self,
        bind: str | URL | Engine | None = None,
        *,
        auto_migrate: bool | None = None,
        lease_ttl: float = 30.0,
        poll_interval: float = 0.25,
        clock: Clock = utc_now,
        secret_resolver: SecretResolver | None = None,
        schema: str | None = None,
    ) -> None:
        if lease_ttl <= 0 or poll_interval <= 0:
            raise InvalidArgumentError("lease_ttl and poll_interval must be positive")
        if isinstance(bind, Engine):
            engine = bind
            self._owns_engine = False
        else:
            engine = _dialect.create_engine(bind)
            self._owns_engine = True
        self._base_engine = engine
        self.schema = schema
        # A view of the engine that renders our tables in ``schema``: the host's own engine
        # object and its options are left as they are.
        self.engine = _dialect.with_schema(engine, schema)
        dialect = self.engine.dialect
        if auto_migrate is None:
            auto_migrate = self._owns_engine and _dialect.is_sqlite(dialect)
        try:
            _dialect.check_engine(engine)
            if auto_migrate:
                migrate.upgrade(self.engine)
            else:
                migrate.assert_at_head(self.engine)
        except BaseException:
            if self._owns_engine:
                engine.dispose()
            raise
        self.clock = clock
        self.lease_ttl = dt.timedelta(seconds=lease_ttl)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._registry: dict[tuple[str, int], Workflow[Any, Any]] = {}
        self._latest: dict[str, int] = {}
        self._lock = threading.Lock()
        self._driving: set[str] = set()
        self.poll_interval = poll_interval
        self.secret_resolver = secret_resolver
        self.limits = ConcurrencyLimits(self.engine)
        self._keeper: _LeaseKeeper | None = None
        self._worker: Worker | None = None
        self._changed = threading.Condition()
        self._closed = False
        self._hot_autocommit = _dialect.supports_dml_cte(dialect)

    # registry -------------------------------------------------------------------------

    def register(self, *workflows: Workflow[Any, Any]) -> None:
        """Register workflows here and in the database catalog (first registration wins).

        All or nothing: if any (name, version) is cataloged with a different source hash,
        nothing is registered.

        Raises:
            WorkflowVersionConflictError: (name, version) exists with a different source.
        """
        self._check_open()
        for wf in workflows:
            known = self._registry.get(wf.key)
            if known is not None and known.source_hash != wf.source_hash:
                raise WorkflowVersionConflictError(
                    wf.name, wf.version, known.source_hash, wf.source_hash
                )
        now = self.clock()
        with self.engine.begin() as conn:
            for wf in workflows:
                cataloged = catalog.catalog_version(conn, wf.name, wf.version, wf.source_hash, now)
                if cataloged != wf.source_hash:
                    raise WorkflowVersionConflictError(
                        wf.name, wf.version, cataloged, wf.source_hash
                    )
        with self._lock:
            for wf in workflows:
                self._registry[wf.key] = wf
                if wf.version > self._latest.get(wf.name, 0):
                    self._latest[wf.name] = wf.version

    def resolve(
        self, workflow: Workflow[Any, Any] | str, version: int | None
    ) -> Workflow[Any, Any]:
        """The registered definition to start: ``version`` if given, else the highest."""
        name = workflow if isinstance(workflow, str) else workflow.name
        if isinstance(workflow, Workflow) and workflow.key not in self._registry:
            self.register(workflow)
        if version is None:
            latest = self._latest.get(name)
            if latest is None:
                raise UnknownWorkflowError(name)
            version = latest
        found = self._registry.get((name, version))
        if found is None:
            if name not in self._latest:
                raise UnknownWorkflowError(name)
            raise MissingWorkflowVersionError(name, version)
        return found

    def definition(self, name: str, version: int) -> Workflow[Any, Any]:
        """The exact pinned version, or :class:`MissingWorkflowVersionError`."""
        found = self._registry.get((name, version))
        if found is None:
            raise MissingWorkflowVersionError(name, version)
        return found

    # validation -------------------------------------------------------------------------

    @staticmethod
    def validate_input(wf: Workflow[Any, Any], payload: Any) -> Any:
        """The payload's stored JSON form; raises before anything is written."""
        if not wf.takes_input and payload is not None:
            raise InvalidPayloadError(
                f"input of workflow {wf.name}",
                [{"loc": (), "msg": "this workflow takes no input"}],
            )
        return _to_json(wf.input_adapter, payload, f"input of workflow {wf.name}")

    # driving --------------------------------------------------------------------------

    def client(self) -> WorkflowClient:
        """A client bound to this runtime."""
        from .client import WorkflowClient

        return WorkflowClient(self)

    def drive(self, execution_id: str) -> bool:
        """Drive ``execution_id`` until it finishes or parks, if this runtime can claim it.

        Returns False when the run is finished, not due, or held by another runtime (or
        thread); True when this call drove it.
        """
        return self.drive_for_outcome(execution_id) is not _NOT_DRIVEN

    def drive_for_outcome(self, execution_id: str) -> Any:
        """Like :meth:`drive`; returns ``(ok, stored value)`` if the run finished here,
        ``None`` if it parked, ``_NOT_DRIVEN`` if it could not be claimed."""
        self._check_open()
        # Another thread here may be just leaving this run (after parking it, say) while a
        # worker claimed it again: wait a moment rather than leave it leased and idle.
        deadline = time.monotonic() + 0.5
        while True:
            with self._lock:
                if execution_id not in self._driving:
                    self._driving.add(execution_id)
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _NOT_DRIVEN
            self.wait_for_change(min(0.05, remaining))
        try:
            return self._drive(execution_id)
        finally:
            with self._lock:
                self._driving.discard(execution_id)
            self._notify()

    def _lease_until(self) -> dt.datetime:
        return self.clock() + self.lease_ttl

    def _claim(
        self, execution_id: str
    ) -> tuple[Workflow[Any, Any], Any, tuple[Journal, int]] | None:
        """Lease the run, then read its history and record ``workflow.started`` the first
        time: one transaction. Reading after the lease is taken means every write fenced by
        a previous owner is already visible, so a recorded step is never run again."""
        now = self.clock()
        with self.engine.begin() as conn:
            claimed = executions.claim(conn, execution_id, self.owner, now, now + self.lease_ttl)
            if claimed is None:
                return None
            wf = self.definition(claimed.workflow_name, claimed.workflow_version)
            rows = history.load(conn, execution_id)
            if not any(r.event["type"] == "workflow.started" for r in rows):
                started = {
                    "type": "workflow.started",
                    "executionId": execution_id,
                    "workflowName": wf.name,
                    "version": wf.version,
                }
                history.append(
                    conn, execution_id, [NewEvent(started, now, "workflow.started")], now=now
                )
        return wf, claimed.input, _journal(rows)

    def _load(self, execution_id: str) -> tuple[Journal, int]:
        with self.engine.connect() as conn:
            conn = conn.execution_options(wf_persist_readonly=True)
            with conn.begin():
                return _journal(history.load(conn, execution_id))

    def _drive(self, execution_id: str) -> Any:
        claimed = self._claim(execution_id)
        if claimed is None:
            return _NOT_DRIVEN
        wf, payload, loaded = claimed
        self._keep_lease(execution_id)
        try:
            with self.engine.connect() as hot:
                if self._hot_autocommit:
                    hot = hot.execution_options(isolation_level="AUTOCOMMIT")
                while True:
                    journal, seen = loaded
                    driver = _RunDriver(self, hot, execution_id, seen)
                    try:
                        self._replay(driver, wf, payload, journal)
                    except Reload:
                        loaded = self._load(execution_id)
                        continue
                    except Suspended:
                        pass
                    return driver.finished
        except Halt as halt:
            if not isinstance(halt.cause, LeaseLostError):
                raise halt.cause from None
        except LeaseLostError:
            pass
        finally:
            self._release_keeper(execution_id)
        return None

    def _replay(
        self, driver: _RunDriver, wf: Workflow[Any, Any], payload: Any, journal: Journal
    ) -> None:
        ctx = Context(driver.execution_id, journal, driver, self.clock)
        try:
            value = wf.input_adapter.validate_python(payload)
            out = wf.fn(ctx, value) if wf.takes_input else wf.fn(ctx)
            if ctx.divergence is not None:
                raise ctx.divergence
            # Cancelled after its last durable call: the cancellation still wins.
            ctx._check_cancelled()
            stored = _to_json(wf.output_adapter, out, f"output of workflow {wf.name}")
        except (Exception, Cancelled) as exc:
            # A divergence wins even if the workflow caught it and failed otherwise.
            failure: BaseException = ctx.divergence or exc
            reason = error_document(failure)
            if not (isinstance(failure, Cancelled) and not failure.compensate):
                errors = ctx.compensate(reason)
                if errors:
                    reason = {**reason, "compensationErrors": errors}
            driver.finish(wf, ok=False, value=reason)
            return
        driver.finish(wf, ok=True, value=stored)

    # waiting for changes ----------------------------------------------------------------

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
        worker = self._worker
        if worker is not None:
            worker.wake()

    def wait_for_change(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds, or until this runtime finishes or parks a run."""
        with self._changed:
            self._changed.wait(timeout)

    # workers ----------------------------------------------------------------------------

    def runnable_workflows(self) -> list[tuple[str, int]]:
        """The (name, version)s this runtime can drive."""
        with self._lock:
            return sorted(self._registry)

    def claim_due(self, limit: int) -> list[str]:
        """Lease up to ``limit`` due runs this runtime can drive (for workers)."""
        now = self.clock()
        with self.engine.begin() as conn:
            return executions.claim_due(
                conn, self.owner, now, now + self.lease_ttl, limit, self.runnable_workflows()
            )

    def next_wake(self) -> dt.datetime | None:
        """The earliest wake time of a run this runtime can drive (None: nothing scheduled)."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(wf_persist_readonly=True)
            with conn.begin():
                return executions.next_wake(conn, self.runnable_workflows(), self.clock())

    def start_worker(self, *, concurrency: int = 4, poll_interval: float | None = None) -> Worker:
        """Run a worker in background threads of this process (embedded mode)."""
        from .worker import Worker

        with self._lock:
            if self._worker is not None:
                return self._worker
            self._worker = Worker(
                self, concurrency=concurrency, poll_interval=poll_interval or self.poll_interval
            )
        return self._worker.start()

    # leases ---------------------------------------------------------------------------

    def _keep_lease(self, execution_id: str) -> None:
        with self._lock:
            if self._keeper is None or not self._keeper.is_alive():
                self._keeper = _LeaseKeeper(self)
                self._keeper.start()
            self._keeper.held.add(execution_id)

    def _release_keeper(self, execution_id: str) -> None:
        with self._lock:
            if self._keeper is not None:
                self._keeper.held.discard(execution_id)

    # lifecycle ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise WfPersistError("Workflow runtime has been closed")

    def close(self) -> None:
        """Stop renewing leases and dispose of an engine this runtime created. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keeper, worker = self._keeper, self._worker
        if worker is not None:
            worker.stop()
        if keeper is not None:
            keeper.stop()
        if self._owns_engine:
            self._base_engine.dispose()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction on this runtime's engine."""
        with self.engine.begin() as conn:
            yield conn


def _acquire_or_halt(acquire: Callable[[], bool]) -> bool:
    """Taking a slot is the runtime's business: its database errors are not step failures."""
    try:
        return acquire()
    except Exception as exc:
        raise Halt(exc) from exc


#: Returned by :meth:`Runtime.drive_for_outcome` when the run could not be claimed.
_NOT_DRIVEN: Any = object()


def _journal(rows: Sequence[Row[Any, Any, Any]]) -> tuple[Journal, int]:
    return Journal.from_events([r.event for r in rows]), int(rows[-1].sequence) if rows else 0


class _RunDriver:
    """Writes for one run on behalf of its context, fenced by this runtime's lease.

    ``seen`` is the last sequence read; a client event after it (a signal, a cancellation)
    makes parking or deciding a race stale, so the context replays from fresh history.
    Database failures unwind the workflow as :class:`Halt`, which user code cannot catch.
    """

    def __init__(self, runtime: Runtime, conn: Connection, execution_id: str, seen: int) -> None:
        self.runtime = runtime
        self.conn = conn
        self.execution_id = execution_id
        self.seen = seen
        #: ``(ok, stored value)`` once this driver recorded the run's outcome.
        self.finished: tuple[bool, Any] | None = None

    def _fenced(
        self,
        events: Sequence[NewEvent],
        values: dict[str, Any] | None = None,
        from_statuses: tuple[str, ...] | None = None,
    ) -> str:
        rt = self.runtime
        now = rt.clock()
        try:
            return history.append_fenced_autocommit(
                self.conn,
                self.execution_id,
                rt.owner,
                events,
                now=now,
                values=values,
                from_statuses=from_statuses,
            ).status
        except Exception as exc:
            raise Halt(exc) from exc

    def record(self, events: Sequence[NewEvent]) -> str:
        return self._fenced(events)

    def secret_resolver(self) -> SecretResolver | None:
        return self.runtime.secret_resolver

    @contextmanager
    def concurrency_slot(self, step: Step[Any], key: str) -> Iterator[None]:
        """Hold one of ``step``'s slots for ``key``, checking meanwhile that the run is still
        ours (a run cancelled while it queues never starts the step)."""
        limit = step.concurrency
        assert limit is not None
        rt = self.runtime
        last_check = time.monotonic()
        delay = 0.002
        with rt.limits.slot(step.name, key, limit.limit) as acquire:
            while not _acquire_or_halt(acquire):
                if time.monotonic() - last_check > 0.2:
                    last_check = time.monotonic()
                    try:
                        with rt.engine.connect() as conn:
                            row = executions.get(conn, self.execution_id)
                    except Exception as exc:
                        raise Halt(exc) from exc
                    if row is None or row.lease_owner != rt.owner:
                        raise Halt(LeaseLostError(self.execution_id))
                    if row.status == "compensating":  # cancelled while queued: never start
                        raise Reload
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            yield

    def _locked(self, events: Sequence[NewEvent], park: bool, wake_at: dt.datetime | None) -> None:
        rt = self.runtime
        now = rt.clock()
        try:
            with rt.engine.begin() as conn:
                history.append(
                    conn, self.execution_id, events, now=now, owner=rt.owner, seen_through=self.seen
                )
                if park:
                    executions.park(conn, self.execution_id, rt.owner, wake_at)
        except StaleHistoryError:
            raise Reload from None
        except Exception as exc:
            raise Halt(exc) from exc

    def record_checked(self, events: Sequence[NewEvent]) -> None:
        self._locked(events, False, None)

    def suspend(self, events: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        self._locked(events, True, wake_at)

    def finish(self, wf: Workflow[Any, Any], *, ok: bool, value: Any) -> None:
        """Record the outcome and release the lease: one fenced write."""
        now = self.runtime.clock()
        kind = "completed" if ok else "failed"
        event: dict[str, Any] = {
            "type": f"workflow.{kind}",
            "executionId": self.execution_id,
            "workflowName": wf.name,
            "result" if ok else "error": value,
        }
        values: dict[str, Any] = {
            "status": kind,
            "result" if ok else "error": value,
            "finished_at": now,
            "lease_owner": None,
            "lease_expires_at": None,
            "wake_at": None,
        }
        # Terminal states are final; a run being compensated may only fail.
        guard = ("running", "suspended") if ok else ("running", "suspended", "compensating")
        try:
            self._fenced([NewEvent(event, now, f"workflow.{kind}", kind)], values, guard)
        except Halt as halt:
            # A cancellation can land between the last call and the outcome: the guard then
            # refuses a completion. Replay from the fresh history to unwind instead.
            if isinstance(halt.cause, LeaseLostError) and self._still_ours_and_cancelled():
                raise Reload from None
            raise
        self.finished = (ok, value)

    def _still_ours_and_cancelled(self) -> bool:
        rt = self.runtime
        with rt.engine.connect() as conn:
            row = executions.get(conn, self.execution_id)
        return row is not None and row.lease_owner == rt.owner and row.status == "compensating"


class _LeaseKeeper(threading.Thread):
    """Renews this runtime's leases every third of the TTL while runs are being driven."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(name="wf-persist-lease-keeper", daemon=True)
        self.runtime = runtime
        self.held: set[str] = set()
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        rt = self.runtime
        interval = rt.lease_ttl.total_seconds() / 3
        while not self._stop_event.wait(interval):
            with rt._lock:
                ids = list(self.held)
            if not ids:
                continue
            try:
                with rt.engine.begin() as conn:
                    executions.renew_leases(conn, rt.owner, ids, rt._lease_until())
            except Exception:
                continue
