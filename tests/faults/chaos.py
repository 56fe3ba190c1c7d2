"""Chaos harness: worker processes killed and stopped past their lease while they drive runs.

``run_chaos(config)`` starts ``config.workers`` worker processes (``wf-persist worker --app
tests.faults.app:runtime``) on one database, feeds them multi-step runs (steps that sleep a
few ms to a second, a retried step, a durable sleep), and meanwhile SIGKILLs random workers
(restarting them) and SIGSTOPs others for longer than the lease before SIGCONTing them. Once
the faults stop it waits for every run to finish, stops the workers and checks the invariants
(:mod:`tests.faults.invariants`) against history and the steps' external ledger.

Long runs, outside pytest::

    python -m tests.faults.chaos --backend all --runs 1000 --faults 400 --workers 4

Backends: ``sqlite`` (the library's own engine, from a URL), ``sqlite-host`` (a plain
``sqlalchemy.create_engine`` handed to the runtime), ``postgresql``, ``mysql``. Scratch server
databases are created and dropped through the admin URLs the test suite uses
(``WF_PERSIST_TEST_POSTGRES_URL``, ``WF_PERSIST_TEST_MYSQL_URL``).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, text

import wf_persist as wp
from wf_persist import migrate

from . import invariants as inv
from .procs import Child, Processes, wait_ready, worker_argv, worker_ready
from .workflows import LEDGER_ENV, URL_ENV, ChaosPlan, StepPlan, chaos_wf, expected_result

APPS = {"url": "tests.faults.app:runtime", "host": "tests.faults.host_app:runtime"}
BACKENDS = ("sqlite", "sqlite-host", "postgresql", "mysql")


@dataclass
class ChaosConfig:
    """One chaos run. ``engine`` is ``url`` (the runtime opens the URL) or ``host`` (a plain
    SQLAlchemy engine handed to the runtime)."""

    label: str
    url: str
    workdir: Path
    engine: str = "url"
    runs: int = 150
    faults: int = 60
    workers: int = 6
    concurrency: int = 3
    lease_ttl: float = 1.5
    poll_interval: float = 0.1
    #: Mean seconds between two faults.
    fault_interval: float = 0.45
    #: A stopped worker stays stopped for lease_ttl times a factor in this range.
    stop_factor: tuple[float, float] = (1.15, 1.7)
    #: Longest step sleep (ms); most steps sleep a few ms.
    max_step_ms: int = 900
    seed: int = 1
    #: How long the runs may take to finish once the faults stopped.
    drain_timeout: float = 90.0
    #: Stop injecting after this many seconds even if fewer faults were injected
    #: (default: four times faults x fault_interval).
    fault_deadline: float | None = None


def make_plans(count: int, seed: int, max_step_ms: int) -> list[ChaosPlan]:
    rng = random.Random(seed)
    plans = []
    for i in range(count):
        n = rng.randint(5, 8)
        steps = []
        for _ in range(n):
            r = rng.random()
            if r < 0.6:
                ms = rng.randint(0, 20)
            elif r < 0.85:
                ms = rng.randint(50, 250)
            else:
                ms = rng.randint(min(400, max_step_ms), max_step_ms)
            steps.append(StepPlan(value=rng.randint(0, 10**6), sleep_ms=ms))
        plans.append(
            ChaosPlan(
                seed=seed * 100_000 + i,
                steps=steps,
                flaky_after=rng.randrange(n) if rng.random() < 0.25 else None,
                nap_after=rng.randrange(n - 1) if rng.random() < 0.3 else None,
                nap_seconds=round(rng.uniform(0.05, 0.8), 3),
            )
        )
    return plans


def plain_engine(url: str) -> Engine:
    """An engine of our own for reading results (never the runtime's)."""
    if sqlalchemy.make_url(url).get_backend_name() == "sqlite":
        return sqlalchemy.create_engine(url, connect_args={"timeout": 30})
    return sqlalchemy.create_engine(url, pool_pre_ping=True)


def migrate_database(url: str, engine: str = "url") -> None:
    """Bring the database to head. A host engine's SQLite file is migrated through a plain
    engine, so it keeps SQLite's defaults (no WAL)."""
    if engine == "host":
        plain = sqlalchemy.create_engine(url)
        try:
            migrate.upgrade(plain)
        finally:
            plain.dispose()
    else:
        migrate.upgrade(url)


def client_runtime(url: str, engine: str) -> wp.Runtime:
    bind: str | Engine = url if engine == "url" else sqlalchemy.create_engine(url)
    runtime = wp.Runtime(bind, auto_migrate=False)
    runtime.register(chaos_wf)
    return runtime


class Fleet:
    """Worker processes in numbered slots; a killed worker is replaced in its slot."""

    def __init__(
        self,
        procs: Processes,
        argv: list[str],
        env: dict[str, str],
        faults: inv.FaultLog,
        t0: float,
    ) -> None:
        self.procs = procs
        self.argv = argv
        self.env = env
        self.faults = faults
        self.t0 = t0
        self.slots: list[Child] = []
        self.generation: list[int] = []
        #: slot -> time it is to be continued.
        self.stopped_until: dict[int, float] = {}
        self.spawned = 0
        self.ready: set[int] = set()
        #: Seconds until each replacement worker was seen serving (checked at fault times).
        self.startup: list[float] = []
        self.unexpected: list[str] = []

    def _spawn(self, slot: int) -> Child:
        """Start a worker in ``slot`` (a new slot if it is the next one)."""
        generation = self.generation[slot] + 1 if slot < len(self.slots) else 1
        child = self.procs.spawn(f"worker{slot}-{generation}", self.argv, self.env)
        if slot < len(self.slots):
            self.slots[slot], self.generation[slot] = child, generation
        else:
            self.slots.append(child)
            self.generation.append(generation)
        self.spawned += 1
        return child

    def start(self, count: int, timeout: float = 90.0) -> None:
        children = [self._spawn(i) for i in range(count)]
        wait_ready(children, timeout)
        self.ready.update(c.pid for c in children)

    def running(self) -> list[int]:
        """Slots whose worker is serving (alive, ready) and not stopped."""
        found = []
        for i, child in enumerate(self.slots):
            if i in self.stopped_until or not child.alive():
                continue
            if child.pid not in self.ready:
                if not worker_ready(child):
                    continue
                self.ready.add(child.pid)
                self.startup.append(time.time() - child.started)
            found.append(i)
        return found

    def kill(self, slot: int) -> None:
        child = self.slots[slot]
        was_stopped = self.stopped_until.pop(slot, None) is not None
        now = time.time()
        child.send(signal.SIGKILL)
        child.proc.wait(10)
        self.faults.killed(now, child.name, child.pid, was_stopped)
        self._spawn(slot)

    def stop(self, slot: int, seconds: float) -> None:
        child = self.slots[slot]
        now = time.time()
        if child.send(signal.SIGSTOP):
            self.faults.stopped(now, child.name, child.pid)
            self.stopped_until[slot] = now + seconds

    def cont(self, slot: int) -> None:
        self.stopped_until.pop(slot, None)
        child = self.slots[slot]
        child.send(signal.SIGCONT)
        self.faults.continued(time.time(), child.pid)

    def tick(self) -> None:
        """Continue workers whose stop is over; replace any that exited on its own."""
        now = time.time()
        for slot, until in list(self.stopped_until.items()):
            if now >= until:
                self.cont(slot)
        for slot, child in enumerate(self.slots):
            if not child.alive() and slot not in self.stopped_until:
                self.unexpected.append(
                    f"{child.name} (pid {child.pid}) exited by itself with "
                    f"{child.proc.returncode} at {now - self.t0:+.3f}s\n{child.tail(20)}"
                )
                self._spawn(slot)

    def resume_all(self) -> None:
        for slot in list(self.stopped_until):
            self.cont(slot)

    def terminate(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM every worker and wait; say which ones did not exit cleanly."""
        self.resume_all()
        problems = []
        current = [c for c in self.slots if c.alive()]
        for child in current:
            child.send(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in current:
            try:
                code = child.proc.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                child.send(signal.SIGKILL)
                child.proc.wait(10)
                problems.append(f"{child.name} ignored SIGTERM for {timeout}s; killed")
                continue
            # A worker still starting up dies of SIGTERM before its handler is installed.
            if code != 0 and worker_ready(child):
                problems.append(f"{child.name} exited {code} on SIGTERM\n{child.tail(15)}")
        return problems

    def tails(self, lines: int = 12) -> str:
        return "\n".join(c.describe(lines) for c in self.slots)

    def stacks(self) -> str:
        """Every live worker's thread stacks (the app prints them on SIGUSR1)."""
        return "\n".join(dump_stacks(c) for c in self.slots if c.alive())


def dump_stacks(child: Child, timeout: float = 3.0) -> str:
    """Ask a worker for its threads' stacks (SIGUSR1) and return what it printed."""
    if not child.alive():
        return f"--- {child.name}: not running"
    size = child.log.stat().st_size if child.log.exists() else 0
    child.send(signal.SIGCONT)
    child.send(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        now = child.log.stat().st_size
        if now > size and now == last:
            break
        last = now
        time.sleep(0.1)
    with child.log.open("rb") as fh:
        fh.seek(size)
        dumped = fh.read().decode(errors="replace")
    return f"--- {child.name} (pid {child.pid}) thread stacks:\n{dumped}"


class Feeder:
    """Starts the planned runs through the public client, each with an idempotency key, so a
    start that failed (database busy or down) is simply tried again.

    It runs in a thread of its own: the fault loop must never wait on the database, since
    the worker it should continue may be the one holding a lock.
    """

    def __init__(self, runtime: wp.Runtime, plans: list[ChaosPlan], prefix: str) -> None:
        self.client = runtime.client()
        self.plans = plans
        self.prefix = prefix
        self.next = 0
        self.started: dict[str, ChaosPlan] = {}
        self.start_errors = 0
        self._lock = threading.Lock()
        self._target = 0
        self._pace: tuple[float, int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.next >= len(self.plans)

    def start(self, count: int) -> int:
        """Start up to ``count`` more runs now, in the calling thread."""
        made = 0
        while made < count and not self.done:
            plan = self.plans[self.next]
            try:
                handle = self.client.start(
                    chaos_wf, plan, idempotency_key=f"{self.prefix}-{self.next}"
                )
            except Exception:
                self.start_errors += 1
                return made
            with self._lock:
                self.started[handle.execution_id] = plan
                self.next += 1
            made += 1
        return made

    def feed_until(self, target: int) -> None:
        """Have the feeding thread start runs until ``target`` were started."""
        with self._lock:
            self._target = max(self._target, min(target, len(self.plans)))
        if self._thread is None:
            self._thread = threading.Thread(target=self._feed, name="chaos-feeder", daemon=True)
            self._thread.start()

    def feed_paced(self, rate: float) -> None:
        """Have the feeding thread start ``rate`` runs a second until all are started."""
        with self._lock:
            self._pace = (time.time(), self.next, rate)
        self.feed_until(self.next)

    def _feed(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._pace is not None:
                    since, base, rate = self._pace
                    paced = base + int((time.time() - since) * rate)
                    self._target = max(self._target, min(paced, len(self.plans)))
                want = self._target - self.next
            if want <= 0 or self.start(want) < want:
                self._stop.wait(0.02)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def snapshot(self) -> dict[str, ChaosPlan]:
        with self._lock:
            return dict(self.started)

    def expected(self) -> dict[str, Any]:
        return {eid: expected_result(plan) for eid, plan in self.snapshot().items()}


def unfinished(engine: Engine, ids: set[str]) -> set[str]:
    """Which of these runs are not completed or failed (None-safe on a busy database)."""
    with engine.connect() as conn:
        done = set(
            conn.execute(
                text(
                    "SELECT id FROM wf_executions WHERE workflow_name = 'chaos'"
                    " AND status IN ('completed', 'failed')"
                )
            ).scalars()
        )
    return ids - done


def wait_drained(
    engine: Engine,
    feeder: Feeder,
    timeout: float,
    tick: Callable[[], None],
    stall: float = 20.0,
) -> tuple[set[str], float]:
    """Have every run started, then wait for all to finish; return the runs still
    unfinished when waiting ended and the seconds it took. Waiting ends at ``timeout``, or
    once no run finished for ``stall`` seconds (the rest are stuck)."""
    began = time.monotonic()
    deadline = began + timeout
    feeder.feed_until(len(feeder.plans))
    left: set[str] = set(feeder.snapshot())
    progress, best = began, len(feeder.plans) + 1
    while time.monotonic() < deadline:
        tick()
        started = feeder.snapshot()
        try:
            left = unfinished(engine, set(started))
        except Exception:
            left = set(started)
        if not left and feeder.done:
            break
        waiting = len(left) + len(feeder.plans) - len(started)
        if waiting < best:
            progress, best = time.monotonic(), waiting
        elif time.monotonic() - progress > stall:
            break
        time.sleep(0.1)
    feeder.close()
    return left, time.monotonic() - began


def analyze(
    title: str,
    engine: Engine,
    feeder: Feeder,
    ledger_dir: Path,
    faults: inv.FaultLog,
    stuck: set[str],
    t0: float,
    stats: dict[str, Any],
) -> inv.Report:
    findings = inv.Findings()
    executions, history = inv.load_database(engine, ["chaos"])
    ledger = inv.load_ledger(ledger_dir)
    inv.check_outcomes(findings, feeder.expected(), executions, history, stuck, t0)
    inv.check_history(findings, history, t0)
    inv.check_leases(findings, executions, t0)
    steps = inv.check_steps(findings, ledger, history, faults, t0)
    counts = faults.counts()
    report_stats = {
        "faults": f"{faults.total} injected ("
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + ")",
        **stats,
        "steps": f"{steps['executions']} executions of {steps['activities']} activities; "
        f"{steps['reruns']} re-runs, {steps['reruns_explained']} explained by a fault or a "
        f"failed attempt",
    }
    return inv.Report(title, findings, report_stats)


@dataclass
class ChaosResult:
    report: inv.Report
    faults: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def run_chaos(cfg: ChaosConfig) -> ChaosResult:
    """Run the chaos scenario of ``cfg`` on a migrated, empty database; return the report."""
    rng = random.Random(cfg.seed)
    ledger_dir = cfg.workdir / "ledger"
    ledger_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        URL_ENV: cfg.url,
        LEDGER_ENV: str(ledger_dir),
        "WF_FAULTS_LEASE_TTL": str(cfg.lease_ttl),
        "WF_FAULTS_POLL_INTERVAL": str(cfg.poll_interval),
    }
    t0 = time.time()
    faults = inv.FaultLog()
    plans = make_plans(cfg.runs, cfg.seed, cfg.max_step_ms)
    engine = plain_engine(cfg.url)
    runtime = client_runtime(cfg.url, cfg.engine)
    procs = Processes(cfg.workdir / "logs")
    argv = worker_argv(APPS[cfg.engine], cfg.concurrency)
    fleet = Fleet(procs, argv, env, faults, t0)
    feeder: Feeder | None = None
    try:
        fleet.start(cfg.workers)
        feeder = Feeder(runtime, plans, f"chaos-{cfg.seed}")
        initial = min(cfg.runs, cfg.workers * cfg.concurrency * 2)
        feeder.start(initial)
        period = max(1.0, cfg.faults * cfg.fault_interval)
        rate = (cfg.runs - initial) / period
        began = time.time()
        next_fault = began + cfg.fault_interval
        retry = False
        deadline = cfg.fault_deadline or period * 4
        while faults.total < cfg.faults and time.time() - began < deadline:
            now = time.time()
            fleet.tick()
            feeder.feed_until(initial + int((now - began) * rate))
            if now >= next_fault:
                if _inject(fleet, rng, cfg, retry):
                    next_fault = now + cfg.fault_interval * rng.uniform(0.5, 1.5)
                    retry = False
                else:
                    next_fault, retry = now + 0.05, True
            time.sleep(0.01)
        fault_seconds = time.time() - began
        fleet.resume_all()
        stuck, drain = wait_drained(engine, feeder, cfg.drain_timeout, fleet.tick)
        stacks = fleet.stacks() if stuck else ""
        exits = fleet.terminate()
        faults.dump(cfg.workdir / "faults.json", t0)
        findings_stats = {
            "runs": f"{len(feeder.started)} started ({feeder.start_errors} start attempts "
            f"failed and were retried), {len(feeder.started) - len(stuck)} finished",
            "workers": f"{cfg.workers} x concurrency {cfg.concurrency}, lease "
            f"{cfg.lease_ttl}s; {fleet.spawned} worker processes started"
            + (
                f" (a replacement served after {statistics.median(fleet.startup):.1f}s median)"
                if fleet.startup
                else ""
            ),
            "timing": f"faults for {fault_seconds:.1f}s, drained {drain:.1f}s after, "
            f"{time.time() - t0:.1f}s in all",
        }
        report = analyze(
            f"chaos [{cfg.label}] seed {cfg.seed}",
            engine,
            feeder,
            ledger_dir,
            faults,
            stuck,
            t0,
            findings_stats,
        )
        for text_ in fleet.unexpected:
            report.findings.note("worker exited by itself", text_)
        for text_ in exits:
            report.findings.note("worker did not stop cleanly on SIGTERM", text_)
        report.logs = fleet.tails() + (f"\n{stacks}" if stacks else "")
        return ChaosResult(report, faults.total, time.time() - t0)
    finally:
        if feeder is not None:
            feeder.close()
        procs.close()
        runtime.close()
        if cfg.engine == "host":
            runtime.engine.dispose()
        engine.dispose()


def _inject(fleet: Fleet, rng: random.Random, cfg: ChaosConfig, retry: bool) -> bool:
    """One fault: SIGSTOP a serving worker past its lease (SIGCONT comes later), SIGKILL one
    (it is replaced at once), or now and then SIGKILL a stopped one. Restarts cost a new
    interpreter, so stops are the more frequent fault. One worker is kept serving. Returns
    False when no worker can take a fault now (``retry``: this is a second try)."""
    running = fleet.running()
    stopped = list(fleet.stopped_until)
    if stopped and not retry and rng.random() < 0.08:
        fleet.kill(rng.choice(stopped))
        return True
    if len(running) < 2:
        return False
    slot = rng.choice(running)
    if rng.random() < 0.3:
        fleet.kill(slot)
    else:
        fleet.stop(slot, cfg.lease_ttl * rng.uniform(*cfg.stop_factor))
    return True


# Command line -----------------------------------------------------------------------------


def _scratch(backend: str, workdir: Path) -> tuple[str, Callable[[], None]]:
    """A new empty database for ``backend`` and how to drop it."""
    if backend.startswith("sqlite"):
        return f"sqlite:///{workdir / 'chaos.sqlite3'}", lambda: None
    from tests.conftest import create_database, drop_database, server_url

    name = create_database(backend)
    return server_url(backend, name), lambda: drop_database(backend, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.chaos", description=__doc__)
    parser.add_argument("--backend", default="sqlite", help=f"{', '.join(BACKENDS)} or all")
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--faults", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lease", type=float, default=1.5)
    parser.add_argument("--interval", type=float, default=0.45, help="mean s between faults")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--keep", action="store_true", help="keep logs and ledgers")
    parser.add_argument("--logs", action="store_true", help="print worker output tails")
    args = parser.parse_args(argv)
    backends = BACKENDS if args.backend == "all" else tuple(args.backend.split(","))
    failed = False
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"unknown backend {backend!r}")
        workdir = Path(tempfile.mkdtemp(prefix=f"wf-faults-{backend}-"))
        url, drop = _scratch(backend, workdir)
        engine = "host" if backend == "sqlite-host" else "url"
        try:
            migrate_database(url, engine)
            result = run_chaos(
                ChaosConfig(
                    label=backend,
                    url=url,
                    workdir=workdir,
                    engine=engine,
                    runs=args.runs,
                    faults=args.faults,
                    workers=args.workers,
                    concurrency=args.concurrency,
                    lease_ttl=args.lease,
                    fault_interval=args.interval,
                    seed=args.seed,
                    drain_timeout=max(120.0, args.runs * 0.2),
                )
            )
        finally:
            drop()
        print(result.report.format(with_logs=args.logs), flush=True)
        failed = failed or not result.report.ok
        if args.keep or not result.report.ok:
            print(f"  logs and ledger kept in {workdir}\n", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
