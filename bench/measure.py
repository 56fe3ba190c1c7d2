"""Clocks and meters shared by the suite and the peer scripts (no wf_persist import here, so a
peer's process loads nothing of ours).

* :func:`timed` gives operations per wall-clock second and this process's CPU time per
  operation (``time.process_time``: every thread of the process, user + system).
* :class:`ServerCpu` adds up the CPU time of every ``postgres`` process on this machine
  (the backends serving each connection, plus the WAL writer and friends), so a system that
  does its work in PL/pgSQL shows the cost it moved to the server. Linux only; elsewhere it
  reads nothing and the figure is left out.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

_ERROR: Final = re.compile(r"\w*(Error|Exception)\b:")
_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC: Final = Path("/proc")


@dataclass(frozen=True)
class Rate:
    """Operations per wall-clock second; CPU µs per operation of this process and (when it
    could be read) of the PostgreSQL server."""

    per_s: float
    cpu_us: float
    server_cpu_us: float | None = None
    elapsed: float = 0.0

    def metrics(self) -> dict[str, float]:
        """The fields every measurement reports (``server_cpu_us`` where it was read)."""
        out = {"per_s": self.per_s, "cpu_us": self.cpu_us}
        if self.server_cpu_us is not None:
            out["server_cpu_us"] = self.server_cpu_us
        return out


def timed(count: int, work: Callable[[], object], server: ServerCpu | None = None) -> Rate:
    """Run ``work`` (which does ``count`` operations) and measure it."""
    server_before = server.seconds() if server is not None else None
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    elapsed, cpu_used = time.perf_counter() - wall, time.process_time() - cpu
    server_us = None
    if server is not None and server_before is not None:
        after = server.seconds()
        if after is not None:
            server_us = (after - server_before) / count * 1e6
    return Rate(count / elapsed, cpu_used / count * 1e6, server_us, elapsed)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a live process (and its reaped children) used, from /proc."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state is field 3; utime, stime, cutime, cstime are fields 14-17.
    return sum(int(v) for v in fields[11:15]) / _TICKS


class ServerCpu:
    """CPU seconds used so far by all ``postgres`` processes of this machine (or None)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and PROC.is_dir()

    def seconds(self) -> float | None:
        if not self.enabled:
            return None
        total = 0.0
        found = False
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() != "postgres":
                    continue
            except OSError:
                continue
            used = process_cpu_seconds(int(entry.name))
            if used is not None:
                total += used
                found = True
        return total if found else None


def peak_rss_kib() -> int | None:
    """This process's peak resident set size (VmHWM) in KiB, Linux only."""
    try:
        for line in (PROC / "self" / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def last_error(lines: Iterable[str]) -> str:
    """The last line naming an exception (``...Error: ...``), else the last lines."""
    kept = [ln.strip() for ln in lines if ln.strip()]
    errors = [ln for ln in kept if _ERROR.search(ln)]
    return errors[-1] if errors else " | ".join(kept[-4:])


def append_line(path: str, text: str) -> None:
    """Append one line atomically (one O_APPEND write), from any thread or process."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``check`` until it holds or ``timeout`` seconds passed; whether it held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


class Child:
    """A child process whose ``stream`` ("stdout" or "stderr") is read in a thread: the first
    line containing ``marker`` (if given) marks it ready (``ready_at``, by ``time.time()``);
    the last lines are kept for error messages. The other stream goes to /dev/null."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        marker: str | None = None,
        stream: str = "stdout",
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.marker = marker
        self.spawned_at = time.time()
        self.ready_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=15)
        self._ready = threading.Event()
        pipe, null = subprocess.PIPE, subprocess.DEVNULL
        self.proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=null,
            stdout=pipe if stream == "stdout" else null,
            stderr=pipe if stream == "stderr" else null,
            text=True,
        )
        source = self.proc.stdout if stream == "stdout" else self.proc.stderr
        self._reader = threading.Thread(target=self._read, args=(source,), daemon=True)
        self._reader.start()

    def _read(self, source: IO[str] | None) -> None:
        assert source is not None
        for line in source:
            if self.ready_at is None and self.marker is not None and self.marker in line:
                self.ready_at = time.time()
                self._ready.set()
            self.tail.append(line.rstrip())
        self._ready.set()  # exited: wake a waiter

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self._ready.wait(timeout) or self.ready_at is None:
            raise RuntimeError(f"child process did not start: {self.describe()}")

    def describe(self) -> str:
        """Whether it runs, and its last error line (else its last lines)."""
        code = self.proc.poll()
        state = "still running" if code is None else f"exit {code}"
        return f"{state}; {last_error(self.tail)}"

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid) or 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def wait_for_count(
    read: Callable[[], int],
    target: int,
    *,
    stall: float = 30.0,
    alive: Callable[[], bool] = lambda: True,
) -> bool:
    """Poll ``read()`` until it reaches ``target``; give up (False) when it has not moved for
    ``stall`` seconds or ``alive()`` turns false."""
    last, moved = read(), time.monotonic()
    while last < target:
        if not alive() or time.monotonic() - moved > stall:
            return False
        time.sleep(0.01)
        now = read()
        if now != last:
            last, moved = now, time.monotonic()
    return True


