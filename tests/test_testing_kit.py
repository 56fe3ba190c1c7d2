"""The test kit (wf_persist.testing) on its own engine: time skipping, stand-in steps,
secrets, buffered signals, compensations and replay, through the ``wf_runtime`` fixture
its pytest plugin provides."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import wf_persist as wp
from wf_persist.testing import RunBlockedError, TestRuntime

from .fixtures import kit
from .fixtures import messaging as m
from .fixtures import saga as s
from .fixtures import workflows as w

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _reset() -> None:
    kit.CALLS.clear()
    s.reset()
    w.CALLS.clear()
    w.CONTROL["diverge"] = False


def test_durable_sleeps_complete_at_once_with_time_skipping(wf_runtime: TestRuntime) -> None:
    wf_runtime.register(kit.daily_wf)
    before = wf_runtime.now()
    began = time.monotonic()
    run = wf_runtime.start(kit.daily_wf, 3)
    assert wf_runtime.result(run).unwrap() == ["reminder 1", "reminder 2", "reminder 3"]
    assert time.monotonic() - began < 10  # three days, skipped
    assert wf_runtime.now() - before >= dt.timedelta(days=3)
    sleeps = [r for r in wf_runtime.history(run) if r.event["type"] == "sleep.completed"]
    assert [r.event["activityName"] for r in sleeps] == ["day#1", "day#2", "day#3"]
    # Recorded times follow the virtual clock: a day apart.
    gap = sleeps[1].created_at - sleeps[0].created_at
    assert dt.timedelta(hours=23) < gap < dt.timedelta(hours=25)


def test_advance_moves_time_by_hand_when_skipping_is_off() -> None:
    with TestRuntime(kit.daily_wf, time_skipping=False) as rt:
        run = rt.start(kit.daily_wf, 1)
        assert rt.drive(run) and rt.status(run) == "suspended"
        with pytest.raises(wp.ResultTimeoutError):
            rt.result(run, timeout=0.3)  # a day of real time: not skipped
        rt.advance(dt.timedelta(hours=23))
        assert not rt.drive(run)  # not due yet
        rt.advance(3600)
        assert rt.result(run, timeout=10).unwrap() == ["reminder 1"]
        with pytest.raises(wp.InvalidArgumentError, match="non-negative duration"):
            rt.advance(-1)


def test_parked_retries_and_signal_timeouts_are_skipped(wf_runtime: TestRuntime) -> None:
    wf_runtime.register(kit.partner_wf, kit.approval_wf)
    attempts: list[int] = []

    def flaky(order: str) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) < 3:
            raise ConnectionError("partner down")
        return f"confirmed {order} after {len(attempts)}"

    wf_runtime.mock_step(kit.call_partner, flaky)
    began = time.monotonic()
    run = wf_runtime.start(kit.partner_wf, "o-1")
    assert wf_runtime.result(run).unwrap() == "confirmed o-1 after 3"
    assert kit.CALLS["call_partner"] == 0  # the real step never ran
    expired = wf_runtime.start(kit.approval_wf, 48.0)
    assert wf_runtime.result(expired).unwrap() == "expired"
    assert time.monotonic() - began < 10  # 30 minutes of backoff and two days of waiting


def test_a_run_waiting_for_a_signal_with_nothing_due_is_reported(
    wf_runtime: TestRuntime,
) -> None:
    wf_runtime.register(kit.approval_wf)
    run = wf_runtime.start(kit.approval_wf, None)
    with pytest.raises(RunBlockedError) as info:
        wf_runtime.result(run)
    assert info.value.signals == ["approval"] and info.value.execution_id == run
    assert wf_runtime.send_signal(run, "approval", {"approved": True}) == "delivered"
    assert wf_runtime.result(run).unwrap() == "approved"
    early = wf_runtime.start(kit.approval_wf, None)
    assert wf_runtime.send_signal(early, "approval", {"approved": False}) == "buffered"
    assert wf_runtime.result(early).unwrap() == "rejected"


def test_fail_step_once_and_injected_failures_follow_the_retry_rules(
    wf_runtime: TestRuntime,
) -> None:
    wf_runtime.register(kit.partner_wf, w.echo_wf)
    wf_runtime.fail_step_once(kit.call_partner)
    run = wf_runtime.start(kit.partner_wf, "o-2")
    assert wf_runtime.result(run).unwrap() == "confirmed o-2"
    failed = [r.event for r in wf_runtime.history(run) if r.event["type"] == "step.failed"]
    assert [f["error"]["message"] for f in failed] == ["Injected failure for step call_partner"]
    # A step without retries fails the run on the injected failure.
    wf_runtime.fail_step_once(w.echo, ValueError("no echo today"))
    outcome = wf_runtime.result(wf_runtime.start(w.echo_wf, 2))
    assert isinstance(outcome, wp.Failed) and "no echo today" in outcome.message


def test_fail_step_once_takes_an_exception_or_its_class(wf_runtime: TestRuntime) -> None:
    """A text (not an exception) was taken, and failed the run later with Python's
    "exceptions must derive from BaseException"; an exception class works as ``raise``."""
    wf_runtime.register(w.echo_wf)
    for bad in ("not an exception", 3, object()):
        with pytest.raises(wp.InvalidArgumentError, match="takes an exception"):
            wf_runtime.fail_step_once(w.echo, bad)  # type: ignore[arg-type]
    wf_runtime.fail_step_once(w.echo, KeyError)
    outcome = wf_runtime.result(wf_runtime.start(w.echo_wf, 2))
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    assert "KeyError" in str(outcome.error)


def test_a_closed_test_runtime_refuses_every_call() -> None:
    """``now()`` after ``close()`` raised a raw driver error; ``advance()`` was taken."""
    runtime = TestRuntime()
    runtime.register(w.echo_wf)
    runtime.close()
    calls: dict[str, Callable[[], object]] = {
        "now": runtime.now,
        "advance": lambda: runtime.advance(1),
        "mock_step": lambda: runtime.mock_step(w.echo, lambda x: x),
        "fail_step_once": lambda: runtime.fail_step_once(w.echo),
        "set_secret": lambda: runtime.set_secret("k", "v"),
        "start": lambda: runtime.start(w.echo_wf, 1),
        "status": lambda: runtime.status("x"),
    }
    for name, call in calls.items():
        with pytest.raises(wp.ClosedError):
            call()
            pytest.fail(f"{name} after close()")


def test_compensations_are_recorded_in_unwind_order(wf_runtime: TestRuntime) -> None:
    wf_runtime.register(s.saga_wf)
    log = wf_runtime.record_compensations()
    run = wf_runtime.start(s.saga_wf, 1)
    assert isinstance(wf_runtime.result(run), wp.Failed)
    assert log == [
        {"execution_id": run, "step": "second_step", "result": "second-2"},
        {"execution_id": run, "step": "first_step", "result": "first-1"},
    ]


def test_compensations_of_a_run_executed_are_recorded_too(wf_runtime: TestRuntime) -> None:
    """``client.execute`` returns the outcome of a run it drove to its end without
    ``result``: the compensations are collected all the same."""
    wf_runtime.register(s.saga_wf)
    log = wf_runtime.record_compensations()
    outcome = wf_runtime.client().execute(s.saga_wf, 1)
    assert isinstance(outcome, wp.Failed)
    assert [entry["step"] for entry in log] == ["second_step", "first_step"]


def test_secrets_are_set_on_the_test_runtime(wf_runtime: TestRuntime) -> None:
    wf_runtime.register(kit.secret_wf)
    wf_runtime.set_secret("partner-key", "k" * 12)
    assert wf_runtime.result(wf_runtime.start(kit.secret_wf)).unwrap() == 12
    history = str(
        [r.event for r in wf_runtime.history(wf_runtime.client().list().items[0].execution_id)]
    )
    assert "k" * 12 not in history


def test_replay_reports_code_that_no_longer_replays_its_history(
    wf_runtime: TestRuntime,
) -> None:
    wf_runtime.register(w.determinism_wf, m.inbox_wf)
    done = wf_runtime.start(w.determinism_wf)
    wf_runtime.result(done)
    waiting = wf_runtime.start(m.inbox_wf, {"count": 1})
    with pytest.raises(RunBlockedError):
        wf_runtime.result(waiting)
    assert wf_runtime.replay(done).ok and wf_runtime.replay(waiting).ok
    w.CONTROL["diverge"] = True  # the body now calls another step (same source hash)
    report = wf_runtime.replay(done)
    assert not report.ok and "expected step:first#1 but saw step:second#1" in str(report.divergence)
    assert wf_runtime.replay(waiting).ok
    assert w.CALLS["second"] == 0  # replaying runs no step


def test_the_readme_example_runs_with_the_plugin_fixture(tmp_path: Path) -> None:
    """The README's test kit example, as a user's test file run by pytest in a fresh
    process: the fixture comes from the installed package's entry point."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Testing workflows") :]
    example = section[section.index("```python\n") + 10 : section.index("```\n\n")]
    assert "def test_reminders(wf_runtime)" in example
    (tmp_path / "test_mine.py").write_text(example)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_parent_waiting_for_children_ends_with_time_skipped(wf_runtime: TestRuntime) -> None:
    """``result`` drives the children the run waits for (theirs too), skipping their
    sleeps: no worker is needed."""
    wf_runtime.register(kit.family_wf, kit.nap_wf, kit.grand_wf)
    began = time.monotonic()
    run = wf_runtime.start(kit.family_wf, 30)
    assert wf_runtime.result(run, timeout=30).unwrap() == [30, 31]
    assert time.monotonic() - began < 10
    assert wf_runtime.now() - dt.datetime.now(dt.UTC) > dt.timedelta(days=30)
    assert wf_runtime.replay(run).ok


