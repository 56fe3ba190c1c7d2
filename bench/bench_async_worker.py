"""The async worker against the thread worker: N concurrent runs whose steps await I/O.

Starts ``--runs`` runs (default 1,000) of a workflow of three ``async def`` steps, each
``await asyncio.sleep(0.05)``, then drives them all with a worker process at concurrency N:
once with the event loop (``wf-persist worker --async``), once with a thread per run. The
two alternate per repetition, each on a fresh database. Each worker reports the wall time
from its start until the last run completed, its peak resident memory (VmHWM), its peak
thread count and its CPU time; medians are printed with the ratios.

    python bench/bench_async_worker.py [--backend sqlite|postgresql] [--runs 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp

WORKER = """
import json, sys, threading, time
import wf_persist as wp
from sqlalchemy import func, select
from wf_persist.models import executions_table as ex
sys.path.insert(0, {bench_dir!r})
from bench_async_worker import naps
rt = wp.Runtime({url!r}, poll_interval=0.05)
rt.register(naps)
began = time.perf_counter()
cpu = time.process_time()
worker = wp.Worker(rt, concurrency={runs}, poll_interval=0.05, event_loop={event_loop})
thread = threading.Thread(target=worker.run)
thread.start()
threads = 0
while True:
    threads = max(threads, threading.active_count())
    with rt.backend.read() as conn:
        done = conn.execute(select(func.count()).where(ex.c.status == "completed")).scalar_one()
    if done == {runs}:
        break
    time.sleep(0.01)
wall = time.perf_counter() - began
cpu = time.process_time() - cpu
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
worker.stop(); thread.join(); rt.close()
print(json.dumps({{"wall": wall, "cpu": cpu, "hwm_kib": hwm, "threads": threads}}))
"""

STEP_SECONDS = 0.05


@wp.step
async def nap(i: int) -> int:
    await asyncio.sleep(STEP_SECONDS)
    return i + 1


@wp.workflow(name="bench_naps", version=1)
async def naps(ctx: wp.AsyncContext, n: int) -> int:
    for _ in range(3):
        n = await ctx.run(nap, n)
    return n


def _database(backend: str, admin_url: str, tmp: Path, tag: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp / f'async_{tag}.sqlite3'}"
    name = f"wf_persist_bench_async_{tag}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    url = make_url(admin_url).set(database=name)
    wp.migrate.upgrade(url)
    return url.render_as_string(hide_password=False)


def _drop(backend: str, admin_url: str, tag: str) -> None:
    if backend == "sqlite":
        return
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS wf_persist_bench_async_{tag} WITH (FORCE)"))
    engine.dispose()


def _measure(url: str, runs: int, event_loop: bool) -> dict[str, Any]:
    with wp.Runtime(url) as rt:
        rt.register(naps)
        client = rt.client()
        for i in range(runs):
            client.start(naps, i)
    code = WORKER.format(
        bench_dir=str(Path(__file__).parent), url=url, runs=runs, event_loop=event_loop
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    found: dict[str, list[dict[str, Any]]] = {"loop": [], "threads": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = ("loop", "threads") if rep % 2 == 0 else ("threads", "loop")
            for mode in order:
                tag = f"{mode}_{rep}"
                url = _database(args.backend, args.pg_url, Path(tmp), tag)
                try:
                    found[mode].append(_measure(url, args.runs, mode == "loop"))
                finally:
                    _drop(args.backend, args.pg_url, tag)
                print(f"  rep {rep} {mode:7} {found[mode][-1]}", file=sys.stderr)

    def median(mode: str, key: str) -> float:
        return statistics.median(float(m[key]) for m in found[mode])

    steps = 3 * args.runs
    print(
        f"async worker vs thread worker, {args.backend}: {args.runs:,} concurrent runs of 3 steps "
        f"awaiting {STEP_SECONDS} s each (medians of {args.reps})"
    )
    print(f"  {'':8} {'wall s':>8} {'steps/s':>9} {'peak RSS MiB':>13} {'threads':>8} {'CPU s':>7}")
    for mode in ("loop", "threads"):
        wall = median(mode, "wall")
        print(
            f"  {mode:8} {wall:8.2f} {steps / wall:9.0f} {median(mode, 'hwm_kib') / 1024:13.0f} "
            f"{median(mode, 'threads'):8.0f} {median(mode, 'cpu'):7.2f}"
        )
    print(
        f"  loop ÷ threads: wall {median('loop', 'wall') / median('threads', 'wall'):.2f}, "
        f"memory {median('loop', 'hwm_kib') / median('threads', 'hwm_kib'):.2f}, "
        f"CPU {median('loop', 'cpu') / median('threads', 'cpu'):.2f}"
    )


if __name__ == "__main__":
    main()
