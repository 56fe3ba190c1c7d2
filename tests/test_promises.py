"""README promises that had no test, each written so that breaking the promise fails it."""

from __future__ import annotations

import ast
import datetime as dt
import inspect
import json
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .dbcount import counting
from .fixtures import saga as s
from .fixtures import workflows as w
from .helpers import ROOT, Processes, history_types, wait_for_mark, wait_status, wait_until

pytestmark = pytest.mark.usefixtures("saga_reset")


def _events(client: wp.WorkflowClient, execution_id: str, kind: str) -> list[dict[str, Any]]:
    return [r.event for r in client.history(execution_id) if r.event["type"] == kind]


def _drive_to_the_wait(runtime: wp.Runtime, execution_id: str) -> list[wp.PendingSignal]:
    """Drive the run in this thread (through its sleeps) until it waits for a signal."""
    client = runtime.client()

    def waiting() -> list[wp.PendingSignal]:
        runtime.drive(execution_id)
        return client.pending_signals(execution_id)

    wait_until(waiting, what="the signal wait")
    return client.pending_signals(execution_id)


# leases --------------------------------------------------------------------------------


def test_a_step_longer_than_the_lease_is_not_taken_over(
    make_runtime: Callable[..., wp.Runtime], db_engine: Engine
) -> None:
    """The lease is renewed while a step runs: a worker polling for due work next to it
    never takes the run over, and the step runs once."""
    holder = make_runtime(lease_ttl=1.0)
    holder.register(*s.ALL)
    handle = holder.client().start(s.outlives_lease_wf, 2.5)
    outcome: list[object] = []

    def drive() -> None:
        try:
            outcome.append(holder.client().result(handle.execution_id, timeout=10))
        except Exception as exc:  # reported below, after what tells most
            outcome.append(exc)

    driving = threading.Thread(target=drive)
    driving.start()
    wait_until(lambda: s.CALLS["slow"] == 1, what="the holder's step")
    poller = make_runtime(lease_ttl=1.0)
    poller.register(*s.ALL)
    poller.start_worker(concurrency=2, poll_interval=0.05)
    driving.join(30)
    assert s.CALLS["slow"] == 1, "the step ran again: the poller took the run over"
    (done,) = outcome
    assert isinstance(done, wp.Completed) and done.value == "slow", done
    with db_engine.connect() as conn:
        epoch = conn.execute(
            select(ex.c.claim_epoch).where(ex.c.id == handle.execution_id)
        ).scalar()
    assert epoch == 1, "claimed once"
    types = history_types(holder.client(), handle.execution_id)
    assert types.count("workflow.started") == 1 and types.count("step.completed") == 1


# cancellation --------------------------------------------------------------------------


def test_except_exception_cannot_swallow_a_cancellation(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.swallow_cancel_wf)
    _drive_to_the_wait(rt, handle.execution_id)
    client.cancel(handle.execution_id, actor="ops")
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.Cancelled)
    assert s.CALLS["swallowed"] == 0, "the workflow's except Exception caught the cancellation"
    assert s.CALLS["undo_first"] == 1, "the saga was unwound"
    assert not issubclass(wp.Cancelled, Exception)


# ctx.all -------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [2, 3])
def test_all_runs_at_most_concurrency_branches_at_once(rt: wp.Runtime, limit: int) -> None:
    client = rt.client()
    handle = client.start(s.fan_out_wf, limit)
    assert client.result(handle.execution_id, timeout=30).unwrap() == [0, 1, 2, 3, 4, 5]
    assert s.MAX_IN_FLIGHT["branches"] == limit


# signals, sleeps, durations ------------------------------------------------------------


@wp.workflow(name="named-sleeps", version=1)
def named_sleeps_wf(ctx: wp.Context) -> str:
    ctx.sleep(dt.timedelta(milliseconds=50), name="cool-off")
    ctx.sleep(0.01)
    got = ctx.wait_for_signal("approval", w.Approval, timeout=dt.timedelta(minutes=5))
    return "timeout" if isinstance(got, wp.TimedOut) else "approved"


