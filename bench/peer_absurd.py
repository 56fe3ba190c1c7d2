"""Absurd (PostgreSQL only) running the suite's workloads (``python -m bench.peer_absurd``).

Absurd is a schema of PL/pgSQL functions plus an SDK: ``pip install absurd-sdk absurdctl``
(the ``bench`` extra). ``--workload setup`` installs the schema into the scratch database
with ``absurdctl init`` (which applies the ``absurd.sql`` bundled in the absurdctl package,
through ``psql``) and makes one queue per workload with ``absurdctl create-queue``. Only the
SDK's public API drives tasks; the recovery workload reads the runs' ``completed_at`` from
Absurd's own table, as the SDK does not expose it.

Like ``peer_dbos.py``: one process per measurement, one JSON line of metrics as the last line
starting with ``{`` (``per_s``, ``cpu_us``, ``server_cpu_us``, ...); exit status 3 and
``{"error": ...}`` when the SDK is not installed. Workloads (``--workload``):

* ``steps``: one task of ``--steps`` ``ctx.step`` calls, spawned and run inline
  (``work_batch()`` in this process);
* ``sequential-inline``: ``--workflows`` 3-step tasks, each ``spawn`` then ``work_batch()``
  here, then its result;
* ``sequential-worker``: the same tasks executed by a worker process (``Absurd.start_worker``)
  with its defaults (``--poll default``: concurrency 1, poll interval 0.25 s, the caller waits
  with ``await_task_result``) or tight polling (``--poll tight``: poll interval 0.01 s, the
  caller polls ``fetch_task_result`` every 2 ms); ``pickup_ms`` as in ours;
* ``concurrent``: ``--runs`` spawns, then every result (``fetch_task_result`` every 2 ms per
  task), executed by ``--processes`` worker processes of ``AsyncAbsurd`` with
  ``--concurrency`` each;
* ``recovery``: ``--runs`` tasks blocked inside step 2 (step 1 checkpointed; the blocked step
  heartbeats its claim) in worker process A with ``claim_timeout`` ``--lease`` (at least 1 s,
  an integer); SIGKILL A and start worker B (concurrency 4) right after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):  # run as a script: find the bench package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import (
    Child,
    RecoveryTrace,
    ServerCpu,
    recovery_first_step,
    recovery_second_step,
    timed,
    wait_for_count,
)

EXIT_NOT_INSTALLED: Final = 3
QUEUES: Final = ("steps", "seq_inline", "seq_worker", "concurrent", "recovery")
WORKLOADS: Final = (
    "setup",
    "steps",
    "sequential-inline",
    "sequential-worker",
    "concurrent",
    "recovery",
    "worker",
)
POLL: Final = {"default": 0.25, "tight": 0.01}
TERMINAL: Final = ("completed", "failed", "cancelled")


def step_value(i: int) -> dict[str, Any]:
    return {"i": i, "ok": True, "at": time.time()}


# tasks ---------------------------------------------------------------------------------


def register_sync(app: Any, lease: int) -> None:
    """The benchmark's tasks on a synchronous client (its queue's)."""

    def many(params: dict[str, Any], ctx: Any) -> int:
        n = int(params["n"])
        for i in range(n):
            ctx.step("step", lambda i=i: step_value(i))
        return n

    def three(params: dict[str, Any], ctx: Any) -> float:
        n = int(params["n"])
        first = ctx.step("step", lambda: step_value(n))
        ctx.step("step", lambda: step_value(n + 1))
        ctx.step("step", lambda: step_value(n + 2))
        return float(first["at"])

    def recover(params: dict[str, Any], ctx: Any) -> str:
        key = str(params["key"])

        def first() -> str:
            recovery_first_step(key)
            return key

        def second() -> str:
            # Blocks in worker A, heartbeating its claim as a live worker's task does.
            recovery_second_step(key, keep_alive=lambda: ctx.heartbeat(lease), interval=lease / 3)
            return key

        ctx.step("first", first)
        return str(ctx.step("second", second))

    app.register_task("many")(many)
    app.register_task("three")(three)
    app.register_task("recover")(recover)


def register_async(app: Any) -> None:
    """The 3-step task on an ``AsyncAbsurd`` client."""

    async def three(params: dict[str, Any], ctx: Any) -> float:
        n = int(params["n"])

        def value(i: int) -> Callable[[], Any]:
            async def run() -> dict[str, Any]:
                return step_value(i)

            return run

        first = await ctx.step("step", value(n))
        await ctx.step("step", value(n + 1))
        await ctx.step("step", value(n + 2))
        return float(first["at"])

    app.register_task("three")(three)


# helpers -------------------------------------------------------------------------------


def client(sdk: Any, url: str, queue: str, lease: int = 120) -> Any:
    app = sdk.Absurd(url, queue_name=queue)
    register_sync(app, lease)
    return app


def result_of(app: Any, task_id: str) -> Any:
    snapshot = app.fetch_task_result(task_id)
    if snapshot is None or snapshot.state != "completed":
        raise RuntimeError(f"task {task_id} did not complete: {snapshot!r}")
    return snapshot.result


def poll_result(app: Any, task_id: str, interval: float = 0.002, timeout: float = 300) -> Any:
    """Wait for a task by ``fetch_task_result`` every ``interval`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = app.fetch_task_result(task_id)
        if snapshot is not None and snapshot.state in TERMINAL:
            return result_of(app, task_id)
        if time.monotonic() > deadline:
            raise RuntimeError(f"task {task_id} still {snapshot!r} after {timeout}s")
        time.sleep(interval)


def await_result(app: Any, task_id: str) -> Any:
    """Wait for a task with the SDK's own ``await_task_result`` (polls from 50 ms, doubling
    up to 1 s)."""
    snapshot = app.await_task_result(task_id, timeout=300)
    if snapshot.state != "completed":
        raise RuntimeError(f"task {task_id} did not complete: {snapshot!r}")
    return snapshot.result


class Worker(Child):
    """This script as ``--workload worker``: prints ``ready`` once its client is up, then
    runs the SDK's worker loop until killed."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        mode: str = "sync",
        concurrency: int = 1,
        poll_interval: float = 0.25,
        lease: int = 120,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [sys.executable, "-m", "bench.peer_absurd", "--workload", "worker"]
        command += ["--url", url, "--queue", queue, "--mode", mode]
        command += ["--concurrency", str(concurrency), "--poll-interval", str(poll_interval)]
        command += ["--lease", str(lease)]
        super().__init__(command, marker="ready", env={**os.environ, **(env or {})})


def run_worker(sdk: Any, args: argparse.Namespace) -> None:
    worker_id = f"bench-{os.getpid()}"
    if args.mode == "async":
        app = sdk.AsyncAbsurd(args.url, queue_name=args.queue)
        register_async(app)

        async def serve() -> None:
            await app.list_queues()  # connect before saying ready
            print("ready", flush=True)
            await app.start_worker(
                worker_id=worker_id,
                claim_timeout=args.lease,
                concurrency=args.concurrency,
                poll_interval=args.poll_interval,
            )

        asyncio.run(serve())
        return
    app = client(sdk, args.url, args.queue, args.lease)
    print("ready", flush=True)
    app.start_worker(
        worker_id=worker_id,
        claim_timeout=args.lease,
        concurrency=args.concurrency,
        poll_interval=args.poll_interval,
    )


# workloads -----------------------------------------------------------------------------


def setup(args: argparse.Namespace) -> dict[str, Any]:
    absurdctl = shutil.which("absurdctl") or str(Path(sys.executable).with_name("absurdctl"))
    commands = [[absurdctl, "init", "-d", args.url]]
    commands += [[absurdctl, "create-queue", "-d", args.url, q] for q in QUEUES]
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])} failed: {proc.stderr.strip()}")
    return {"queues": list(QUEUES)}


def run_steps(sdk: Any, args: argparse.Namespace, server: ServerCpu) -> dict[str, float]:
    app = client(sdk, args.url, "steps")
    app.spawn("many", {"n": 3})
    app.work_batch(worker_id="inline")  # warm-up

    def work() -> None:
        spawned = app.spawn("many", {"n": args.steps})
        app.work_batch(worker_id="inline")
        assert result_of(app, spawned["task_id"]) == args.steps

    out = timed(args.steps, work, server).metrics()
    app.close()
    return out


def run_sequential(
    sdk: Any, args: argparse.Namespace, server: ServerCpu, inline: bool
) -> dict[str, float]:
    queue = "seq_inline" if inline else "seq_worker"
    app = client(sdk, args.url, queue)
    worker: Worker | None = None
    if not inline:
        worker = Worker(args.url, queue, poll_interval=POLL[args.poll])
        worker.wait_ready()
    wait = poll_result if (inline or args.poll == "tight") else await_result
    pickups: list[float] = []

    def one(n: int) -> None:
        began = time.time()
        spawned = app.spawn("three", {"n": n})
        if inline:
            app.work_batch(worker_id="inline")
        pickups.append(float(wait(app, spawned["task_id"])) - began)

    try:
        one(0)  # warm-up
        pickups.clear()
        cpu_before = worker.cpu_seconds() if worker is not None else 0.0

        def work() -> None:
            for n in range(args.workflows):
                one(n)

        out = timed(args.workflows, work, server).metrics()
        out["pickup_ms"] = statistics.median(pickups) * 1e3
        if worker is not None:
            out["worker_cpu_us"] = (worker.cpu_seconds() - cpu_before) / args.workflows * 1e6
        return out
    finally:
        if worker is not None:
            worker.kill()
        app.close()


def run_concurrent(sdk: Any, args: argparse.Namespace, server: ServerCpu) -> dict[str, float]:
    app = client(sdk, args.url, "concurrent")
    workers = [
        Worker(args.url, "concurrent", mode="async", concurrency=args.concurrency)
        for _ in range(args.processes)
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        warm = [app.spawn("three", {"n": n})["task_id"] for n in range(2 * args.processes)]
        for task_id in warm:
            poll_result(app, task_id)
        cpu_before = sum(w.cpu_seconds() for w in workers)

        def work() -> None:
            ids = [app.spawn("three", {"n": n})["task_id"] for n in range(args.runs)]
            for task_id in ids:
                poll_result(app, task_id)

        out = timed(args.runs, work, server).metrics()
        out["worker_cpu_us"] = (
            (sum(w.cpu_seconds() for w in workers) - cpu_before) / args.runs * 1e6
        )
        return out
    finally:
        for worker in workers:
            worker.kill()
        app.close()


def run_recovery(sdk: Any, args: argparse.Namespace) -> dict[str, float]:
    import psycopg

    lease = max(1, int(args.lease))
    app = client(sdk, args.url, "recovery", lease)
    tag = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-absurd-") as tmp:
        trace = RecoveryTrace(tmp)
        first = Worker(args.url, "recovery", concurrency=args.runs, lease=lease, env=trace.env_a())
        second: Worker | None = None
        try:
            first.wait_ready()
            ids = [app.spawn("recover", {"key": f"{tag}-{i}"})["task_id"] for i in range(args.runs)]
            if not wait_for_count(
                trace.blocked, args.runs, alive=lambda: first.proc.poll() is None
            ):
                raise RuntimeError(
                    f"only {trace.blocked()} of {args.runs} tasks reached step 2: "
                    + first.describe()
                )
            killed_at = time.time()
            first.kill()
            second = Worker(args.url, "recovery", concurrency=4, lease=lease, env=trace.env_b())
            for task_id in ids:
                poll_result(app, task_id, interval=0.01, timeout=lease * 2 + 120)
            second.wait_ready()
        finally:
            first.kill()
            if second is not None:
                second.kill()
            app.close()
        # The SDK does not expose when a task completed; its run table does.
        with psycopg.connect(args.url) as conn:
            rows = conn.execute(
                "SELECT extract(epoch FROM completed_at) FROM absurd.r_recovery"
                " WHERE state = 'completed' AND task_id = ANY(%s::uuid[])",
                (ids,),
            ).fetchall()
        done = [float(row[0]) for row in rows]
        return trace.metrics(killed_at, second.spawned_at, second.ready_at, done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="libpq URL of the scratch database")
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--poll", choices=tuple(POLL), default="default")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--lease", type=int, default=120, help="claim_timeout, seconds")
    parser.add_argument("--queue", default="default", help="worker: its queue")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--poll-interval", type=float, default=0.25)
    args = parser.parse_args(argv)

    try:
        import absurd_sdk  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print(json.dumps({"error": "absurd-sdk not installed"}), flush=True)
        return EXIT_NOT_INSTALLED

    server = ServerCpu()
    result: dict[str, Any]
    if args.workload == "worker":
        run_worker(absurd_sdk, args)
        return 0
    if args.workload == "setup":
        result = setup(args)
    elif args.workload == "steps":
        result = run_steps(absurd_sdk, args, server)
    elif args.workload in ("sequential-inline", "sequential-worker"):
        result = run_sequential(absurd_sdk, args, server, args.workload == "sequential-inline")
    elif args.workload == "concurrent":
        result = run_concurrent(absurd_sdk, args, server)
    else:
        result = run_recovery(absurd_sdk, args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