def test_a_parent_whose_child_waits_for_a_signal_is_reported_blocked(
    wf_runtime: TestRuntime,
) -> None:
    wf_runtime.register(kit.waiting_parent_wf, kit.approval_wf)
    run = wf_runtime.start(kit.waiting_parent_wf)
    began = time.monotonic()
    with pytest.raises(RunBlockedError, match="child runs that cannot go on") as blocked:
        wf_runtime.result(run, timeout=30)
    assert blocked.value.signals == [] and time.monotonic() - began < 10
    child = next(r for r in wf_runtime.client().list().items if r.workflow_name == "kit-approval")
    wf_runtime.send_signal(child.execution_id, "approval", {"approved": True})
    assert wf_runtime.result(run, timeout=30).unwrap() == "approved"


def test_advance_past_the_range_of_dates_is_refused() -> None:
    with TestRuntime(kit.daily_wf) as rt:
        for bad in (1e30, dt.timedelta(days=999_999_999), float("nan"), True, "1"):
            with pytest.raises(wp.InvalidArgumentError):
                rt.advance(bad)  # type: ignore[arg-type]
        for _ in range(3):
            rt.advance(dt.timedelta(days=365_250))  # 1000 years, three times
        rt.advance(dt.timedelta(days=365_250 - 7))
        with pytest.raises(wp.InvalidArgumentError, match="4000 years"):
            rt.advance(dt.timedelta(days=8))
        assert rt.now().year > 6000
        assert rt.result(rt.start(kit.daily_wf, 1), timeout=30).unwrap() == ["reminder 1"]


def test_a_parent_with_more_children_than_one_read_takes(wf_runtime: TestRuntime) -> None:
    """600 children parked on a signal, then one that ends at once: the due one is found
    past the first slice of children, and no time is skipped for nothing meanwhile."""
    wf_runtime.register(kit.crowd_wf, kit.approval_wf, kit.nap_wf)
    run = wf_runtime.start(kit.crowd_wf, 600)
    began = time.monotonic()
    assert wf_runtime.result(run, timeout=120).unwrap() == 0
    assert time.monotonic() - began < 60
    assert wf_runtime.now() - dt.datetime.now(dt.UTC) < dt.timedelta(minutes=5)
