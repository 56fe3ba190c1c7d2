"""A private PostgreSQL cluster, for tests that restart or crash the server.

The shared test server is never restarted: a test that needs to take PostgreSQL down starts
its own cluster with ``initdb`` in a temporary directory (owned by the ``postgres`` OS user
when we run as root), on a free port with its socket in that directory and trust
authentication, and stops it (``-m immediate``) and deletes it at the end.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import sqlalchemy

#: Where the server binaries are, unless ``initdb``/``pg_ctl`` are on PATH.
BINDIR_ENV = "WF_FAULTS_PG_BINDIR"


def _bindir() -> Path:
    configured = os.environ.get(BINDIR_ENV)
    if configured:
        return Path(configured)
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    try:
        out = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(
            f"PostgreSQL server binaries not found (pg_ctl not on PATH, no pg_config); "
            f"set {BINDIR_ENV}: {exc}"
        ) from exc
    return Path(out.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """``initdb`` + ``pg_ctl`` on a temporary directory; see the module docstring."""

    def __init__(self) -> None:
        self.bindir = _bindir()
        self.root = Path(tempfile.mkdtemp(prefix="wf-faults-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.running = False

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n"
                f"server log:\n{self.log_tail()}"
            )
        return done

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def _options(self) -> str:
        return (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c max_connections=300 -c fsync=off -c full_page_writes=off"
        )

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", self._options(),
                  "-w", "-t", "120", "start")  # fmt: skip
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")
        self.running = False

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``: shut down (``immediate`` is a crash) and start again."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", mode,
                  "-o", self._options(), "-w", "-t", "120", "restart")  # fmt: skip
        self.running = True

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def execute(self, sql: str, database: str = "postgres") -> list[tuple[object, ...]]:
        engine = sqlalchemy.create_engine(self.url(database), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                result = conn.exec_driver_sql(sql)
                return [tuple(r) for r in result] if result.returns_rows else []
        finally:
            engine.dispose()

    def wait_accepting(self, timeout: float = 60) -> float:
        """Wait until a new connection works; return when it first did."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.execute("SELECT 1")
                return time.time()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(Exception):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
