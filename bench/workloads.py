"""wf_persist's side of every workload, through the public API only: ``wp.Runtime``,
``runtime.client()``, ``client.start/result``, ``runtime.start_worker()``, ``wp.Client`` and
the ``wf-persist worker`` CLI.

Each measurement returns a flat ``dict[str, float]`` (the peers print the same shape):
``per_s`` (operations per second), ``cpu_us`` (this process's CPU µs per operation),
``server_cpu_us`` (PostgreSQL processes' CPU µs per operation), and workload-specific
fields (``pickup_ms``, ``worker_cpu_us``, ``all_done_s``, ...).

Run as a module for the pool workload, in a process of its own so its peak RSS is its own:
``python -m bench.workloads pool --url URL``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import wf_persist as wp
from bench.app import WORKFLOWS, many_steps, pool_engine, sleepy, three_steps
from bench.measure import (
    Child,
    RecoveryTrace,
    ServerCpu,
    last_error,
    peak_rss_kib,
    timed,
    wait_for_count,
)

REPO: Final = Path(__file__).resolve().parent.parent
Metrics = dict[str, float]
#: Statement kinds the round-trip count breaks its figure into.
VERBS: Final = ("SELECT", "INSERT", "UPDATE", "DELETE", "BEGIN", "COMMIT", "ROLLBACK")


def _check(value: Any, expected: Any, what: str) -> None:
    if value != expected:
        raise RuntimeError(f"{what}: expected {expected!r}, got {value!r}")


# in-process ------------------------------------------------------------------------------


def open_runtime(url: str, **kwargs: Any) -> wp.Runtime:
    runtime = wp.Runtime(url, **kwargs)
    runtime.register(*WORKFLOWS)
    return runtime


def warm_up(client: wp.WorkflowClient | wp.Client) -> None:
    """One 3-step run end to end: pool, catalog, prepared statements, the worker's first
    claim."""
    handle = client.start("bench_three_steps", 0)
    client.result(handle.execution_id, timeout=120).unwrap()


def steps(client: wp.WorkflowClient, count: int, server: ServerCpu) -> Metrics:
    """One workflow of ``count`` steps, started and driven in this thread."""

    def work() -> None:
        handle = client.start(many_steps, count)
        _check(client.result(handle.execution_id).unwrap(), count, "many_steps")

    rate = timed(count, work, server)
    return rate.metrics()


def sequential(client: wp.WorkflowClient | wp.Client, count: int, server: ServerCpu) -> Metrics:
    """``count`` 3-step workflows one after the other, each started then awaited; also the
    median time from just before ``start()`` to the first step's function beginning."""
    pickups: list[float] = []

    def work() -> None:
        for n in range(count):
            began = time.time()
            handle = client.start("bench_three_steps", n)
            first = client.result(handle.execution_id, timeout=120).unwrap()
            pickups.append(float(first) - began)

    rate = timed(count, work, server)
    return {**rate.metrics(), "pickup_ms": statistics.median(pickups) * 1e3}


def sequential_execute(client: wp.WorkflowClient, count: int, server: ServerCpu) -> Metrics:
    """As :func:`sequential`, each run started and driven by one ``client.execute()`` (the
    start writes the claim)."""
    pickups: list[float] = []

    def work() -> None:
        for n in range(count):
            began = time.time()
            first = client.execute("bench_three_steps", n).unwrap()
            pickups.append(float(first) - began)

    rate = timed(count, work, server)
    return {**rate.metrics(), "pickup_ms": statistics.median(pickups) * 1e3}


def sequential_embedded(url: str, count: int, server: ServerCpu) -> Metrics:
    """As :func:`sequential`, with an embedded worker (``runtime.start_worker()``, its
    defaults) running."""
    runtime = open_runtime(url)
    try:
        runtime.start_worker()
        client = runtime.client()
        warm_up(client)
        return sequential(client, count, server)
    finally:
        runtime.close()


def concurrent(url: str, runs: int, concurrency: int, server: ServerCpu) -> Metrics:
    """Start ``runs`` 3-step workflows, then await them all, with an embedded worker."""
    runtime = open_runtime(url)
    try:
        runtime.start_worker(concurrency=concurrency)
        client = runtime.client()
        warm_up(client)

        def work() -> None:
            ids = [client.start(three_steps, n).execution_id for n in range(runs)]
            for execution_id in ids:
                client.result(execution_id, timeout=300).unwrap()

        return timed(runs, work, server).metrics()
    finally:
        runtime.close()


def round_trips(runtime: wp.Runtime, execute: bool = False) -> Metrics | None:
    """What the database ran for one 3-step workflow started and awaited in this process
    (no worker; with ``execute``, one ``client.execute()``), counted by the test suite's
    ``DatabaseCounter`` (``tests/dbcount.py``); None where that module is not importable
    (an installed package without the tests)."""
    try:
        from tests.dbcount import DatabaseCounter
    except ImportError:
        return None
    client = runtime.client()
    warm_up(client)
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-count-") as tmp:
        counter = DatabaseCounter(runtime.engine, Path(tmp)).start()
        try:
            if execute:
                client.execute(three_steps, 1).unwrap()
            else:
                client.result(client.start(three_steps, 1).execution_id).unwrap()
        finally:
            counts = counter.stop()
    out = {"statements": float(counts.statements), "transactions": float(counts.transactions)}
    out.update({verb: float(n) for verb, n in counts.verbs.items() if n and verb in VERBS})
    return out


