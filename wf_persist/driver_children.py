"""What a drive writes for its run's children: a child's start (``ctx.start_child``), in
the same transaction as the parent's ``child.started``, and the cancellation of the children
a cancelled parent asked to take along. :class:`~.driver.RunDriver` is one.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import events, telemetry
from .authoring import Workflow
from .backends import Backend
from .bridge import off_loop
from .control import Halt, Reload
from .errors import StaleHistoryError
from .events import NewEvent
from .lending import Lender
from .store import children, executions, history

if TYPE_CHECKING:
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

    def start_child(
        self,
        child_id: str,
        workflow: Workflow[Any, Any] | str,
        version: int | None,
        payload: Any,
        who: events.Activity,
        cancel_with_parent: bool,
    ) -> Workflow[Any, Any]:
        return off_loop(
            self._start_child_now, child_id, workflow, version, payload, who, cancel_with_parent
        )

    def _start_child_now(
        self,
        child_id: str,
        workflow: Workflow[Any, Any] | str,
        version: int | None,
        payload: Any,
        who: events.Activity,
        cancel_with_parent: bool,
    ) -> Workflow[Any, Any]:
        rt = self.runtime
        wf = rt.choose(workflow, version)
        stored = rt.validate_input(wf, payload)  # before anything is written
        if isinstance(workflow, Workflow):
            rt.ensure_registered(workflow)
        now = self.clock()
        deadline = None if wf.timeout is None else now + dt.timedelta(seconds=wf.timeout)
        # The child's drives continue this drive's trace.
        trace = telemetry.carrier()
        started = events.execution_started(child_id, wf.name, wf.version, stored, None, now, trace)
        mark = events.child_started(who, child_id, wf.name, wf.version, cancel_with_parent, now)
        with self.conn_lock:
            self._open()
            evs = [*self._deferred, mark]
            try:
                with self.lender.connection() as conn, self.backend.begin(conn):
                    appended = history.append(
                        conn,
                        self.backend,
                        self.execution_id,
                        evs,
                        now=now,
                        epoch=self.epoch,
                        seen_through=self.seen,
                        values=self._reset or None,
                        on_progress=self._unfailing(),
                    )
                    executions.create(
                        conn,
                        self.backend,
                        execution_id=child_id,
                        workflow_name=wf.name,
                        workflow_version=wf.version,
                        payload=stored,
                        idempotency_key=None,
                        actor=None,
                        started=started,
                        now=now,
                        deadline=deadline,
                        parent_id=self.execution_id,
                    )
            except StaleHistoryError:
                raise Reload from None
            except Exception as exc:
                raise Halt(exc) from exc
            self._deferred.clear()
            self._written(appended.progressed)
        self.runtime._notify()  # this process's worker may take the child at once
        telemetry.run_started(wf.name, wf.version)
        return wf

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
            try:
                with self.lender.connection() as own, self.backend.begin(own) as conn:
                    children.cancel(
                        conn,
                        self.backend,
                        child_id,
                        compensate=compensate,
                        actor=None,
                        now=self.clock(),
                    )
            except Exception as exc:
                raise Halt(exc) from exc
