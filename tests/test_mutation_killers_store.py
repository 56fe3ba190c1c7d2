"""Mutant killers for the store (catalog, executions, signals) and for step attempts: what
they record, the errors they raise and the log records they write.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no other selected
test asserted, and its docstring names the mutants it kills. Several cover what a test file
the mutation selection leaves out already pins (``tests/test_messages.py``,
``tests/test_diagnostics.py``, ``tests/test_bad_input.py``, ``tests/test_thin_client.py``),
fast and in this process; those with a named schema run on PostgreSQL only, while the
mutation run itself is SQLite's.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, select, text, update
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist import migrate
from wf_persist.error_documents import MAX_TRACEBACK
from wf_persist.models import history_table as hist
from wf_persist.models import workflows_table as wft

from .fixtures import fencing as f
from .fixtures import messaging as m
from .fixtures import workflows as w
from .fixtures.workflows import SimulatedCrash
from .test_mutation_killers import T0, _create, _row, mutation_refuse

# listing -------------------------------------------------------------------------------


def test_runs_created_at_one_instant_are_listed_by_id_whatever_the_filter(
    runtime: wp.Runtime,
) -> None:
    """``list`` is ordered by ``(created_at, id)``: runs created at the same instant come
    by id, with or without a workflow, a status or a page size, however they were inserted.
    Kills ``list_page``'s mutants that drop ``id`` from the ORDER BY (with 40 ties neither
    SQLite nor PostgreSQL returns them by id without it)."""
    ids = [str(uuid.UUID(int=i + 1)) for i in range(40)]
    for execution_id in random.Random(7).sample(ids, len(ids)):
        _create(runtime, execution_id, T0, None)
    client = runtime.client()

    def listed(**kwargs: Any) -> list[str]:
        return [i.execution_id for i in client.list(**kwargs).items]

    assert listed(workflow=w.echo_wf) == ids
    assert listed() == ids
    assert listed(status="running") == ids
    assert listed(workflow=w.echo_wf, limit=5) == ids[:5]


# the catalog -----------------------------------------------------------------------------


def _catalog_row(engine: Engine, name: str, schema: str | None = None) -> dict[str, Any]:
    table = wft if schema is None else wft.to_metadata(sa.MetaData(), schema=schema)
    with engine.connect() as conn:
        return dict(conn.execute(select(table).where(table.c.name == name)).mappings().one())


def test_a_version_cataloged_without_schemas_gets_each_missing_one_from_its_next_registration(
    runtime: wp.Runtime, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """``catalog_version``: a version cataloged without its input or output schema (before
    they were recorded) gets what is missing from the next registration of the same source,
    from any process; a schema already there is left as it is. Kills the
    ``catalog_version`` mutants of that UPDATE (no statement, no values, no name or version
    in its WHERE)."""
    runtime.register(w.echo_wf, w.approval_wf)
    full = _catalog_row(runtime.engine, "echo")
    assert full["input_schema"] == {"type": "integer"} and full["output_schema"] is not None
    with runtime.transaction() as conn:
        conn.execute(update(wft).values(input_schema=None, output_schema=None))
    make_runtime().register(w.echo_wf)  # e.g. a worker of the new release starting
    again = _catalog_row(runtime.engine, "echo")
    assert (again["input_schema"], again["output_schema"]) == (
        full["input_schema"],
        full["output_schema"],
    )
    assert _catalog_row(runtime.engine, "approval")["input_schema"] is None, "only its version"
    marker = {"type": "integer", "description": "recorded by another process"}
    with runtime.transaction() as conn:
        conn.execute(update(wft).where(wft.c.name == "echo").values(output_schema=None))
        conn.execute(update(wft).where(wft.c.name == "echo").values(input_schema=marker))
    make_runtime().register(w.echo_wf)
    last = _catalog_row(runtime.engine, "echo")
    assert last["input_schema"] == marker, "a recorded schema is never replaced"
    assert last["output_schema"] == full["output_schema"]


@pytest.mark.needs("schemas")
def test_a_host_session_starts_and_catalogs_in_the_runtimes_named_schema(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """README: ``Runtime(engine, schema="wf")`` keeps every table in schema ``wf``, and a
    start or a registration in the host's own session (whose connection knows nothing of
    that schema) writes there too: the run and its first event, the catalog row and the
    schemas a registration fills in, and the existing run returned for an idempotency key.
    Kills the ``create`` and ``catalog_version`` mutants that run one of those statements
    without the schema translation."""
    migrate.upgrade(blank_db_url, schema="wf")
    engine = make_engine(blank_db_url)
    with wp.Runtime(engine, schema="wf") as rt:
        client = rt.client()
        with Session(engine) as session:  # the host's session, its default schema
            first = client.start(w.echo_wf, 2, idempotency_key="order-1", session=session)
            session.commit()
        with Session(engine) as session:
            again = client.start(w.echo_wf, 2, idempotency_key="order-1", session=session)
            session.commit()
        assert (again.execution_id, again.created) == (first.execution_id, False)
        assert client.result(first.execution_id, timeout=10).unwrap() == [1, 2]
        assert _catalog_row(engine, "echo", "wf")["input_schema"] == {"type": "integer"}
        with engine.begin() as conn:
            conn.execute(text("UPDATE wf.wf_workflows SET input_schema = NULL"))
    with wp.Runtime(engine, schema="wf") as other, Session(engine) as session:
        other.register(w.echo_wf, session=session)
        session.commit()
    assert _catalog_row(engine, "echo", "wf")["input_schema"] == {"type": "integer"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('public.wf_executions')")).scalar() is None


# idempotency ----------------------------------------------------------------------------


def test_a_start_whose_key_a_transaction_cannot_see_yet_says_which_run_to_retry(
    runtime: wp.Runtime, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``IdempotencyConflictError``: a host transaction whose snapshot is older than a
    concurrent start with the same key either sees that run (and gets its handle) or, at
    REPEATABLE READ (MySQL/MariaDB's default), cannot: the error names the workflow and the
    key, and a start in a new transaction gets the existing run. Kills ``create``'s mutant
    that drops the workflow's name from the error."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    host = make_engine(db_url)
    with host.connect() as conn:
        conn.execute(select(sa.literal(1)).select_from(hist)).all()  # the snapshot starts
        first = client.start(w.echo_wf, 1, idempotency_key="k-1")  # commits meanwhile
        try:
            seen = client.start(w.echo_wf, 1, idempotency_key="k-1", session=conn)
        except wp.IdempotencyConflictError as exc:
            assert (exc.workflow_name, exc.idempotency_key) == ("echo", "k-1")
            assert str(exc).startswith("a run of echo with idempotency key 'k-1' was started")
        else:
            assert (seen.execution_id, seen.created) == (first.execution_id, False)
        conn.rollback()
    retried = client.start(w.echo_wf, 1, idempotency_key="k-1")
    assert (retried.execution_id, retried.created) == (first.execution_id, False)


# buffered signals ------------------------------------------------------------------------


def _events(client: wp.WorkflowClient, execution_id: str, kind: str) -> list[Any]:
    return [r for r in client.history(execution_id) if r.event["type"] == kind]


def test_a_buffered_signal_is_recorded_whole_and_the_next_wait_takes_it(
    runtime: wp.Runtime,
) -> None:
    """``signal(..., buffer=True)`` to a run not waiting on the name records
    ``signal.buffered`` (the run, the name, a fresh ``signalId``, the payload, the actor,
    a time) and returns ``"buffered"``; the run's next wait takes it by that id, recording
    its schema, so a later buffered payload that misfits it is refused at once
    (``SignalPayloadError``, nothing recorded). Kills the ``deliver`` mutants of the
    buffered branch and the ``_waits`` ones that lose the schema a taken signal records."""
    runtime.register(m.inbox_wf)
    client = runtime.client()
    run = client.start(m.inbox_wf, {"count": 2, "nap": 3600}).execution_id
    assert client.signal(run, "approval", {"approved": True}, buffer=True, actor="kim") == (
        "buffered"
    )
    (record,) = _events(client, run, "signal.buffered")
    buffered = record.event
    signal_id = buffered["signalId"]
    assert str(uuid.UUID(signal_id)) == signal_id
    assert buffered == {
        "type": "signal.buffered",
        "executionId": run,
        "name": "approval",
        "signalId": signal_id,
        "payload": {"approved": True},
        "actor": "kim",
    }
    assert isinstance(record.created_at, dt.datetime)
    assert _row(runtime, run)["next_seq"] == record.sequence + 1
    assert runtime.drive(run)  # takes it without waiting, then naps
    (received,) = [r.event for r in _events(client, run, "signal.received")]
    assert received["signalId"] == signal_id and received["payload"] == {"approved": True}
    assert received["payloadSchema"]
    history_before = [r.event for r in client.history(run)]
    with pytest.raises(wp.SignalPayloadError):
        client.signal(run, "approval", {"approved": "yes"}, buffer=True)
    assert [r.event for r in client.history(run)] == history_before
    assert client.signal(run, "approval", {"approved": False}, buffer=True) == "buffered"
    second = [r.event["signalId"] for r in _events(client, run, "signal.buffered")]
    assert len(set(second)) == 2, "each buffered signal has an id of its own"


def test_a_buffered_send_to_a_waiting_run_is_delivered_and_its_wait_still_judges_later_ones(
    runtime: wp.Runtime,
) -> None:
    """A send with ``buffer=True`` while the run waits on the name is delivered to that
    wait (``"delivered"``); once delivered, the wait's recorded schema (not the delivery)
    still judges a buffered payload of the name. A finished run takes no signal:
    ``SignalNotWaitingError`` with its ``status``. Kills the ``deliver`` mutants that
    buffer for a pending wait, report a delivery as buffered, or lose the status, and the
    ``_waits`` ones that let a delivery stand for the wait's schema."""
    runtime.register(m.inbox_wf, w.echo_wf)
    client = runtime.client()
    run = client.start(m.inbox_wf, {"count": 2, "nap": 3600}).execution_id
    assert runtime.drive(run)  # parks on approval#1
    assert [p.activity_name for p in client.pending_signals(run)] == ["approval#1"]
    assert client.signal(run, "approval", {"approved": False}, buffer=True) == "delivered"
    assert _events(client, run, "signal.buffered") == []
    assert client.signal(run, "other", {"any": 1}, buffer=True) == "buffered"
    with pytest.raises(wp.SignalPayloadError):
        client.signal(run, "approval", {"approved": "yes"}, buffer=True)
    assert runtime.drive(run)
    assert [r.event["payload"] for r in _events(client, run, "signal.received")] == [
        {"approved": False}
    ]
    done = client.start(w.echo_wf, 2).execution_id
    assert client.result(done, timeout=10).unwrap() == [1, 2]
    for buffer in (False, True):
        with pytest.raises(wp.SignalNotWaitingError) as caught:
            client.signal(done, "approval", {"approved": True}, buffer=buffer)
        assert caught.value.status == "completed"
        assert str(caught.value).endswith("(it is completed)")


