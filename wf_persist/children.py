"""Child workflows as a workflow body uses them: ``ctx.start_child``, ``ctx.child_result``.

A child is a run like any other (any worker claims and drives it). Its id is derived from
the parent's id and the call's activity name, and the parent's history records the start
(``child.started``) in the same transaction that creates the child's row: a replay returns
the recorded handle and never starts a second child. Waiting for the outcome parks the
parent (``child.waiting``, no thread held); the transaction that ends the child appends
``child.finished`` to the parent's history and wakes it, so the parent cannot miss it, also
across crashes of either side.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from . import events
from .arguments import check_version
from .authoring import Workflow, child_call_name
from .control import Suspended
from .driving import Driver
from .error_documents import shown
from .errors import ChildWorkflowError, InvalidArgumentError
from .events import Activity
from .replay import Cursor, Journal
from .values import from_json

Out = TypeVar("Out")

#: The namespace of child ids (uuid5 of the parent's id and the call's activity name).
CHILD_IDS = uuid.UUID("6f1d3c2e-8b0a-5d4f-9c7e-2a1b3c4d5e6f")


def child_execution_id(parent_id: str, activity: str) -> str:
    """The id of the child a call starts: the same on every replay of the parent."""
    return str(uuid.uuid5(CHILD_IDS, f"{parent_id}\0{activity}"))


@dataclass(frozen=True)
class ChildHandle(Generic[Out]):
    """A child run a workflow started (:meth:`Context.start_child`); pass it to
    :meth:`Context.child_result`."""

    execution_id: str
    workflow_name: str
    version: int
    #: The parent's activity name of the call that started it (``child:<workflow>#<n>``).
    activity_name: str
    workflow: Workflow[Any, Out] | None = field(default=None, repr=False, compare=False)
    #: Its result comes back as JSON: the process that started it did not serve it.
    plain: bool = field(default=False, repr=False, compare=False)


class ChildRunner:
    """The child calls of one replay of a parent's body."""

    def __init__(
        self,
        execution_id: str,
        journal: Journal,
        cursor: Cursor,
        driver: Driver,
        before_new_call: Callable[[], None],
    ) -> None:
        self._execution_id = execution_id
        self._journal = journal
        self._cursor = cursor
        self._driver = driver
        self._before_new_call = before_new_call

    def start(
        self,
        workflow: Workflow[Any, Out] | str,
        payload: Any,
        version: int | None,
        cancel_with_parent: bool,
    ) -> ChildHandle[Out]:
        if not isinstance(workflow, Workflow | str):
            raise InvalidArgumentError(
                f"start_child needs a workflow or its name, got {shown(workflow)}"
            )
        if not isinstance(cancel_with_parent, bool):
            raise InvalidArgumentError(
                f"cancel_with_parent must be a bool, got {shown(cancel_with_parent)}"
            )
        # A plain int from here on: a subclass's own equality ran when a replay compared it
        # with the recorded version (and may raise, or answer otherwise than at the start).
        version = check_version(version)
        name = workflow if isinstance(workflow, str) else workflow.name
        base = child_call_name(name)
        child = None
        new = not self._cursor.replaying()
        if not self._recorded_next(base, version):
            if new:  # what a new call does first (a finished step's events written, say)
                self._before_new_call()
            # Checked before the call takes a place: a refusal records nothing, so it
            # must not move the calls after it; a replay finds the refusal again here.
            child = self._driver.prepare_child(workflow, version, payload)
        activity, invocation = self._cursor.enter("child", base)
        definition = workflow if isinstance(workflow, Workflow) else None
        recorded = self._journal.children.get(activity)
        if recorded is not None:
            pinned = int(recorded["version"])
            plain = recorded.get("plainResult") is True
            if plain or (definition is not None and definition.version != pinned):
                definition = None  # another version ran: its result is decoded by that one
            return ChildHandle(
                str(recorded["childExecutionId"]),
                str(recorded["workflowName"]),
                pinned,
                activity,
                definition,
                plain,
            )
        assert child is not None  # a call past the journal is new
        who = Activity(self._execution_id, base, invocation, activity)
        child_id = child_execution_id(self._execution_id, activity)
        self._driver.start_child(child_id, child, who, cancel_with_parent)
        plain = child.definition is None
        self._journal.children[activity] = {  # as the recorded child.started will say
            **who.base(),
            "childExecutionId": child_id,
            "workflowName": child.name,
            "version": child.version,
            "cancelWithParent": cancel_with_parent,
            **({"plainResult": True} if plain else {}),
        }
        return ChildHandle(child_id, child.name, child.version, activity, child.definition, plain)

    def _recorded_next(self, base: str, version: int | None) -> bool:
        """Whether the next recorded call is this start (a refused one recorded nothing:
        one of the same name after it, pinned to another version, is not it)."""
        activity = self._cursor.upcoming("child", base)
        if activity is None:
            return False
        recorded = self._journal.children.get(activity)
        return recorded is None or version is None or int(recorded["version"]) == version

    def result(self, handle: ChildHandle[Out]) -> Out:
        if not isinstance(handle, ChildHandle):
            raise InvalidArgumentError(f"child_result needs a ChildHandle, got {shown(handle)}")
        activity = handle.activity_name
        recorded = self._journal.children.get(activity)
        if recorded is None or recorded.get("childExecutionId") != handle.execution_id:
            raise InvalidArgumentError(
                f"run {handle.execution_id} is not a child this run started ({activity})"
            )
        done = self._journal.children_done.get(activity)
        if activity in self._journal.children_late:
            self._before_new_call()  # its end came after the run's cancellation: that wins
        if done is None:
            self._before_new_call()
            who = Activity(
                self._execution_id, str(recorded["name"]), int(recorded["invocation"]), activity
            )
            mark = (
                []
                if activity in self._journal.child_waits
                else [events.child_waiting(who, handle.execution_id, self._driver.clock())]
            )
            self._driver.suspend(mark, None)
            raise Suspended
        ok, value = done
        if not ok:
            raise ChildWorkflowError(handle.execution_id, handle.workflow_name, dict(value or {}))
        definition = (
            None
            if handle.plain
            else handle.workflow
            or self._driver.child_definition(handle.workflow_name, handle.version)
        )
        if definition is None:
            result: Out = value
            return result
        what = f"result of child workflow {handle.workflow_name}"
        found: Out = from_json(definition.output_adapter, value, what)
        return found
