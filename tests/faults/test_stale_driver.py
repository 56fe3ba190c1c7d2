"""A worker stopped mid-step past its lease and continued after the run moved on.

Worker A starts a step and is SIGSTOPped inside it. Its lease expires; worker B takes the run
over, runs the step again (allowed: it was in flight at a fault), runs the next step, and
parks the run on a short durable sleep; B is then killed. When the sleep is over A is
continued while A's old driver thread is still inside the step from before the stop. A's
worker loop must not claim the (due) run while that thread still drives it (a process never
claims a run it is still driving), and the old driver must not write anything any more, nor
start a step whose completion is committed: the run's history has each step completed once,
and the next step never starts again. Once the old thread is gone the run is finished.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

import wf_persist as wp

from . import invariants as inv
from .chaos import plain_engine
from .procs import Processes, wait_for, wait_ready, worker_argv
from .workflows import ALL, LEDGER_ENV, URL_ENV, HoldPlan, stale_driver_wf, step_value

LEASE = 1.5


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    found = plain_engine(db_url)
    yield found
    found.dispose()


def _row(engine: Engine, execution_id: str) -> tuple[str, str | None, object]:
    with engine.connect() as conn:
        r = conn.execute(
            text("SELECT status, lease_owner, wake_at FROM wf_executions WHERE id = :e"),
            {"e": execution_id},
        ).one()
    return str(r.status), r.lease_owner, r.wake_at


def _has_event(engine: Engine, execution_id: str, kind: str) -> bool:
    with engine.connect() as conn:
        return (
            conn.execute(
                text("SELECT 1 FROM wf_history WHERE execution_id = :e AND type = :t"),
                {"e": execution_id, "t": kind},
            ).first()
            is not None
        )


def _sleep_over(engine: Engine, execution_id: str) -> bool:
    wake_at = inv.as_utc(_row(engine, execution_id)[2])
    return wake_at is None or wake_at.timestamp() <= time.time()


@pytest.mark.timeout(240)
def test_continued_stale_driver_writes_nothing(
    db_url: str, engine: Engine, procs: Processes, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    env = {
        **os.environ,
        URL_ENV: db_url,
        LEDGER_ENV: str(ledger),
        "WF_FAULTS_LEASE_TTL": str(LEASE),
        "WF_FAULTS_POLL_INTERVAL": "0.05",
    }
    argv = worker_argv("tests.faults.app:runtime", 2)
    t0 = time.time()
    faults = inv.FaultLog()
    token, release = tmp_path / "token", tmp_path / "release"
    with wp.Runtime(db_url, auto_migrate=False) as rt:
        rt.register(*ALL)
        client = rt.client()
        a = procs.spawn("worker-a", argv, env)
        wait_ready([a])
        plan = HoldPlan(token=str(token), release=str(release), nap=0.3)
        execution_id = client.start(stale_driver_wf, plan).execution_id
        wait_for(token.exists, 60, "worker A entering the held step", a.describe)
        a.send(signal.SIGSTOP)
        faults.stopped(time.time(), a.name, a.pid)
        b = procs.spawn("worker-b", argv, env)
        wait_ready([b])
        wait_for(
            lambda: _has_event(engine, execution_id, "sleep.started"),
            60,
            "worker B taking the run over and parking it on its sleep",
            lambda: procs.describe(),
        )
        b.send(signal.SIGKILL)
        b.proc.wait(10)
        faults.killed(time.time(), b.name, b.pid, was_stopped=False)
        wait_for(lambda: _sleep_over(engine, execution_id), 30, "the sleep being over")
        a.send(signal.SIGCONT)
        faults.continued(time.time(), a.pid)
        # The run is due, but the only live process is A, whose old thread still drives it.
        unclaimed_until = time.monotonic() + 2 * LEASE
        while time.monotonic() < unclaimed_until:
            status, owner, _ = _row(engine, execution_id)
            assert owner is None and status not in inv.TERMINAL, (
                "worker A claimed a run its own stale thread still drives\n" + a.describe()
            )
            time.sleep(0.05)
        release.touch()
        # Wait without driving it here: the workers do (and their steps write the ledger).
        wait_for(
            lambda: client.status(execution_id) in inv.TERMINAL,
            90,
            "the run finishing",
            procs.describe,
            interval=0.05,
        )
        outcome = client.result(execution_id)
    findings = inv.Findings()
    executions, history = inv.load_database(engine, ["stale-driver"])
    inv.check_outcomes(
        findings,
        {execution_id: [1, step_value(0, 11), step_value(1, 12)]},
        executions,
        history,
        set(),
        t0,
    )
    inv.check_history(findings, history, t0)
    inv.check_leases(findings, executions, t0)
    inv.check_steps(findings, inv.load_ledger(ledger), history, faults, t0)
    report = inv.Report(f"stale driver, run {execution_id} ended {outcome.status}", findings)
    assert report.ok, report.format() + "\n" + procs.describe() + "\n" + report.verdict()
