"""Waiting helpers, and the owner of a test's child processes (the ``procs`` fixture)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from sqlalchemy import event

import wf_persist as wp

from .fixtures import workflows as w

#: The worktree: children run here, so ``-m tests.fixtures...`` and ``wf_persist`` are ours.
ROOT = Path(__file__).resolve().parent.parent
#: Lines of a child's stderr a failing test's report shows.
TAIL_LINES = 40


def wait_until(
    predicate: Callable[[], object], timeout: float = 10, what: str = "it", every: float = 0.01
) -> None:
    """Poll ``predicate`` until it is true; fail the test if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(every)


def drive_until_parked(client: wp.WorkflowClient, execution_id: str, timeout: float = 10) -> None:
    """Let ``result()`` drive the run until it parks. A drive that outlasts a short
    ``result()`` timeout hands the run over at its next step (due again, ``running``),
    as on a slow machine: ask again rather than expect one call to reach the park."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(wp.ResultTimeoutError):
            client.result(execution_id, timeout=0.2)
        if client.status(execution_id) == "suspended":
            return
        assert time.monotonic() < deadline, f"{execution_id} did not park within {timeout}s"


def pause_calls(
    monkeypatch: pytest.MonkeyPatch,
    owner: object,
    name: str,
    only: Callable[..., bool] = lambda *args, **kwargs: True,
) -> tuple[threading.Event, threading.Event]:
    """Patch ``owner.name`` to stop at each call ``only`` picks until let go: ``(reached,
    go_on)``, set as a call stops and by the test to let it on."""
    real = getattr(owner, name)
    reached, go_on = threading.Event(), threading.Event()

    def paused(*args: Any, **kwargs: Any) -> Any:
        if only(*args, **kwargs):
            reached.set()
            assert go_on.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, paused)
    return reached, go_on


def wait_status(
    client: wp.WorkflowClient | wp.Client, execution_id: str, status: str, timeout: float = 30
) -> None:
    """Wait for a run driven elsewhere (a worker) to reach ``status``."""
    wait_until(lambda: client.status(execution_id) == status, timeout, f"{execution_id} {status}")


def wait_for_mark(path: Path, label: str, timeout: float = 60) -> None:
    """Wait for a side effect (a line in a marks file) from another process."""
    wait_until(lambda: label in w.marks(path), timeout, f"mark {label!r}")


def is_due(rt: wp.Runtime, execution_id: str) -> bool:
    """Whether the run is due now (its timer passed, or it was woken), by the database."""
    from wf_persist.store import executions

    with rt.backend.read() as conn:
        row = executions.get(conn, execution_id)
    return bool(row is not None and row.due)


def history_types(client: wp.WorkflowClient, execution_id: str) -> list[str]:
    return [r.event["type"] for r in client.history(execution_id)]


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """One child process of a test, its stderr (and unread stdout) in files."""

    name: str
    popen: subprocess.Popen[str]
    stderr_path: Path
    stdout_path: Path | None
    files: list[IO[str]]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        """Everything the child printed (children started with ``stdout=True`` are read
        through ``popen.stdout`` instead)."""
        assert self.stdout_path is not None, "this child's stdout is a pipe"
        return self.stdout_path.read_text(errors="replace")

    def tail(self) -> str:
        return _tail(self.stderr_path)

    def wait_for_stderr(self, text: str, timeout: float = 60) -> None:
        """A handshake: wait until the child says ``text`` on stderr (fail if it exits)."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            code = self.popen.poll()
            assert code is None, (
                f"{self.name} exited ({code}) before saying {text!r}:\n{self.tail()}"
            )
            assert time.monotonic() < deadline, f"{self.name} did not say {text!r} in {timeout}s"
            time.sleep(0.01)

    def send(self, signum: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            pytest.fail(f"{self.name} did not exit within {timeout}s:\n{self.tail()}")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Ask the child to stop and wait for it; its exit status."""
        self.send(signum)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


@dataclass
class Finished:
    """What a child run to completion printed."""

    returncode: int
    stdout: str
    stderr: str


class Processes:
    """Starts the children of one test in the worktree and owns them: ``close`` (the
    fixture's teardown, also after a failure) kills every child still running."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def spawn(
        self,
        args: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str | None] | None = None,
        stdout: bool = False,
        cwd: Path | None = None,
    ) -> Child:
        """Start ``args`` with this environment plus ``env`` (``None`` removes a variable);
        with ``stdout`` its stdout is a text pipe (``child.popen.stdout``), else it goes to
        a file like its stderr."""
        environment = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                environment.pop(key, None)
            else:
                environment[key] = value
        n = len(self.children) + 1
        label = f"#{n} {name or ' '.join(str(a) for a in args[1:4])}"
        err_path = self.directory / f"{n}.stderr"
        err = open(err_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        files: list[IO[str]] = [err]
        out_path = None
        out: Any = subprocess.PIPE
        if not stdout:
            out_path = self.directory / f"{n}.stdout"
            out = open(out_path, "w", encoding="utf-8")  # noqa: SIM115
            files.append(out)
        popen = subprocess.Popen(
            list(args),
            cwd=cwd or ROOT,
            env=environment,
            stdout=out,
            stderr=err,
            text=True,
        )
        child = Child(label, popen, err_path, out_path, files)
        self.children.append(child)
        return child

    def python(self, *args: str, **kwargs: Any) -> Child:
        return self.spawn([sys.executable, *args], **kwargs)

    def worker(
        self, db_url: str, *extra: str, lease_ttl: float = 2.0, app_poll_interval: float = 0.05
    ) -> Child:
        """``wf-persist worker`` serving the test application (tests/fixtures/app.py), whose
        runtime has this lease TTL and poll interval."""
        env: dict[str, str | None] = {
            "WF_PERSIST_DATABASE_URL": db_url,
            "WF_TEST_LEASE_TTL": str(lease_ttl),
            "WF_TEST_POLL_INTERVAL": str(app_poll_interval),
        }
        return self.python(
            "-m",
            "wf_persist.cli",
            "worker",
            "--app",
            "tests.fixtures.app:runtime",
            *extra,
            env=env,
            name=f"worker {' '.join(extra)}".strip(),
        )

    def proc(self, db_url: str, *args: str, **kwargs: Any) -> Child:
        """``python -m tests.fixtures.proc URL CMD ...`` (see that module)."""
        return self.python(
            "-m", "tests.fixtures.proc", db_url, *args, name=f"proc {args[0]}", **kwargs
        )

    def finish(self, child: Child, *, timeout: float = 120, check: bool = True) -> Finished:
        """Wait for ``child`` to exit; with ``check`` a non-zero status fails the test with
        the tail of its stderr."""
        code = child.wait(timeout)
        for f in child.files:
            f.flush()
        stdout = child.stdout() if child.stdout_path is not None else ""
        if check and code != 0:
            pytest.fail(f"{child.name} exited with status {code}:\n{child.tail()}")
        return Finished(code, stdout, child.stderr())

    def run(
        self,
        args: Sequence[str],
        *,
        timeout: float = 120,
        check: bool = True,
        **kwargs: Any,
    ) -> Finished:
        """Run a child to completion (``subprocess.run`` that owns the child)."""
        return self.finish(self.spawn(args, **kwargs), timeout=timeout, check=check)

    def run_proc(self, db_url: str, *args: str, timeout: float = 120) -> str:
        """A ``tests.fixtures.proc`` command run to completion; its stdout, stripped."""
        return self.finish(self.proc(db_url, *args), timeout=timeout).stdout.strip()

    def cli(self, *args: str, timeout: float = 120, check: bool = True, **kwargs: Any) -> Finished:
        """``wf-persist ARGS`` run to completion."""
        return self.run(
            [sys.executable, "-m", "wf_persist.cli", *args],
            timeout=timeout,
            check=check,
            name=f"wf-persist {' '.join(args[:2])}",
            **kwargs,
        )

    def tails(self) -> list[tuple[str, str]]:
        """The tail of every child's stderr (for a failing test's report)."""
        return [(c.name, c.tail() or "(nothing)") for c in self.children]

    def close(self) -> None:
        for child in self.children:
            child.kill()
            if child.popen.stdout is not None:
                child.popen.stdout.close()
            for f in child.files:
                f.close()


@contextmanager
def client_statements(client: wp.Client) -> Iterator[list[str]]:
    """Every statement this client sends through SQLAlchemy while the block runs, and
    every look at a run (which PostgreSQL sends straight to the driver)."""
    seen: list[str] = []
    backend = client.backend
    read_one = backend.read_one
    looking = threading.local()

    def record(*args: Any) -> None:
        if not getattr(looking, "now", False):  # a look's own statement: counted below
            seen.append(str(args[2]))

    def look(stmt: Any, params: dict[str, Any]) -> Any:
        seen.append(str(stmt.compile(dialect=client.engine.dialect)))
        looking.now = True
        try:
            return read_one(stmt, params)
        finally:
            looking.now = False

    event.listen(client.engine, "before_cursor_execute", record)
    backend.read_one = look  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del backend.read_one
        event.remove(client.engine, "before_cursor_execute", record)
