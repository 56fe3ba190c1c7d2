"""The replay checker: would the current code replay the stored histories the same way?

A deploy gate for workflow changes (what Temporal's ``Replayer`` is for). Each run is
replayed against the definition of its pinned version, in this process, without writing
anything and without running a step: the body gets the recorded results, and the first
thing it would do that its history lacks stops the replay. A run diverges when the body
makes a different call than the one recorded at that position (``NonDeterminismError``),
ends before it replayed every recorded call, would record something new although the run
has finished, or ends differently (completed instead of failed, or another result). An
unfinished run replays up to where it stands (or to the end its next drive would reach).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from . import lifecycle
from .arguments import check_id
from .async_context import call_body
from .authoring import Step, Workflow
from .context import Context
from .control import Stop
from .driving import ChildStart
from .error_documents import shown
from .errors import (
    Cancelled,
    InvalidArgumentError,
    NonDeterminismError,
    UnknownExecutionError,
    WfPersistError,
    WorkflowVersionConflictError,
)
from .events import Activity, NewEvent
from .replay import Journal
from .secrets import Redactor, SecretResolver
from .store import executions, history
from .values import from_json, to_json

if TYPE_CHECKING:
    from .client import Client
    from .runtime import Runtime

T = TypeVar("T")


@dataclass(frozen=True)
class ReplayReport:
    """One run replayed: ``divergence`` says how the code departs from its history."""

    execution_id: str
    workflow_name: str
    version: int
    status: str
    #: ``None`` when the code replays the history exactly.
    divergence: str | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


class _Frontier(Stop):
    """The body reached what its history lacks (a BaseException: user code cannot catch
    it, as it cannot catch a suspension)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _DryDriver:
    """A driver that writes nothing and runs no step (see :class:`~wf_persist.driving.Driver`)."""

    record_start_after: float | None = None
    news = False
    deadline: dt.datetime | None = None  # a timeout replays from its recorded event

    def __init__(
        self,
        workflow: str,
        now: dt.datetime,
        recorded: set[str],
        keys: set[str],
        definitions: Callable[[str, int], Workflow[Any, Any] | None] | None = None,
    ) -> None:
        self.redactor = Redactor()
        self.workflow = workflow
        self._now = now
        self._recorded = recorded
        self._keys = keys
        self._definitions = definitions

    def clock(self) -> dt.datetime:
        return self._now

    def record(self, events: Sequence[NewEvent]) -> None:
        # A keyed event the history holds is appended as nothing (a replay of an unfinished
        # ``ctx.all`` records its start again): only the others are new.
        fresh = [e for e in events if e.dedupe_key is None or e.dedupe_key not in self._keys]
        if fresh:
            raise _Frontier(f"would record {', '.join(e.type for e in fresh)}")

    def defer(self, events: Sequence[NewEvent]) -> None:
        self.record(events)

    def flush(self) -> None:
        return None

    def record_checked(self, events: Sequence[NewEvent]) -> None:
        if (
            events
            and "execution.cancelled" in self._recorded
            and all(e.type == "cancellation.received" for e in events)
        ):
            return  # the cancellation the history shows: the body unwinds as it did
        self.record(events)

    def suspend(self, events: Sequence[NewEvent], wake_at: dt.datetime | None) -> None:
        raise _Frontier("would wait" if not events else f"would record {events[0].type}")

    def check_lease(self) -> None:
        return None

    def check_size(self, what: str, value: Any) -> None:
        return None

    def as_stored(self, doc: Any) -> Any:
        return doc

    def secret_resolver(self) -> SecretResolver | None:
        return None

    @contextlib.contextmanager
    def concurrency_slot(self, step: Step[Any], key: str) -> Iterator[Callable[[], None]]:
        yield lambda: None

    def prepare_child(
        self, workflow: Workflow[Any, Any] | str, version: int | None, payload: Any
    ) -> ChildStart:
        raise _Frontier(f"would start a child of {workflow!r}")

    def start_child(
        self, child_id: str, child: ChildStart, who: Activity, cancel_with_parent: bool
    ) -> None:
        raise _Frontier(f"would start child {who.activity}")

    def child_definition(self, name: str, version: int) -> Workflow[Any, Any] | None:
        # As a drive does: a child's result comes back as its workflow's output type.
        return None if self._definitions is None else self._definitions(name, version)

    def after(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        return lambda: None

    def pause(self, seconds: float) -> None:
        return None

    def user_code(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step_function(self, step: Step[Any]) -> Callable[..., Any]:
        def never(**_: Any) -> Any:
            raise _Frontier(f"would run step {step.name}")

        return never

    def code_function(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        def never() -> T:
            raise _Frontier(f"would run code block {name}")

        return never


def replay_run(
    wf: Workflow[Any, Any],
    row: Any,
    events: Sequence[dict[str, Any]],
    keys: set[str],
    definitions: Callable[[str, int], Workflow[Any, Any] | None] | None = None,
) -> str | None:
    """Replay one stored run (its events and their dedupe ``keys``) against ``wf``; how it
    diverges, or ``None``. ``definitions``: the registered workflow of a name and version
    (a child's, started by name), or ``None``."""
    finished = row.status in lifecycle.TERMINAL
    if finished and (row.error or {}).get("name") == "CancelledCallError":
        return "the run failed with CancelledCallError: no replay can repeat a wall-clock cancel"
    journal = Journal.from_events(events)
    recorded = {str(e["type"]) for e in events}
    driver = _DryDriver(wf.name, row.updated_at, recorded, keys, definitions)
    ctx = Context(row.id, journal, driver)
    try:
        value = from_json(wf.input_adapter, row.input, f"input of workflow {wf.name}")
        out = call_body(wf, ctx, value)
        if isinstance(ctx._stopped, _Frontier):  # the body caught it and went on
            raise ctx._stopped.with_traceback(None)
        ctx._ended()
        ending: tuple[str, Any] = ("completed", to_json(wf.output_adapter, out, "output"))
    except _Frontier as stop:
        return _at_frontier(stop, row, finished)
    except NonDeterminismError as exc:
        return str(exc)
    except (Exception, Cancelled) as exc:
        if isinstance(ctx._stopped, _Frontier):  # the body caught it, then raised
            return _at_frontier(ctx._stopped, row, finished)
        with contextlib.suppress(NonDeterminismError):
            ctx._ended(exc)
        failure = ctx.failure(exc)  # a cancelled call hides no error the body raised after
        if isinstance(failure, NonDeterminismError):
            return str(failure)
        ending = ("failed", type(failure).__name__)
    if not finished:
        return None  # what its next drive will do
    if ending[0] != row.status:
        return f"would end {ending[0]} where the run ended {row.status}"
    if ending[0] == "completed" and not same_output(wf, ending[1], row.result):
        return f"would return {ending[1]!r:.200} where the run returned {row.result!r:.200}"
    return None


def same_output(wf: Workflow[Any, Any], replayed: Any, stored: Any) -> bool:
    """Whether a replay's output is the run's: equal as stored, or equal once read back
    into the output type (a ``set`` is stored in the order its process's hash seed gave, and
    the check runs in another process)."""
    if same_json(replayed, stored):
        return True
    try:
        what = f"output of workflow {wf.name}"
        adapter = wf.output_adapter
        return bool(from_json(adapter, replayed, what) == from_json(adapter, stored, what))
    except Exception:  # not readable back, or an equality of the user's own that raises
        return False


def _at_frontier(stop: _Frontier, row: Any, finished: bool) -> str | None:
    """How a replay that reached the end of the history diverges, or ``None``."""
    if not finished or (row.error or {}).get("name") == "DriveFailedError":
        return None  # where it stands, or where the runtime gave it up (not its body)
    return f"{stop.what}, but the run has finished"


def same_json(a: Any, b: Any) -> bool:
    """Whether two JSON documents are equal as stored: a number equals one of the other
    kind with the same double value (PostgreSQL's JSONB gives back the float 1e23 as the
    integer 10**23)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if (
        isinstance(a, numbers)
        and isinstance(b, numbers)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and type(a) is not type(b)
    ):
        try:
            return float(a) == float(b)
        except OverflowError:
            return False
    return bool(type(a) is type(b) and a == b)


def check_replay(
    runtime: Runtime,
    runs: Iterable[str] | None = None,
    *,
    since: dt.datetime | None = None,
    database: Client | None = None,
) -> list[ReplayReport]:
    """Replay stored runs against ``runtime``'s registered definitions.

    Args:
        runs: execution ids; default every run of the workflows the runtime registered
            (created at or after ``since``, an aware datetime, if given).
        database: where the runs are read (default: the runtime's own database), e.g. a
            thin client on production checked against the code about to be deployed.

    Returns:
        One report per run, oldest first. A run whose pinned version is not registered
        reports that as its divergence if it is unfinished (nothing could drive it), and is
        skipped if it has finished.
    """
    from .client import Client
    from .runtime import Runtime

    if not isinstance(runtime, Runtime):
        raise InvalidArgumentError(
            f"check_replay needs the wp.Runtime holding the code to check, got {shown(runtime)}"
        )
    if database is not None and not isinstance(database, Client):
        raise InvalidArgumentError(f"database must be a wp.Client, got {shown(database)}")
    if since is not None and (not isinstance(since, dt.datetime) or since.tzinfo is None):
        raise InvalidArgumentError(f"since must be an aware datetime, got {since!r:.80}")
    # One id would be read as a list of characters.
    if runs is not None and (isinstance(runs, str | bytes) or not isinstance(runs, Iterable)):
        raise InvalidArgumentError(f"runs must be a list of execution ids, got {runs!r:.80}")
    if database is not None:
        _check_catalog(runtime, database)
    reader = database if database is not None else runtime.client()
    ids = [check_id(r) for r in runs] if runs is not None else _runs_of(runtime, reader, since)
    reports: list[ReplayReport] = []
    for execution_id in ids:
        with reader.backend.read() as conn:
            row = executions.get(conn, execution_id)
            if row is None:
                if runs is not None:  # a mistyped id must not pass a gate
                    raise UnknownExecutionError(execution_id)
                continue  # purged since it was listed
            events = [dict(r.event) for r in history.load(conn, execution_id)]
            keys = history.dedupe_keys(conn, execution_id)
        key = (row.workflow_name, int(row.workflow_version))
        try:
            wf = runtime.definition(*key)
        except WfPersistError as exc:
            if row.status not in lifecycle.TERMINAL:
                reports.append(ReplayReport(row.id, *key, row.status, str(exc)))
            continue
        divergence = replay_run(wf, row, events, keys, lambda n, v: runtime._registry.get((n, v)))
        reports.append(ReplayReport(row.id, *key, row.status, divergence))
    return reports


def _check_catalog(runtime: Runtime, database: Client) -> None:
    """The runtime's definitions against the catalog of the database checked (its own
    were checked as they registered): another body under a version cataloged there is
    refused as the release would be where it deploys."""
    cataloged = {(e.name, e.version): e.source_hash for e in database.workflows()}
    for key in runtime.registered_workflows():
        wf = runtime.definition(*key)
        found = cataloged.get(key)
        if found is not None and found != wf.source_hash:
            raise WorkflowVersionConflictError(wf.name, wf.version, found, wf.source_hash)


def _runs_of(runtime: Runtime, client: Client, since: dt.datetime | None) -> list[str]:
    """Every run of the workflows the runtime registers (any version). A workflow it does
    not register at all may be another service's, sharing the database: its runs are not
    this code's to check."""
    ids: list[str] = []
    for name in sorted({name for name, _ in runtime.registered_workflows()}):
        cursor = None
        while True:
            page = client.list(name, created_after=since, limit=500, cursor=cursor)
            ids += [item.execution_id for item in page.items]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    return ids