# step attempts: logs, sizes, secrets ---------------------------------------------------------

ALWAYS: list[int] = []


@wp.step(retry=wp.Retry(attempts=2))
def mutation_down() -> str:
    ALWAYS.append(1)
    raise ConnectionError("budget service down")


@wp.workflow(name="mutation-logged-failures", version=1)
def logged_failures_wf(ctx: wp.Context) -> str:
    return ctx.run(mutation_down)


def test_failed_attempts_are_logged_with_the_run_workflow_step_and_attempt(
    runtime: wp.Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """README (Diagnostics): ``wf_persist.steps`` logs a failed attempt that is retried as a
    warning and the step's last failure as an error, and every record carries
    ``execution_id``, ``workflow``, ``step`` and ``attempt`` as attributes. Kills the
    ``_log_failure`` mutants of those fields and ``_execute``'s that pass no step name or
    no ``final``."""
    ALWAYS.clear()
    runtime.register(logged_failures_wf)
    client = runtime.client()
    caplog.set_level(logging.INFO, logger="wf_persist")
    execution_id = client.start(logged_failures_wf).execution_id
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    records = [r for r in caplog.records if r.name == "wf_persist.steps"]
    fields = [
        (
            r.levelname,
            getattr(r, "execution_id", None),
            getattr(r, "workflow", None),
            getattr(r, "step", None),
            getattr(r, "attempt", None),
        )
        for r in records
    ]
    assert fields == [
        ("WARNING", execution_id, "mutation-logged-failures", "mutation_down", 1),
        ("ERROR", execution_id, "mutation-logged-failures", "mutation_down", 2),
    ]


@wp.step
def mutation_big_result(size: int) -> str:
    return "x" * size


@wp.step
def mutation_take(value: str) -> int:
    return len(value)


@wp.workflow(name="mutation-sizes", version=1)
def sizes_wf(ctx: wp.Context, spec: dict[str, Any]) -> int:
    if spec["where"] == "result":
        return len(ctx.run(mutation_big_result, spec["size"]))
    return ctx.run(mutation_take, "x" * spec["size"])


def test_a_step_value_too_large_for_the_database_fails_the_run_naming_it(
    runtime: wp.Runtime,
) -> None:
    """``ValueTooLargeError.what`` names the value: a step's result too large fails the
    step (``StepExecutionError`` with that cause, nothing completed), and arguments too
    large fail the run before the step starts. Kills the ``_attempt`` and ``_execute``
    mutants that check the size of nothing or name nothing (the mutation selection leaves
    out ``tests/test_bad_input.py``, which pins the same)."""
    runtime.register(sizes_wf)
    client = runtime.client()
    runtime.backend.max_value_bytes = limit = 10_000  # a traceback still fits
    too_big = client.start(sizes_wf, {"where": "result", "size": limit}).execution_id
    outcome = client.result(too_big, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    cause = outcome.error["cause"]
    assert cause["name"] == "ValueTooLargeError"
    assert cause["message"].startswith("result of step mutation_big_result is ")
    assert "step.completed" not in [r.event["type"] for r in client.history(too_big)]
    arguments = client.start(sizes_wf, {"where": "arguments", "size": limit}).execution_id
    outcome = client.result(arguments, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "ValueTooLargeError"
    assert outcome.error["message"].startswith("arguments of step mutation_take is ")
    assert "step.started" not in [r.event["type"] for r in client.history(arguments)]


def test_a_secret_where_a_stored_traceback_is_cut_is_scrubbed_before_the_cut(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a stored traceback is scrubbed of secret values and keeps its last 8000
    characters; it is scrubbed before it is cut, so a secret straddling the cut leaves no
    fragment the redactor would no longer recognise. Kills ``StepRunner.error_document``'s
    mutant that scrubs only the cut document (``tests/test_diagnostics.py``, which pins the
    same, is not in the mutation selection)."""
    secret = "sk_live_0123456789abcdef-very-secret"
    monkeypatch.setenv("STRIPE_KEY", secret)
    runtime = make_runtime(secret_resolver=wp.env_secret_resolver())
    runtime.register(f.leaky_padded_wf)
    client = runtime.client()
    pad = MAX_TRACEBACK - 1 - len(secret) // 2  # the last line ends with the pad and "\n"
    handle = client.start(f.leaky_padded_wf, {"api_key": wp.secret("stripe-key"), "pad": pad})
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "LeakyError"
    stored = json.dumps([r.event for r in client.history(handle.execution_id)])
    for found in (json.dumps(outcome.error), stored):
        assert secret[len(secret) // 2 :] not in found
        assert "secret:stripe-key" in found


# replays of recorded step outcomes -----------------------------------------------------------


def _edit_event(runtime: wp.Runtime, execution_id: str, kind: str, edit: Any) -> None:
    """Rewrite the run's (only) ``kind`` event as ``edit`` returns it."""
    with runtime.transaction() as conn:
        sequence, event = conn.execute(
            select(hist.c.sequence, hist.c.event).where(
                hist.c.execution_id == execution_id, hist.c.type == kind
            )
        ).one()
        conn.execute(
            update(hist)
            .where(hist.c.execution_id == execution_id, hist.c.sequence == sequence)
            .values(event=edit(dict(event)))
        )


@wp.workflow(name="mutation-undeclared-failure", version=1)
def undeclared_failure_wf(ctx: wp.Context) -> str:
    try:
        ctx.run(mutation_refuse, "no stock")
    except Exception as exc:
        caught = f"{type(exc).__name__}:{exc}"
    ctx.sleep(0.05)
    return caught


def test_a_terminal_failure_recorded_without_its_declared_type_replays_by_its_name(
    runtime: wp.Runtime,
) -> None:
    """Histories of earlier releases mark a terminal ``step.failed`` with ``terminal`` but
    no ``declared`` type: a replay still raises the declared error class of that name (here
    one not importable by its module path), not ``StepExecutionError``. Kills the
    ``_recorded_step_error`` mutants of that fallback."""
    runtime.register(undeclared_failure_wf)
    client = runtime.client()
    execution_id = client.start(undeclared_failure_wf).execution_id
    assert runtime.drive(execution_id)  # the step failed, the run sleeps
    (failed,) = [r.event for r in _events(client, execution_id, "step.failed")]
    assert failed["terminal"] is True and failed["declared"] == "Refused"

    def recorded_before_declared(event: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in event.items() if k != "declared"}

    _edit_event(runtime, execution_id, "step.failed", recorded_before_declared)
    assert client.result(execution_id, timeout=10).unwrap() == "Refused:no stock"


@wp.step
def mutation_text() -> str:
    return "abc"


#: Set to make the next drive of ``edited_result_wf`` stop after its step, as a process dies.
CRASH: dict[str, bool] = {}


@wp.workflow(name="mutation-edited-result", version=1)
def edited_result_wf(ctx: wp.Context) -> str:
    value = ctx.run(mutation_text)
    if CRASH.pop("once", False):
        raise SimulatedCrash
    return value


def test_a_recorded_result_that_no_longer_fits_its_step_fails_the_run_naming_it(
    runtime: wp.Runtime,
) -> None:
    """``from_json``: a recorded value that no longer fits its type is a typed error. A run
    resumed after its driver died, whose recorded step result no longer fits the step's
    return type (the step's code changed meanwhile), fails with ``InvalidPayloadError``
    naming the recorded result of that step. Kills ``StepRunner.run``'s mutant that names
    nothing."""
    runtime.register(edited_result_wf)
    client = runtime.client()
    execution_id = client.start(edited_result_wf).execution_id
    CRASH["once"] = True
    with pytest.raises(SimulatedCrash):
        client.result(execution_id, timeout=10)
    assert "step.completed" in [r.event["type"] for r in client.history(execution_id)]

    def an_integer(event: dict[str, Any]) -> dict[str, Any]:
        return {**event, "result": 42}

    _edit_event(runtime, execution_id, "step.completed", an_integer)
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "InvalidPayloadError"
    assert outcome.error["message"].startswith(
        "Invalid recorded result of step mutation_text: <root>:"
    )


# a bug: arguments a step changes in place ----------------------------------------------------

UNDONE: list[Any] = []


def mutation_undo(result: str, data: Any, reason: dict[str, Any]) -> None:
    UNDONE.append(data)


@wp.step(compensate=mutation_undo)
def mutation_mutates(data: Any) -> str:
    data["touched"] = True  # changes the argument it was given
    return "done"


class MutationStop(Exception):
    pass


@wp.step(errors=(MutationStop,))
def mutation_stop() -> None:
    raise MutationStop("stop")


@wp.workflow(name="mutation-mutated-argument", version=1)
def mutated_argument_wf(ctx: wp.Context) -> None:
    ctx.run(mutation_mutates, {"a": 1})
    ctx.run(mutation_stop)


def test_a_step_changing_its_argument_in_place_records_and_compensates_what_it_was_given(
    runtime: wp.Runtime,
) -> None:
    """``StepCall.inputs``: a step's arguments are stored as validated JSON at the call,
    and a compensation's arguments are the step's. An ``Any`` argument validates to the
    very object stored, so the attempt gets a copy (``values.fresh``): a step that changes
    it in place changes neither its recorded input (written after the attempt, with its
    outcome) nor its compensation's argument."""
    UNDONE.clear()
    runtime.register(mutated_argument_wf)
    client = runtime.client()
    execution_id = client.start(mutated_argument_wf).execution_id
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "MutationStop"
    started = [
        r.event["input"]
        for r in _events(client, execution_id, "step.started")
        if r.event["stepName"] == "mutation_mutates"
    ]
    assert started == [{"data": {"a": 1}}]
    assert UNDONE == [{"a": 1}]
