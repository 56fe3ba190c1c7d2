"""``lease_checked_at()`` as user code sees it, per call path.

The chaos checker and users read ``lease_checked_at()`` inside a step to tell "paused
between the lease check and the call" from a re-run. Each path that calls user code after a
lease check should see that check's time (a fresh one, taken before the call).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import wf_persist as wp
from wf_persist.lease_checks import lease_checked_at

from .helpers import wait_until

SEEN: dict[str, Any] = {}


def _note(kind: str) -> None:
    at = lease_checked_at()
    SEEN[kind] = None if at is None else time.time() - at


@wp.step
async def _seen_async_step() -> str:
    _note("async step")
    return "a"


@wp.step
def _seen_sync_step() -> str:
    _note("sync step")
    return "s"


async def _seen_async_code() -> str:
    _note("async code")
    return "c"


@wp.workflow(name="t-lease-checked-at", version=1)
async def _seen_wf(ctx: wp.AsyncContext) -> list[str]:
    out = [await ctx.run(_seen_sync_step), await ctx.run(_seen_async_step)]
    out.append(await ctx.code("code", _seen_async_code, output=str))
    return out


@pytest.mark.parametrize("event_loop", [False, True], ids=["thread-worker", "async-worker"])
def test_every_user_call_sees_the_check_it_was_made_on(
    event_loop: bool, make_runtime: Callable[..., wp.Runtime]
) -> None:
    SEEN.clear()
    rt = make_runtime(lease_ttl=30)
    rt.register(_seen_wf)
    run = rt.client().start(_seen_wf).execution_id
    rt.start_worker(concurrency=4, poll_interval=0.05, event_loop=event_loop)
    assert rt.client().result(run, timeout=30).unwrap() == ["s", "a", "c"]
    wait_until(lambda: len(SEEN) == 3, what="three calls", timeout=5)
    missing = {k: v for k, v in SEEN.items() if v is None or v > 5}
    assert not missing, f"no (or a stale) lease check seen by: {missing}; all: {SEEN}"
