"""Child processes owned by a test: started with their output in a file, killed at the end.

``Processes`` keeps every child it started; ``close()`` sends SIGCONT then SIGKILL to whatever
is still alive (stopped ones included) and reaps it, so no test leaves a worker behind, even
when it fails. Children also die with the process that started them (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: The repository root: children run from here so ``tests.faults...`` imports resolve.
ROOT = Path(__file__).resolve().parents[2]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # not Linux: the owner's close() still kills it
        pass


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no output file)"
    kept = text.splitlines()[-lines:]
    return "\n".join(kept) if kept else "(empty)"


def line_count(path: Path) -> int:
    try:
        with path.open("rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    stdout: Path | None
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: signal.Signals) -> bool:
        """Send ``sig`` if the process is still running; False if it already exited."""
        if self.proc.poll() is not None:
            return False
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def output(self) -> str:
        return self.stdout.read_text() if self.stdout is not None and self.stdout.exists() else ""

    def tail(self, lines: int = 25) -> str:
        return tail(self.log, lines)

    def describe(self, lines: int = 25) -> str:
        code = self.proc.poll()
        state = "running" if code is None else f"exit {code}"
        return f"--- {self.name} (pid {self.pid}, {state}) {self.log.name}:\n{self.tail(lines)}"


class Processes:
    """Starts children with their stderr captured to files under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        capture_stdout: bool = False,
    ) -> Child:
        """Start ``argv`` from the repository root; stderr (and stdout, unless captured
        separately) goes to ``<name>.log``."""
        log = self.directory / f"{name}.log"
        out = self.directory / f"{name}.out" if capture_stdout else None
        with log.open("ab") as err_fh:
            if out is not None:
                with out.open("ab") as out_fh:
                    proc = self._popen(argv, env, out_fh, err_fh)
            else:
                proc = self._popen(argv, env, err_fh, err_fh)
        child = Child(name, proc, log, out)
        self.children.append(child)
        return child

    @staticmethod
    def _popen(
        argv: Sequence[str], env: Mapping[str, str] | None, stdout: IO[Any], stderr: IO[Any]
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env=dict(os.environ if env is None else env),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            preexec_fn=_die_with_parent,
        )

    def wait_all(self, children: Sequence[Child], timeout: float) -> None:
        """Wait for ``children`` to exit; fail with their output if one does not in time."""
        deadline = time.monotonic() + timeout
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{child.name} did not exit within {timeout}s\n{child.describe()}"
                ) from None

    def describe(self, lines: int = 25, only: Callable[[Child], bool] | None = None) -> str:
        chosen = [c for c in self.children if only is None or only(c)]
        return "\n".join(c.describe(lines) for c in chosen)

    def close(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.send(signal.SIGCONT)
                child.send(signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(10)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_argv(app: str, concurrency: int, poll_interval: float | None = None) -> list[str]:
    """The worker command: ``wf-persist worker`` run by this interpreter."""
    argv = [sys.executable, "-m", "wf_persist.cli", "worker", "--app", app]
    argv += ["--concurrency", str(concurrency)]
    if poll_interval is not None:
        argv += ["--poll-interval", str(poll_interval)]
    return argv


def worker_ready(child: Child) -> bool:
    """The worker printed its start line (it imported the app and opened the runtime)."""
    try:
        text = child.log.read_text(errors="replace")
    except FileNotFoundError:
        return False
    return "serving" in text.replace("\n", " ")


def wait_ready(children: Sequence[Child], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        for child in list(pending):
            if worker_ready(child):
                pending.remove(child)
            elif not child.alive():
                raise AssertionError(f"{child.name} exited before it was ready\n{child.describe()}")
        if pending and time.monotonic() > deadline:
            raise AssertionError(
                f"workers not ready within {timeout}s\n" + "\n".join(c.describe() for c in pending)
            )
        time.sleep(0.05)


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    explain: Callable[[], str] = lambda: "",
    interval: float = 0.02,
) -> None:
    """Poll ``predicate`` until true; fail, with ``explain()`` (say, process output), if
    ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s\n{explain()}")
        time.sleep(interval)
