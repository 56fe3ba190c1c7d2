"""Mutant killers for ``wf_persist/driver.py`` and ``wf_persist/runtime.py``: client events
and takeovers that land inside a drive, a lease the keeper has not confirmed lately, failed
drives (a database that refuses a write), ``close``'s timeout, two runs driven at once, the
drive's clock under the test kit, and the runtime's argument checks and defaults.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no selected test
asserted, and its docstring names the mutants it kills. Where a test needs something to
happen inside a drive (a signal, a takeover, a cancellation), a step or the workflow's own
code does it, in this process, on the real database.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import wf_persist as wp
from wf_persist.backends.clock import db_now
from wf_persist.models import executions_table as ex
from wf_persist.testing import TestRuntime

from .helpers import history_types, wait_until
from .test_mutation_killers import _pooled, _row, _row_of, _types_of

# a step holding its drive until the test lets it go -------------------------------------

HOLD: dict[str, threading.Event] = {"held": threading.Event(), "go": threading.Event()}


@wp.step
def hold_the_drive() -> str:
    HOLD["held"].set()
    HOLD["go"].wait(5)
    return "held"


@wp.workflow(name="mutation-driver-held", version=1)
def held_wf(ctx: wp.Context) -> str:
    return ctx.run(hold_the_drive)


@wp.workflow(name="mutation-driver-quick", version=1)
def quick_wf(ctx: wp.Context) -> str:
    return "quick"


@pytest.fixture
def gate() -> Iterator[dict[str, threading.Event]]:
    """Fresh events for ``hold_the_drive``; the step is let go at teardown in any case."""
    HOLD["held"], HOLD["go"] = threading.Event(), threading.Event()
    yield HOLD
    HOLD["go"].set()


# client events and takeovers inside a drive ----------------------------------------------

PEERS: dict[str, Any] = {}


@wp.step
def buffer_a_signal_to(execution_id: str) -> str:
    client: wp.WorkflowClient = PEERS["client"]
    return client.signal(execution_id, "go", 7, buffer=True)


@wp.workflow(name="mutation-driver-own-signal", version=1)
def own_signal_wf(ctx: wp.Context) -> int:
    ctx.run(buffer_a_signal_to, ctx.execution_id)
    got = ctx.wait_for_signal("go", int)
    assert isinstance(got, wp.Received)
    return got.value


def test_a_signal_buffered_while_the_run_is_driven_is_taken_by_its_next_wait(
    runtime: wp.Runtime,
) -> None:
    """A signal buffered for a run while its driver is inside a step (after the history it
    read) is a client event that driver has not seen: parking the run at the wait that
    follows is stale, so the body replays from fresh history and the wait takes the signal
    (README: the next wait "takes the oldest buffered one without suspending"; "no run is
    lost or stuck"). Kills ``driver.drive``'s, ``RunDriver.__init__``'s and
    ``RunDriver._locked``'s mutants that drop the last sequence read (the run would park
    for good, waiting for a signal it was already sent)."""
    runtime.register(own_signal_wf)
    client = runtime.client()
    PEERS["client"] = client
    execution_id = client.start(own_signal_wf).execution_id
    assert runtime.drive(execution_id)
    assert _row(runtime, execution_id)["status"] == "completed", "finished in this drive"
    assert client.result(execution_id, timeout=5).unwrap() == 7
    types = history_types(client, execution_id)
    assert "signal.buffered" in types and "drive.failed" not in types
    assert "signal.waiting" not in types, "the stale park was not written"


@wp.step
def first_step() -> str:
    return "first"


def _take_over(execution_id: str) -> None:
    """What another runtime does once this one's lease ran out: claim the run."""
    other: wp.Runtime = PEERS["other"]
    with other.transaction() as conn:  # the lease ran out (by the database's clock)
        conn.execute(
            ex.update()
            .where(ex.c.id == execution_id)
            .values(lease_expires_at=db_now(), wake_at=db_now())
        )
    with other.transaction() as conn:
        claim = other.backend.claim(conn, execution_id, other.owner, 30.0)
    assert claim is not None
    PEERS["claim"] = claim


@wp.workflow(name="mutation-driver-taken-over", version=1)
def taken_over_wf(ctx: wp.Context) -> str:
    ctx.run(first_step)
    if "claim" not in PEERS:
        _take_over(ctx.execution_id)
    ctx.sleep(3600)
    return "slept"