def test_named_sleeps_timedelta_durations_and_the_recorded_timeout(runtime: wp.Runtime) -> None:
    runtime.register(named_sleeps_wf, w.approval_wf)
    client = runtime.client()
    handle = client.start(named_sleeps_wf)
    (pending,) = _drive_to_the_wait(runtime, handle.execution_id)
    assert pending.timeout == 300.0 and pending.activity_name == "approval#1"
    sleeps = _events(client, handle.execution_id, "sleep.started")
    assert [(e["activityName"], e["duration"]) for e in sleeps] == [
        ("cool-off#1", 0.05),
        ("sleep:0.01s#1", 0.01),
    ]
    client.signal(handle.execution_id, "approval", {"approved": True})
    assert client.result(handle.execution_id, timeout=10).unwrap() == "approved"
    seconds = client.start(w.approval_wf, 30)
    assert [p.timeout for p in _drive_to_the_wait(runtime, seconds.execution_id)] == [30.0]


# failures ------------------------------------------------------------------------------


def test_failed_matches_by_module_as_well_as_name(rt: wp.Runtime) -> None:
    assert s.Rejected.__name__ == w.Rejected.__name__
    assert s.Rejected.__module__ != w.Rejected.__module__
    outcome = rt.client().result(rt.client().start(s.saga_wf, 1).execution_id)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["module"] == "tests.fixtures.saga"
    assert outcome.matches(s.Rejected)
    assert not outcome.matches(w.Rejected), "same name, other module"
    assert not outcome.matches(s.Boom)


