"""The benchmark's workflows, and the runtime a separate worker process serves:

    BENCH_DATABASE_URL=... python -m wf_persist.cli worker --app bench.app:make_runtime

The suite imports the same definitions (same source hashes) to start runs and to drive them
in its own process. Everything a worker process needs to know comes from the environment:

* ``BENCH_DATABASE_URL`` (required), ``BENCH_LEASE_TTL`` (seconds, default 30);
* ``BENCH_POOL``: ``"size,overflow"`` for an engine of that pool (default: the runtime's own
  engine);
* ``BENCH_MARKS``, ``BENCH_BLOCKED``, ``BENCH_RESUMED``: the files the steps of a recovery run
  write (see :func:`bench.measure.recovery_second_step`); with ``BENCH_BLOCKED`` set, step 2
  blocks until the process is killed.
"""

from __future__ import annotations

import os
import time
from typing import Any

import wf_persist as wp
from bench.measure import recovery_first_step, recovery_second_step


@wp.step
def bench_step(i: int) -> dict[str, Any]:
    """A small step whose result records when its function began (``time.time()``), so a
    run's first step tells the pickup latency."""
    return {"i": i, "ok": True, "at": time.time()}


@wp.workflow(name="bench_many_steps", version=1)
def many_steps(ctx: wp.Context, n: int) -> int:
    for i in range(n):
        ctx.run(bench_step, i)
    return n


@wp.workflow(name="bench_three_steps", version=1)
def three_steps(ctx: wp.Context, n: int) -> float:
    """Three steps; the result is the time the first step's function began."""
    first = ctx.run(bench_step, n)
    ctx.run(bench_step, n + 1)
    ctx.run(bench_step, n + 2)
    return float(first["at"])


@wp.step
def recover_first(key: str) -> str:
    recovery_first_step(key)
    return key


@wp.step
def recover_second(key: str) -> str:
    recovery_second_step(key)  # blocks in worker A
    return key


@wp.workflow(name="bench_recover", version=1)
def recover(ctx: wp.Context, key: str) -> str:
    ctx.run(recover_first, key)
    return ctx.run(recover_second, key)


@wp.step
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@wp.workflow(name="bench_sleepy", version=1)
def sleepy(ctx: wp.Context, seconds: float) -> float:
    return ctx.run(nap, seconds)


WORKFLOWS: tuple[wp.Workflow[Any, Any], ...] = (many_steps, three_steps, recover, sleepy)


def pool_engine(url: str, spec: str) -> Any:
    """An engine with wf_persist's settings and the pool ``"size,overflow"``."""
    size, _, overflow = spec.partition(",")
    return wp.create_engine(url, pool_size=int(size), max_overflow=int(overflow or 0))


def make_runtime() -> wp.Runtime:
    """The runtime of a worker process, configured from the environment (see above)."""
    url = os.environ["BENCH_DATABASE_URL"]
    pool = os.environ.get("BENCH_POOL")
    bind = pool_engine(url, pool) if pool else url
    runtime = wp.Runtime(bind, lease_ttl=float(os.environ.get("BENCH_LEASE_TTL", "30")))
    runtime.register(*WORKFLOWS)
    return runtime
