"""User code raising a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
``SystemExit``, ``GeneratorExit``, ``asyncio.CancelledError``, one of its own).

In a worker's threads or on the async worker's loop no signal raises anything, so it is the
code's failure: a step's attempt fails (its retry policy applies), a body's run fails. Given
back as an interruption instead, the run was driven again at once, for ever (the step ran
hundreds of times a second), and on the event loop asyncio let a ``KeyboardInterrupt`` or
``SystemExit`` out of the loop, which stopped serving every run on it. In the main thread,
where a signal handler may raise any of them, they still interrupt: the run is given back
for another drive.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.replaycheck import check_replay

from .helpers import history_types


class _Own(BaseException):
    """A BaseException of the user's own."""


RAISED: dict[str, Callable[[], BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": GeneratorExit,
    "CancelledError": asyncio.CancelledError,
    "_Own": _Own,
}
RUNS: Counter[str] = Counter()
_lock = threading.Lock()


def _ran(key: str) -> None:
    with _lock:
        RUNS[key] += 1


@wp.step(retry=wp.Retry(attempts=2, base=0.01, jitter=False))
def _raising(key: str, kind: str) -> None:
    _ran(key)
    raise RAISED[kind]()


@wp.workflow(name="test_user_base_step", version=1)
def _step_wf(ctx: wp.Context, args: list[str]) -> None:
    ctx.run(_raising, args[0], args[1])


@wp.workflow(name="test_user_base_body", version=1)
def _body_wf(ctx: wp.Context, args: list[str]) -> None:
    _ran(args[0])
    raise RAISED[args[1]]()


@wp.step(retry=wp.Retry(attempts=2, base=0.01, jitter=False))
async def _araising(key: str, kind: str) -> None:
    _ran(key)
    await asyncio.sleep(0)
    raise RAISED[kind]()


@wp.workflow(name="test_user_base_async", version=1)
async def _async_wf(ctx: wp.AsyncContext, args: list[str]) -> None:
    await ctx.run(_araising, args[0], args[1])


@wp.step
async def _nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@wp.workflow(name="test_user_base_napper", version=1)
async def _napper(ctx: wp.AsyncContext, seconds: float) -> float:
    return await ctx.run(_nap, seconds) + await ctx.run(_nap, seconds)


def _undo_a(result: str, key: str, kind: str, reason: dict[str, object]) -> None:
    _ran(f"{key}-undo_a")


def _undo_b(result: str, key: str, kind: str, reason: dict[str, object]) -> None:
    _ran(f"{key}-undo_b")
    raise RAISED[kind]()


@wp.step(compensate=_undo_a)
def _do_a(key: str, kind: str) -> str:
    return "a"


@wp.step(compensate=_undo_b)
def _do_b(key: str, kind: str) -> str:
    return "b"


@wp.workflow(name="test_user_base_saga", version=1)
def _saga_wf(ctx: wp.Context, args: list[str]) -> None:
    ctx.run(_do_a, args[0], args[1])
    ctx.run(_do_b, args[0], args[1])
    raise ValueError("the body's own failure")


@pytest.fixture
def served(make_runtime: Callable[..., wp.Runtime]) -> Iterator[tuple[wp.Runtime, wp.Client]]:
    """A runtime whose worker threads drive, and a thin client (never drives) to await."""
    rt = make_runtime(poll_interval=0.05)
    for wf in (_step_wf, _body_wf, _async_wf, _napper, _saga_wf):
        rt.register(wf)
    with wp.Client(rt.engine, poll_interval=0.05) as thin:
        yield rt, thin


def _failures(rt: wp.Runtime, execution_id: str) -> int:
    with rt.backend.read() as conn:
        found = conn.execute(select(ex.c.drive_failures).where(ex.c.id == execution_id))
        return int(found.scalar_one())


@pytest.mark.parametrize("kind", list(RAISED))
def test_a_step_raising_it_in_a_worker_thread_fails_its_attempts(
    served: tuple[wp.Runtime, wp.Client], kind: str
) -> None:
    rt, thin = served
    rt.start_worker()
    key = f"step-{kind}-{time.monotonic_ns()}"
    handle = thin.start("test_user_base_step", [key, kind])
    outcome = thin.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed), outcome
    assert "StepExecutionError" in str(outcome.error) and kind in str(outcome.error)
    time.sleep(0.2)  # a run driven again would run the step again meanwhile
    assert RUNS[key] == 2, "one run per attempt of its retry policy"
    assert history_types(rt.client(), handle.execution_id).count("step.failed") == 2
    assert _failures(rt, handle.execution_id) == 0


@pytest.mark.parametrize("kind", list(RAISED))
def test_a_body_raising_it_in_a_worker_thread_fails_its_run(
    served: tuple[wp.Runtime, wp.Client], kind: str
) -> None:
    rt, thin = served
    rt.start_worker()
    key = f"body-{kind}-{time.monotonic_ns()}"
    handle = thin.start("test_user_base_body", [key, kind])
    outcome = thin.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed), outcome
    assert outcome.error.get("name") == kind, outcome.error
    time.sleep(0.2)
    assert RUNS[key] == 1


