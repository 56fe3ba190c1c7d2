"""Small waiting helpers shared by the tests that watch other threads or processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import wf_persist as wp

from .fixtures import workflows as w


def wait_until(predicate: Callable[[], object], timeout: float = 10, what: str = "it") -> None:
    """Poll ``predicate`` until it is true; fail the test if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.01)


def wait_status(
    client: wp.WorkflowClient, execution_id: str, status: str, timeout: float = 30
) -> None:
    """Wait for a run driven elsewhere (a worker) to reach ``status``."""
    wait_until(lambda: client.status(execution_id) == status, timeout, f"{execution_id} {status}")


def wait_for_mark(path: Path, label: str, timeout: float = 60) -> None:
    """Wait for a side effect (a line in a marks file) from another process."""
    wait_until(lambda: label in w.marks(path), timeout, f"mark {label!r}")


def worker_process(db_url: str, *extra: str, lease_ttl: float = 2.0) -> subprocess.Popen[bytes]:
    """``wf-persist worker`` serving the test application (tests/fixtures/app.py)."""
    env = {**os.environ, "WF_PERSIST_DATABASE_URL": db_url, "WF_TEST_LEASE_TTL": str(lease_ttl)}
    command = [sys.executable, "-m", "wf_persist.cli", "worker"]
    return subprocess.Popen(
        [*command, "--app", "tests.fixtures.app:runtime", *extra],
        env=env,
        stderr=subprocess.DEVNULL,
    )