# the recovery workload's traces, the same for ours and the peers ---------------------------


def recovery_first_step(key: str) -> None:
    """Step 1 of a recovery run: append ``key`` to ``$BENCH_MARKS`` (a second line for the
    same key means step 1 ran twice)."""
    marks = os.environ.get("BENCH_MARKS")
    if marks:
        append_line(marks, key)


def recovery_second_step(
    key: str, keep_alive: Callable[[], None] | None = None, interval: float = 3600.0
) -> None:
    """Step 2 of a recovery run. In worker A (``$BENCH_BLOCKED`` set): append ``key`` there,
    then block until killed, calling ``keep_alive`` every ``interval`` seconds. In worker B
    (``$BENCH_RESUMED`` set): append ``key`` and the time it began there."""
    blocked = os.environ.get("BENCH_BLOCKED")
    if blocked:
        append_line(blocked, key)
        while True:
            if keep_alive is not None:
                keep_alive()
            time.sleep(interval)
    resumed = os.environ.get("BENCH_RESUMED")
    if resumed:
        append_line(resumed, f"{key} {time.time()!r}")


class RecoveryTrace:
    """The files a recovery measurement's steps write, in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.marks = f"{directory}/marks"
        self.blocked_path = f"{directory}/blocked"
        self.resumed = f"{directory}/resumed"

    def env_a(self) -> dict[str, str]:
        return {"BENCH_MARKS": self.marks, "BENCH_BLOCKED": self.blocked_path}

    def env_b(self) -> dict[str, str]:
        return {"BENCH_MARKS": self.marks, "BENCH_RESUMED": self.resumed}

    def blocked(self) -> int:
        return count_lines(self.blocked_path)

    def metrics(
        self, killed_at: float, spawned_at: float, ready_at: float | None, done: list[float]
    ) -> dict[str, float]:
        """From the kill (``killed_at``), B's start (``spawned_at``) and readiness, and the
        runs' finish times: ``first_done_s`` and ``all_done_s`` after the kill;
        ``taken_over_s``: the first step 2 beginning in B, counted from B being ready or the
        kill, whichever is later; ``after_ready_s``: all done, counted the same way;
        ``startup_s`` of B; ``step1_twice``: runs whose step 1 ran more than once."""
        ready = ready_at if ready_at is not None else killed_at
        since = max(killed_at, ready)
        with open(self.marks) as f:
            counts = collections.Counter(f.read().split())
        with open(self.resumed) as f:
            began = [float(line.split()[1]) for line in f if line.strip()]
        return {
            "first_done_s": min(done) - killed_at,
            "all_done_s": max(done) - killed_at,
            "taken_over_s": min(began) - since,
            "after_ready_s": max(done) - since,
            "startup_s": ready - spawned_at,
            "step1_twice": float(sum(1 for n in counts.values() if n > 1)),
        }
