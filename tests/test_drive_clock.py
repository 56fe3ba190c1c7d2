"""A drive's clock is the database's time at the claim, advanced from when the claim's answer
arrived: time spent before the drive begins (a long history read, a pause of the process)
does not put the drive's times early. It once ran from when the drive began, so a durable
sleep set after a slow history read ended early by that read's length."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

import wf_persist as wp
from wf_persist import clocks
from wf_persist.driver import DriveClock

from .helpers import is_due, wait_until

#: How long the history read of the drive after the first park is held up.
SLOW_READ = 1.0


@wp.step
def wall() -> float:
    return time.time()


@wp.workflow(name="clock-after-a-slow-read", version=1)
def sleeps_after_a_park(ctx: wp.Context, seconds: float) -> list[float]:
    ctx.sleep(0.05)  # parks: the next drive reads the history before it goes on
    before = ctx.run(wall)
    ctx.sleep(seconds)
    return [before, ctx.run(wall)]


def test_the_clock_runs_from_when_the_claim_was_answered() -> None:
    base = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    clock = DriveClock(base, lambda: 0.0, read_at=clocks.elapsed() - 5.0)
    assert dt.timedelta(seconds=5) <= clock() - base < dt.timedelta(seconds=6)
    fresh = DriveClock(base, lambda: 0.0)
    assert fresh() - base < dt.timedelta(seconds=1)


def _sleep_after_held_drive(
    make_runtime: Callable[..., wp.Runtime], when: str, held_up: Callable[[str], bool]
) -> None:
    """Park a run on its first sleep, drive it on with the statements ``held_up`` picks
    held up for SLOW_READ (at the engine's ``when`` event), and check that the sleep that
    drive set lasted its full length in real time."""
    rt = make_runtime(lease_ttl=300)
    rt.register(sleeps_after_a_park)
    client = rt.client()
    execution_id = client.start(sleeps_after_a_park, SLOW_READ).execution_id
    assert rt.drive(execution_id)
    assert client.status(execution_id) == "suspended"
    wait_until(lambda: is_due(rt, execution_id), what="the first sleep")
    held = threading.Event()

    def hold(_conn: Any, _cursor: Any, statement: str, *_args: Any, **_kwargs: Any) -> None:
        if held_up(statement) and not held.is_set():
            held.set()
            time.sleep(SLOW_READ)

    engine = rt.backend.base_engine
    event.listen(engine, when, hold)
    try:
        assert rt.drive(execution_id)
    finally:
        event.remove(engine, when, hold)
    assert held.is_set(), "a statement was held up"
    assert client.status(execution_id) == "suspended", "parked on the second sleep"
    wait_until(lambda: is_due(rt, execution_id), what="the second sleep", timeout=30)
    assert rt.drive(execution_id)
    before, after = client.result(execution_id, timeout=30).unwrap()
    assert after - before >= SLOW_READ - 0.05, f"slept {after - before:.3f}s of {SLOW_READ}s"


@pytest.mark.lacks("libpq")  # PostgreSQL reads the history in the claim's own statement
def test_a_sleep_after_a_slow_history_read_lasts_its_length(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The drive after the park reads the history after its claim (a query of its own),
    held up by SLOW_READ here; the sleep it then sets lasts its full length in real time."""
    _sleep_after_held_drive(
        make_runtime,
        "before_cursor_execute",
        lambda statement: "FROM wf_history" in statement and "ORDER BY" in statement,
    )


@pytest.mark.lacks("libpq")  # PostgreSQL's claim goes straight to libpq, past these events
def test_a_sleep_after_a_slow_claim_answer_lasts_its_length(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The claim's statement has read the database's time (SQLite: the claim's UPDATE ...
    RETURNING; MySQL: the read after it), then its answer is held up (SLOW_READ, as a pause
    of the process there would): the drive reads the time again, and the sleep it sets
    lasts its full length in real time."""

    def claim_answer(statement: str) -> bool:
        claim = statement.startswith("UPDATE wf_executions SET wake_at") and "lease_" in statement
        read = statement.startswith("SELECT wf_executions.id, wf_executions.claim_epoch")
        return (claim and "RETURNING" in statement) or read

    _sleep_after_held_drive(make_runtime, "after_cursor_execute", claim_answer)
