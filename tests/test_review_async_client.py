"""Review of ``wp.AsyncClient``: what it did wrong on real databases."""

from __future__ import annotations

import asyncio
import threading

import pytest

import wf_persist as wp

from .fixtures import workflows as w


def test_concurrent_opens_that_migrate_do_not_stall_the_event_loop(blank_db_url: str) -> None:
    """Two clients opening with ``auto_migrate=True`` on one loop: the first held the
    process's Alembic lock while awaiting its I/O on the loop, and the second blocked the
    loop's thread on that lock, so neither ever finished."""

    async def app() -> int:
        first = wp.AsyncClient(blank_db_url, auto_migrate=True)
        second = wp.AsyncClient(blank_db_url, auto_migrate=True)
        try:
            found = await asyncio.gather(first.workflows(), second.workflows())
            return sum(len(f) for f in found)
        finally:
            await first.close()
            await second.close()

    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(app())), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the event loop is stuck on the migration lock"
    assert result == [0]


def test_a_timeout_too_large_for_a_float_is_a_typed_error(runtime: wp.Runtime, db_url: str) -> None:
    runtime.register(*w.ALL)

    async def app() -> None:
        async with wp.AsyncClient(db_url) as client:
            waiting = (await client.start("approval", None)).execution_id
            with pytest.raises(wp.InvalidArgumentError):
                await client.result(waiting, timeout=10**400)

    asyncio.run(app())
    with pytest.raises(wp.InvalidArgumentError):
        runtime.client().result("0d5e9c4e-9a7b-4a7e-9d8b-1c2d3e4f5a6b", timeout=10**400)