def test_a_driver_whose_run_was_taken_over_parks_nothing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Guarantees: "a driver that lost its run records nothing". Another runtime claims the
    run while its first driver is between two calls; that driver's next write (parking the
    run for a sleep, under the row lock, with the finished step's events) is refused by the
    claim epoch: no ``sleep.started``, no status change, the new holder's lease left alone,
    no failed drive counted. The step's outcome went out with that write, so it is not
    recorded either: the new holder runs the step again (at-least-once for a step whose
    outcome was not recorded). Kills ``RunDriver._locked``'s mutants that write without the
    epoch."""
    runtime, other = make_runtime(), make_runtime()
    runtime.register(taken_over_wf)
    other.register(taken_over_wf)
    PEERS.clear()
    PEERS["other"] = other
    execution_id = runtime.client().start(taken_over_wf).execution_id
    assert runtime.drive(execution_id)
    claim = PEERS["claim"]
    row = _row(runtime, execution_id)
    assert row["status"] == "running" and row["claim_epoch"] == claim.epoch
    assert row["lease_owner"] == other.owner and row["drive_failures"] == 0
    types = history_types(runtime.client(), execution_id)
    assert "sleep.started" not in types and "drive.failed" not in types
    assert types.count("step.completed") == 0


LATE: dict[str, Any] = {}


def undo_the_reservation(result: str, reason: dict[str, Any]) -> None:
    LATE.setdefault("undone", []).append(result)


@wp.step(compensate=undo_the_reservation)
def reserve() -> str:
    return "seat-1"


@wp.workflow(name="mutation-driver-cancelled-at-the-end", version=1)
def cancelled_at_the_end_wf(ctx: wp.Context) -> str:
    seat = ctx.run(reserve)
    if "cancelled" not in LATE:  # after the last durable call: nothing new runs after it
        LATE["cancelled"] = True
        client: wp.WorkflowClient = LATE["client"]
        client.cancel(ctx.execution_id, actor="late")
    return seat


def test_a_cancellation_after_the_last_call_wins_over_the_completion(
    runtime: wp.Runtime,
) -> None:
    """A cancellation recorded between a run's last durable call and its outcome: the
    completion is refused by its status guard (a compensating run cannot complete), the
    body replays from fresh history and unwinds, and the run ends failed with ``Cancelled``
    (README: a cancel racing the completion ends the run "either completed or cancelled,
    never both"). Kills ``RunDriver.finish``'s mutants that write the outcome without the
    guard or with the failure's guard, and ``RunDriver._write``'s that drop it."""
    LATE.clear()
    runtime.register(cancelled_at_the_end_wf)
    client = runtime.client()
    LATE["client"] = client
    execution_id = client.start(cancelled_at_the_end_wf).execution_id
    assert runtime.drive(execution_id)
    outcome = client.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert LATE["undone"] == ["seat-1"], "the completed step was compensated"
    types = history_types(client, execution_id)
    assert "workflow.completed" not in types and types[-1] == "workflow.failed"
    assert "drive.failed" not in types
    row = _row(runtime, execution_id)
    assert row["status"] == "failed" and row["result"] is None


# a lease the keeper has not confirmed lately ---------------------------------------------


@wp.step
def echo(value: str) -> str:
    return value


AGED: dict[str, wp.Runtime] = {}


def _age_the_lease(execution_id: str) -> None:
    """As if the keeper had not confirmed the lease for longer than half the TTL (it lags,
    or the process was paused)."""
    keeper = AGED["runtime"].keeper()
    lease = keeper.hold(execution_id, keeper.held()[execution_id])
    lease.confirmed = -math.inf


@wp.workflow(name="mutation-driver-aged-lease", version=1)
def aged_lease_wf(ctx: wp.Context) -> list[str]:
    out = [ctx.run(echo, "a")]
    _age_the_lease(ctx.execution_id)
    out.append(ctx.run(echo, "b"))
    out.append(ctx.run(echo, "c"))
    return out


def test_a_lease_not_confirmed_lately_is_confirmed_by_the_database_and_the_run_goes_on(
    runtime: wp.Runtime,
) -> None:
    """``RunDriver.check_lease``: when the keeper's word is older than half the TTL, the
    driver asks the database itself (a renewal fenced by the epoch) before the next step;
    the run still holds its lease, so the step runs and the run completes in this drive,
    with no failed drive. Kills the ``check_lease`` mutants that renew without the
    connection or the TTL (a failed drive), ignore the renewal's answer, or record no time
    for the confirmation (the next check fails)."""
    AGED["runtime"] = runtime
    runtime.register(aged_lease_wf)
    client = runtime.client()
    execution_id = client.start(aged_lease_wf).execution_id
    assert runtime.drive(execution_id)
    assert client.result(execution_id, timeout=5).unwrap() == ["a", "b", "c"]
    row = _row(runtime, execution_id)
    assert row["status"] == "completed" and row["drive_failures"] == 0
    assert "drive.failed" not in history_types(client, execution_id)


# failed drives: a database that refuses a write ------------------------------------------

REFUSAL = "refused by a test trigger"
TRIGGER = "wf_test_refuse_driver"


def _trigger_sql(backend: str, condition: str) -> list[str]:
    if backend == "sqlite":
        return [
            f"""CREATE TRIGGER {TRIGGER} BEFORE INSERT ON wf_history WHEN {condition}
                BEGIN SELECT RAISE(ABORT, '{REFUSAL}'); END"""
        ]
    if backend == "postgresql":
        return [
            f"""CREATE FUNCTION {TRIGGER}() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                  IF {condition} THEN RAISE EXCEPTION '{REFUSAL}'; END IF;
                  RETURN NEW;
                END $$""",
            f"""CREATE TRIGGER {TRIGGER} BEFORE INSERT ON wf_history
                FOR EACH ROW EXECUTE FUNCTION {TRIGGER}()""",
        ]
    return [
        f"""CREATE TRIGGER {TRIGGER} BEFORE INSERT ON wf_history FOR EACH ROW
            BEGIN
              IF {condition} THEN
                SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{REFUSAL}';
              END IF;
            END"""
    ]


def _drop_sql(backend: str) -> list[str]:
    if backend == "postgresql":
        return [
            f"DROP TRIGGER IF EXISTS {TRIGGER} ON wf_history",
            f"DROP FUNCTION IF EXISTS {TRIGGER}()",
        ]
    return [f"DROP TRIGGER IF EXISTS {TRIGGER}"]


@pytest.fixture
def refuse(db_url: str, backend: str) -> Iterator[Callable[[str], None]]:
    """Install a trigger that makes the database refuse history rows matching an SQL
    condition on ``NEW``; dropped at teardown."""
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
def refused_step(n: int) -> int:
    return n


@wp.workflow(name="mutation-driver-refused", version=1)
def refused_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(refused_step, n)


def _drive_failed_events(runtime: wp.Runtime, execution_id: str) -> list[dict[str, Any]]:
    return [
        r.event for r in runtime.client().history(execution_id) if r.event["type"] == "drive.failed"
    ]


def test_a_refused_write_counts_a_failed_drive_and_the_tenth_fails_the_run(
    make_runtime: Callable[..., wp.Runtime], refuse: Callable[[str], None]
) -> None:
    """README, "Runs that keep failing end": a drive that stops on an error that is not a
    lost lease (here the database refuses the step's write) is counted on the run
    (``drive_failures``, a ``drive.failed`` event naming the error) and its lease given up
    for a retry after a backoff; after ``max_drive_failures`` (default 10) in a row the run
    fails with ``DriveFailedError`` (``.failures``, ``.cause``). Kills ``driver.drive``'s
    mutants that call ``failed`` without the runtime or the claim,
    ``RunDriver._write``'s that stops the drive without the database's error, and the
    ``Runtime.__init__`` mutants of the default limit and of keeping it."""
    refuse("NEW.type = 'step.completed' AND NEW.activity_name = 'refused_step#1'")
    runtime = make_runtime()
    runtime.register(refused_wf)
    client = runtime.client()
    execution_id = client.start(refused_wf, 3).execution_id
    assert runtime.drive(execution_id)
    [failed] = _drive_failed_events(runtime, execution_id)
    assert failed["failures"] == 1 and REFUSAL in failed["error"]["message"]
    row = _row(runtime, execution_id)
    assert row["status"] == "running" and row["drive_failures"] == 1
    assert row["lease_owner"] is None and row["wake_at"] is not None
    with runtime.transaction() as conn:  # eight more failed drives, and due again now
        conn.execute(
            ex.update().where(ex.c.id == execution_id).values(drive_failures=9, wake_at=db_now())
        )
    assert runtime.drive(execution_id)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed" and row["drive_failures"] == 10, "the tenth failed drive"
    outcome = client.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)
    assert outcome.error["failures"] == 10
    assert REFUSAL in outcome.error["cause"]["message"]


def test_a_claimed_run_whose_start_is_refused_counts_a_failed_drive(
    runtime: wp.Runtime, refuse: Callable[[str], None]
) -> None:
    """A worker's claim (``claim_due`` then ``drive_claim``) whose first read-and-record
    (``workflow.started``) fails is a failed drive like any other: counted on the run with
    the database's error, the lease given up and forgotten by the keeper. Kills the
    ``Runtime._drive`` mutants that forget no lease or record the failure without the
    runtime, the claim or the error."""
    runtime.register(quick_wf)
    execution_id = runtime.client().start(quick_wf).execution_id
    refuse("NEW.type = 'workflow.started'")
    claims = runtime.claim_due(1)
    assert [c.execution_id for c in claims] == [execution_id]
    assert runtime.drive_claim(claims[0]) is None
    [failed] = _drive_failed_events(runtime, execution_id)
    assert failed["failures"] == 1 and REFUSAL in failed["error"]["message"]
    row = _row(runtime, execution_id)
    assert row["drive_failures"] == 1 and row["lease_owner"] is None
    assert execution_id not in runtime.keeper().held()


@wp.workflow(name="mutation-driver-sleeps-first", version=1)
def sleeps_first_wf(ctx: wp.Context) -> str:
    ctx.sleep(3600)
    return "slept"


def test_a_drive_that_parks_the_run_resets_the_failed_drive_count(runtime: wp.Runtime) -> None:
    """README: "A drive that makes progress resets the count", also when its first write
    parks the run (``sleep.started``, written under the row lock) rather than records a
    step. Kills ``RunDriver._locked``'s mutants that do not write the reset."""
    runtime.register(sleeps_first_wf)
    execution_id = runtime.client().start(sleeps_first_wf).execution_id
    with runtime.transaction() as conn:  # two failed drives before this one
        conn.execute(ex.update().where(ex.c.id == execution_id).values(drive_failures=2))
    assert runtime.drive(execution_id)
    row = _row(runtime, execution_id)
    assert row["status"] == "suspended" and row["drive_failures"] == 0


# the size of a run's output ---------------------------------------------------------------


@wp.workflow(name="mutation-driver-big-output", version=1)
def big_output_wf(ctx: wp.Context, size: int) -> str:
    return "x" * size


def test_an_output_too_large_fails_the_run_naming_the_output(runtime: wp.Runtime) -> None:
    """A run whose output is larger than the backend stores fails with
    ``ValueTooLargeError`` naming "output of workflow <name>" and the limit (checked before
    anything is written, never retried). Kills ``run_body``'s and ``RunDriver.check_size``'s
    mutants that check nothing or name nothing (``tests/test_bad_input.py``, outside the
    mutation selection, pins the rest)."""
    runtime.register(big_output_wf)
    client = runtime.client()
    real = runtime.backend.max_value_bytes
    runtime.backend.max_value_bytes = 1000
    try:
        execution_id = client.start(big_output_wf, 2000).execution_id
        outcome = client.result(execution_id, timeout=5)
    finally:
        runtime.backend.max_value_bytes = real
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "ValueTooLargeError"
    assert "output of workflow mutation-driver-big-output" in outcome.message
    assert outcome.error["limit"] == 1000
    assert "drive.failed" not in history_types(client, execution_id)


# two runs at once; close's timeout ---------------------------------------------------------


def test_two_threads_of_one_runtime_drive_two_runs_at_once(
    runtime: wp.Runtime, gate: dict[str, threading.Event]
) -> None:
    """``Runtime.drive`` returns False only when the run is finished, not due, or held by
    another runtime or thread: a run due and held by nobody is driven at once, even while
    another thread of the runtime drives another run. Kills
    ``Runtime.drive_for_outcome``'s mutant that marks every run as the same one."""
    runtime.register(held_wf, quick_wf)
    client = runtime.client()
    held = client.start(held_wf).execution_id
    quick = client.start(quick_wf).execution_id
    thread = threading.Thread(target=runtime.drive, args=(held,))
    thread.start()
    try:
        assert gate["held"].wait(10)
        assert runtime.drive(quick), "not driven while another run was"
        assert _row(runtime, quick)["status"] == "completed"
    finally:
        gate["go"].set()
        thread.join(10)
    assert client.result(held, timeout=5).unwrap() == "held"


def test_close_waits_no_longer_than_its_timeout_and_the_last_drive_disposes_of_the_engine(
    make_runtime: Callable[..., wp.Runtime], gate: dict[str, threading.Event]
) -> None:
    """``Runtime.close(timeout)`` lets runs in flight stop at their next step, "waiting up
    to ``timeout`` seconds": a drive stuck in a step does not hold it up longer. The engine
    is then left to that drive, which hands its run over when it stops and disposes of the
    engine as the last one: no pooled connection is left open. Kills the ``close`` mutants
    that wait for a change without a timeout or a second at a time, and those that dispose
    of the engine with a drive in flight."""
    runtime = make_runtime()
    runtime.register(held_wf)
    execution_id = runtime.client().start(held_wf).execution_id
    url = runtime.engine.url
    thread = threading.Thread(target=runtime.drive, args=(execution_id,))
    thread.start()
    try:
        assert gate["held"].wait(10)
        began = time.monotonic()
        runtime.close(timeout=0.3)
        took = time.monotonic() - began
        assert thread.is_alive(), "the step is still running"
    finally:
        gate["go"].set()
        thread.join(10)
    assert 0.3 <= took < 0.9, took
    assert not thread.is_alive()
    assert _pooled(runtime.engine) == 0, "a connection outlived the runtime"
    row = _row_of(url, execution_id)
    assert row["lease_owner"] is None and row["status"] == "running", "handed over"
    assert "step.completed" in _types_of(url, execution_id)


def test_close_with_a_worker_waits_no_longer_than_its_timeout(
    make_runtime: Callable[..., wp.Runtime], gate: dict[str, threading.Event]
) -> None:
    """With a worker, ``close(timeout)`` waits for runs in flight through the worker's
    ``stop(timeout)`` and then not again: a run stuck in a step holds it up about
    ``timeout`` seconds, not more. Kills the ``close`` mutants that wait again after the
    worker stopped."""
    runtime = make_runtime()
    runtime.register(held_wf)
    execution_id = runtime.client().start(held_wf).execution_id
    url = runtime.engine.url
    runtime.start_worker(concurrency=1, poll_interval=0.02)
    try:
        assert gate["held"].wait(10)
        began = time.monotonic()
        runtime.close(timeout=0.6)
        took = time.monotonic() - began
    finally:
        gate["go"].set()
    assert 0.6 <= took < 1.1, took
    wait_until(
        lambda: (
            _row_of(url, execution_id)["lease_owner"] is None
            and "step.completed" in _types_of(url, execution_id)
        ),
        what="the stopped drive to hand its run over",
    )
    wait_until(lambda: _pooled(runtime.engine) == 0, what="the last drive to dispose")


# the test kit: skipped time and stand-in steps --------------------------------------------


@wp.step
def look_up(key: str) -> str:
    return f"real {key}"


@wp.workflow(name="mutation-driver-kit", version=1)
def kit_wf(ctx: wp.Context) -> str:
    return ctx.run(look_up, "k")


def test_a_drive_after_skipped_time_records_on_the_virtual_clock() -> None:
    """``DriveClock``: "the database's time at the claim, advanced by this process's
    monotonic clock (and by the time the test kit skips meanwhile)". Time skipped before a
    run starts is already in the claim's time: every event of the drive is stamped right
    after ``workflow.started``, not hours off. Kills the ``DriveClock`` mutants that
    subtract the skipped time."""
    with TestRuntime(kit_wf) as rt:
        rt.advance(dt.timedelta(hours=1))
        run = rt.start(kit_wf)
        assert rt.result(run).unwrap() == "real k"
        records = rt.history(run)
    at = {r.event["type"]: r.created_at for r in records}
    started = at["workflow.started"]
    for kind in ("step.completed", "workflow.completed"):
        assert dt.timedelta(0) <= at[kind] - started < dt.timedelta(seconds=30), kind


def test_a_stand_in_step_of_the_test_kit_is_called_instead_of_the_step() -> None:
    """``TestRuntime.mock_step(step, fn)``: ``fn`` is called instead of the step, with the
    same arguments, and its result recorded (README, "Testing workflows"). Kills
    ``RunDriver.step_function``'s mutant that never finds the stand-in."""
    with TestRuntime(kit_wf) as rt:
        rt.mock_step(look_up, lambda key: f"stand-in {key}")
        run = rt.start(kit_wf)
        assert rt.result(run).unwrap() == "stand-in k"
        completed = next(r.event for r in rt.history(run) if r.event["type"] == "step.completed")
    assert completed["result"] == "stand-in k"


# the runtime's arguments ------------------------------------------------------------------

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"lease_ttl": None}, "lease_ttl must be a positive number, got None"),
    ({"lease_ttl": 0}, "lease_ttl must be a positive number, got 0"),
    ({"lease_ttl": -1.5}, "lease_ttl must be a positive number, got -1.5"),
    ({"lease_ttl": float("inf")}, "lease_ttl must be a positive number, got inf"),
    ({"lease_ttl": True}, "lease_ttl must be a positive number, got True"),
    ({"lease_ttl": "30"}, "lease_ttl must be a positive number, got '30'"),
    ({"poll_interval": None}, "poll_interval must be a positive number, got None"),
    ({"poll_interval": 0}, "poll_interval must be a positive number, got 0"),
    (
        {"record_start_after": -1},
        "record_start_after must be a non-negative number or None, got -1",
    ),
    (
        {"record_start_after": float("inf")},
        "record_start_after must be a non-negative number or None, got inf",
    ),
    (
        {"record_start_after": True},
        "record_start_after must be a non-negative number or None, got True",
    ),
    (
        {"record_start_after": "1"},
        "record_start_after must be a non-negative number or None, got '1'",
    ),
    ({"max_drive_failures": 0}, "max_drive_failures must be a positive integer, got 0"),
    ({"max_drive_failures": True}, "max_drive_failures must be a positive integer, got True"),
    ({"max_drive_failures": 2.5}, "max_drive_failures must be a positive integer, got 2.5"),
    ({"max_drive_failures": "3"}, "max_drive_failures must be a positive integer, got '3'"),
]


