"""Review of child workflows and async workflows (d50380e, a4979bb): regressions."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel

import wf_persist as wp
from wf_persist.replaycheck import check_replay

from .helpers import wait_status

UNDONE: list[str] = []


async def _refund(result: str, label: str, *, reason: dict[str, Any]) -> None:
    await asyncio.sleep(0)
    UNDONE.append(result)


@wp.step(compensate=_refund)
async def charge(label: str) -> str:
    await asyncio.sleep(0)
    return f"charged:{label}"


@wp.step
async def boom() -> None:
    raise RuntimeError("boom")


@wp.workflow(name="review_async_saga", version=1)
async def async_saga(ctx: wp.AsyncContext, label: str) -> str:
    await ctx.run(charge, label)
    await ctx.run(boom)
    return "never"


def test_an_async_compensation_of_an_async_workflow_runs(runtime: wp.Runtime) -> None:
    """The unwind runs after the body's loop is gone: an async compensation must still be
    awaited (it was closed unrun, recorded as a compensation error)."""
    UNDONE.clear()
    runtime.register(async_saga)
    client = runtime.client()
    run = client.start(async_saga, "a").execution_id
    outcome = client.result(run, timeout=30)
    assert outcome.status == "failed"
    assert UNDONE == ["charged:a"]
    assert "compensationErrors" not in (outcome.error or {})


class Parcel(BaseModel):
    label: str
    weight: int


@wp.workflow(name="review_parcel_child", version=1)
def parcel_child(ctx: wp.Context, label: str) -> Parcel:
    return Parcel(label=label, weight=len(label))


@wp.workflow(name="review_parcel_parent", version=1)
def parcel_parent(ctx: wp.Context, label: str) -> int:
    """Starts its child by name: the result comes back as the child's output type."""
    handle: wp.ChildHandle[Parcel] = ctx.start_child("review_parcel_child", label)
    return ctx.child_result(handle).weight


def test_replay_check_of_a_parent_gets_a_child_result_by_name_as_its_type(
    runtime: wp.Runtime,
) -> None:
    """The replay checker rebuilt a child's result started by name as raw JSON (a dict):
    a parent reading ``.weight`` failed there and the run was reported as diverging."""
    runtime.register(parcel_child, parcel_parent)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    client = runtime.client()
    run = client.start(parcel_parent, "abcd").execution_id
    assert client.result(run, timeout=30).unwrap() == 4
    [report] = check_replay(runtime, [run])
    assert report.divergence is None, report


GATHERED: list[str] = []


@wp.step(retry=wp.Retry(attempts=1))
async def tally(label: str) -> str:
    GATHERED.append(label)
    await asyncio.sleep(0.2)
    return label


@wp.workflow(name="review_gather_park", version=1)
async def gather_park(ctx: wp.AsyncContext) -> str:
    """A park and a step awaited together (documented: they take turns)."""
    _, got = await asyncio.gather(ctx.wait_for_signal("go", bool), ctx.run(tally, "x"))
    return got


def test_a_step_gathered_with_a_park_is_not_started_after_the_park(
    runtime: wp.Runtime,
) -> None:
    """The signal wait parks the run (Suspended); the gathered step's turn came next and it
    was started on the helper thread anyway, by a drive that had given the run up: run an
    extra time, its outcome never recorded (and racing the next driver)."""
    GATHERED.clear()
    runtime.register(gather_park)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    client = runtime.client()
    run = client.start(gather_park).execution_id
    wait_status(client, run, "suspended")
    time.sleep(0.5)  # the gathered step's turn, if it is (wrongly) taken after the park
    client.signal(run, "go", True)
    outcome = client.result(run, timeout=30)
    assert outcome.status == "completed", outcome.error
    assert outcome.unwrap() == "x"
    types = [r.event["type"] for r in client.history(run)]
    assert "step.failed" not in types
    assert GATHERED == ["x"]  # no crash: the step ran once, not also after the park
