"""Fixtures of the fault suite: process owners and the handshake helper for races."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .pgcluster import PrivatePostgres
from .procs import Child, Processes


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of the test's own (never the shared server's), started."""
    with PrivatePostgres() as pg:
        pg.init()
        pg.start()
        yield pg


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Every child process a test starts; whatever is left is killed at teardown."""
    owner = Processes(tmp_path / "logs")
    yield owner
    owner.close()


class Race:
    """Racing processes synchronised per round by files: each racer says it is ready for
    round r, and the round starts when the test creates the round's go-file."""

    def __init__(self, procs: Processes, url: str, directory: Path) -> None:
        self.procs = procs
        self.url = url
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.racers: list[Child] = []

    def racer(self, name: str, kind: str, targets: Sequence[str]) -> Child:
        argv = ["-m", "tests.faults.racer", self.url, str(self.directory), name, kind]
        child = self.procs.spawn(name, [sys.executable, *argv, *targets], capture_stdout=True)
        self.racers.append(child)
        return child

    def wait_files(self, names: Sequence[str], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            path = self.directory / name
            while not path.exists():
                dead = [c for c in self.procs.children if not c.alive() and c.proc.returncode]
                if dead:
                    raise AssertionError(
                        f"a process died before {name}\n" + "\n".join(c.describe() for c in dead)
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{name} did not appear within {timeout}s\n" + self.procs.describe()
                    )
                time.sleep(0.005)

    def run_round(self, r: int, also: Sequence[str] = ()) -> None:
        """Wait until every racer (and the ``also`` files) is ready for round ``r``, then
        start it."""
        self.wait_files([f"ready-{r}-{c.name}" for c in self.racers] + list(also))
        (self.directory / f"go-{r}").touch()

    def results(self, timeout: float = 90.0) -> dict[int, list[dict[str, Any]]]:
        """Wait for the racers to exit; their outcomes per round."""
        self.procs.wait_all(self.racers, timeout)
        by_round: dict[int, list[dict[str, Any]]] = {}
        for child in self.racers:
            assert child.proc.returncode == 0, child.describe()
            for line in child.output().splitlines():
                found = json.loads(line)
                by_round.setdefault(found["round"], []).append(found)
        return by_round


@pytest.fixture
def race(procs: Processes, db_url: str, tmp_path: Path) -> Race:
    return Race(procs, db_url, tmp_path / "race")
