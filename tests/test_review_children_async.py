"""Review of child workflows and async workflows (d50380e, a4979bb): regressions."""

from __future__ import annotations

import asyncio
from typing import Any

import wf_persist as wp

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