# worker processes ------------------------------------------------------------------------


class WorkerProcess(Child):
    """A ``wf-persist worker --app bench.app:make_runtime`` process, configured through the
    environment (see :mod:`bench.app`). The ``serving`` line it prints on stderr before its
    loop starts marks it ready."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int | None = None,
        lease_ttl: float | None = None,
        pool: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        environ = {**os.environ, "BENCH_DATABASE_URL": url, **(env or {})}
        if lease_ttl is not None:
            environ["BENCH_LEASE_TTL"] = str(lease_ttl)
        if pool is not None:
            environ["BENCH_POOL"] = pool
        command = [sys.executable, "-m", "wf_persist.cli", "worker"]
        command += ["--app", "bench.app:make_runtime"]
        if concurrency is not None:
            command += ["--concurrency", str(concurrency)]
        super().__init__(command, marker="serving", stream="stderr", env=environ, cwd=REPO)


def worker_sequential(url: str, count: int, server: ServerCpu) -> Metrics:
    """Sequential 3-step workflows started and awaited here with a thin ``wp.Client``,
    executed by a separate ``wf-persist worker`` process with default settings."""
    worker = WorkerProcess(url)
    try:
        worker.wait_ready()
        with wp.Client(url) as client:
            warm_up(client)
            cpu_before = worker.cpu_seconds()
            out = sequential(client, count, server)
            out["worker_cpu_us"] = (worker.cpu_seconds() - cpu_before) / count * 1e6
        return out
    finally:
        worker.stop()


def _epoch(moment: dt.datetime | None) -> float:
    if moment is None:
        raise RuntimeError("a finished run without finished_at")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def recovery(url: str, runs: int, lease_ttl: float) -> Metrics:
    """``runs`` runs blocked inside step 2 (step 1 recorded) in worker process A; SIGKILL A
    and start worker B (defaults) right after; the runs' finish times are their recorded
    ``finished_at``. The figures are :meth:`bench.measure.RecoveryTrace.metrics`'."""
    tag = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-recovery-") as tmp:
        trace = RecoveryTrace(tmp)
        # Room for every run should a drive hold a connection while its step runs.
        first = WorkerProcess(
            url,
            concurrency=runs,
            lease_ttl=lease_ttl,
            pool=f"{runs + 2},{runs}",
            env=trace.env_a(),
        )
        second: WorkerProcess | None = None
        try:
            first.wait_ready()
            with wp.Client(url) as client:
                ids = [
                    client.start("bench_recover", f"{tag}-{i}").execution_id for i in range(runs)
                ]
                if not wait_for_count(trace.blocked, runs, alive=lambda: first.proc.poll() is None):
                    raise RuntimeError(
                        f"only {trace.blocked()} of {runs} runs reached step 2 in worker A: "
                        + first.describe()
                    )
                killed_at = time.time()
                first.kill()
                second = WorkerProcess(url, lease_ttl=lease_ttl, env=trace.env_b())
                for execution_id in ids:
                    client.result(execution_id, timeout=lease_ttl * 2 + 120).unwrap()
                finished = [_epoch(client.describe(i).finished_at) for i in ids]
            return trace.metrics(killed_at, second.spawned_at, second.ready_at, finished)
        finally:
            first.kill()
            if second is not None:
                second.stop()


# the pool workload, in a process of its own ------------------------------------------------


def pool_workload(
    url: str, runs: int, pool_size: int, concurrency: int, seconds: float
) -> Metrics | str:
    """Run :func:`pool_main` in a fresh process; its metrics, or the error it reported."""
    command = [sys.executable, "-m", "bench.workloads", "pool", "--url", url]
    command += ["--runs", str(runs), "--pool-size", str(pool_size)]
    command += ["--concurrency", str(concurrency), "--seconds", str(seconds)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return f"exit {proc.returncode}: {last_error((proc.stderr or proc.stdout).splitlines())}"
    found = json.loads(lines[-1])
    if "error" in found:
        return str(found["error"])
    return {k: float(v) for k, v in found.items()}


def pool_main(args: argparse.Namespace) -> int:
    """``runs`` runs whose one step sleeps ``seconds``, started first, then driven at once by
    one embedded worker of ``concurrency`` on an engine whose pool has ``pool_size``
    connections (no overflow). Wall time from starting the worker to the last result."""
    engine = pool_engine(args.url, f"{args.pool_size},0")
    runtime = wp.Runtime(engine)
    try:
        runtime.register(*WORKFLOWS)
        client = runtime.client()
        ids = [client.start(sleepy, args.seconds).execution_id for _ in range(args.runs)]
        began = time.perf_counter()
        try:
            runtime.start_worker(concurrency=args.concurrency)
        except wp.WfPersistError as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return 0
        for execution_id in ids:
            client.result(execution_id, timeout=120).unwrap()  # ~1 s expected
        wall = time.perf_counter() - began
    finally:
        runtime.close()
        engine.dispose()
    print(json.dumps({"wall_s": wall, "peak_rss_kib": peak_rss_kib() or 0}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="wf_persist workloads run in a process of their own."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pool = sub.add_parser("pool", help="many sleeping steps, one worker, a small pool")
    pool.add_argument("--url", required=True)
    pool.add_argument("--runs", type=int, default=500)
    pool.add_argument("--pool-size", type=int, default=20)
    pool.add_argument("--concurrency", type=int, default=500)
    pool.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {"pool": pool_main}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
