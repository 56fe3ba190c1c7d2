"""DBOS running the suite's workloads, for a peer comparison (``python -m bench.peer_dbos``).

Runs in its own process (the suite starts it once per measurement) so DBOS's global state and
background threads never run beside our own measurement. Prints one JSON line, the last line
starting with ``{``: the metrics of :mod:`bench.workloads` (``per_s``, ``cpu_us``,
``server_cpu_us``, ...); on a missing ``dbos`` package it prints ``{"error": "dbos not
installed"}`` and exits with status 3.

Workloads (``--workload``):

* ``steps``: one workflow of ``--steps`` steps, called in this thread;
* ``sequential``: ``--workflows`` 3-step workflows, each ``DBOS.start_workflow`` then
  ``get_result()`` (``pickup_ms``: from just before the start to the first step's function);
* ``concurrent``: ``--runs`` ``start_workflow`` calls, then every ``get_result()``;
* ``recovery``: ``--runs`` workflows blocked inside step 2 (step 1 recorded) in child process A;
  SIGKILL A and start child B right after, whose ``DBOS.launch()`` recovers them (DBOS
  recovers the pending workflows of its executor id at launch; there is no lease). Times are
  from the kill to when each workflow's body ended (its result, ``time.time()``).
* without ``--workload``: the two figures ``bench/bench_steps.py`` reads (``steps_per_s``,
  ``wf_per_s``).

The timed part is only the workload: import, ``DBOS.launch()`` (which migrates the system
database on first use) and a warm-up run come before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (bench_steps.py does): find the bench package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import (
    Child,
    RecoveryTrace,
    ServerCpu,
    last_error,
    recovery_first_step,
    recovery_second_step,
    timed,
    wait_for_count,
)

EXIT_NOT_INSTALLED = 3
WORKLOADS = ("steps", "sequential", "concurrent", "recovery", "recovery-child")


class Peer:
    """DBOS with the benchmark's workflows registered (decorators applied as calls: without
    dbos's types an untyped decorator is an error under mypy --strict)."""

    def __init__(self, dbos: Any, url: str) -> None:
        self.DBOS = dbos.DBOS

        def bench_step(i: int) -> dict[str, Any]:
            return {"i": i, "ok": True, "at": time.time()}

        step = self.DBOS.step()(bench_step)

        def many_steps(n: int) -> int:
            for i in range(n):
                step(i)
            return n

        def three_steps(n: int) -> float:
            first = step(n)
            step(n + 1)
            step(n + 2)
            return float(first["at"])

        def recover_first(key: str) -> str:
            recovery_first_step(key)
            return key

        def recover_second(key: str) -> str:
            recovery_second_step(key)  # blocks in child A
            return key

        first = self.DBOS.step()(recover_first)
        second = self.DBOS.step()(recover_second)

        def recover(key: str) -> float:
            first(key)
            second(key)
            # When the body ended: DBOS's updated_at has whole seconds on SQLite.
            return time.time()

        self.many = self.DBOS.workflow()(many_steps)
        self.three = self.DBOS.workflow()(three_steps)
        self.recover = self.DBOS.workflow()(recover)
        config = {
            "name": "wf-bench",
            "system_database_url": url,
            "application_version": "bench-v1",
            "log_level": "WARNING",
        }
        self.DBOS(config=config)

    def launch(self) -> None:
        self.DBOS.launch()

    def destroy(self) -> None:
        self.DBOS.destroy()

    def warm_up(self) -> None:
        self.many(3)  # connection pool, statement caches
        self.DBOS.start_workflow(self.three, 0).get_result()


def run_steps(peer: Peer, args: argparse.Namespace, server: ServerCpu) -> dict[str, float]:
    def work() -> None:
        assert peer.many(args.steps) == args.steps

    return timed(args.steps, work, server).metrics()


def run_sequential(peer: Peer, args: argparse.Namespace, server: ServerCpu) -> dict[str, float]:
    pickups: list[float] = []

    def work() -> None:
        for n in range(args.workflows):
            began = time.time()
            first = peer.DBOS.start_workflow(peer.three, n).get_result()
            pickups.append(float(first) - began)

    out = timed(args.workflows, work, server).metrics()
    out["pickup_ms"] = statistics.median(pickups) * 1e3
    return out


