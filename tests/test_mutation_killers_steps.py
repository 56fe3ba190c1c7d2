"""More mutant killers: retries inside ``ctx.all``, replays reaching a parked retry or an
unwind cut short, the delayed ``step.started``, the journal's signal and compensation
records, and the runtime's registry and input checks.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no other test
asserted, and its docstring names the mutants it kills.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import wf_persist as wp
from wf_persist.errors import WfPersistError
from wf_persist.leases import Outage
from wf_persist.models import workflows_table as wft
from wf_persist.replay import Journal, Received, TimedOut
from wf_persist.store import executions

from .fixtures import saga as s
from .fixtures import workflows as w
from .fixtures.workflows import SimulatedCrash
from .helpers import history_types, wait_until
from .test_mutation_killers import (
    ATTEMPTS,
    CANCELLER,
    _row,
    cancel_own_run,
)

# retries inside ctx.all ------------------------------------------------------------------

FLAKY: dict[str, int] = {}


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=1.2))
def flaky_branch(key: str) -> str:
    FLAKY[key] = FLAKY.get(key, 0) + 1
    if FLAKY[key] == 1:
        raise RuntimeError(f"{key}: first attempt fails")
    return key


@wp.workflow(name="mutation-branch-retry", version=1)
def branch_retry_wf(ctx: wp.Context) -> list[str]:
    return ctx.all([wp.call(flaky_branch, "a"), wp.call(flaky_branch, "b")])


def test_a_branch_waits_out_a_long_retry_delay_in_its_thread(runtime: wp.Runtime) -> None:
    """``StepRunner.wait_until``: a retry delay longer than the inline limit parks the run,
    except inside ``ctx.all``, whose branches wait in their own threads (a parked branch
    would park its siblings too). One drive completes the block. Kills the ``Context.all``
    mutants that run branches without ``inline``, ``StepRunner.run``'s that drops it and
    ``_execute``'s/``wait_until``'s that ignore it."""
    FLAKY.clear()
    runtime.register(branch_retry_wf)
    client = runtime.client()
    execution_id = client.start(branch_retry_wf).execution_id
    assert runtime.drive(execution_id)
    assert _row(runtime, execution_id)["status"] == "completed", "one drive, never parked"
    assert client.result(execution_id, timeout=5).unwrap() == ["a", "b"]
    assert FLAKY == {"a": 2, "b": 2}


@wp.step(retry=wp.Retry(attempts=3, backoff="exponential", base=60, factor=1))
def fails_for_a_minute() -> str:
    ATTEMPTS.append(1)
    raise RuntimeError("still down")


@wp.workflow(name="mutation-parked-retry-minute", version=1)
def parked_minute_wf(ctx: wp.Context) -> str:
    """A retry a minute away: a loaded machine never reaches it within the test."""
    return ctx.run(fails_for_a_minute)


def test_a_parked_retry_woken_early_parks_again_until_its_retry_time(
    runtime: wp.Runtime,
) -> None:
    """A run parked for a retry and made due before its retry time (as a delivered signal
    or ``wake`` does) replays to the step and parks again until the same time, without
    running another attempt. Kills ``_execute``'s mutant that forgets the recorded retry
    time on replay."""
    ATTEMPTS.clear()
    runtime.register(parked_minute_wf)
    execution_id = runtime.client().start(parked_minute_wf).execution_id
    assert runtime.drive(execution_id)
    assert len(ATTEMPTS) == 1
    before = _row(runtime, execution_id)
    types_before = history_types(runtime.client(), execution_id)
    with runtime.transaction() as conn:
        executions.wake(conn, runtime.backend, execution_id)
    assert runtime.drive(execution_id)
    after = _row(runtime, execution_id)
    assert len(ATTEMPTS) == 1, "no attempt before the retry time"
    assert after["wake_at"] == before["wake_at"] is not None, "parked until the same time"
    assert after["lease_owner"] is None and after["drive_failures"] == 0
    assert history_types(runtime.client(), execution_id) == types_before


RETRIED: list[int] = []


@wp.step(retry=wp.Retry(attempts=3, backoff="exponential", base=0.3, factor=3, jitter=True))
def jittered() -> int:
    RETRIED.append(1)
    if len(RETRIED) == 1:
        raise RuntimeError("first attempt fails")
    return len(RETRIED)


@wp.workflow(name="mutation-jittered-retry", version=1)
def jittered_wf(ctx: wp.Context) -> int:
    return ctx.run(jittered)


def test_a_jittered_retry_waits_the_first_delay_and_completes_numbered(
    runtime: wp.Runtime,
) -> None:
    """``Retry``: the delay before attempt 2 is ``base`` (``factor ** 0``), scaled by a
    random factor in [0.5, 1) with ``jitter``, recorded as ``retryAt``; the attempt that
    succeeds records its number in ``step.completed``. Kills ``_execute``'s mutants that
    pass no random source, count the attempt wrong for the delay, or drop the attempt
    number of ``step.completed``."""
    RETRIED.clear()
    runtime.register(jittered_wf)
    client = runtime.client()
    execution_id = client.start(jittered_wf).execution_id
    assert client.result(execution_id, timeout=30).unwrap() == 2
    records = client.history(execution_id)
    failed = next(r for r in records if r.event["type"] == "step.failed")
    delay = (dt.datetime.fromisoformat(failed.event["retryAt"]) - failed.created_at).total_seconds()
    assert 0.14 <= delay < 0.3, delay
    completed = next(r.event for r in records if r.event["type"] == "step.completed")
    assert completed["attempt"] == 2


# cancellation reaching ctx.all -----------------------------------------------------------

RAN: list[str] = []


@wp.step
def noted(key: str) -> str:
    RAN.append(key)
    return key


@wp.workflow(name="mutation-cancel-then-all", version=1)
def cancel_then_all_wf(ctx: wp.Context) -> list[str]:
    ctx.run(cancel_own_run, ctx.execution_id)
    return ctx.all([wp.call(noted, "x"), wp.call(noted, "y")])


@wp.workflow(name="mutation-cancel-inside-all", version=1)
def cancel_inside_all_wf(ctx: wp.Context) -> list[str]:
    calls = [wp.call(cancel_own_run, ctx.execution_id), wp.call(noted, "y")]
    return ctx.all(calls, concurrency=1)


def _cancelled(runtime: wp.Runtime, workflow: Any) -> list[str]:
    RAN.clear()
    runtime.register(workflow)
    client = runtime.client()
    CANCELLER["client"] = client
    execution_id = client.start(workflow).execution_id
    outcome = client.result(execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert RAN == [], "no step started after the cancellation was seen"
    return history_types(client, execution_id)


def test_a_cancellation_seen_before_a_new_ctx_all_stops_it_before_it_starts(
    runtime: wp.Runtime,
) -> None:
    """Cancellation is checked before anything new runs: a ``ctx.all`` reached after a
    cancellation arrived records nothing of the block. Kills ``Context.all``'s mutant that
    checks only blocks already recorded."""
    types = _cancelled(runtime, cancel_then_all_wf)
    assert "all.started" not in types and "cancellation.received" in types


def test_a_cancellation_seen_inside_ctx_all_ends_the_block_unrecorded(
    runtime: wp.Runtime,
) -> None:
    """Control flow from a branch (here the cancellation a branch's step caused) wins over
    step errors and ends the block without a recorded outcome: the run unwinds as
    cancelled, ``all.completed``/``all.failed`` are never written. Kills ``Context.all``'s
    mutant that treats control flow as a branch failure."""
    types = _cancelled(runtime, cancel_inside_all_wf)
    assert "all.started" in types
    assert "all.completed" not in types and "all.failed" not in types


# an unwind cut short, replayed -------------------------------------------------------------


@pytest.mark.usefixtures("saga_reset")
def test_an_unwind_resumed_after_a_crash_reports_the_failures_recorded_before(
    rt: wp.Runtime,
) -> None:
    """A compensation failure recorded before a crash is part of the run's outcome after
    the unwind resumes (``Failed.compensation_errors``: step, activity, recorded error),
    and a compensation run on the resumed drive gets the step's recorded result and names
    the run. Kills the ``StepRunner.compensate`` mutants that lose the recorded failures or
    their fields or the run id of new compensation events, ``Journal.from_events``' that
    lose a recorded compensation error, and ``StepRunner.run``'s that registers a replayed
    step without its stored result."""
    s.CONTROL["fail_second_comp"] = True
    s.CONTROL["crash_in_compensation"] = True
    client = rt.client()
    execution_id = client.start(s.saga_wf, 5).execution_id
    with pytest.raises(SimulatedCrash):
        client.result(execution_id)
    s.CONTROL["crash_in_compensation"] = False
    outcome = client.result(execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Rejected"
    assert s.CALLS["undo_second"] == 1 and s.CALLS["undo_first"] == 2
    (recorded,) = outcome.compensation_errors
    assert (recorded["stepName"], recorded["activityName"]) == ("second_step", "second_step#1")
    assert recorded["error"]["message"] == "refund service down"
    events = [r.event for r in client.history(execution_id)]
    (resumed,) = [
        e for e in events if e["type"] == "compensation.started" and e["stepName"] == "first_step"
    ]
    assert resumed["executionId"] == execution_id
    assert resumed["result"] == "first-5" and resumed["input"] == {"value": 5}


# the journal ---------------------------------------------------------------------------------


def test_the_journal_settles_signal_waits_and_remembers_compensations() -> None:
    """What a replay learns from signal and compensation events: a received signal or a
    timeout settles its wait (a signal taken from the buffer was never waited for), a code
    block that only started has no outcome, and each finished compensation is remembered
    with its error (an empty one when the event has none) or ``None``. Kills the
    ``Journal.from_events`` mutants of those branches."""

    def ev(etype: str, act: str, **fields: object) -> dict[str, object]:
        return {"type": etype, "activityName": act, **fields}

    journal = Journal.from_events(
        [
            ev("signal.waiting", "go#1", name="go"),
            ev("signal.received", "go#1", payload={"ok": 1}),
            ev("signal.waiting", "late#1", name="late"),
            ev("signal.timeout", "late#1"),
            ev("signal.received", "buffered#1", payload=2),  # taken, never waited for
            ev("signal.waiting", "open#1", name="open"),
            ev("code.started", "compute#1", name="compute"),
            ev("compensation.completed", "a#1"),
            ev("compensation.failed", "b#1", error={"name": "E", "message": "no"}),
            ev("compensation.failed", "c#1"),
        ]
    )
    assert set(journal.waiting) == {"open#1"}
    received = journal.outcomes["go#1"][1]
    assert isinstance(received, Received) and received.value == {"ok": 1}
    assert isinstance(journal.outcomes["late#1"][1], TimedOut)
    assert journal.outcomes["buffered#1"][1] == Received(2)
    assert "compute#1" not in journal.outcomes and "open#1" not in journal.outcomes
    assert journal.compensated == {"a#1": None, "b#1": {"name": "E", "message": "no"}, "c#1": {}}


# the delayed step.started ----------------------------------------------------------------

STEP_GATE = threading.Event()
STEP_RUNNING = threading.Event()


@wp.step
def gated() -> str:
    STEP_RUNNING.set()
    assert STEP_GATE.wait(30)
    return "done"


@wp.workflow(name="mutation-gated-step", version=1)
def gated_wf(ctx: wp.Context) -> str:
    return ctx.run(gated)


def test_an_attempts_start_is_recorded_on_its_own_only_once_it_runs_long(
    make_runtime: Any,
) -> None:
    """``record_start_after`` (default 1 s): an attempt is one write with its outcome,
    unless it is still running after that long, when its ``step.started`` is recorded on
    its own. Kills the ``_StartWatch`` mutants that record every start at once."""
    STEP_GATE.clear()
    STEP_RUNNING.clear()
    runtime = make_runtime()
    runtime.register(gated_wf)
    client = runtime.client()
    execution_id = client.start(gated_wf).execution_id
    thread = threading.Thread(target=runtime.drive, args=(execution_id,))
    thread.start()
    try:
        assert STEP_RUNNING.wait(10)
        time.sleep(0.3)
        assert "step.started" not in history_types(client, execution_id), "recorded at once"
        wait_until(
            lambda: "step.started" in history_types(client, execution_id),
            timeout=10,
            what="the delayed step.started",
        )
    finally:
        STEP_GATE.set()
        thread.join(30)
    assert client.result(execution_id, timeout=10).unwrap() == "done"
    assert history_types(client, execution_id).count("step.started") == 1


# the runtime: registry, input checks, wake-ups, closed --------------------------------------


@wp.workflow(name="mutation-registry", version=1)
def registry_v1(ctx: wp.Context, n: int) -> int:
    return n


def _registry_v1_edited() -> Any:
    @wp.workflow(name="mutation-registry", version=1)
    def registry_v1(ctx: wp.Context, n: int) -> int:  # another source, same name/version
        return n + 1

    return registry_v1


def test_a_version_registered_twice_with_another_source_is_refused_naming_both(
    make_runtime: Any,
) -> None:
    """``register``: the first registration of a (name, version) wins; the same source
    registers again from another runtime, another source is refused with
    ``WorkflowVersionConflictError`` naming the workflow, version and both hashes, whether
    this runtime or the database catalog knows the first. The catalog row keeps the input
    and output schemas. Kills the ``Runtime.register`` mutants of the conflict checks and
    their error arguments, and the one that catalogs no schemas."""
    first, second = make_runtime(), make_runtime()
    first.register(registry_v1)
    second.register(registry_v1)  # the same source: fine
    edited = _registry_v1_edited()
    assert edited.source_hash != registry_v1.source_hash
    for runtime in (first, make_runtime()):  # known here / known only to the catalog
        with pytest.raises(wp.WorkflowVersionConflictError) as caught:
            runtime.register(edited)
        error = caught.value
        assert (error.workflow_name, error.version) == ("mutation-registry", 1)
        assert (error.cataloged_hash, error.new_hash) == (
            registry_v1.source_hash,
            edited.source_hash,
        )
    with first.transaction() as conn:
        row = conn.execute(select(wft).where(wft.c.name == "mutation-registry")).mappings().one()
    assert row["input_schema"] == {"type": "integer"}
    assert row["output_schema"] == {"type": "integer"}


@wp.workflow(name="mutation-no-input", version=1)
def no_input_wf(ctx: wp.Context) -> str:
    return "ok"


@wp.workflow(name="mutation-text-input", version=1)
def text_wf(ctx: wp.Context, text: str) -> int:
    return len(text)


def test_input_errors_name_the_workflows_input(runtime: wp.Runtime) -> None:
    """``start`` checks the input: a workflow that takes none refuses one, saying so; an
    invalid or too large input is refused naming ``input of workflow <name>``. Kills the
    ``Runtime.validate_input`` mutants of those errors' arguments."""
    client = runtime.client()
    with pytest.raises(wp.InvalidPayloadError) as caught:
        client.start(no_input_wf, 3)
    assert caught.value.what == "input of workflow mutation-no-input"
    assert caught.value.errors == [{"loc": (), "msg": "this workflow takes no input"}]
    with pytest.raises(wp.InvalidPayloadError) as caught:
        client.start(registry_v1, "not a number")
    assert caught.value.what == "input of workflow mutation-registry"
    runtime.backend.max_value_bytes = 64
    with pytest.raises(wp.ValueTooLargeError) as too_large:
        client.start(text_wf, "x" * 200)
    assert "input of workflow mutation-text-input" in str(too_large.value)


def test_a_closed_runtime_refuses_work_saying_so(make_runtime: Any) -> None:
    """A closed runtime refuses new work with the root error type saying it is closed.
    Kills the ``Runtime._check_open`` mutants of its message."""
    runtime = make_runtime()
    runtime.close()
    with pytest.raises(WfPersistError, match=r"^Workflow runtime has been closed$"):
        runtime.register(registry_v1)


def test_a_start_wakes_the_starting_processs_worker_at_once(make_runtime: Any) -> None:
    """README: a process that starts a run wakes its own worker at once, whatever its poll
    interval. Kills ``Runtime._notify``'s mutant that wakes nobody."""
    runtime = make_runtime()
    runtime.register(w.echo_wf)
    runtime.start_worker(concurrency=1, poll_interval=30)
    time.sleep(0.2)  # the worker's first look for work found nothing: it waits
    client = runtime.client()
    began = time.monotonic()
    execution_id = client.start(w.echo_wf, 7).execution_id
    wait_until(
        lambda: _row(runtime, execution_id)["status"] == "completed",
        timeout=10,
        what="the worker to run the new start",
    )
    assert time.monotonic() - began < 5


def test_nothing_scheduled_means_no_next_wake(runtime: wp.Runtime) -> None:
    """``seconds_to_next_wake`` is ``None`` when no run of this runtime's workflows has a
    wake time. Kills its mutant that subtracts from a missing time."""
    runtime.register(w.echo_wf)
    assert runtime.seconds_to_next_wake() is None


def test_an_outages_backoff_doubles_up_to_ten_seconds_and_names_what_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``Outage``: the wait after each failure doubles from ``base`` up to the cap (10 s by
    default), and its log line names what failed. Kills the ``Outage.__init__`` mutants of
    the default cap and the name."""
    outage = Outage(logging.getLogger("wf_persist.test"), "claiming runs", base=1.0)
    with caplog.at_level(logging.ERROR, logger="wf_persist.test"):
        waits = [outage.failed(RuntimeError("down")) for _ in range(6)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert caplog.records[0].getMessage().startswith("claiming runs failed")


def test_in_memory_sqlite_urls_run_on_a_private_file_leaving_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: an in-memory SQLite URL (``sqlite://``, ``sqlite:///:memory:``, an empty
    path, or ``mode=memory``) simply works, on a private temporary database shared by the
    runtime's connections; nothing is written to the working directory. Kills the
    ``SQLiteBackend.configure_engine`` mutants that miss a form of the URL, keep its
    query, or put the database file in the working directory."""
    monkeypatch.chdir(tmp_path)
    for url in (
        "sqlite://",
        "sqlite:///",
        "sqlite:///:memory:",
        "sqlite:///file:wfmem?mode=memory&uri=true",
    ):
        with wp.Runtime(url) as runtime:
            runtime.register(w.echo_wf)
            client = runtime.client()
            execution_id = client.start(w.echo_wf, 5).execution_id
            assert client.result(execution_id, timeout=10).unwrap() == [1, 2, 3, 4, 5], url
            assert "memory" not in str(runtime.engine.url.query), url
    assert list(tmp_path.iterdir()) == []