def test_runtime_arguments_out_of_range_are_refused_naming_the_argument(db_url: str) -> None:
    """``Runtime(...)`` checks its numbers before it opens anything, and says which argument
    is wrong and what it must be. Kills the mutants of ``runtime.positive`` and of
    ``Runtime.__init__``'s checks and messages."""
    for kwargs, message in REFUSED:
        try:
            taken = wp.Runtime(db_url, **kwargs)
        except wp.InvalidArgumentError as exc:
            assert str(exc) == message, kwargs
            continue
        taken.close()
        pytest.fail(f"Runtime took {kwargs}")


def test_runtime_defaults_are_the_documented_ones_and_edge_values_are_taken(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """README and the ``Runtime`` docstring: ``lease_ttl`` 30 s, ``poll_interval`` 0.25 s,
    ``record_start_after`` 1 s (``0`` and ``None`` allowed), ``max_drive_failures`` 10 (``1``
    allowed). Kills ``Runtime.__init__``'s mutants of the defaults and of the bounds."""
    rt = make_runtime()
    assert rt.lease_ttl == dt.timedelta(seconds=30)
    assert rt.poll_interval == 0.25
    assert rt.record_start_after == 1.0
    assert rt.max_drive_failures == 10
    edge = make_runtime(lease_ttl=2, poll_interval=1e-3, record_start_after=0, max_drive_failures=1)
    assert edge.lease_ttl == dt.timedelta(seconds=2) and edge.record_start_after == 0
    assert edge.max_drive_failures == 1
    assert make_runtime(record_start_after=None).record_start_after is None


SLOW_RUNS: list[int] = []


@wp.step
def slow_refused_step(n: int) -> int:
    SLOW_RUNS.append(n)
    return n


@wp.workflow(name="mutation-driver-slow-refused", version=1)
def slow_refused_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(slow_refused_step, n)


def test_a_step_whose_start_is_recorded_but_completion_refused_still_ends_the_run(
    make_runtime: Callable[..., wp.Runtime], refuse: Callable[[str], None]
) -> None:
    """A write that records only a step's ``step.started`` (a long attempt's, here every
    attempt's: ``record_start_after=0``) is not progress: were it to reset the run's
    count of failed drives, a step whose completion write the database refuses every
    time would run again at every drive, for ever. It fails the run after
    ``max_drive_failures`` drives instead, having run that many times."""
    refuse("NEW.type = 'step.completed'")
    runtime = make_runtime(record_start_after=0, max_drive_failures=3)
    runtime.register(slow_refused_wf)
    client = runtime.client()
    SLOW_RUNS.clear()
    execution_id = client.start(slow_refused_wf, 7).execution_id
    for _ in range(6):
        if _row(runtime, execution_id)["status"] == "failed":
            break
        with runtime.transaction() as conn:  # due again now, not after the backoff
            conn.execute(ex.update().where(ex.c.id == execution_id).values(wake_at=db_now()))
        assert runtime.drive(execution_id)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed" and row["drive_failures"] == 3
    assert SLOW_RUNS == [7, 7, 7]
    outcome = client.result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)
