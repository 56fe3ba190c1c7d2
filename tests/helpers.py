"""Small waiting helpers shared by the tests that watch other threads or processes."""

from __future__ import annotations

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
