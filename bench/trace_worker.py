"""Where a workflow's time goes when a separate worker process drives it, against the same
workflow driven by its caller (PostgreSQL).

The ratio of the two (``make bench``, workload 3) says how much a worker process costs; this
says where. Each of ``--workflows`` 3-step runs (``bench_three_steps``) is started and
awaited; the time just before ``start()``, its return and the result in hand are taken
here, and each step's result records when its function began (``time.time()``, one clock
for every process of a machine). Printed per phase, in µs: medians and means over the runs,
caller-driven (a runtime with no worker: ``result()`` claims and drives) and worker process
(a thin ``wp.Client``; ``wf-persist worker`` with defaults), alternating per repetition.

Run: ``.venv/bin/python -m bench.trace_worker [--workflows 300] [--reps 3] [--pg-url URL]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable

import wf_persist as wp
from bench.app import WORKFLOWS
from bench.scratch import scratch
from bench.suite import DEFAULT_PG_ADMIN_URL, PG_URL_ENV
from bench.workloads import WorkerProcess

PHASES = ("start", "start → step 1", "step 1 → 2", "step 2 → 3", "step 3 → result", "all")
Timeline = dict[str, list[float]]


def _trace(client: wp.WorkflowClient | wp.Client, count: int) -> Timeline:
    """``count`` runs one after the other: each phase's seconds, per run."""
    marks: list[tuple[str, float, float, float]] = []
    for n in range(count):
        began = time.time()
        execution_id = client.start("bench_three_steps", n).execution_id
        started = time.time()
        client.result(execution_id, timeout=120).unwrap()
        marks.append((execution_id, began, started, time.time()))
    out: Timeline = {phase: [] for phase in PHASES}
    for execution_id, began, started, done in marks:
        steps = [
            float(e.event["result"]["at"])
            for e in client.history(execution_id)
            if e.event["type"] == "step.completed"
        ]
        if len(steps) != 3:
            raise RuntimeError(f"run {execution_id}: {len(steps)} steps completed, not 3")
        points = [started, *steps, done]
        out["start"].append(started - began)
        for phase, (a, b) in zip(PHASES[1:5], itertools.pairwise(points), strict=True):
            out[phase].append(b - a)
        out["all"].append(done - began)
    return out


def _caller(url: str, count: int) -> Timeline:
    runtime = wp.Runtime(url)
    try:
        runtime.register(*WORKFLOWS)
        client = runtime.client()
        _trace(client, 20)  # warm: pool, catalog, prepared statements
        return _trace(client, count)
    finally:
        runtime.close()


def _worker(url: str, count: int) -> Timeline:
    worker = WorkerProcess(url)
    try:
        worker.wait_ready()
        with wp.Client(url) as client:
            _trace(client, 20)
            return _trace(client, count)
    finally:
        worker.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflows", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pg-url", default=os.environ.get(PG_URL_ENV, DEFAULT_PG_ADMIN_URL))
    args = parser.parse_args()
    if args.workflows < 1 or args.reps < 1:
        parser.error("--workflows and --reps must be at least 1")
    ways: dict[str, Callable[[str, int], Timeline]] = {"caller": _caller, "worker": _worker}
    found: dict[str, Timeline] = {way: {phase: [] for phase in PHASES} for way in ways}
    with scratch("postgresql", args.pg_url) as where:
        url = where.url("ours")
        for rep in range(args.reps):
            for way in list(ways)[rep % 2 :] + list(ways)[: rep % 2]:
                for phase, seconds in ways[way](url, args.workflows).items():
                    found[way][phase].extend(seconds)
    print(f"µs per phase, {args.workflows} workflows x {args.reps} repetitions")
    print(
        f"{'phase':18} {'caller median':>14} {'worker median':>14} {'caller mean':>12} "
        f"{'worker mean':>12}"
    )
    for phase in PHASES:
        c, w = found["caller"][phase], found["worker"][phase]
        print(
            f"{phase:18} {statistics.median(c) * 1e6:14,.0f} {statistics.median(w) * 1e6:14,.0f}"
            f" {statistics.mean(c) * 1e6:12,.0f} {statistics.mean(w) * 1e6:12,.0f}"
        )
    caller, worker = (
        statistics.mean(found["caller"]["all"]),
        statistics.mean(found["worker"]["all"]),
    )
    print(f"worker process ÷ caller-driven, workflows/s (from the means): {caller / worker:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