def test_exhausted_retries_unwind_the_saga(rt: wp.Runtime) -> None:
    client = rt.client()
    outcome = client.result(client.start(s.retries_exhausted_wf).execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    assert s.CALLS["transient"] == 3, "every attempt ran"
    assert s.LOG == [("undo_first", ("held-8", 8, "StepExecutionError"))]
    types = history_types(client, outcome.execution_id)
    assert types.count("step.failed") == 3
    assert types[-3:] == ["compensation.started", "compensation.completed", "workflow.failed"]


def _documented_errors() -> tuple[set[str], dict[str, set[str]]]:
    """Error names and ``Name.attribute`` pairs the README's Errors section mentions."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Errors", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`(?:wf_persist\.)?([A-Z]\w*(?:Error|Cancelled))", section))
    attributes: dict[str, set[str]] = {}
    for name, attrs in re.findall(r"`([A-Z]\w*Error)((?:/?\.\w+)+)`", section):
        attributes[name] = set(re.findall(r"\.(\w+)", attrs))
    return names, attributes


#: One instance of each documented error, as wf_persist raises it.
SAMPLES: dict[str, BaseException] = {
    "WfPersistError": wp.WfPersistError("x"),
    "InvalidPayloadError": wp.InvalidPayloadError("input", [{"loc": ("a",), "msg": "bad"}]),
    "UnknownExecutionError": wp.UnknownExecutionError("id-1"),
    "WorkflowVersionConflictError": wp.WorkflowVersionConflictError("wf", 1, "aaa", "bbb"),
    "MissingWorkflowVersionError": wp.MissingWorkflowVersionError("wf", 2),
    "NonDeterminismError": wp.NonDeterminismError("step:a#1", "step:b#1"),
    "CancelledCallError": wp.CancelledCallError("ctx.run('charge')", "cancelled it while it ran"),
    "SchemaVersionError": wp.SchemaVersionError(None, "wf_0002", "wf-persist db upgrade"),
    "SchemaTooNewError": wp.SchemaTooNewError("wf_0099", "wf_0002"),
    "MergedSchemaVersionError": wp.MergedSchemaVersionError(
        "wf_0001", "wf_0002", "alembic upgrade heads", "alembic_version"
    ),
    "SchemaVersionConflictError": wp.SchemaVersionConflictError(
        "wf_0001", "wf_0001", "wf_0002", "DROP TABLE wf_persist_alembic_version"
    ),
    "SchemaNamesTakenError": wp.SchemaNamesTakenError(
        ["wf_executions"], "wf_0002", "wf-persist db upgrade"
    ),
    "StepExecutionError": wp.StepExecutionError("charge", {"name": "RuntimeError"}),
    "CodeExecutionError": wp.CodeExecutionError("block", {"name": "ValueError"}),
    "SignalNotWaitingError": wp.SignalNotWaitingError("id-1", "approval"),
    "SignalPayloadError": wp.SignalPayloadError("id-1", "approval", [{"loc": (), "msg": "no"}]),
    "SignalAlreadyDeliveredError": wp.SignalAlreadyDeliveredError("id-1", "approval"),
    "CannotCancelError": wp.CannotCancelError("id-1", "completed"),
    "SecretError": wp.SecretError("stripe-key", "missing"),
    "ResultTimeoutError": wp.ResultTimeoutError("id-1", 1.5),
    "ForkedRuntimeError": wp.ForkedRuntimeError(),
    "ClosedError": wp.ClosedError("Client"),
    "InvalidCursorError": wp.InvalidCursorError("zz"),
    "InvalidArgumentError": wp.InvalidArgumentError("bad"),
    "NotSerializableError": wp.NotSerializableError("result", "no"),
    "WorkflowFailedError": wp.WorkflowFailedError("id-1", {"name": "Boom"}),
    "ValueTooLargeError": wp.ValueTooLargeError("result of step x", 20, 10),
    "WorkflowDefinitionError": wp.WorkflowDefinitionError("bad"),
    "UnsupportedDatabaseError": wp.UnsupportedDatabaseError("oracle"),
    "DatabaseConnectError": wp.DatabaseConnectError("cannot connect", ConnectionRefusedError()),
    "DatabaseUnavailableError": wp.DatabaseUnavailableError("lost", ConnectionResetError(), True),
    "StatementCancelledError": wp.StatementCancelledError("timed out", TimeoutError(), False),
    "DriveFailedError": wp.DriveFailedError(10, {"name": "DataError"}),
    "PoolTooSmallError": wp.PoolTooSmallError(3, 5, 4),
    "PoolExhaustedError": wp.PoolExhaustedError("no connection of the pool was free"),
    "IdempotencyConflictError": wp.IdempotencyConflictError("wf", "key"),
    "LeaseLostError": wp.LeaseLostError("id-1"),
    "Cancelled": wp.Cancelled(False, "ops"),
    "WorkflowTimeoutError": wp.WorkflowTimeoutError("wf", "2026-12-02T00:00:00+00:00"),
    "StepTimeoutError": wp.StepTimeoutError("fetch", 1.5),
    "ChildWorkflowError": wp.ChildWorkflowError("id-2", "ship", {"name": "Boom"}),
}


def test_the_error_hierarchy_and_documented_attributes() -> None:
    names, attributes = _documented_errors()
    assert names <= set(SAMPLES), f"README errors without a sample here: {names - set(SAMPLES)}"
    assert len(names) >= 18 and len(attributes) >= 10, (names, attributes)
    public = {
        name: getattr(wp, name)
        for name in wp.__all__
        if inspect.isclass(getattr(wp, name)) and issubclass(getattr(wp, name), BaseException)
    }
    assert set(SAMPLES) <= set(public)
    for name, cls in public.items():
        if issubclass(cls, wp.Cancelled):  # a timeout unwinds as a cancellation does
            assert not issubclass(cls, Exception), "Cancelled must not be an Exception"
            assert not issubclass(cls, wp.WfPersistError)
        else:
            assert issubclass(cls, wp.WfPersistError), f"{name} is not a WfPersistError"
    for name in names:
        assert getattr(wp, name) is type(SAMPLES[name]), f"wp.{name} is exported"
    for name, attrs in attributes.items():
        sample = SAMPLES[name]
        for attr in attrs:
            assert hasattr(sample, attr), f"{name}.{attr} (README)"
    assert SAMPLES["UnknownExecutionError"].execution_id == "id-1"  # type: ignore[attr-defined]
    assert SAMPLES["CannotCancelError"].status == "completed"  # type: ignore[attr-defined]
    assert SAMPLES["SchemaVersionError"].head == "wf_0002"  # type: ignore[attr-defined]
    assert SAMPLES["NonDeterminismError"].actual == "step:b#1"  # type: ignore[attr-defined]
    cancelled_call = SAMPLES["CancelledCallError"]
    assert isinstance(cancelled_call, wp.NonDeterminismError)
    assert cancelled_call.call == "ctx.run('charge')"  # type: ignore[attr-defined]
    assert str(cancelled_call).startswith("ctx.run('charge'): the workflow body cancelled it")


# authoring -----------------------------------------------------------------------------


@dataclass
class Parcel:
    sku: str
    grams: int


@dataclass
class Label:
    sku: str
    code: str


@wp.step
def print_label(parcel: Parcel) -> Label:
    return Label(parcel.sku, f"{parcel.sku}-{parcel.grams}g")


@wp.workflow(name="ship", version=1)
def ship_wf(ctx: wp.Context, parcel: Parcel) -> Label:
    return ctx.run(print_label, parcel)


def test_dataclass_inputs_and_outputs(runtime: wp.Runtime) -> None:
    runtime.register(ship_wf)
    client = runtime.client()
    handle = client.start(ship_wf, Parcel("book", 350))
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Completed) and outcome.value == Label("book", "book-350g")
    assert isinstance(outcome.value, Label)
    history = client.history(handle.execution_id)
    assert history[0].event["payload"] == {"sku": "book", "grams": 350}
    started = next(r.event for r in history if r.event["type"] == "step.started")
    assert started["input"] == {"parcel": {"sku": "book", "grams": 350}}
    again = client.start(ship_wf, {"sku": "pen", "grams": "12"})
    assert client.result(again.execution_id).unwrap() == Label("pen", "pen-12g")
    with pytest.raises(wp.InvalidPayloadError) as info:
        client.start(ship_wf, {"sku": "pen"})
    assert [tuple(e["loc"]) for e in info.value.errors] == [("grams",)]


@wp.step(name="charge-card")
def charge_with_a_name(amount: int) -> str:
    return f"charged {amount}"


@wp.workflow(name="named-step", version=1)
def named_step_wf(ctx: wp.Context) -> list[str]:
    return [ctx.run(charge_with_a_name, 1), ctx.run(charge_with_a_name, 2)]


def test_a_step_named_explicitly_records_that_name(runtime: wp.Runtime) -> None:
    runtime.register(named_step_wf)
    client = runtime.client()
    handle = client.start(named_step_wf)
    assert client.result(handle.execution_id).unwrap() == ["charged 1", "charged 2"]
    completed = _events(client, handle.execution_id, "step.completed")
    assert [(e["stepName"], e["activityName"]) for e in completed] == [
        ("charge-card", "charge-card#1"),
        ("charge-card", "charge-card#2"),
    ]


# retention -----------------------------------------------------------------------------


def test_purge_deletes_in_batches_of_batch_size(runtime: wp.Runtime, tmp_path: Path) -> None:
    """5 finished runs, ``batch_size=2``: three short transactions (2, 2, 1 runs), as the
    database counts the DELETEs and commits, and one that finds no lapsed ``Limit`` slot
    to sweep."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    ids = [client.start(w.echo_wf, 2).execution_id for _ in range(5)]
    for execution_id in ids:
        client.result(execution_id)
    with counting(runtime.backend.base_engine, tmp_path / "count") as counter:
        deleted = client.purge(older_than=dt.timedelta(0), batch_size=2)
        counts = counter.counts()
    assert deleted == 5
    assert counts.verbs["DELETE"] == 6, "history and runs, once per batch"
    assert counts.transactions == 3 + 1, counts
    assert client.list(w.echo_wf).items == []


# processes -----------------------------------------------------------------------------


def test_make_demo_prints_the_result_and_history(procs: Processes, tmp_path: Path) -> None:
    """``make demo`` runs examples/order.py on ./wf_persist.sqlite3; a second run finds the
    first by its idempotency key and prints the same."""
    env: dict[str, str | None] = {"WF_PERSIST_DATABASE_URL": None}
    script = str(ROOT / "examples" / "order.py")
    first = procs.run([sys.executable, script], cwd=tmp_path, env=env).stdout
    second = procs.run([sys.executable, script], cwd=tmp_path, env=env).stdout
    assert (tmp_path / "wf_persist.sqlite3").exists()
    head = re.search(r"place-order@v1 execution (\S+) \(new\): completed", first)
    assert head, first
    assert f"place-order@v1 execution {head[1]} (found by idempotency key): completed" in second
    confirmation = json.loads(first[first.index("{") : first.index("}") + 1])
    assert confirmation["order_id"] == "A-1001"
    assert confirmation["total_cents"] == 2 * 1250 + 3 * 199
    assert confirmation["payment_id"] == "pay_ada_3097"
    assert confirmation["reservation_id"] == "res_bookx2_penx3"
    again = json.loads(second[second.index("{") : second.index("}") + 1])
    assert again == confirmation, "the second run charged nothing new"
    rows = [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in first.splitlines()
        if line.startswith("│")
    ]
    assert [row[0] for row in rows] == [str(n) for n in range(1, 12)]
    assert [row[3] for row in rows if row[2] == "step.completed"] == [
        "price#1",
        "reserve_stock#1",
        "charge_payment#1",
    ]
    assert [row[2] for row in rows] == [
        "execution.started",
        "workflow.started",
        "step.started",
        "step.completed",
        "step.started",
        "step.completed",
        "step.started",
        "step.completed",
        "now.recorded",
        "uuid.recorded",
        "workflow.completed",
    ]


def test_worker_cli_poll_interval_and_sigint(
    procs: Processes, tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """``--poll-interval`` overrides the application's interval (here 30 s: a run started
    from another process would wait that long for a worker that ignored the option), and
    SIGINT stops the worker cleanly."""
    url = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    with wp.Runtime(url) as starter:
        starter.register(*w.ALL)
        client = starter.client()
        first = client.start(w.echo_wf, 2)
        worker = procs.worker(url, "--poll-interval", "0.1", app_poll_interval=30)
        worker.wait_for_stderr("serving")
        wait_status(client, first.execution_id, "completed")
        for _ in range(2):  # started while the worker idles: seen at its next look
            later = client.start(w.echo_wf, 3)
            wait_status(client, later.execution_id, "completed", timeout=10)
    assert worker.stop(signal.SIGINT) == 0
    assert "stopping (SIGINT)" in worker.stderr()


def test_a_dead_workers_limit_slot_is_released(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """A worker killed inside a ``Limit(1)`` step held the slot database-wide; it lapses a
    lease TTL later, so the other worker, which took the run over, gets the slot."""
    runtime.register(*w.ALL)
    client = runtime.client()
    workers = [procs.worker(db_url, lease_ttl=1.0) for _ in range(2)]
    for worker in workers:
        worker.wait_for_stderr("serving")
    marks, hang = tmp_path / "marks", tmp_path / "hang"
    hang.touch()
    job = {"marks": str(marks), "hang_file": str(hang)}
    first = client.start(w.hold_slot_wf, {**job, "label": "first"})
    wait_for_mark(marks, "first-start")

    def slot_free() -> bool:
        with runtime.slots.slot("hold_slot", "hold_slot", 1, "probe") as acquire:
            return acquire()

    assert not slot_free(), "the worker holds the step's slot, database-wide"
    (holder_pid,) = {int(line.split()[1]) for line in marks.read_text().splitlines()}
    (doomed,) = [worker for worker in workers if worker.pid == holder_pid]
    (survivor,) = [worker for worker in workers if worker is not doomed]
    doomed.stop(signal.SIGKILL)
    # The survivor takes the run over once its lease lapses, and gets the slot once the
    # dead worker's lapses (a lease TTL after its last renewal): the step starts again.
    wait_until(
        lambda: marks.read_text().count("first-start") == 2, 30, "the dead worker's slot lapses"
    )
    hang.unlink()
    second = client.start(w.hold_slot_wf, {**job, "label": "second"})
    wait_status(client, second.execution_id, "completed")
    wait_status(client, first.execution_id, "completed")
    assert survivor.stop() == 0
    starts = [line.split() for line in marks.read_text().splitlines()]
    assert sorted(label for label, _ in starts) == [
        "first",
        "first-start",
        "first-start",
        "second",
        "second-start",
    ]
    assert {int(pid) for label, pid in starts if label != "first-start"} == {survivor.pid}


def test_readme_python_blocks_parse() -> None:
    """The README's examples are Python that parses (a broken snippet is a broken promise)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 8
    for block in blocks:
        ast.parse(block)
