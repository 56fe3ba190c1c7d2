"""Running a peer script (``bench.peer_dbos``, ``bench.peer_absurd``) once per measurement,
in a process of its own, and reading the one JSON line of metrics it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Final

from bench.measure import last_error

REPO: Final = Path(__file__).resolve().parent.parent
NOT_INSTALLED_EXIT: Final = 3


class PeerError(RuntimeError):
    """A peer's measurement failed (its process said why)."""


class PeerScript:
    """``python -m <module> <base args> --workload W ...``. A peer whose package is missing
    (exit status 3) is disabled, once, with the reason kept in ``disabled``."""

    def __init__(self, module: str, base: list[str], timeout: float = 900) -> None:
        self.module = module
        self.base = base
        self.timeout = timeout
        self.disabled: str | None = None

    def _call(self, *args: str) -> dict[str, float] | None:
        if self.disabled is not None:
            return None
        command = [sys.executable, "-m", self.module, *self.base, *args]
        proc = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=self.timeout
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        found = json.loads(lines[-1]) if lines else {}
        if proc.returncode == NOT_INSTALLED_EXIT:
            self.disabled = str(found.get("error", "not installed"))
            print(f"peer {self.module}: {self.disabled}", file=sys.stderr, flush=True)
            return None
        if proc.returncode != 0 or not lines:
            output = (proc.stderr or proc.stdout).splitlines()
            raise PeerError(f"exit {proc.returncode}: {last_error(output)}")
        return {k: float(v) for k, v in found.items() if isinstance(v, int | float)}

    def run(self, workload: str, *args: str) -> dict[str, float] | None:
        return self._call("--workload", workload, *args)

    def setup(self) -> None:
        """One-time preparation (Absurd: its schema and queues); a failure disables it."""
        try:
            self.run("setup")
        except PeerError as exc:
            self.disabled = f"setup failed: {exc}"
            print(f"peer {self.module}: {self.disabled}", file=sys.stderr, flush=True)
