"""The chaos harness on every backend: CI-sized by default, long with
``WF_PERSIST_FAULTS_LONG=1`` (or ``python -m tests.faults.chaos``).

Each run: worker processes on one database, runs of 5-8 steps fed to them while random workers
are SIGKILLed (and restarted) or SIGSTOPped past their lease (and continued); then every
invariant of :mod:`tests.faults.invariants` is checked against history and the steps' ledger.
SQLite runs twice: with the library's own engine (a URL) and with a plain host engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from .chaos import ChaosConfig, migrate_database, run_chaos

LONG = os.environ.get("WF_PERSIST_FAULTS_LONG") == "1"
#: CI size: about 40 s per backend on an idle 2-core machine, at least MIN_FAULTS faults. The
#: lease leaves room for a loaded 2-core machine (renewals every quarter of it), so that a
#: lease only runs out where a fault was injected.
CI_SIZE: dict[str, Any] = {
    "runs": 100,
    "faults": 56,
    "workers": 5,
    "concurrency": 3,
    "fault_interval": 0.3,
    "lease_ttl": 2.5,
}
MIN_FAULTS = 50
LONG_SIZE: dict[str, Any] = {
    "runs": int(os.environ.get("WF_PERSIST_FAULTS_RUNS", "1200")),
    "faults": int(os.environ.get("WF_PERSIST_FAULTS_COUNT", "500")),
    "workers": 5,
    "concurrency": 4,
    "drain_timeout": 300.0,
}


def _chaos(label: str, url: str, workdir: Path, engine: str, size: dict[str, Any]) -> None:
    migrate_database(url, engine)
    seed = int(os.environ.get("WF_PERSIST_FAULTS_SEED", "1"))
    cfg = ChaosConfig(label=label, url=url, workdir=workdir, engine=engine, seed=seed, **size)
    result = run_chaos(cfg)
    print(result.report.format())
    assert result.faults >= min(MIN_FAULTS, cfg.faults), (
        f"only {result.faults} faults injected (want {MIN_FAULTS})\n{result.report.format()}"
    )
    assert result.report.ok, (
        result.report.format(with_logs=True) + f"\n(logs in {workdir})\n" + result.report.verdict()
    )


@pytest.mark.timeout(400)
def test_chaos(backend: str, blank_db_url: str, tmp_path: Path) -> None:
    _chaos(backend, blank_db_url, tmp_path, "url", CI_SIZE)


@pytest.mark.needs("embedded")
@pytest.mark.timeout(400)
def test_chaos_sqlite_host_engine(backend: str, blank_db_url: str, tmp_path: Path) -> None:
    _chaos("sqlite-host", blank_db_url, tmp_path, "host", CI_SIZE)


if LONG:  # the long runs exist only when asked for (never collected, never skipped)

    @pytest.mark.timeout(7200)
    def test_chaos_long(backend: str, blank_db_url: str, tmp_path: Path) -> None:
        _chaos(f"{backend} long", blank_db_url, tmp_path, "url", LONG_SIZE)

    @pytest.mark.needs("embedded")
    @pytest.mark.timeout(7200)
    def test_chaos_long_sqlite_host_engine(backend: str, blank_db_url: str, tmp_path: Path) -> None:
        _chaos("sqlite-host long", blank_db_url, tmp_path, "host", LONG_SIZE)
