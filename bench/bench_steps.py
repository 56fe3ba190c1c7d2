"""Per-step write throughput of wf_persist, against raw-SQL floors and DBOS.

A durable step is one committed write, so the useful question is not "how many steps per
second" (that is mostly the disk's fsync rate) but "how close to one bare committed INSERT
per step do we get". Every backend run therefore measures, in the same process and on the
same database settings:

1. ours, steps/s: one workflow doing ``--steps`` steps;
2. ours, wf/s: ``--workflows`` sequential 3-step workflows (start + result);
3. floor A: raw SQLAlchemy Core, INSERT + COMMIT per write on one connection;
4. floor B (PostgreSQL only): the same INSERT in autocommit, one round trip per write;
5. peer: DBOS on the same two workloads, in a subprocess (``peer_dbos.py``).

The machine is noisy, so repetitions are interleaved (ours, floors, peer, ours, ...) and
the report is ratios between numbers taken in this run, never absolute figures alone; each
ratio also shows its range over the per-repetition pairs.

Run: ``.venv/bin/python bench/bench_steps.py --backend all``. ``--profile`` skips the
benchmark and prints a cProfile of one ``--steps`` workflow per backend instead.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Column, Connection, Engine, Integer, MetaData, Table, Text, insert, text
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import URL, make_url

import wf_persist as wp
from bench.compare_workload import bench_step, many_steps

PG_URL_ENV: Final = "WF_PERSIST_BENCH_POSTGRES_URL"
DEFAULT_PG_ADMIN_URL: Final = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SCRATCH_DB: Final = "wf_persist_bench"
PEER_SCRATCH_DB: Final = "wf_persist_bench_dbos"
PEER_SCRIPT: Final = Path(__file__).with_name("peer_dbos.py")
PEER_NOT_INSTALLED_EXIT: Final = 3
#: steps/s must reach this fraction of the floor named beside it.
TARGETS: Final = {"sqlite": ("floor_a", 0.7), "postgresql": ("floor_b", 0.6)}
PROFILE_FILTER: Final = "wf_persist|sqlalchemy|psycopg"


# workloads -------------------------------------------------------------------------------


@wp.workflow(name="bench_three_steps", version=1)
def three_steps(ctx: wp.Context, n: int) -> int:
    for i in range(3):
        ctx.run(bench_step, i)
    return n


def run_workflow(client: wp.WorkflowClient, wf: wp.Workflow[Any, Any], n: int) -> None:
    """Start a run and drive it to its end in this thread, as an application would."""
    handle = client.start(wf, n)
    outcome = client.result(handle.execution_id)
    if not isinstance(outcome, wp.Completed) or outcome.value != n:
        raise RuntimeError(f"benchmark workflow {wf.name} did not complete: {outcome!r}")


@dataclass(frozen=True)
class Rate:
    """Operations per wall-clock second, and this process's CPU time per operation.

    The CPU figure is what does not shrink when the disk gets faster: a side that is
    CPU-bound keeps its rate while an fsync-bound floor speeds up, so their ratio moves.
    """

    per_s: float
    cpu_us: float


def timed(count: int, work: Callable[[], object]) -> Rate:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    elapsed, cpu_used = time.perf_counter() - wall, time.process_time() - cpu
    return Rate(count / elapsed, cpu_used / count * 1e6)


def ours_steps(client: wp.WorkflowClient, steps: int) -> Rate:
    return timed(steps, lambda: run_workflow(client, many_steps, steps))


def ours_workflows(client: wp.WorkflowClient, count: int) -> Rate:
    def work() -> None:
        for n in range(count):
            run_workflow(client, three_steps, n)

    return timed(count, work)


# floors ----------------------------------------------------------------------------------

_floor_metadata = MetaData()
floor_table = Table(
    "bench_floor",
    _floor_metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("doc", Text, nullable=False),
)


class Floor:
    """The cheapest durable write SQLAlchemy Core can do: one small row per commit.

    Ids keep counting across repetitions so every write is a fresh row, as a step is.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.next_id = 0
        _floor_metadata.create_all(engine)
        self.committed(1)  # warm-up: pool, connect-time pragmas, statement cache

    def _writes(self, conn: Connection, count: int, commit: bool) -> Rate:
        stmt = insert(floor_table)
        base = self.next_id
        self.next_id += count

        def work() -> None:
            for i in range(base, base + count):
                doc = json.dumps({"i": i, "ok": True, "msg": "hello"})
                conn.execute(stmt, {"id": i, "doc": doc})
                if commit:
                    conn.commit()

        return timed(count, work)

    def committed(self, count: int) -> Rate:
        """Floor A: INSERT + COMMIT per write (BEGIN IMMEDIATE on SQLite via our engine)."""
        with self.engine.connect() as conn:
            return self._writes(conn, count, commit=True)

    def autocommit(self, count: int) -> Rate:
        """Floor B: the INSERT alone in autocommit, one round trip per write."""
        with self.engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            return self._writes(auto, count, commit=False)


# peer ------------------------------------------------------------------------------------