@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "_Own"])
def test_a_compensation_raising_it_is_a_failed_compensation_and_the_unwind_goes_on(
    served: tuple[wp.Runtime, wp.Client], kind: str
) -> None:
    rt, thin = served
    rt.start_worker()
    key = f"saga-{kind}-{time.monotonic_ns()}"
    handle = thin.start("test_user_base_saga", [key, kind])
    outcome = thin.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error.get("name") == "ValueError", outcome
    assert [e["error"]["name"] for e in outcome.compensation_errors] == [kind]
    time.sleep(0.2)
    assert RUNS[f"{key}-undo_b"] == 1 and RUNS[f"{key}-undo_a"] == 1
    assert _failures(rt, handle.execution_id) == 0


@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit", "CancelledError"])
def test_an_async_step_raising_it_on_the_event_loop_leaves_the_loop_serving(
    served: tuple[wp.Runtime, wp.Client], kind: str
) -> None:
    rt, thin = served
    rt.start_worker(event_loop=True, concurrency=8)
    key = f"async-{kind}-{time.monotonic_ns()}"
    hostile = thin.start("test_user_base_async", [key, kind])
    napping = [thin.start("test_user_base_napper", 0.2) for _ in range(3)]
    outcome = thin.result(hostile.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and kind in str(outcome.error), outcome
    for handle in napping:
        assert thin.result(handle.execution_id, timeout=30).unwrap() == 0.4
    after = thin.start("test_user_base_napper", 0.0)  # the loop still serves new runs
    assert thin.result(after.execution_id, timeout=30).unwrap() == 0.0
    assert RUNS[key] == 2


def test_a_keyboard_interrupt_in_the_main_thread_still_interrupts(
    served: tuple[wp.Runtime, wp.Client],
) -> None:
    """``execute()`` drives in the calling (main) thread, where Ctrl-C raises it: the run
    is given back unfailed, and a worker then finds the step's own raise a failure."""
    rt, thin = served
    assert threading.current_thread() is threading.main_thread()
    key = f"main-{time.monotonic_ns()}"
    with pytest.raises(KeyboardInterrupt):
        rt.client().execute(_step_wf, [key, "KeyboardInterrupt"])
    assert RUNS[key] == 1
    with rt.backend.read() as conn:
        (execution_id, owner, status), *_ = conn.execute(
            select(ex.c.id, ex.c.lease_owner, ex.c.status).where(
                ex.c.workflow_name == "test_user_base_step"
            )
        ).all()
    assert owner is None and status == "running"
    rt.start_worker()
    assert isinstance(thin.result(execution_id, timeout=30), wp.Failed)
    assert RUNS[key] == 3


@wp.workflow(name="test_user_base_caught", version=1)
def _caught_wf(ctx: wp.Context, args: list[str]) -> str:
    try:
        ctx.run(_raising, args[0], args[1])
    except BaseException:  # what the test is about: Ctrl-C caught around a step
        return "caught"
    return "ran"


def test_a_main_thread_interrupt_caught_by_the_body_does_not_end_the_run(
    served: tuple[wp.Runtime, wp.Client],
) -> None:
    """A body that caught the interrupt of a step driven in the main thread went on and
    completed the run with the step never recorded (neither started nor failed): the
    interrupt stops the body's outcome as the runtime's own stops do; the run is given
    back, and a worker then records the step's failures and the body's answer."""
    rt, thin = served
    rt.register(_caught_wf)
    key = f"caught-{time.monotonic_ns()}"
    with pytest.raises(KeyboardInterrupt):
        rt.client().execute(_caught_wf, [key, "KeyboardInterrupt"])
    assert RUNS[key] == 1
    with rt.backend.read() as conn:
        execution_id, owner, status = conn.execute(
            select(ex.c.id, ex.c.lease_owner, ex.c.status).where(
                ex.c.workflow_name == "test_user_base_caught"
            )
        ).one()
    assert owner is None and status == "running"
    assert history_types(rt.client(), execution_id) == ["execution.started", "workflow.started"]
    rt.start_worker()
    assert thin.result(execution_id, timeout=30).unwrap() == "caught"
    assert history_types(rt.client(), execution_id).count("step.failed") == 2


#: Whether the helper below is the next release's (an edit outside the workflow's hash).
NEXT_RELEASE = {"helper": False}


def _checked_helper(ctx: wp.Context) -> str:
    if not NEXT_RELEASE["helper"]:
        return "caught"
    try:
        ctx.run(_raising, "checked", "KeyboardInterrupt")
    except BaseException:  # swallows the replay check's stop
        return "caught"
    return "ran"


@wp.workflow(name="test_user_base_checked", version=1)
def _checked(ctx: wp.Context) -> str:
    return _checked_helper(ctx)


def test_a_replay_check_sees_past_a_body_that_catches_its_stop(
    runtime: wp.Runtime, tmp_path: Path
) -> None:
    """A body catching everything around a new step swallowed the check's own stop and
    returned what the run had returned: the change (a step the finished run never ran)
    went unreported."""
    runtime.register(_checked)
    client = runtime.client()
    finished = client.execute(_checked)
    assert finished.unwrap() == "caught"
    NEXT_RELEASE["helper"] = True
    try:
        with (
            wp.Runtime(f"sqlite:///{tmp_path / 'next.sqlite3'}", auto_migrate=True) as deploying,
            wp.Client(runtime.engine) as production,
        ):
            deploying.register(_checked)
            (report,) = check_replay(deploying, [finished.execution_id], database=production)
    finally:
        NEXT_RELEASE["helper"] = False
    assert report.divergence == "would run step _raising, but the run has finished"
