"""A suspended run costs nothing but rows: worker memory with 0 and with N parked runs.

Parks N runs (default 10,000) on a signal wait, then starts a fresh worker process against the
database twice: once before the runs exist and once after. Each worker polls for a few
seconds and reports its resident memory (VmRSS) and how many runs it holds. The two figures
are printed side by side; a flat worker shows a ratio near 1.0.

    python bench/bench_suspended.py [--backend sqlite|postgresql] [--runs 10000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp

WORKER = """
import json, sys, threading, time
import wf_persist as wp
sys.path.insert(0, {bench_dir!r})
from bench_suspended import parked
rt = wp.Runtime({url!r}, poll_interval=0.05)
rt.register(parked)
worker = wp.Worker(rt, concurrency=8, poll_interval=0.05)
thread = threading.Thread(target=worker.run)
thread.start()
time.sleep({seconds})
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
held = len(rt._driving)
threads = threading.active_count()
worker.stop(); thread.join(); rt.close()
print(json.dumps({{"rss_kib": rss, "threads": threads, "held": held}}))
"""


@wp.workflow(name="parked", version=1)
def parked(ctx: wp.Context) -> str:
    got = ctx.wait_for_signal("never", bool)
    return "woken" if isinstance(got, wp.Received) else "timeout"


def _measure(url: str, seconds: float) -> dict[str, int]:
    code = WORKER.format(bench_dir=str(Path(__file__).parent), url=url, seconds=seconds)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _database(backend: str, admin_url: str, tmp: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp / 'suspended.sqlite3'}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS wf_persist_bench_suspended WITH (FORCE)"))
        conn.execute(text("CREATE DATABASE wf_persist_bench_suspended"))
    engine.dispose()
    url = make_url(admin_url).set(database="wf_persist_bench_suspended")
    wp.migrate.upgrade(url)
    return url.render_as_string(hide_password=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=3.0, help="worker polling time")
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = _database(args.backend, args.pg_url, Path(tmp))
        with wp.Runtime(url) as rt:
            rt.register(parked)
            empty = _measure(url, args.seconds)
            client = rt.client()
            began = time.perf_counter()
            for _ in range(args.runs):
                rt.drive(client.start(parked).execution_id)
            parked_s = time.perf_counter() - began
            suspended = len(client.list(parked, status="suspended").items)
            full = _measure(url, args.seconds)
    print(f"backend {args.backend}: parked {suspended} runs in {parked_s:.1f}s")
    print(
        f"  worker RSS, no runs:            {empty['rss_kib']:>8,} KiB  threads {empty['threads']}"
    )
    print(
        f"  worker RSS, {suspended:,} suspended: {full['rss_kib']:>8,} KiB  threads "
        f"{full['threads']}  runs held {full['held']}"
    )
    print(f"  ratio {full['rss_kib'] / empty['rss_kib']:.3f} (1.0 = flat)")


if __name__ == "__main__":
    main()