def run_concurrent(peer: Peer, args: argparse.Namespace, server: ServerCpu) -> dict[str, float]:
    def work() -> None:
        handles = [peer.DBOS.start_workflow(peer.three, n) for n in range(args.runs)]
        for handle in handles:
            handle.get_result()

    return timed(args.runs, work, server).metrics()


def run_recovery_child(peer: Peer, args: argparse.Namespace, ready_at: float) -> dict[str, Any]:
    """Child A (``BENCH_BLOCKED`` set): start the runs, write their ids, wait to be killed.
    Child B: its launch (which began at ``ready_at``) recovers them; await them and report
    when each one's body ended (its result)."""
    if os.environ.get("BENCH_BLOCKED"):
        tag = uuid.uuid4().hex[:8]
        ids = [
            peer.DBOS.start_workflow(peer.recover, f"{tag}-{i}").workflow_id
            for i in range(args.runs)
        ]
        Path(args.ids_file).write_text("\n".join(ids))
        while True:
            time.sleep(3600)
    finished = [
        float(peer.DBOS.retrieve_workflow(workflow_id).get_result())
        for workflow_id in Path(args.ids_file).read_text().split()
    ]
    return {"ready_at": ready_at, "finished": finished}


def run_recovery(args: argparse.Namespace) -> dict[str, float]:
    """The orchestrator: children A and B are this script with ``--workload recovery-child``.
    B counts as ready when its ``DBOS.launch()`` begins (DBOS recovers inside it)."""
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-dbos-") as tmp:
        trace = RecoveryTrace(tmp)
        command = [sys.executable, "-m", "bench.peer_dbos", "--backend", args.backend]
        command += ["--url", args.url, "--workload", "recovery-child"]
        command += ["--runs", str(args.runs), "--ids-file", f"{tmp}/ids"]
        first = Child(command, marker="\0", stream="stderr", env={**os.environ, **trace.env_a()})
        try:
            if not wait_for_count(
                trace.blocked, args.runs, alive=lambda: first.proc.poll() is None
            ):
                raise RuntimeError(
                    f"only {trace.blocked()} of {args.runs} workflows reached step 2: "
                    + first.describe()
                )
            killed_at = time.time()
            first.kill()
            spawned_at = time.time()
            env = {**os.environ, **trace.env_b()}
            second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        finally:
            first.kill()
        lines = [ln for ln in second.stdout.splitlines() if ln.startswith("{")]
        if second.returncode != 0 or not lines:
            raise RuntimeError(
                f"recovering process failed (exit {second.returncode}): "
                + last_error(second.stderr.splitlines())
            )
        found = json.loads(lines[-1])
        return trace.metrics(killed_at, spawned_at, float(found["ready_at"]), found["finished"])


def legacy(peer: Peer, args: argparse.Namespace) -> dict[str, Any]:
    """What ``bench_steps.py`` reads."""
    began = time.perf_counter()
    assert peer.many(args.steps) == args.steps
    steps_elapsed = time.perf_counter() - began
    began = time.perf_counter()
    for n in range(args.workflows):
        peer.three(n)
    wf_elapsed = time.perf_counter() - began
    return {
        "backend": args.backend,
        "steps_per_s": args.steps / steps_elapsed,
        "wf_per_s": args.workflows / wf_elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), required=True)
    parser.add_argument("--url", required=True, help="DBOS system database URL")
    parser.add_argument("--workload", choices=WORKLOADS)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--ids-file", help="recovery: where child A writes the workflow ids")
    args = parser.parse_args(argv)

    try:
        # dbos is an optional extra: type-check the same with or without it installed.
        import dbos  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print(json.dumps({"error": "dbos not installed"}), flush=True)
        return EXIT_NOT_INSTALLED

    if args.workload == "recovery":
        print(json.dumps(run_recovery(args)), flush=True)
        return 0
    server = ServerCpu(args.backend == "postgresql")
    peer = Peer(dbos, args.url)
    launched_at = time.time()
    peer.launch()
    try:
        if args.workload == "recovery-child":
            result: dict[str, Any] = run_recovery_child(peer, args, launched_at)
        else:
            peer.warm_up()
            if args.workload == "steps":
                result = run_steps(peer, args, server)
            elif args.workload == "sequential":
                result = run_sequential(peer, args, server)
            elif args.workload == "concurrent":
                result = run_concurrent(peer, args, server)
            else:
                result = legacy(peer, args)
    finally:
        peer.destroy()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
