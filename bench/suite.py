"""The benchmark suite: wf_persist against raw-SQL floors, DBOS and Absurd, in one run.

    python -m bench.suite [--backend sqlite|postgresql|all] [--reps 5] [--quick]
                          [--workloads steps,seq,proc,conc,recov,pool] [--json]
                          [--write-readme]

Workloads (each on every backend unless said):

1. ``steps``: steps/s in one workflow of ``--steps`` steps, against the floors (INSERT +
   COMMIT per write; on PostgreSQL also the autocommitted INSERT), DBOS and Absurd; CPU µs
   per step of the process (and of the PostgreSQL server).
2. ``seq``: sequential 3-step workflows/s, start + result in one process, (a) the caller's
   ``result()`` driving the run, (b) one ``client.execute()`` (start claimed, driven in the
   caller's thread), (c) with an embedded worker; DBOS ``start_workflow`` +
   ``get_result``; Absurd ``spawn`` + ``work_batch()`` inline; and the statements the
   database ran for one such workflow (``tests/dbcount.py``).
3. ``proc``: the same executed by a separate ``wf-persist worker`` process (defaults), started
   and awaited with a thin ``wp.Client``; the median pickup latency (just before ``start()``
   to the first step's function, same clock); Absurd with a worker process, default and tight
   polling.
4. ``conc``: ``--runs`` starts, then every result, from one process: ours with an embedded
   worker at each ``--concurrency`` (the best is compared); an 8-thread autocommit INSERT
   floor; DBOS; Absurd with 1 and 2 worker processes of AsyncAbsurd (concurrency 8).
5. ``recov``: ``--recovery-runs`` runs blocked inside step 2 in worker process A, SIGKILL,
   worker B started right after: seconds until all complete and until B took them over, per
   lease (``--leases``); DBOS (recovery at launch, no lease); Absurd (claim_timeout 1 s).
   Checks that no step 1 ran twice.
6. ``pool``: ``--pool-runs`` runs whose one step sleeps 1 s, driven at once by one embedded
   worker of that concurrency on an engine with a pool of 20: wall time and peak RSS.

Repetitions are interleaved: within a workload each repetition measures every system, in an
order rotated by one each time; figures are medians with their per-repetition range, and a
ratio is the ratio of medians with the range of the per-repetition ratios. Every figure
shows its target and PASS/FAIL where the issue sets one. Scratch databases are created per
system and dropped afterwards (PostgreSQL: ``wf_persist_bench_*``; SQLite: temporary files).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import os
import platform
import sqlite3
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import wf_persist as wp
from bench import workloads as ours
from bench.floors import Floor
from bench.measure import ServerCpu
from bench.peers import PeerScript
from bench.report import Results, Row, Target, json_lines, markdown_table, verdicts, write_readme
from bench.scratch import Scratch, libpq_url, scratch

PG_URL_ENV: Final = "WF_PERSIST_BENCH_POSTGRES_URL"
DEFAULT_PG_ADMIN_URL: Final = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REPO: Final = Path(__file__).resolve().parent.parent
WORKLOADS: Final = ("steps", "seq", "proc", "conc", "recov", "pool")
SYSTEMS: Final = ("ours", "floor", "dbos", "absurd")

Metrics = dict[str, float]
Measure = Callable[[], Metrics | None]


# the plan --------------------------------------------------------------------------------


@dataclass
class Run:
    """What one backend run needs while it measures."""

    backend: str
    args: argparse.Namespace
    where: Scratch
    res: Results
    server: ServerCpu
    runtime: wp.Runtime  # no worker: drives runs in the caller's thread
    floor: Floor | None
    dbos: PeerScript | None
    absurd: PeerScript | None

    @property
    def pg(self) -> bool:
        return self.backend == "postgresql"

    def url(self) -> str:
        return self.where.url("ours")

    def interleave(self, workload: str, measures: Sequence[tuple[str, Measure]]) -> None:
        """Every repetition measures each system once, starting one later each time."""
        # A system is the part of the name before "_": ours_caller is ours, floor_a a floor.
        measures = [m for m in measures if m[0].split("_")[0] in self.args.systems]
        for rep in range(self.args.reps):
            shift = rep % len(measures) if measures else 0
            for system, measure in [*measures[shift:], *measures[:shift]]:
                key = f"{workload}.{system}"
                if key in self.res.errors:
                    continue  # failed in an earlier repetition: said once
                progress(f"{self.backend} {workload} rep {rep + 1}/{self.args.reps}: {system}")
                try:
                    found = measure()
                except Exception as exc:
                    self.res.errors[key] = f"{type(exc).__name__}: {exc}"
                    progress(f"  failed: {self.res.errors[key]}")
                    traceback.print_exc(file=sys.stderr)
                    continue
                if found is None:  # a peer that is not installed or not set up
                    continue
                for name, value in found.items():
                    self.res.add(f"{key}.{name}", value)

    def peer(self, which: PeerScript | None, workload: str, *extra: str) -> Measure:
        def measure() -> Metrics | None:
            if which is None:
                return None
            return which.run(workload, *extra)

        return measure


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


# workloads -------------------------------------------------------------------------------


def w_steps(run: Run) -> None:
    a = run.args
    client = run.runtime.client()
    measures: list[tuple[str, Measure]] = [
        ("ours", lambda: ours.steps(client, a.steps, run.server)),
    ]
    if run.floor is not None:
        floor = run.floor
        measures.append(("floor_a", lambda: floor.committed(a.steps).metrics()))
        if run.pg:
            measures.append(("floor_b", lambda: floor.autocommit(a.steps).metrics()))
    measures.append(("dbos", run.peer(run.dbos, "steps", "--steps", str(a.steps))))
    if run.pg:
        measures.append(("absurd", run.peer(run.absurd, "steps", "--steps", str(a.steps))))
    run.interleave("steps", measures)


def w_seq(run: Run) -> None:
    a = run.args
    client, url, n = run.runtime.client(), run.url(), str(a.workflows)
    if "ours" in a.systems:
        for key, execute in (("roundtrips", False), ("roundtrips_execute", True)):
            try:
                counted = ours.round_trips(run.runtime, execute)
            except Exception as exc:
                run.res.errors[f"seq.{key}"] = f"{type(exc).__name__}: {exc}"
                counted = None
            for name, value in (counted or {}).items():
                run.res.add(f"seq.{key}.{name}", value)
    measures: list[tuple[str, Measure]] = [
        ("ours_caller", lambda: ours.sequential(client, a.workflows, run.server)),
        ("ours_execute", lambda: ours.sequential_execute(client, a.workflows, run.server)),
        ("ours_worker", lambda: ours.sequential_embedded(url, a.workflows, run.server)),
        ("dbos", run.peer(run.dbos, "sequential", "--workflows", n)),
    ]
    if run.pg:
        measures.append(
            ("absurd_inline", run.peer(run.absurd, "sequential-inline", "--workflows", n))
        )
    run.interleave("seq", measures)
    best = {
        "ours_caller": "in-process: caller drives",
        "ours_execute": "in-process: execute()",
        "ours_worker": "in-process: embedded worker",
    }
    run.res.pick_best("seq", best, "ours_best")


def w_proc(run: Run) -> None:
    a = run.args
    url, n = run.url(), str(a.proc_workflows)
    measures: list[tuple[str, Measure]] = [
        ("ours", lambda: ours.worker_sequential(url, a.proc_workflows, run.server)),
    ]
    if run.pg:
        for poll in ("default", "tight"):
            extra = ("--workflows", n, "--poll", poll)
            measures.append((f"absurd_{poll}", run.peer(run.absurd, "sequential-worker", *extra)))
    run.interleave("proc", measures)


def w_conc(run: Run) -> None:
    a = run.args
    url, runs = run.url(), str(a.runs)
    measures: list[tuple[str, Measure]] = [
        (f"ours_c{c}", _concurrent(url, a.runs, c, run.server)) for c in a.concurrency
    ]
    if run.floor is not None:
        floor = run.floor
        measures.append(("floor_8t", lambda: floor.threaded(a.floor_writes).metrics()))
    measures.append(("dbos", run.peer(run.dbos, "concurrent", "--runs", runs)))
    if run.pg:
        for p in (1, 2):
            extra = ("--runs", runs, "--processes", str(p), "--concurrency", "8")
            measures.append((f"absurd_p{p}", run.peer(run.absurd, "concurrent", *extra)))
    run.interleave("conc", measures)
    candidates = {f"ours_c{c}": f"ours best: concurrency {c}" for c in a.concurrency}
    run.res.pick_best("conc", candidates, "ours_best")
    absurd = {f"absurd_p{p}": f"Absurd best: {p} process(es)" for p in (1, 2)}
    run.res.pick_best("conc", absurd, "absurd_best")


def _concurrent(url: str, runs: int, concurrency: int, server: ServerCpu) -> Measure:
    return lambda: ours.concurrent(url, runs, concurrency, server)


def w_recov(run: Run) -> None:
    a = run.args
    url, runs = run.url(), str(a.recovery_runs)
    measures: list[tuple[str, Measure]] = [
        (f"ours_lease{_num(lease)}", _recovery(url, a.recovery_runs, lease)) for lease in a.leases
    ]
    measures.append(("dbos", run.peer(run.dbos, "recovery", "--runs", runs)))
    if run.pg:
        measures.append(
            ("absurd", run.peer(run.absurd, "recovery", "--runs", runs, "--lease", "1"))
        )
    run.interleave("recov", measures)


def _recovery(url: str, runs: int, lease: float) -> Measure:
    return lambda: ours.recovery(url, runs, lease)


def w_pool(run: Run) -> None:
    a = run.args

    def measure() -> Metrics:
        found = ours.pool_workload(run.url(), a.pool_runs, 20, a.pool_runs, 1.0)
        if isinstance(found, str):
            raise RuntimeError(found)
        return found

    run.interleave("pool", [("ours", measure)])


STEPS: Final[dict[str, Callable[[Run], None]]] = {
    "steps": w_steps,
    "seq": w_seq,
    "proc": w_proc,
    "conc": w_conc,
    "recov": w_recov,
    "pool": w_pool,
}


def _num(value: float) -> str:
    return f"{value:g}"


# rows and targets --------------------------------------------------------------------------


def rows_for(backend: str, args: argparse.Namespace) -> list[Row]:
    pg = backend == "postgresql"
    floor = "steps.floor_b.per_s" if pg else "steps.floor_a.per_s"
    floor_name = "autocommit floor" if pg else "INSERT+COMMIT floor"

    def on_pg(op: str, value: float, text: str) -> Target | None:
        return Target(op, value, text) if pg else None

    rows = [
        Row("1", f"ours: steps/s, one {args.steps:,}-step workflow", "steps.ours.per_s", cpu=True),
        Row("1", "floor: INSERT + COMMIT per write, writes/s", "steps.floor_a.per_s", cpu=True),
    ]
    if pg:
        rows.append(Row("1", "floor: autocommitted INSERT, writes/s", floor, cpu=True))
    rows.append(Row("1", "DBOS: steps/s", "steps.dbos.per_s", cpu=True))
    if pg:
        rows.append(Row("1", "Absurd: steps/s (ctx.step, inline)", "steps.absurd.per_s", cpu=True))
    rows.append(
        Row(
            "1",
            f"**ours ÷ {floor_name}**",
            "steps.ours.per_s",
            floor,
            ".2f",
            Target(">=", 0.7, "≥ 0.70") if pg else Target(">=", 0.75, "≥ 0.75"),
        )
    )
    rows.append(Row("1", "ours ÷ DBOS", "steps.ours.per_s", "steps.dbos.per_s", ".2f"))
    if pg:
        rows.append(Row("1", "ours ÷ Absurd", "steps.ours.per_s", "steps.absurd.per_s", ".2f"))

    seq = [
        ("caller drives", "seq.ours_caller.per_s"),
        ("execute()", "seq.ours_execute.per_s"),
        ("embedded worker", "seq.ours_worker.per_s"),
    ]
    rows += [
        Row("2", f"ours: 3-step wf/s, {label}", key, spec=",.1f", cpu=True) for label, key in seq
    ]
    rows.append(
        Row("2", "DBOS: start_workflow + get_result, wf/s", "seq.dbos.per_s", spec=",.1f", cpu=True)
    )
    if pg:
        rows.append(
            Row(
                "2",
                "Absurd: spawn + work_batch() inline, wf/s",
                "seq.absurd_inline.per_s",
                spec=",.1f",
                cpu=True,
            )
        )
    for label, key in seq:
        rows.append(
            Row(
                "2",
                f"ours ({label}) ÷ {floor_name}",
                key,
                floor,
                ".3f",
                on_pg(">=", 1 / 8, "≥ 0.125"),
            )
        )
        if pg:
            rows.append(
                Row(
                    "2",
                    f"ours ({label}) ÷ Absurd",
                    key,
                    "seq.absurd_inline.per_s",
                    ".2f",
                    on_pg(">=", 2, "≥ 2"),
                )
            )
        rows.append(
            Row("2", f"ours ({label}) ÷ DBOS", key, "seq.dbos.per_s", ".2f", on_pg(">=", 3, "≥ 3"))
        )
    for how, key in (("start + result", "roundtrips"), ("execute()", "roundtrips_execute")):
        rows.append(
            Row(
                "2",
                f"ours: statements the database ran for one 3-step workflow ({how})",
                f"seq.{key}.statements",
                spec=",.0f",
                target=on_pg("<=", 6, "≤ 6"),
                note_fields=(
                    ("transactions", "transactions", ",.0f"),
                    *((verb, verb, ",.0f") for verb in ours.VERBS),
                ),
            )
        )

    pickup = (("pickup_ms", "median pickup ms", ",.1f"),)
    rows.append(
        Row(
            "3",
            "ours: wf/s, separate `wf-persist worker` (defaults)",
            "proc.ours.per_s",
            spec=",.1f",
            cpu=True,
        )
    )
    rows.append(
        Row(
            "3",
            "ours: median pickup, start() → first step, ms",
            "proc.ours.pickup_ms",
            spec=",.1f",
            target=on_pg("<=", 5, "≤ 5 ms"),
        )
    )
    rows.append(
        Row(
            "3",
            "ours: worker process ÷ in-process, the same `start` + `result` (caller drives, 2)",
            "proc.ours.per_s",
            "seq.ours_caller.per_s",
            ".2f",
            on_pg(">=", 0.8, "≥ 0.8"),
        )
    )
    rows.append(
        Row(
            "3",
            "ours: worker process ÷ the best of the three in-process ways in 2",
            "proc.ours.per_s",
            "seq.ours_best.per_s",
            ".2f",
        )
    )
    if pg:
        for poll, text in (("default", "defaults"), ("tight", "tight polling")):
            rows.append(
                Row(
                    "3",
                    f"Absurd: wf/s, worker process ({text})",
                    f"proc.absurd_{poll}.per_s",
                    spec=",.1f",
                    cpu=True,
                    note_fields=pickup,
                )
            )

    for c in args.concurrency:
        rows.append(
            Row(
                "4",
                f"ours: {args.runs} starts then results, wf/s, worker concurrency {c}",
                f"conc.ours_c{c}.per_s",
                cpu=True,
            )
        )
    rows.append(
        Row("4", "floor: autocommit INSERT, 8 threads, writes/s", "conc.floor_8t.per_s", cpu=True)
    )
    rows.append(
        Row("4", "DBOS: start_workflow x N, then results, wf/s", "conc.dbos.per_s", cpu=True)
    )
    if pg:
        for p in (1, 2):
            rows.append(
                Row(
                    "4",
                    f"Absurd: {p} worker process(es) x AsyncAbsurd(8), wf/s",
                    f"conc.absurd_p{p}.per_s",
                    cpu=True,
                )
            )
    rows.append(
        Row(
            "4",
            "**ours, best concurrency, wf/s**",
            "conc.ours_best.per_s",
            target=on_pg(">=", 800, "≥ 800"),
        )
    )
    if pg:
        rows.append(
            Row(
                "4",
                "ours best ÷ Absurd best",
                "conc.ours_best.per_s",
                "conc.absurd_best.per_s",
                ".2f",
                on_pg(">=", 2, "≥ 2"),
            )
        )
    rows.append(
        Row(
            "4",
            "ours best ÷ DBOS",
            "conc.ours_best.per_s",
            "conc.dbos.per_s",
            ".2f",
            on_pg(">=", 3, "≥ 3"),
        )
    )
    rows.append(
        Row("4", "ours best ÷ 8-thread floor", "conc.ours_best.per_s", "conc.floor_8t.per_s", ".3f")
    )

    details = (
        ("first_done_s", "first done", ".2f"),
        ("taken_over_s", "taken over after B ready", ".2f"),
        ("after_ready_s", "all done after B ready", ".2f"),
        ("startup_s", "B startup", ".2f"),
        ("step1_twice", "step 1 twice", ".0f"),
    )
    n = args.recovery_runs
    for lease in args.leases:
        system = f"recov.ours_lease{_num(lease)}"
        rows.append(
            Row(
                "5",
                f"ours, lease {_num(lease)} s: all {n} done after SIGKILL, s",
                f"{system}.all_done_s",
                spec=".2f",
                note_fields=details,
            )
        )
        target = (
            Target("<=", 0.3, "≤ 0.3 s")
            if pg
            else Target("<=", lease + 1.0, f"≤ {_num(lease + 1.0)} s (lease + 1)")
        )
        rows.append(
            Row(
                "5",
                f"ours, lease {_num(lease)} s: taken over (first step 2 in worker B) after B "
                "was ready, s",
                f"{system}.taken_over_s",
                spec=".2f",
                target=target,
            )
        )
        rows.append(
            Row(
                "5",
                f"ours, lease {_num(lease)} s: runs whose step 1 ran twice",
                f"{system}.step1_twice",
                spec=".0f",
                target=Target("<=", 0, "0"),
            )
        )
    rows.append(
        Row(
            "5",
            f"DBOS (recovery at launch): all {n} done after SIGKILL, s",
            "recov.dbos.all_done_s",
            spec=".2f",
            note_fields=details,
        )
    )
    if pg:
        rows.append(
            Row(
                "5",
                f"Absurd (claim_timeout 1 s): all {n} done after SIGKILL, s",
                "recov.absurd.all_done_s",
                spec=".2f",
                note_fields=details,
            )
        )

    rows.append(
        Row(
            "6",
            f"ours: {args.pool_runs} runs x one 1-s step, worker concurrency "
            f"{args.pool_runs}, pool 20: wall s",
            "pool.ours.wall_s",
            spec=".2f",
            target=Target("<=", 2.0, "≤ 2 s"),
        )
    )
    rows.append(
        Row("6", "ours: peak RSS of that process, MiB", "pool.ours.peak_rss_mib", spec=",.0f")
    )
    workloads = {"1": "steps", "2": "seq", "3": "proc", "4": "conc", "5": "recov", "6": "pool"}
    return [
        r
        for r in rows
        if workloads[r.workload] in args.workloads
        and all(_system_of(k) in args.systems for k in (r.key, r.den) if k)
    ]


def _system_of(key: str) -> str:
    """The system a sample key belongs to: ``conc.absurd_p2.per_s`` is Absurd's."""
    group = key.split(".")[1].split("_")[0]
    return group if group in SYSTEMS else "ours"


