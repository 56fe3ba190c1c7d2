"""Mutant killers for driving runs: failed drives and their backoff, the log record of a
run resumed after its driver stopped mid-drive, events a run publishes (``ctx.set_event``),
the messages of rejected buffered signals, and a ``ctx.all`` branch that finds its retry
time still ahead after a crash.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no selected test
asserted, and its docstring names the mutants it kills. Where a drive has to stop mid-way,
a step (or the runtime's in-thread wait) raises ``SimulatedCrash``, a ``BaseException``
that nothing records, in this process, on the real database.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator
from sqlalchemy import create_engine, text

import wf_persist as wp
from wf_persist.backends.clock import db_now
from wf_persist.context import MAX_REJECTION_MESSAGE
from wf_persist.models import executions_table as ex

from .fixtures.workflows import SimulatedCrash
from .test_mutation_killers import _row
from .test_mutation_killers_driver import REFUSAL, _drop_sql, _trigger_sql


def _make_due(runtime: wp.Runtime, execution_id: str, **values: Any) -> None:
    """Make a run due now by the database's clock (as its timer, a signal or a lapsed lease
    would), setting ``values`` too."""
    with runtime.transaction() as conn:
        conn.execute(ex.update().where(ex.c.id == execution_id).values(wake_at=db_now(), **values))


def _events(runtime: wp.Runtime, execution_id: str, kind: str) -> list[dict[str, Any]]:
    return [r.event for r in runtime.client().history(execution_id) if r.event["type"] == kind]


# failed drives: the backoff and what the last one records ---------------------------------


@pytest.fixture
def refuse_history(db_url: str, backend: str) -> Iterator[Callable[[str], None]]:
    """Make the database refuse history rows matching an SQL condition on ``NEW`` (a
    trigger, dropped at teardown)."""
    engine = create_engine(db_url)

    def install(condition: str) -> None:
        with engine.begin() as conn:
            for sql in _trigger_sql(backend, condition):
                conn.execute(text(sql))

    try:
        yield install
    finally:
        with engine.begin() as conn:
            for sql in _drop_sql(backend):
                conn.execute(text(sql))
        engine.dispose()


@wp.step
def mutation_refused_write(n: int) -> int:
    return n


@wp.workflow(name="mutation-runs-refused", version=1)
def refused_write_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(mutation_refused_write, n)


def test_failed_drives_back_off_doubling_and_the_last_one_records_the_runs_failure(
    make_runtime: Callable[..., wp.Runtime], refuse_history: Callable[[str], None]
) -> None:
    """README, "Runs that keep failing end": a failed drive is "retried after a backoff
    (1 s, 2 s, 4 s, ... up to 60 s)", measured by the database's clock from the failure
    (``wake_at``), and recorded as ``drive.failed`` naming the run, its error and the count;
    the drive that reaches ``max_drive_failures`` fails the run and records its
    ``workflow.failed`` like any failed run (the run, its workflow, the stored error).
    Kills ``driver.failed`` mutants 79-82 (another backoff), 31 (``drive.failed`` without
    the run) and 48, 49, 51 (``workflow.failed`` without the run, the workflow or the
    error)."""
    refuse_history("NEW.type = 'step.completed'")
    runtime = make_runtime()
    runtime.register(refused_write_wf)
    client = runtime.client()
    execution_id = client.start(refused_write_wf, 3).execution_id
    backoffs = {}
    for before, count in ((0, 1), (3, 4), (7, 8)):
        if before:
            _make_due(runtime, execution_id, drive_failures=before)
        assert runtime.drive(execution_id)
        last = _events(runtime, execution_id, "drive.failed")[-1]
        assert (last["executionId"], last["failures"]) == (execution_id, count)
        assert REFUSAL in last["error"]["message"]
        row = _row(runtime, execution_id)
        assert row["status"] == "running" and row["drive_failures"] == count
        failed_at = runtime.client().history(execution_id)[-1].created_at
        assert isinstance(row["wake_at"], dt.datetime)
        backoffs[count] = (row["wake_at"] - failed_at).total_seconds()
    assert backoffs[1] == pytest.approx(1, abs=0.4)
    assert backoffs[4] == pytest.approx(8, abs=0.4)
    assert backoffs[8] == pytest.approx(60, abs=0.4), "2 ** 7 s, capped at 60 s"
    _make_due(runtime, execution_id, drive_failures=9)
    assert runtime.drive(execution_id)
    outcome = client.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)
    assert outcome.error["failures"] == 10
    [finished] = _events(runtime, execution_id, "workflow.failed")
    assert finished == {
        "type": "workflow.failed",
        "executionId": execution_id,
        "workflowName": "mutation-runs-refused",
        "error": outcome.error,
    }


# a run resumed after its driver stopped mid-drive ------------------------------------------


class MutationStop(Exception):
    """A terminal failure the workflow catches."""


@wp.step(errors=(MutationStop,))
def mutation_stops() -> None:
    raise MutationStop("stop")


DIED: set[str] = set()


@wp.step
def mutation_dies_once(key: str) -> str:
    if key not in DIED:
        DIED.add(key)
        raise SimulatedCrash(key)
    return key


@wp.workflow(name="mutation-runs-left-in-flight", version=1)
def left_in_flight_wf(ctx: wp.Context, key: str) -> str:
    with contextlib.suppress(MutationStop):
        ctx.run(mutation_stops)
    return ctx.run(mutation_dies_once, key)


@wp.workflow(name="mutation-runs-naps", version=1)
def naps_wf(ctx: wp.Context) -> str:
    ctx.sleep(3600)
    return "woke"


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=3600))
def mutation_fails_first() -> str:
    raise RuntimeError("try again in an hour")


@wp.workflow(name="mutation-runs-retries-later", version=1)
def retries_later_wf(ctx: wp.Context) -> str:
    return ctx.run(mutation_fails_first)


def test_only_a_run_whose_driver_stopped_mid_drive_is_logged_as_resumed(
    runtime: wp.Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """README, Diagnostics: ``wf_persist.runtime`` logs "a run resumed from a driver that
    stopped mid-drive" (``driver._left_in_flight``: running, no failed drive, and its last
    event neither a client's nor a retry parked for later). Logged once for a run whose
    driver died right after recording a step's final failure; not for a run's first drive,
    a sleeping run whose timer woke it, a run waking for a parked retry, or a run whose last
    drive failed (it is counted, not left in flight). Kills ``_left_in_flight`` mutants 1-3,
    9, 12-14 and 21, and ``driver._start`` mutants 13 and 19 (a fresh run, or the event
    before the last, taken for a run left in flight)."""
    DIED.clear()
    runtime.register(left_in_flight_wf, naps_wf, retries_later_wf)
    client = runtime.client()
    caplog.set_level(logging.INFO, logger="wf_persist")

    def resumed(execution_id: str) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if getattr(r, "execution_id", None) == execution_id and "resuming" in r.getMessage()
        ]

    crashed = client.start(left_in_flight_wf, "crashed").execution_id
    with pytest.raises(SimulatedCrash):
        runtime.drive(crashed)
    assert _events(runtime, crashed, "step.failed")[-1]["final"] is True, "the last event"
    assert resumed(crashed) == []
    assert runtime.drive(crashed)
    assert client.result(crashed, timeout=5).unwrap() == "crashed"
    [record] = resumed(crashed)
    assert (record.name, record.levelname) == ("wf_persist.runtime", "INFO")

    counted = client.start(left_in_flight_wf, "counted").execution_id
    with pytest.raises(SimulatedCrash):
        runtime.drive(counted)
    _make_due(runtime, counted, drive_failures=1)  # its last drive failed
    assert runtime.drive(counted)
    assert client.result(counted, timeout=5).unwrap() == "counted"

    napping = client.start(naps_wf).execution_id
    assert runtime.drive(napping)  # its first drive
    assert client.status(napping) == "suspended"
    _make_due(runtime, napping)  # its timer, say
    assert runtime.drive(napping)

    retrying = client.start(retries_later_wf).execution_id
    assert runtime.drive(retrying)
    assert _events(runtime, retrying, "step.failed")[-1]["final"] is False
    _make_due(runtime, retrying)
    assert runtime.drive(retrying)
    assert _row(runtime, retrying)["status"] == "running", "parked again for its retry"

    assert resumed(counted) == [] and resumed(napping) == [] and resumed(retrying) == []


# events a run publishes: ctx.set_event ----------------------------------------------------


@wp.workflow(name="mutation-runs-publishes", version=1)
def publishes_wf(ctx: wp.Context, what: str) -> str:
    if what == "nan":
        ctx.set_event("reading", float("nan"))
    elif what == "large":
        ctx.set_event("report", "x" * 4000)
    elif what == "no key":
        ctx.set_event("", 1)
    else:
        ctx.set_event("progress", {"done": 1})
        ctx.set_event("stage", "started")
        ctx.set_event("progress", {"done": 2})
    return what


def test_published_events_are_recorded_by_key_and_bad_ones_fail_the_run_naming_them(
    runtime: wp.Runtime,
) -> None:
    """README, "Events: values a run publishes" and docs/sql.md: ``ctx.set_event(key,
    value)`` records ``event.set`` (``key``, ``value``; its activity is ``<key>#<n>``, like
    any call's), a later call with the same key replaces the value for clients
    (``client.events``, ``get_event``); a key that is no name, a value no database keeps and
    a value too large fail the run with the typed error naming the event key or "value of
    event <key>". Kills ``Context.set_event`` mutants 2, 5, 6 (the key's error names
    something else), 9, 29, 30 (the activity, name or invocation lost), 16, 18, 37, 38 (no
    key or value recorded), 19 and 24 (errors that name no event) and 25 (no size check)."""
    runtime.register(publishes_wf)
    client = runtime.client()
    execution_id = client.start(publishes_wf, "fine").execution_id
    assert client.result(execution_id, timeout=5).unwrap() == "fine"
    assert client.events(execution_id) == {"progress": {"done": 2}, "stage": "started"}
    assert client.get_event(execution_id, "progress", timeout=0) == {"done": 2}
    recorded = _events(runtime, execution_id, "event.set")
    published = [
        (e["name"], e["invocation"], e["activityName"], e["key"], e["value"]) for e in recorded
    ]
    assert published == [
        ("progress", 1, "progress#1", "progress", {"done": 1}),
        ("stage", 1, "stage#1", "stage", "started"),
        ("progress", 2, "progress#2", "progress", {"done": 2}),
    ]
    assert all(e["executionId"] == execution_id for e in recorded)

    def failed(what: str) -> wp.Failed:
        outcome = client.result(client.start(publishes_wf, what).execution_id, timeout=5)
        assert isinstance(outcome, wp.Failed), outcome
        return outcome

    no_key = failed("no key")
    assert no_key.error_type == "InvalidArgumentError"
    assert no_key.message == "event key must be a non-empty string, got ''"
    nan = failed("nan")
    assert nan.error_type == "NotSerializableError"
    assert nan.message.startswith("value of event reading is not JSON-serializable")
    real = runtime.backend.max_value_bytes
    runtime.backend.max_value_bytes = 1000
    try:
        large = failed("large")
    finally:
        runtime.backend.max_value_bytes = real
    assert large.error_type == "ValueTooLargeError"
    assert (large.error["what"], large.error["limit"]) == ("value of event report", 1000)


# messages of rejected buffered signals ----------------------------------------------------

#: The prefix pydantic puts before a validator's ``ValueError`` text.
VALUE_ERROR = "Value error, "


def _judge(note: str) -> str:
    if note == "exactly the limit":
        raise ValueError("e" * (MAX_REJECTION_MESSAGE - len(VALUE_ERROR)))
    if note == "over the limit":
        raise ValueError("o" * (2 * MAX_REJECTION_MESSAGE))
    return note


Judged = Annotated[str, AfterValidator(_judge)]


@wp.workflow(name="mutation-runs-judged-note", version=1)
def judged_note_wf(ctx: wp.Context) -> str:
    got = ctx.wait_for_signal("note", Judged)
    assert isinstance(got, wp.Received)
    return got.value


def test_a_rejected_signals_message_is_kept_up_to_its_limit_then_cut(
    runtime: wp.Runtime,
) -> None:
    """A buffered signal the wait refuses is recorded as ``signal.rejected`` with its
    errors (docs/sql.md) and the wait goes on to the next one (README); a message is kept
    whole up to ``MAX_REJECTION_MESSAGE`` characters and cut there with "..." beyond
    (``context._brief``: a JSON Schema message quotes the whole value). Kills ``_brief``
    mutants 3 (a message of exactly the limit cut), 4 (a long message fails the run
    instead) and 5 (another mark of the cut)."""
    runtime.register(judged_note_wf)
    client = runtime.client()
    execution_id = client.start(judged_note_wf).execution_id
    for note in ("exactly the limit", "over the limit", "fine"):
        assert client.signal(execution_id, "note", note, buffer=True) == "buffered"
    assert runtime.drive(execution_id)
    assert client.result(execution_id, timeout=5).unwrap() == "fine"
    messages = [e["errors"][0]["msg"] for e in _events(runtime, execution_id, "signal.rejected")]
    exact = VALUE_ERROR + "e" * (MAX_REJECTION_MESSAGE - len(VALUE_ERROR))
    assert len(exact) == MAX_REJECTION_MESSAGE
    cut = (VALUE_ERROR + "o" * (2 * MAX_REJECTION_MESSAGE))[:MAX_REJECTION_MESSAGE] + "..."
    assert messages == [exact, cut]


# a ctx.all branch whose retry time is still ahead after a crash ---------------------------

FLAKY: dict[str, int] = {}


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=3.0))
def mutation_flaky_branch(key: str) -> str:
    FLAKY[key] = FLAKY.get(key, 0) + 1
    if FLAKY[key] == 1:
        raise RuntimeError(f"{key}: the first attempt fails")
    return key


@wp.step
def mutation_steady_branch(key: str) -> str:
    return key


@wp.workflow(name="mutation-runs-branch-retry", version=1)
def branch_retry_wf(ctx: wp.Context) -> list[str]:
    return ctx.all([wp.call(mutation_flaky_branch, "a"), wp.call(mutation_steady_branch, "b")])


class DiesInABackoff(wp.Runtime):
    """A runtime whose process dies while a step waits out a retry delay in its thread."""

    def pause(self, seconds: float) -> None:
        raise SimulatedCrash(f"died {seconds:.1f}s before a retry")


def test_a_branch_replayed_before_its_retry_time_waits_for_it_in_its_thread(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """``StepRunner.wait_until``: a retry delay is waited "in this thread if it is soon (or
    inside ``ctx.all``)", also when the delay was recorded by an earlier drive: a branch
    whose process died while it waited finds its retry time still ahead (more than the
    inline limit) on the next drive and waits there, in its thread, instead of parking the
    run; that drive completes the block. Kills ``StepRunner._execute`` mutant 25 (the
    recorded retry time waited for without ``inline``)."""
    FLAKY.clear()
    dying = DiesInABackoff(db_url)
    try:
        dying.register(branch_retry_wf)
        execution_id = dying.client().start(branch_retry_wf).execution_id
        with pytest.raises(SimulatedCrash):
            dying.drive(execution_id)
    finally:
        dying.close()
    runtime = make_runtime()
    runtime.register(branch_retry_wf)
    [failed] = _events(runtime, execution_id, "step.failed")
    assert failed["final"] is False and "retryAt" in failed
    assert runtime.drive(execution_id)
    assert _row(runtime, execution_id)["status"] == "completed", "one drive, never parked"
    assert runtime.client().result(execution_id, timeout=5).unwrap() == ["a", "b"]
    assert FLAKY == {"a": 2}
