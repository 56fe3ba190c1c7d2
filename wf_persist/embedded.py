"""The embedded client (:meth:`Runtime.client`): starts the runtime's own definitions,
validated with their types, hands runs it starts to the runtime's worker (created claimed),
and may drive a due run in the calling thread while it waits for a result.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import Row

from . import arguments, clocks, refusals
from .authoring import Workflow
from .awaiting import _AGAIN, _WAIT
from .backends import Cataloged, Claim, Stale
from .client import Client
from .records import Completed, Failed, Outcome
from .runtime import NOT_DRIVEN
from .store import Executor, children, executions
from .values import from_json
from .wakeups import Ends

if TYPE_CHECKING:
    from .runtime import Runtime


class WorkflowClient(Client):
    """The embedded client of a :class:`~wf_persist.Runtime` (get one from
    :meth:`Runtime.client`): starts the runtime's own definitions, validated with their
    types, and may drive a due run in the calling thread while :meth:`result` waits."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._database = None  # the runtime's: closed with it
        self.backend = runtime.backend
        self.engine = runtime.engine
        self._wakeups = None  # the runtime's listener wakes this client's waits
        self._ends = Ends()
        #: :meth:`execute` in progress on this thread: the claim its start wrote.
        self._here = threading.local()

    def _listen(self) -> None:
        self.runtime.wakeups()

    def _hear_ends(self) -> None:
        self.runtime.hear_ends()

    def _now(self) -> dt.datetime:
        return self.runtime.clock()

    def _poll(self) -> float:
        return self.runtime.poll_interval

    def _notify(self) -> None:
        self.runtime._notify()

    def _wait(self, seconds: float) -> None:
        self.runtime.wait_for_change(seconds)

    def _check_open(self) -> None:
        self.runtime._check_clients_open()  # the runtime's engine is the client's

    def _prepare_start(
        self,
        workflow: Workflow[Any, Any] | str,
        version: int | None,
        payload: Any,
        session: Executor | None,
    ) -> tuple[str, int, Any, Cataloged | None]:
        rt = self.runtime
        rt._check_process()
        wf = rt.choose(workflow, version)
        stored = rt.validate_input(wf, payload)  # before anything is written, the catalog too
        # In a host transaction, even cataloging a new workflow goes into that transaction:
        # a second write transaction of our own would wait on the host's lock.
        rt.ensure_startable(workflow, wf, session)
        return wf.name, wf.version, stored, None

    def _workflow_timeout(self, name: str, version: int) -> float | None:
        # The definition this start just registered: no catalog read (the host's transaction
        # may hold the pool's last connection).
        found = self.runtime.registered(name, version)
        return None if found is None else found.timeout

    def _outcome(self, row: Row[Any]) -> Outcome:
        outcome = super()._outcome(row)
        definition = self.runtime._registry.get((row.workflow_name, row.workflow_version))
        if isinstance(outcome, Completed) and definition is not None:
            return Completed(row.id, _output(definition, outcome.value))
        return outcome

    def _executing(self) -> bool:
        """Whether the start in progress on this thread is :meth:`execute`'s."""
        return bool(getattr(self._here, "wanted", False))

    def _lease(self, execution_id: str) -> tuple[str, float] | None:
        rt = self.runtime
        if self._executing():  # execute(): this thread drives it
            if rt.closing:
                return None
            rt.wakeups()  # the presence lock first: its owner name is the lease's
        else:
            self._here.reservation = rt.reserve_drive()
            if self._here.reservation is None:
                return None
        rt.starting_claimed(execution_id)
        return rt.owner, rt.lease_ttl.total_seconds()

    def _lease_settled(self, execution_id: str) -> None:
        claim = self._here.claim if self._executing() else None
        if claim is None or claim[0].execution_id != execution_id:
            self.runtime.started_claimed(execution_id)
        # else execute() carries the claim on to its drive, and says when it is held.

    def _abandoned(self, execution_id: str, workflow: str) -> None:
        self.runtime.give_back_started(execution_id, workflow)  # never created: matches none

    def _recorded(self, found: executions.Created | Stale, asked: float) -> None:
        # execute(): known before the commit, so an interrupt from then on gives it back.
        if self._executing():
            claim = found.claim if isinstance(found, executions.Created) else None
            self._here.claim = None if claim is None else (claim, asked)

    def _started(self, created: executions.Created, leased: bool, asked: float) -> None:
        if leased and self._executing():
            return  # execute() drives it (see _recorded)
        if leased:
            self.runtime.dispatch(created.claim, asked, self._here.reservation)
        else:
            self._notify()

    def _interrupted(self, execution_id: str, workflow: str) -> None:
        if self._executing():
            return  # execute() gives it back
        self.runtime.undispatch(execution_id, workflow, self._here.reservation)

    @refusals.typed
    def execute(
        self,
        workflow: Workflow[Any, Any] | str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        actor: str | None = None,
        version: int | None = None,
        timeout: dt.timedelta | float | None = None,
    ) -> Outcome:
        """Start a run and drive it to its end in this thread; its outcome.

        What ``result(start(...).execution_id)`` does, with one statement fewer: the start
        writes the run already claimed by this runtime, so no worker anywhere sees it due
        while this thread drives it. A run that parks (a durable sleep, a signal wait) is
        left to workers and waited for, as :meth:`result` waits. An ``idempotency_key``
        already used returns the outcome of the run it started (driving it here if it is
        due). The arguments are :meth:`start`'s (``timeout`` is the run's, not a bound on
        this wait: use ``start`` and ``result(timeout=...)`` for that).
        """
        self.runtime._check_open()  # nothing is started on a closed runtime
        here = self._here
        # A step of a run this thread drives may call execute() too: the outer call's
        # claim is put back for it as this one's start ends.
        outer = getattr(here, "claim", None)
        here.wanted, here.claim = True, None
        drove: Any = None
        claimed: tuple[Claim, float] | None = None
        try:
            try:
                handle = self.start(
                    workflow,
                    payload,
                    idempotency_key=idempotency_key,
                    actor=actor,
                    version=version,
                    timeout=timeout,
                )
            finally:
                here.wanted = False
                claimed, here.claim = here.claim, outer
            if claimed is not None:
                drove = self.runtime.drive_started(*claimed)
        except BaseException:
            # Made claimed, then interrupted, before or during its drive: due again at once
            # (after a drive that gave it back itself, or finished it, this matches nothing).
            if claimed is not None:
                self.runtime.give_back(claimed[0])
            raise
        finally:
            if claimed is not None:  # driven, or given back: its start is over
                self.runtime.started_claimed(claimed[0].execution_id)
        execution_id = handle.execution_id
        if isinstance(drove, tuple):
            known = self._known(execution_id)
            if known is not None:
                return known
        return self.result(execution_id)

    def _known(self, execution_id: str) -> Outcome | None:
        found = self.runtime.finished_here(execution_id)
        if found is None:
            return None
        name, version, ok, value = found
        if not ok:
            return Failed(execution_id, dict(value or {}))
        definition = self.runtime._registry.get((name, version))
        if definition is not None:
            value = _output(definition, value)
        return Completed(execution_id, value)

    def _busy(self, execution_id: str) -> bool:
        return self.runtime.busy_here(execution_id)

    @refusals.typed
    def result(self, execution_id: str, timeout: float | None = None) -> Outcome:
        """Wait for the run to finish and return its outcome, driving it in this thread
        when it is due and nobody drives it: first by claiming it outright (a run just
        started needs no read before), else as :meth:`Client.result` does.

        With a ``timeout``, a drive here stops at the first step boundary past it and
        hands the run over (due again at once, for a worker or a later call): a step in
        flight is not interrupted, so the call may return that much later.
        """
        execution_id = arguments.check_id(execution_id)
        timeout = arguments.check_timeout(timeout)
        rt = self.runtime
        rt._check_process()
        deadline = None if timeout is None else clocks.elapsed() + timeout
        if self._known(execution_id) is None and not self._busy(execution_id):
            drove = rt.drive_for_outcome(execution_id, deadline)
            if isinstance(drove, tuple):
                known = self._known(execution_id)
                if known is not None:
                    return known
        return self._await_outcome(execution_id, deadline, timeout)

    def _try_drive(self, row: Row[Any], deadline: float | None) -> Outcome | bool:
        """A due run nobody holds is driven in this thread; a run whose pinned version is
        not registered here raises :class:`MissingWorkflowVersionError` (use a
        :class:`Client` to wait for runs this process cannot drive)."""
        rt = self.runtime
        definition = rt.definition(row.workflow_name, row.workflow_version)
        if not row.due:
            return self._drive_below(row.id, deadline)
        drove = rt.drive_for_outcome(row.id, deadline)
        if isinstance(drove, tuple):  # finished here: no need to read it back
            ok, value = drove
            if not ok:
                return Failed(row.id, dict(value or {}))
            return Completed(row.id, _output(definition, value))
        return _WAIT if drove is NOT_DRIVEN else _AGAIN

    def _drive_below(self, execution_id: str, deadline: float | None) -> bool:
        """Drive here the due runs the run waits for (its children, theirs in turn) that
        nobody holds: a run waiting on a child then ends with no worker running (a test
        runtime, a script). ``_AGAIN`` if one was driven."""
        rt = self.runtime
        with rt.backend.read() as conn:
            below = children.due_descendants(conn, execution_id)
        drove = False
        for child_id in below:
            if deadline is not None and clocks.elapsed() >= deadline:
                break
            drove = rt.drive_for_outcome(child_id, deadline) is not NOT_DRIVEN or drove
        return _AGAIN if drove else _WAIT

    def close(self) -> None:
        """Nothing to do: the runtime owns the engine."""


def _output(definition: Workflow[Any, Any], value: Any) -> Any:
    """A run's recorded output as the registered type (a typed error if it no longer fits)."""
    return from_json(definition.output_adapter, value, f"output of workflow {definition.name}")