# machine and output ------------------------------------------------------------------------


def machine(pg_version: str | None) -> list[str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    ram = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
                break
    except OSError:
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return [
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs ({cpu}), {ram} RAM, "
        f"{platform.system()} {platform.release()}",
        f"- PostgreSQL {pg_version or 'not measured'}; SQLite {sqlite3.sqlite_version}; "
        f"Python {platform.python_version()}",
        f"- wf_persist {commit or '?'}; DBOS {version('dbos')}; absurd-sdk {version('absurd-sdk')}"
        f" (schema from absurdctl {version('absurdctl')})",
    ]


def settings(args: argparse.Namespace) -> str:
    return (
        f"`python -m bench.suite {' '.join(args.argv)}`".replace("` ", "`").strip()
        + f": medians of {args.reps} interleaved repetitions; {args.steps:,} steps; "
        f"{args.workflows} sequential workflows ({args.proc_workflows} via a worker process); "
        f"{args.runs} concurrent; {args.recovery_runs} recovery runs; "
        f"{args.pool_runs} sleeping runs."
    )


# main ------------------------------------------------------------------------------------


def bench_backend(backend: str, args: argparse.Namespace) -> tuple[Results, str | None]:
    res = Results(backend)
    with scratch(backend, args.pg_url) as where:
        pg_version = where.server_version()
        server = ServerCpu(backend == "postgresql")
        runtime = ours.open_runtime(where.url("ours"))
        floor = Floor(where.url("floor"), server) if "floor" in args.systems else None
        dbos = None
        if "dbos" in args.systems:
            dbos = PeerScript("bench.peer_dbos", ["--backend", backend, "--url", where.url("dbos")])
        absurd = None
        if backend == "postgresql" and "absurd" in args.systems:
            absurd = PeerScript("bench.peer_absurd", ["--url", libpq_url(where.url("absurd"))])
            absurd.setup()
        run = Run(backend, args, where, res, server, runtime, floor, dbos, absurd)
        try:
            ours.warm_up(runtime.client())
            for workload in WORKLOADS:
                if workload in args.workloads:
                    STEPS[workload](run)
        finally:
            runtime.close()
            if floor is not None:
                floor.close()
        for peer, name in ((dbos, "dbos"), (absurd, "absurd")):
            if peer is not None and peer.disabled:
                for workload in WORKLOADS:
                    res.errors.setdefault(f"{workload}.{name}", peer.disabled)
        for key, values in list(res.samples.items()):
            if key.endswith(".peak_rss_kib"):
                res.samples[key.replace("_kib", "_mib")] = [v / 1024 for v in values]
    return res, pg_version


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="wf_persist against raw-SQL floors, DBOS and Absurd (make bench)."
    )
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "all"), default="all")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get(PG_URL_ENV) or DEFAULT_PG_ADMIN_URL,
        help=f"admin URL used to create scratch databases (default: ${PG_URL_ENV}, "
        f"else {DEFAULT_PG_ADMIN_URL})",
    )
    parser.add_argument("--reps", type=positive, help="repetitions (default 5; quick: 1)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--steps", type=positive, help="steps in one workflow (1000)")
    parser.add_argument("--workflows", type=positive, help="sequential workflows (200)")
    parser.add_argument("--proc-workflows", type=positive, help="via a worker process (200)")
    parser.add_argument("--runs", type=positive, help="concurrent runs (500)")
    parser.add_argument("--concurrency", help="embedded worker concurrencies (8,16,32)")
    parser.add_argument("--recovery-runs", type=positive, help="blocked runs (100)")
    parser.add_argument("--leases", help="lease seconds of ours in recovery (30,1)")
    parser.add_argument("--pool-runs", type=positive, help="sleeping runs (500)")
    parser.add_argument("--json", action="store_true", help="also print JSON lines")
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="replace the block between the bench markers in README.md with the report",
    )
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    quick = args.quick
    defaults: dict[str, Any] = {
        "reps": 1 if quick else 5,
        "steps": 200 if quick else 1000,
        "workflows": 20 if quick else 200,
        "proc_workflows": 5 if quick else 200,
        "runs": 100 if quick else 500,
        "concurrency": "8" if quick else "8,16,32",
        "recovery_runs": 10 if quick else 100,
        "leases": "3,1" if quick else "30,1",
        "pool_runs": 100 if quick else 500,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.floor_writes = 800 if quick else 4000
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.leases = [float(v) for v in str(args.leases).split(",")]
    args.workloads = _subset(args.workloads, WORKLOADS, parser)
    args.systems = _subset(args.systems, SYSTEMS, parser)
    return args


def _subset(value: str, allowed: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown:
        parser.error(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return chosen


def positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    backends = ["sqlite", "postgresql"] if args.backend == "all" else [args.backend]
    began = time.perf_counter()
    sections: list[str] = []
    json_out: list[str] = []
    pg_version = None
    status, failed_total = 0, 0
    for backend in backends:
        try:
            res, version = bench_backend(backend, args)
        except Exception as exc:  # one backend down must not hide the other's numbers
            print(f"\n{backend}: skipped ({type(exc).__name__}: {exc})", flush=True)
            traceback.print_exc(file=sys.stderr)
            sections.append(f"**{backend}**: not measured ({type(exc).__name__}: {exc})\n")
            status = 1
            continue
        pg_version = version or pg_version
        rows = rows_for(backend, args)
        passed, failed = verdicts(res, rows)
        failed_total += failed
        title = (
            "SQLite (WAL, synchronous=FULL; Absurd runs on PostgreSQL only)"
            if backend == "sqlite"
            else f"PostgreSQL {version}"
        )
        sections.append(
            "\n".join(
                [
                    f"**{title}** — targets: {passed} pass, {failed} fail",
                    "",
                    *markdown_table(res, rows),
                    "",
                ]
            )
        )
        json_out += json_lines(res, rows)
    header = [*machine(pg_version), f"- run: {settings(args)}"]
    if args.quick:
        header.append(
            "- **a `--quick` smoke run**: small counts, few repetitions; it shows that every "
            "workload runs end to end, its figures are not measurements"
        )
    report = "\n".join([*header, "", *sections])
    print("\n" + report)
    if args.json:
        print("\n".join(json_out))
    print(f"total {time.perf_counter() - began:.0f}s; {failed_total} target(s) failed", flush=True)
    if args.write_readme:
        write_readme(REPO / "README.md", report)
        print("README.md: benchmark block replaced", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