class Peer:
    """Runs ``peer_dbos.py`` once per repetition; gives up (once, loudly) if it cannot."""

    def __init__(self, backend: str, url: str, steps: int, workflows: int) -> None:
        self.command = [
            sys.executable,
            str(PEER_SCRIPT),
            "--backend",
            backend,
            "--url",
            url,
            "--steps",
            str(steps),
            "--workflows",
            str(workflows),
        ]
        self.disabled: str | None = None

    def run(self) -> dict[str, float] | None:
        if self.disabled is not None:
            return None
        proc = subprocess.run(self.command, capture_output=True, text=True, timeout=600)
        if proc.returncode == PEER_NOT_INSTALLED_EXIT:
            self.disabled = "dbos not installed (pip install dbos)"
        elif proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            self.disabled = f"dbos run failed (exit {proc.returncode}): " + " | ".join(tail)
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if lines:
                found = json.loads(lines[-1])
                return {"steps": float(found["steps_per_s"]), "wf": float(found["wf_per_s"])}
            self.disabled = "dbos run printed no result"
        print(f"peer: {self.disabled}", flush=True)
        return None


# scratch databases -----------------------------------------------------------------------


def psycopg_url(url: str | URL) -> URL:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def url_string(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def recreate_database(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))


def drop_database(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class Scratch:
    """Where one backend run writes: our database, the floor's, and the peer's."""

    ours: str
    floor: Engine
    peer: str


@contextmanager
def scratch(backend: str, pg_admin_url: str) -> Iterator[Scratch]:
    """Fresh, empty databases for one backend run, removed afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="wf-persist-bench-") as tmp:
            # Same settings as our engine: WAL, synchronous=FULL, BEGIN IMMEDIATE.
            floor = wp.create_engine(f"sqlite:///{tmp}/floor.sqlite3")
            try:
                yield Scratch(
                    f"sqlite:///{tmp}/ours.sqlite3", floor, f"sqlite:///{tmp}/dbos.sqlite3"
                )
            finally:
                floor.dispose()
        return
    admin_url = psycopg_url(pg_admin_url)
    admin = sa_create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        recreate_database(admin, SCRATCH_DB)
        recreate_database(admin, PEER_SCRATCH_DB)
        ours = url_string(admin_url.set(database=SCRATCH_DB))
        wp.migrate.upgrade(ours)
        floor = sa_create_engine(ours)
        try:
            yield Scratch(ours, floor, url_string(admin_url.set(database=PEER_SCRATCH_DB)))
        finally:
            floor.dispose()
    finally:
        drop_database(admin, SCRATCH_DB)
        drop_database(admin, PEER_SCRATCH_DB)
        admin.dispose()


# measurement and report ------------------------------------------------------------------

#: (key, label) in report order.
METRICS: Final = (
    ("ours_steps", "ours       steps/s (1 workflow)"),
    ("ours_wf", "ours       3-step wf/s"),
    ("floor_a", "floor A    writes/s (INSERT+COMMIT)"),
    ("floor_b", "floor B    writes/s (autocommit)"),
    ("dbos_steps", "DBOS       steps/s (1 workflow)"),
    ("dbos_wf", "DBOS       3-step wf/s"),
)
#: (label, numerator, denominator).
RATIOS: Final = (
    ("ours/floorA  steps", "ours_steps", "floor_a"),
    ("ours/floorB  steps", "ours_steps", "floor_b"),
    ("ours/DBOS    steps", "ours_steps", "dbos_steps"),
    ("ours/DBOS    wf", "ours_wf", "dbos_wf"),
    ("DBOS/floorA  steps", "dbos_steps", "floor_a"),
)


@dataclass
class Results:
    backend: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    cpu_us: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, per_s: float, cpu_us: float | None = None) -> None:
        self.samples.setdefault(key, []).append(per_s)
        if cpu_us is not None:
            self.cpu_us.setdefault(key, []).append(cpu_us)

    def median(self, key: str) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(res: Results, as_json: bool) -> None:
    """The table, then the ratios; with ``as_json`` one JSON line per row after them."""
    records: list[dict[str, Any]] = []
    print(f"\n{res.backend}")
    print(f"  {'measurement':<38}{'min':>10}{'median':>10}{'max':>10}{'cpu us/op':>11}")
    for key, label in METRICS:
        values = res.samples.get(key)
        lo, mid, hi = (
            (min(values), statistics.median(values), max(values)) if values else (None,) * 3
        )
        cpu = res.cpu_us.get(key)
        cpu_mid = statistics.median(cpu) if cpu else None
        print(f"  {label:<38}{fmt(lo):>10}{fmt(mid):>10}{fmt(hi):>10}{fmt(cpu_mid):>11}")
        if values:
            records.append(
                {
                    "backend": res.backend,
                    "metric": key,
                    "unit": "per_s",
                    "min": lo,
                    "median": mid,
                    "max": hi,
                    "samples": values,
                    "cpu_us_per_op": cpu,
                }
            )
    target_key, target = TARGETS[res.backend]
    print(f"  {'ratio (of medians)':<38}{'value':>10}  per-rep range")
    for label, num, den in RATIOS:
        top, bottom = res.median(num), res.median(den)
        if top is None or bottom is None:
            continue
        value = top / bottom
        # Paired per-repetition ratios show how much of the spread is common-mode noise.
        paired = [a / b for a, b in zip(res.samples[num], res.samples[den], strict=False)]
        line = f"  {label:<38}{value:>10.2f}  {min(paired):.2f}-{max(paired):.2f}"
        verdict = None
        if num == "ours_steps" and den == target_key:
            verdict = "ok" if value >= target else "BELOW TARGET"
            line += f"   target >= {target:.1f}: {verdict}"
        print(line)
        records.append(
            {
                "backend": res.backend,
                "ratio": f"{num}/{den}",
                "value": value,
                "per_rep": paired,
                "target": target if verdict else None,
                "verdict": verdict,
            }
        )
    if as_json:
        for record in records:
            print(json.dumps(record))


def bench_backend(backend: str, args: argparse.Namespace, peer_ok: bool) -> Results:
    res = Results(backend)
    with scratch(backend, args.pg_url) as where:
        runtime = wp.Runtime(where.ours)
        try:
            runtime.register(many_steps, three_steps)
            client = runtime.client()
            run_workflow(client, many_steps, 3)  # warm-up
            run_workflow(client, three_steps, 0)
            floor = Floor(where.floor)
            peer = Peer(backend, where.peer, args.steps, args.workflows) if peer_ok else None
            # Steps and floors sit next to each other (they are divided by each other) and
            # swap order every repetition, so a drift in disk speed hits both sides alike.
            paired: list[tuple[str, Callable[[], Rate]]] = [
                ("ours_steps", lambda: ours_steps(client, args.steps)),
                ("floor_a", lambda: floor.committed(args.steps)),
            ]
            if backend == "postgresql":
                paired.append(("floor_b", lambda: floor.autocommit(args.steps)))
            wf_rate = ("ours_wf", lambda: ours_workflows(client, args.workflows))
            for rep in range(args.reps):
                order = paired if rep % 2 == 0 else paired[::-1]
                for key, measure in [*order, wf_rate]:
                    progress(f"{backend} rep {rep + 1}/{args.reps}: {key}")
                    rate = measure()
                    res.add(key, rate.per_s, rate.cpu_us)
                if peer is not None:
                    progress(f"{backend} rep {rep + 1}/{args.reps}: dbos")
                    found = peer.run()
                    if found is not None:
                        res.add("dbos_steps", found["steps"])
                        res.add("dbos_wf", found["wf"])
        finally:
            runtime.close()
    return res


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def profile_backend(backend: str, args: argparse.Namespace) -> None:
    """cProfile one ``--steps`` workflow (after a warm-up), top cumulative entries only."""
    with scratch(backend, args.pg_url) as where, wp.Runtime(where.ours) as runtime:
        runtime.register(many_steps)
        client = runtime.client()
        run_workflow(client, many_steps, 3)
        profiler = cProfile.Profile()
        began = time.perf_counter()
        profiler.runcall(run_workflow, client, many_steps, args.steps)
        elapsed = time.perf_counter() - began
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(PROFILE_FILTER, 40)
    print(f"\n{backend}: {args.steps} steps in {elapsed:.2f}s under cProfile")
    print(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="wf_persist per-step throughput against raw-SQL floors and DBOS."
    )
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "all"), default="all")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get(PG_URL_ENV) or DEFAULT_PG_ADMIN_URL,
        help=f"admin URL used to create scratch databases (default: ${PG_URL_ENV}, "
        f"else {DEFAULT_PG_ADMIN_URL})",
    )
    parser.add_argument(
        "--steps",
        type=positive,
        default=1000,
        help="steps in the one-workflow run, and writes per floor run",
    )
    parser.add_argument("--workflows", type=positive, default=200)
    parser.add_argument("--reps", type=positive, default=3)
    parser.add_argument("--json", action="store_true", help="also print one JSON line each")
    parser.add_argument("--no-peer", action="store_true", help="skip the DBOS comparison")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of benchmarking, cProfile one --steps workflow",
    )
    args = parser.parse_args(argv)

    backends = ["sqlite", "postgresql"] if args.backend == "all" else [args.backend]
    peer_ok = not args.no_peer
    if peer_ok and importlib.util.find_spec("dbos") is None:
        print("peer: dbos not installed (pip install dbos)")
        peer_ok = False
    status = 0
    began = time.perf_counter()
    for backend in backends:
        try:
            if args.profile:
                profile_backend(backend, args)
            else:
                report(bench_backend(backend, args, peer_ok), args.json)
        except Exception as exc:  # one backend down must not hide the other's numbers
            print(f"\n{backend}: skipped ({type(exc).__name__}: {exc})")
            traceback.print_exc(file=sys.stderr)
            status = 1
    print(
        f"\ntotal {time.perf_counter() - began:.0f}s; targets: steps/s >= "
        + ", ".join(f"{t}x floor {k[-1].upper()} on {b}" for b, (k, t) in TARGETS.items())
    )
    return status


def positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


if __name__ == "__main__":
    sys.exit(main())
