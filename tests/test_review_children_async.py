"""Review of child workflows and async workflows (d50380e, a4979bb): regressions."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

import wf_persist as wp
from wf_persist.replaycheck import check_replay

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
