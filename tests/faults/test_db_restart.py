"""Workers under load while their PostgreSQL server restarts, crashes, or kills their
connections; a private cluster (never the shared server).

Two workers drive multi-step runs on a private PostgreSQL cluster; meanwhile the server is
restarted with ``pg_ctl restart -m fast`` and ``-m immediate`` (a crash), shut down with
``-m immediate`` and kept down for a few seconds before it starts again, and every backend
of the database is terminated with ``pg_terminate_backend``. The workers are never
restarted. Checked: they recover by themselves; nothing is lost and every invariant of the
chaos harness holds; runs that were mid-step at each fault resume within about one lease
after the server is back; and a worker does not log the outage on every poll (lines printed
per second of outage are reported, and a steady stream during a long outage is a violation).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from . import invariants as inv
from .chaos import Feeder, Fleet, analyze, client_runtime, make_plans, plain_engine, wait_drained
from .pgcluster import PrivatePostgres
from .procs import Processes, line_count, wait_for, worker_argv
from .workflows import LEDGER_ENV, URL_ENV

LEASE = 1.5
WORKERS = 2
CONCURRENCY = 4
#: A run mid-step at a fault must show progress this soon after the server is back.
RESUME_BOUND = LEASE + 2.0
#: Seconds the server stays down in the long outage.
HOLD = 3.0
#: Lines a worker may print in the steady part of an outage (one logged failure with its
#: traceback fits; a record per poll does not).
STEADY_LINES = 30


@dataclass
class Outage:
    label: str
    started: float
    back: float
    mid_step: set[str]
    #: worker name -> lines printed while the server was out, and in its steady part.
    lines: dict[str, int]
    steady: dict[str, tuple[int, float]]
    #: run -> seconds from "server back" to its next recorded event.
    resumed: dict[str, float]


def open_steps(ledger: Path, alive: set[int]) -> set[str]:
    """Runs with a step started and not ended in a live process: mid-step right now."""
    open_tokens: dict[str, str] = {}
    for path in ledger.glob("*.jsonl"):
        if int(path.stem) not in alive:
            continue
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec["k"] == "start":
                open_tokens[rec["tok"]] = rec["eid"]
            else:
                open_tokens.pop(rec["tok"], None)
    return set(open_tokens.values())


def resumed_after(engine: Engine, runs: set[str], back: float) -> dict[str, float]:
    """For each run, seconds from ``back`` to its first event recorded after it; a run that
    finished before the server was back (its write landed before the fault took effect)
    needed no resuming and counts as 0."""
    if not runs:
        return {}
    marks = ", ".join(f":r{i}" for i in range(len(runs)))
    params = {f"r{i}": r for i, r in enumerate(sorted(runs))}
    with engine.connect() as conn:
        done = {
            r.id: 0.0
            for r in conn.execute(
                text(
                    f"SELECT id FROM wf_executions WHERE id IN ({marks}) "
                    "AND status IN ('completed', 'failed')"
                ),
                params,
            )
        }
    return {**done, **_first_event_after(engine, runs, back)}


def _first_event_after(engine: Engine, runs: set[str], back: float) -> dict[str, float]:
    marks = ", ".join(f":r{i}" for i in range(len(runs)))
    params = {f"r{i}": r for i, r in enumerate(sorted(runs))}
    found: dict[str, float] = {}
    with engine.connect() as conn:
        for r in conn.execute(
            text(
                f"SELECT execution_id, created_at FROM wf_history WHERE execution_id IN ({marks})"
            ),
            params,
        ):
            at = inv.as_utc(r.created_at)
            assert at is not None
            if at.timestamp() > back:
                delay = at.timestamp() - back
                found[r.execution_id] = min(delay, found.get(r.execution_id, delay))
    return found


def _unresumed(engine: Engine, runs: set[str], back: float) -> str:
    """The rows and last events of runs that have not resumed (for the failure message)."""
    waiting = sorted(runs - set(resumed_after(engine, runs, back)))
    lines = [f"not resumed: {len(waiting)} of {len(runs)}"]
    with engine.connect() as conn:
        for run in waiting:
            row = conn.execute(
                text(
                    "SELECT status, lease_owner, lease_expires_at, wake_at, claim_epoch, "
                    "drive_failures, clock_timestamp() AS now FROM wf_executions WHERE id = :r"
                ),
                {"r": run},
            ).one()
            last = conn.execute(
                text(
                    "SELECT sequence, type, activity_name, created_at FROM wf_history "
                    "WHERE execution_id = :r ORDER BY sequence DESC LIMIT 3"
                ),
                {"r": run},
            ).all()
            lines.append(f"{run}: {dict(row._mapping)} last={[tuple(e) for e in last]}")
    return "\n".join(lines)


@pytest.mark.needs("initdb")
@pytest.mark.timeout(300)
def test_workers_ride_out_database_restarts(
    backend: str, private_pg: PrivatePostgres, procs: Processes, tmp_path: Path
) -> None:
    pg = private_pg
    pg.execute("CREATE DATABASE chaos")
    url = pg.url("chaos")
    from .chaos import migrate_database

    migrate_database(url)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    env = {
        **os.environ,
        URL_ENV: url,
        LEDGER_ENV: str(ledger),
        "WF_FAULTS_LEASE_TTL": str(LEASE),
        "WF_FAULTS_POLL_INTERVAL": "0.1",
    }
    t0 = time.time()
    faults = inv.FaultLog()
    engine = plain_engine(url)
    runtime = client_runtime(url, "url")
    feeder = Feeder(runtime, make_plans(90, 7, 400), "restart")
    fleet = Fleet(procs, worker_argv("tests.faults.app:runtime", CONCURRENCY), env, faults, t0)
    outages: list[Outage] = []
    try:
        fleet.start(WORKERS)
        feeder.start(WORKERS * CONCURRENCY)
        feeder.feed_paced(3.0)

        def fault(label: str, act: Callable[[], list[tuple[float, dict[str, int]]]]) -> None:
            alive = {c.pid for c in fleet.slots}
            wait_for(
                lambda: len(open_steps(ledger, alive)) >= 3,
                60,
                f"three runs mid-step before {label}",
                fleet.tails,
            )
            mid = open_steps(ledger, alive)
            before = {c.name: line_count(c.log) for c in fleet.slots}
            started = time.time()
            samples = act()
            back = pg.wait_accepting()
            after = {c.name: line_count(c.log) for c in fleet.slots}
            faults.outage(started, back, label, grace=LEASE + 1.0)
            steady: dict[str, tuple[int, float]] = {}
            if len(samples) == 2:
                (t1, l1), (t2, l2) = samples
                steady = {name: (l2[name] - l1[name], t2 - t1) for name in l1}
            wait_for(
                lambda: set(resumed_after(engine, mid, back)) >= mid,
                LEASE * 4 + 30,
                f"runs mid-step at {label} resuming",
                lambda: f"{_unresumed(engine, mid, back)}\n{fleet.tails(30)}\n{fleet.stacks()}",
            )
            lines = {name: after[name] - before[name] for name in before}
            outages.append(
                Outage(label, started, back, mid, lines, steady, resumed_after(engine, mid, back))
            )

        def counts() -> dict[str, int]:
            return {c.name: line_count(c.log) for c in fleet.slots}

        def restart_fast() -> list[tuple[float, dict[str, int]]]:
            pg.restart("fast")
            return []

        def restart_immediate() -> list[tuple[float, dict[str, int]]]:
            pg.restart("immediate")
            return []

        def crash_and_hold() -> list[tuple[float, dict[str, int]]]:
            pg.stop("immediate")
            time.sleep(1.0)  # the outage itself: the server stays down for HOLD seconds
            first = (time.time(), counts())
            time.sleep(HOLD - 1.0)
            second = (time.time(), counts())
            pg.start()
            return [first, second]

        def terminate() -> list[tuple[float, dict[str, int]]]:
            pg.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = 'chaos' AND pid <> pg_backend_pid()"
            )
            return []

        fault("pg_ctl restart -m fast", restart_fast)
        fault("pg_ctl restart -m immediate", restart_immediate)
        fault(f"pg_ctl stop -m immediate, down {HOLD:.0f}s, start", crash_and_hold)
        fault("pg_terminate_backend", terminate)
        stuck, drain = wait_drained(engine, feeder, 120, lambda: None)
        survivors = [c for c in fleet.slots if c.alive()]
        exits = fleet.terminate()
        report = analyze(
            f"database restarts [postgresql {pg.port}]",
            engine,
            feeder,
            ledger,
            faults,
            stuck,
            t0,
            {
                "runs": f"{len(feeder.started)} started, {len(feeder.started) - len(stuck)} "
                f"finished; drained {drain:.1f}s after the last fault",
                "workers": f"{WORKERS} x concurrency {CONCURRENCY}, lease {LEASE}s, never "
                "restarted",
            },
        )
    finally:
        feeder.close()
        runtime.close()
        engine.dispose()
    f = report.findings
    if len(survivors) != WORKERS or fleet.spawned != WORKERS:
        f.violation(
            "db.workers-recover",
            f"{WORKERS - len(survivors)} worker(s) died during the outages\n{fleet.tails(30)}",
        )
    for text_ in exits:
        f.note("worker did not stop cleanly on SIGTERM", text_)
    for o in outages:
        worst = max(o.resumed.values(), default=0.0)
        seconds = max(o.back - o.started, 1e-3)
        per_worker = ", ".join(
            f"{name} {n} lines ({n / seconds:.0f}/s)" for name, n in sorted(o.lines.items())
        )
        report.stats[o.label] = (
            f"out {seconds:.2f}s; {len(o.mid_step)} runs mid-step resumed "
            f"{statistics.median(o.resumed.values()):.2f}s (median), {worst:.2f}s (max) after "
            f"the server was back; printed {per_worker}"
        )
        late = {r: d for r, d in o.resumed.items() if d > RESUME_BOUND}
        for run, delay in sorted(late.items()):
            f.violation(
                "db.resume-within-lease",
                f"{o.label}: run {run} was mid-step and resumed {delay:.2f}s after the server "
                f"was back (bound {RESUME_BOUND:.1f}s = lease + 2s)",
            )
        for name, (n, window) in sorted(o.steady.items()):
            if n > STEADY_LINES:
                f.violation(
                    "db.log-once-per-outage",
                    f"{o.label}: {name} printed {n} lines in {window:.1f}s of the outage's "
                    f"steady part ({n / window:.0f} lines/s; {STEADY_LINES} allowed)",
                )
    logs = "\n".join(c.describe(40) for c in fleet.slots)
    print(report.format())
    assert report.ok, (
        report.format() + "\n" + logs + f"\nserver log:\n{pg.log_tail()}\n" + report.verdict()
    )
