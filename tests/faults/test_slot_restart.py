"""A ``Limit`` slot held across a PostgreSQL restart and crash; a private cluster (never the
shared server).

When a slot was a session lock, a restart (or a failover, or a killed session) freed it
while its step ran on, and a run waiting for the slot took it within a second or two:
``Limit(1)`` had two holders. A slot is now a row its holder keeps ahead of the database's
clock, which the restart does not touch.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

import wf_persist as wp
from tests.helpers import wait_until
from wf_persist.leases import Outage

from .pgcluster import PrivatePostgres

STEP_SECONDS = 3.0


@pytest.fixture
def migrated_pg(private_pg: PrivatePostgres) -> PrivatePostgres:
    wp.migrate.upgrade(private_pg.url())
    return private_pg


def _free(runtime: wp.Runtime) -> bool:
    try:
        with runtime.slots.slot("restart-step", "k", 1, "probe") as acquire:
            return acquire()
    except Exception:
        return False  # the server is still coming back


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_restart_keeps_a_held_slot(migrated_pg: PrivatePostgres, mode: str) -> None:
    url = migrated_pg.url()
    with wp.Runtime(url, lease_ttl=4) as holder, wp.Runtime(url) as other:
        with holder.slots.slot("restart-step", "k", 1, "holder-run") as acquire:
            assert acquire()
            migrated_pg.restart(mode)
            migrated_pg.wait_accepting()
            until = time.monotonic() + 6  # past renewals, past the TTL
            while time.monotonic() < until:
                assert not _free(other), "the restart freed a held slot"
                time.sleep(0.2)
        wait_until(lambda: _free(other), what="the slot given back", timeout=20)


inside = {"now": 0, "peak": 0, "done": 0}
inside_lock = threading.Lock()
restart_now = threading.Event()


@wp.step(concurrency=wp.Limit(1))
def exclusive(i: int) -> int:
    with inside_lock:
        inside["now"] += 1
        inside["peak"] = max(inside["peak"], inside["now"])
    restart_now.set()
    time.sleep(STEP_SECONDS)
    with inside_lock:
        inside["now"] -= 1
        inside["done"] += 1
    return i


@wp.workflow(name="restart_limited", version=1)
def restart_limited_wf(ctx: wp.Context, i: int) -> int:
    return ctx.run(exclusive, i)


def test_limit_one_has_one_holder_through_a_crash(migrated_pg: PrivatePostgres) -> None:
    """End to end: two runs of a ``Limit(1)`` step, the server crashing while the first is
    inside it; the other run queues through the crash and after it."""
    inside.update(now=0, peak=0, done=0)
    restart_now.clear()
    with wp.Runtime(migrated_pg.url(), lease_ttl=5, record_start_after=None) as rt:
        rt.register(restart_limited_wf)
        runs = [rt.client().start(restart_limited_wf, i).execution_id for i in range(2)]
        rt.start_worker(concurrency=4, poll_interval=0.05)
        assert restart_now.wait(30)
        migrated_pg.restart("immediate")
        migrated_pg.wait_accepting()
        results = sorted(rt.client().result(r, timeout=90).unwrap() for r in runs)
    assert results == [0, 1]
    assert inside["peak"] == 1


held_inside = threading.Event()


@wp.step(concurrency=wp.Limit(1, key=lambda i: "k"))
def held_long(i: int) -> int:
    held_inside.set()
    time.sleep(STEP_SECONDS)
    return i


@wp.workflow(name="restart_reaped", version=1)
def restart_reaped_wf(ctx: wp.Context, i: int) -> int:
    return ctx.run(held_long, i)


def test_another_workers_reaper_leaves_a_live_holders_slot_alone(
    migrated_pg: PrivatePostgres,
) -> None:
    """A restart frees every presence lock: a live worker's looks free until its listener
    takes it again. The reaper of another worker made the live worker's slots lapse with
    its runs (0.2 s), and a second run entered ``Limit(1)`` while the first was inside."""
    held_inside.clear()
    url = migrated_pg.url()
    with wp.Runtime(url, lease_ttl=30) as holder, wp.Runtime(url, lease_ttl=30) as other:
        holder.register(restart_reaped_wf)
        run = holder.client().start(restart_reaped_wf, 1).execution_id
        holder.start_worker(concurrency=2, poll_interval=0.05)
        wakeups = holder.wakeups()
        # The holder's listener reconnects 4 s after it fails, not 0.1 s: the window in which
        # its lock looks free outlasts a loaded machine's slowness (CI once saw it retaken
        # before the other reaper's connection came back, and nothing reaped).
        wakeups._outage = Outage(logging.getLogger(__name__), "listening for wake-ups", 4.0)
        other.wakeups()
        assert held_inside.wait(30)
        migrated_pg.restart("fast")
        migrated_pg.wait_accepting()
        reaped: list[str] = []
        until = time.monotonic() + 4
        while time.monotonic() < until and not reaped:
            try:
                reaped = other.reap()
            except Exception:
                time.sleep(0.01)
        assert reaped == [run], "the live worker's lock looked free: its run was reaped"
        time.sleep(0.5)  # past the reaper's grace
        with other.slots.slot(held_long.name, "k", 1, "probe") as acquire:
            assert not acquire(), "a second holder while the first step runs"
        assert holder.client().result(run, timeout=60).unwrap() == 1
