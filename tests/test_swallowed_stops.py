"""A body that catches the runtime's stop cannot go on past it.

A durable call stops the body with a ``BaseException`` (the run parked, must be replayed,
or cannot go on). ``except Exception`` does not catch it, but ``asyncio.gather(...,
return_exceptions=True)`` and a bare ``except:`` do. Once a call stopped the replay, every
later durable call stops it again and the body's outcome (a return, another exception) is
not recorded: the run stays parked, or the drive counts as failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import wf_persist as wp

from .helpers import history_types
from .test_drive_failures import _due_now
from .test_mutation_killers import _row
from .test_mutation_killers_driver import refuse  # noqa: F401  (a fixture)

RUNS: list[str] = []


def _driven(runtime: wp.Runtime, workflow: wp.Workflow[Any, Any]) -> str:
    """A new run of ``workflow``, driven once in this thread: its id."""
    runtime.register(workflow)
    execution_id = runtime.client().start(workflow).execution_id
    runtime.drive(execution_id)
    return execution_id


@wp.workflow(name="swallowed-gather-sleep", version=1)
async def gather_sleep_wf(ctx: wp.AsyncContext) -> str:
    await asyncio.gather(ctx.sleep(3600), return_exceptions=True)
    return "done"


@wp.step
def after_sleep() -> str:
    RUNS.append("after")
    return "after"


@wp.workflow(name="swallowed-bare-except-sleep", version=1)
def bare_except_sleep_wf(ctx: wp.Context) -> str:
    with contextlib.suppress(BaseException):  # what the test is about
        ctx.sleep(3600)
    return ctx.run(after_sleep)


def test_a_park_caught_by_gather_leaves_the_run_parked(runtime: wp.Runtime) -> None:
    """Before: the run parked, then completed with ``"done"`` in the same drive."""
    execution_id = _driven(runtime, gather_sleep_wf)
    row = _row(runtime, execution_id)
    assert row["status"] == "suspended" and row["result"] is None
    assert row["lease_owner"] is None and row["wake_at"] is not None


def test_a_park_caught_by_a_bare_except_runs_nothing_after_it(runtime: wp.Runtime) -> None:
    """Before: the step after the sleep ran and the parked run completed."""
    RUNS.clear()
    execution_id = _driven(runtime, bare_except_sleep_wf)
    assert _row(runtime, execution_id)["status"] == "suspended"
    assert RUNS == []
    types = history_types(runtime.client(), execution_id)
    assert "step.completed" not in types and "workflow.completed" not in types


@wp.step
async def async_refused(n: int) -> int:
    RUNS.append("async")
    return n


@wp.workflow(name="swallowed-gather-all", version=1)
async def gather_all_wf(ctx: wp.AsyncContext, n: int) -> str:
    got = await asyncio.gather(ctx.all([wp.call(async_refused, n)]), return_exceptions=True)
    return repr(got)[:60]


def test_a_refused_write_caught_by_gather_is_a_failed_drive(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """Before: the run completed with the text of the runtime's stop as its result."""
    refuse("NEW.type = 'step.completed'")
    runtime = make_runtime(max_drive_failures=3)
    runtime.register(gather_all_wf)
    RUNS.clear()
    execution_id = runtime.client().start(gather_all_wf, 1).execution_id
    for _ in range(3):
        _due_now(runtime, execution_id)
        runtime.drive(execution_id)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed" and row["drive_failures"] == 3
    assert RUNS == ["async"] * 3
    outcome = runtime.client().result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)


# after the drive is over: nothing of the body's is recorded ------------------------------

LATE: list[str] = []


def _undo(result: int) -> None:
    LATE.append("undo")


@wp.step(compensate=_undo)
def book() -> int:
    LATE.append("book")
    return 1


@wp.workflow(name="swallowed-compensate-after-park", version=1)
def compensate_after_park_wf(ctx: wp.Context) -> str:
    ctx.run(book)
    try:
        ctx.sleep(3600)
    except BaseException:
        ctx.compensate({"name": "mine"})
    return "x"


def test_a_compensation_after_a_caught_park_records_nothing(runtime: wp.Runtime) -> None:
    """Before: the undo ran and was recorded on a run that had merely parked."""
    LATE.clear()
    execution_id = _driven(runtime, compensate_after_park_wf)
    assert _row(runtime, execution_id)["status"] == "suspended"
    types = history_types(runtime.client(), execution_id)
    assert types[-1] == "sleep.started" and "compensation.started" not in types


def _slowly() -> int:
    time.sleep(0.6)
    return 1


@wp.workflow(name="swallowed-in-flight", version=1)
def in_flight_wf(ctx: wp.Context) -> str:
    def other() -> None:
        with contextlib.suppress(BaseException):
            ctx.code("slow", _slowly)

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.2)
    with contextlib.suppress(BaseException):
        ctx.sleep(3600)
    thread.join()
    return "x"


def test_a_call_in_flight_on_a_body_thread_records_nothing_after_the_park(
    runtime: wp.Runtime,
) -> None:
    """Before: ``code.completed`` was recorded after ``sleep.started``."""
    execution_id = _driven(runtime, in_flight_wf)
    assert _row(runtime, execution_id)["status"] == "suspended"
    assert history_types(runtime.client(), execution_id)[-1] == "sleep.started"


LEFT_BEHIND: list[str] = []


@wp.workflow(name="swallowed-orphan", version=1)
def orphan_wf(ctx: wp.Context) -> str:
    def late() -> None:
        try:
            ctx.set_event("late", 1)
        except BaseException as stop:  # the runtime's refusal, on a thread of the body's
            LEFT_BEHIND.append(type(stop).__name__)

    threading.Timer(0.3, late).start()
    return "done"


def test_a_thread_left_behind_records_nothing_after_the_outcome(runtime: wp.Runtime) -> None:
    """Before: ``event.set`` was recorded after ``workflow.completed``."""
    LEFT_BEHIND.clear()
    execution_id = _driven(runtime, orphan_wf)
    deadline = time.monotonic() + 5
    while not LEFT_BEHIND and time.monotonic() < deadline:
        time.sleep(0.05)
    assert LEFT_BEHIND == ["Halt"]
    assert history_types(runtime.client(), execution_id)[-1] == "workflow.completed"


@wp.step
def plain_step(n: int) -> int:
    RUNS.append("plain")
    return n


@wp.workflow(name="swallowed-async-hand-over", version=1)
async def hand_over_wf(ctx: wp.AsyncContext, n: int) -> str:
    got = await asyncio.gather(ctx.run(plain_step, n), return_exceptions=True)
    return repr(got)[:80]


def test_a_stop_before_the_call_began_is_not_the_result(
    runtime: wp.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit a thread pool takes no new work: the async context's hand-over
    stops the body before the step's sync call begins. Before: the run completed with
    that stop's text as its result."""
    runtime.register(hand_over_wf)
    RUNS.clear()
    execution_id = runtime.client().start(hand_over_wf, 1).execution_id
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    try:
        runtime.drive(execution_id)
    finally:
        monkeypatch.setattr(concurrent.futures.thread, "_shutdown", False)
    row = _row(runtime, execution_id)
    assert row["status"] == "running" and row["result"] is None and RUNS == []
