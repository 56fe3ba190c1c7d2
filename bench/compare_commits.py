"""Steps/s of one 1,000-step workflow with two versions of wf_persist, and the floor, on this
machine, alternating per repetition.

A ratio to a floor depends on the machine (how much a durable commit costs next to the
CPU of a write): the suite's targets were set on one host, and the same code measures other
ratios on another. This shows whether a change moved the step path, whatever the host:
the working tree's package and the package of ``--base`` (a commit, exported with ``git
archive``) run the same workflow, each in a process of its own, then the floor of
:mod:`bench.floors` (SQLite: INSERT + COMMIT per write, WAL, synchronous=FULL;
PostgreSQL: one autocommitted INSERT per write).

Run: ``.venv/bin/python -m bench.compare_commits --base <commit> [--backend all] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SCRATCH_DB = "wf_persist_bench_compare"


def _fresh_url(backend: str, admin_url: str, directory: str) -> str:
    """An empty database: a new SQLite file, or the scratch PostgreSQL database made anew."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    if backend == "sqlite":
        return f"sqlite:///{directory}/steps-{time.time_ns()}.sqlite3"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)"))
            conn.execute(text(f"CREATE DATABASE {SCRATCH_DB}"))
    finally:
        admin.dispose()
    return make_url(admin_url).set(database=SCRATCH_DB).render_as_string(hide_password=False)


def _child_steps(code: str | None, url: str, steps: int) -> dict[str, float]:
    """Steps/s of one workflow driven by its caller, with the package found in ``code``
    (imported only here, after the path is set)."""
    if code is not None:
        sys.path.insert(0, code)
    import wf_persist as wp
    from bench.compare_workload import many_steps

    engine = wp.create_engine(url)
    wp.migrate.upgrade(engine)
    engine.dispose()
    runtime = wp.Runtime(url)
    try:
        runtime.register(many_steps)
        client = runtime.client()

        def run(n: int) -> None:
            outcome = client.result(client.start(many_steps, n).execution_id)
            if getattr(outcome, "value", None) != n:
                raise RuntimeError(f"the workflow did not complete: {outcome!r}")

        run(50)  # warm-up: pool, catalog, statement caches
        began, cpu = time.perf_counter(), time.process_time()
        run(steps)
        wall = time.perf_counter() - began
        return {"per_s": steps / wall, "cpu_us": (time.process_time() - cpu) / steps * 1e6}
    finally:
        runtime.close()


def _child_floor(url: str, writes: int) -> dict[str, float]:
    from bench.floors import Floor

    floor = Floor(url)
    try:
        rate = floor.committed(writes) if floor.sqlite else floor.autocommit(writes)
        return {"per_s": rate.per_s, "cpu_us": rate.cpu_us}
    finally:
        floor.close()


def _measure(argv: list[str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.compare_commits", *argv],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _export(commit: str, directory: str) -> str:
    """The tree of ``commit`` (``git archive``: its package and its migrations), in a
    directory of its own."""
    target = Path(directory, "base")
    target.mkdir()
    archive = Path(directory, "base.tar")
    with archive.open("wb") as fh:
        subprocess.run(
            ["git", "archive", commit], cwd=ROOT, check=True, stdout=fh, stderr=subprocess.DEVNULL
        )
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return str(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the commit to compare the working tree with")
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "all"), default="all")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--floor-writes", type=int, default=3000)
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("WF_PERSIST_BENCH_POSTGRES_URL", DEFAULT_PG_ADMIN_URL),
    )
    parser.add_argument("--child", choices=("ours", "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "ours":
        print(json.dumps(_child_steps(args.code, args.url, args.steps)))
        return 0
    if args.child == "floor":
        print(json.dumps(_child_floor(args.url, args.floor_writes)))
        return 0
    if not args.base:
        parser.error("--base is required")
    backends = ("sqlite", "postgresql") if args.backend == "all" else (args.backend,)
    if args.reps < 1 or args.steps < 1 or args.floor_writes < 1:
        parser.error("--reps, --steps and --floor-writes must be positive")
    with tempfile.TemporaryDirectory(prefix="wf-persist-compare-") as tmp:
        try:
            base_code = _export(args.base, tmp)
        except subprocess.CalledProcessError:
            parser.error(f"--base {args.base!r}: not a commit of this repository")
        for backend in backends:
            samples: dict[str, list[dict[str, float]]] = {"base": [], "tree": [], "floor": []}
            for rep in range(args.reps):
                for system in samples:
                    url = _fresh_url(backend, args.pg_url, tmp)
                    if system == "floor":
                        argv = ["--child", "floor", "--url", url]
                    else:
                        argv = ["--child", "ours", "--url", url, "--steps", str(args.steps)]
                        if system == "base":
                            argv += ["--code", base_code]
                    samples[system].append(_measure(argv))
                print(f".. {backend} rep {rep + 1}/{args.reps}", file=sys.stderr)
            median = {k: statistics.median(s["per_s"] for s in v) for k, v in samples.items()}
            cpu = {k: statistics.median(s["cpu_us"] for s in v) for k, v in samples.items()}
            print(f"{backend}: medians of {args.reps} (steps/s or writes/s; CPU µs per op)")
            labels = (("base", args.base), ("tree", "working tree"), ("floor", "floor"))
            for system, label in labels:
                print(f"  {label:>14}: {median[system]:8,.0f}/s  CPU {cpu[system]:5.0f} µs")
            print(
                f"  base ÷ floor {median['base'] / median['floor']:.2f}; "
                f"working tree ÷ floor {median['tree'] / median['floor']:.2f}; "
                f"working tree ÷ base {median['tree'] / median['base']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
