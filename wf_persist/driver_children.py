"""What a drive writes for its run's children: a child's start (``ctx.start_child``), in
the same transaction as the parent's ``child.started``, and the cancellation of the children
a cancelled parent asked to take along. :class:`~.driver.RunDriver` is one.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import events, refusals, telemetry
from .authoring import Workflow, adapter_for
from .backends import Backend
from .bridge import off_loop
from .control import Halt, Reload
from .driving import ChildStart
from .errors import (
    MissingWorkflowVersionError,
    StaleHistoryError,
    UnknownWorkflowError,
)
from .events import NewEvent
from .lending import Lender
from .store import catalog, children, executions, history
from .values import cataloged_document, to_json

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from .driver import DriveClock
    from .runtime import Runtime


class ChildDriving:
    """The child-run half of a driver (its state is :class:`~.driver.RunDriver`'s)."""

    runtime: Runtime
    backend: Backend
    lender: Lender
    clock: DriveClock
    execution_id: str
    epoch: int
    seen: int
    conn_lock: threading.RLock
    _deferred: list[NewEvent]

    if TYPE_CHECKING:  # RunDriver's
        _reset: dict[str, Any]

        def _open(self) -> None: ...

        def _unfailing(self) -> dict[str, Any] | None: ...

        def _written(self, progressed: bool) -> None: ...

    # children ------------------------------------------------------------------------

    def prepare_child(
        self, workflow: Workflow[Any, Any] | str, version: int | None, payload: Any
    ) -> ChildStart:
        return off_loop(self._prepare_child_now, workflow, version, payload)

    def _prepare_child_now(
        self, workflow: Workflow[Any, Any] | str, version: int | None, payload: Any
    ) -> ChildStart:
        rt = self.runtime
        wf = self._registered(workflow, version)
        if wf is None:  # served elsewhere: as a thin client starts it
            name = workflow.name if isinstance(workflow, Workflow) else workflow
            return self._cataloged(name, version, payload)
        stored = rt.validate_input(wf, payload)
        try:
            rt.ensure_startable(workflow, wf)
        except Exception as exc:
            # Not raised in the body: the catalog's refusal meets only the processes
            # running another body of the version (a release that changed it without a new
            # version), a database error only this drive, and a replay by another must
            # meet what this drive met. A failed drive: retried after a backoff, by
            # whichever process (one of the release the catalog holds, say).
            raise Halt(exc) from exc
        return ChildStart(wf.name, wf.version, wf, stored, wf.timeout)

    def start_child(
        self, child_id: str, child: ChildStart, who: events.Activity, cancel_with_parent: bool
    ) -> None:
        off_loop(self._start_child_now, child_id, child, who, cancel_with_parent)

    def _start_child_now(
        self, child_id: str, child: ChildStart, who: events.Activity, cancel_with_parent: bool
    ) -> None:
        name, pinned = child.name, child.version
        now = self.clock()
        deadline = None if child.timeout is None else now + dt.timedelta(seconds=child.timeout)
        # The child's drives continue this drive's trace.
        trace = telemetry.carrier()
        started = events.execution_started(child_id, name, pinned, child.stored, None, now, trace)
        plain = child.definition is None
        mark = events.child_started(who, child_id, name, pinned, cancel_with_parent, now, plain)
        with self.conn_lock:
            self._open()
            evs = [*self._deferred, mark]

            def append() -> history.AppendResult:
                with self.lender.connection() as conn, self.backend.begin(conn):
                    appended = self._append(conn, evs, now, self._reset or None, self._unfailing())
                    executions.create(
                        conn,
                        self.backend,
                        execution_id=child_id,
                        workflow_name=name,
                        workflow_version=pinned,
                        payload=child.stored,
                        idempotency_key=None,
                        actor=None,
                        started=started,
                        now=now,
                        deadline=deadline,
                        parent_id=self.execution_id,
                    )
                    return appended

            try:
                appended = refusals.again_if_deadlocked(self.backend, append)
            except StaleHistoryError:
                raise Reload from None
            except Exception as exc:
                raise Halt(exc) from exc
            self._deferred.clear()
            self._written(appended.progressed)
        self.runtime._notify()  # this process's worker may take the child at once
        telemetry.run_started(name, pinned)

    def _append(
        self,
        conn: Connection,
        evs: Sequence[NewEvent],
        now: dt.datetime,
        values: dict[str, Any] | None,
        on_progress: dict[str, Any] | None,
    ) -> history.AppendResult:
        """The drive's events appended in ``conn``'s transaction, fenced by its epoch and
        by what it has seen of the history."""
        return history.append(
            conn,
            self.backend,
            self.execution_id,
            evs,
            now=now,
            epoch=self.epoch,
            seen_through=self.seen,
            values=values,
            on_progress=on_progress,
        )

    def _registered(
        self, workflow: Workflow[Any, Any] | str, version: int | None
    ) -> Workflow[Any, Any] | None:
        """The definition a child start runs where this runtime has it; None for a name
        (and version) registered only in other processes. A workflow passed in counts as
        registered, but a version of it pinned that this process lacks is served elsewhere
        too (a rolling deploy's new version): which process drives the parent must not
        decide whether the body sees an error."""
        try:
            return self.runtime.choose(workflow, version)
        except MissingWorkflowVersionError:
            return None
        except UnknownWorkflowError:
            if isinstance(workflow, Workflow):
                raise
            return None

    def _cataloged(self, name: str, version: int | None, payload: Any) -> ChildStart:
        """A child whose workflow this process does not serve: the version from the
        database's catalog (``version``, else the newest cataloged), the payload checked
        against the JSON Schema that version recorded. A worker that serves it drives it.
        Read on the drive's own connection: a drive never holds one while it waits for a
        second."""
        what = f"input of workflow {name}"
        with self.conn_lock:
            self._open()
            try:
                with self.lender.connection() as own, self.backend.read(own) as conn:
                    entry = catalog.entry(conn, self.backend, name, version)
            except Exception as exc:
                raise Halt(exc) from exc
        if entry is None:
            # Not raised in the body: what the catalog holds changes (the child's service
            # may be deploying), and a replay must meet what the drive met. A failed drive:
            # retried after a backoff, the run failed at the runtime's limit.
            missing: Exception = (
                UnknownWorkflowError(name, cataloged=True)
                if version is None
                else MissingWorkflowVersionError(name, version, cataloged=True)
            )
            raise Halt(missing)
        doc = to_json(adapter_for(Any), payload, what)
        stored = cataloged_document(what, doc, entry.input_schema)
        self.backend.check_size(what, stored)
        return ChildStart(name, int(entry.version), None, stored, None)

    def child_definition(self, name: str, version: int) -> Workflow[Any, Any] | None:
        return self.runtime._registry.get((name, version))

    def cancel_children(self, ids: Sequence[str], compensate: bool) -> None:
        """Cancel these children as this run was cancelled (or timed out), each in a
        transaction of its own; one that ended meanwhile is left as it is. Done before the
        unwind, so a crash before the outcome does it again at the next drive."""
        off_loop(self._cancel_children_now, ids, compensate)
        if ids:
            self.runtime._notify()

    def _cancel_children_now(self, ids: Sequence[str], compensate: bool) -> None:
        for child_id in ids:
            ended: list[tuple[str, int]] = []  # the child, if this ended it (no drive counts it)

            def cancel(child_id: str = child_id, ended: list[tuple[str, int]] = ended) -> None:
                ended.clear()
                with self.lender.connection() as own, self.backend.begin(own) as conn:
                    children.cancel(
                        conn,
                        self.backend,
                        child_id,
                        compensate=compensate,
                        actor=None,
                        now=self.clock(),
                        ended=ended,
                    )

            try:
                refusals.again_if_deadlocked(self.backend, cancel)
            except Exception as exc:
                raise Halt(exc) from exc
            for name, version in ended:
                telemetry.run_ended(name, version, ok=False)
