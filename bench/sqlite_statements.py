"""A step's SQLite statements with no wf_persist code around them, against the floor's.

What part of the SQLite steps ratio is the database's own work? This sends, with a bare
``sqlite3`` loop (WAL, ``synchronous=FULL``, no SQLAlchemy, no wf_persist), exactly what a
step write sends (BEGIN IMMEDIATE, the fenced UPDATE ... RETURNING of the run, two history
INSERTs, COMMIT) on a database wf_persist's migrations made, and the floor's INSERT + COMMIT
of one small row, alternating per repetition. It prints wall and CPU microseconds per write
and their ratio.

Run: ``.venv/bin/python -m bench.sqlite_statements [--writes 1000] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import wf_persist as wp

BUMP = (
    "UPDATE wf_executions SET next_seq = wf_executions.next_seq + 2, updated_at = ? "
    "WHERE wf_executions.id = ? AND wf_executions.claim_epoch = ? RETURNING next_seq, status"
)
INSERT = (
    "INSERT INTO wf_history (execution_id, sequence, type, activity_name, dedupe_key, "
    "created_at, event) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def _ours(directory: Path) -> Callable[[int], None]:
    """A run row in a database migrated by wf_persist, and one step write per call."""
    path = directory / "ours.sqlite3"

    @wp.workflow(name="bench_sqlite_statements", version=1)
    def noop(ctx: wp.Context) -> None:
        return None

    with wp.Runtime(f"sqlite:///{path}") as runtime:
        runtime.register(noop)
        handle = runtime.client().start(noop)
    conn = _connect(path)
    conn.execute("UPDATE wf_executions SET claim_epoch = 1 WHERE id = ?", (handle.execution_id,))
    run = handle.execution_id

    def write(i: int) -> None:
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
        activity = f"bench_step#{i}"
        started = {"type": "step.started", "activityName": activity, "attempt": 1}
        result = {"i": i, "ok": True, "msg": "hello"}
        completed = {"type": "step.completed", "activityName": activity, "result": result}
        conn.execute("BEGIN IMMEDIATE")
        top = conn.execute(BUMP, (now, run, 1)).fetchone()[0]
        conn.executemany(
            INSERT,
            [
                (run, top - 2, "step.started", activity, None, now, json.dumps(started)),
                (run, top - 1, "step.completed", activity, None, now, json.dumps(completed)),
            ],
        )
        conn.execute("COMMIT")

    return write


def _floor(directory: Path) -> Callable[[int], None]:
    conn = _connect(directory / "floor.sqlite3")
    conn.execute("CREATE TABLE bench_floor (id INTEGER PRIMARY KEY, doc TEXT NOT NULL)")

    def write(i: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO bench_floor VALUES (?, ?)",
            (i, json.dumps({"i": i, "ok": True, "msg": "hello"})),
        )
        conn.execute("COMMIT")

    return write


def _time(write: Callable[[int], None], start: int, count: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(start, start + count):
        write(i)
    return (
        (time.perf_counter() - wall) / count * 1e6,
        (time.process_time() - cpu) / count * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wf-persist-bench-sqlite-") as tmp:
        systems = {"step statements": _ours(Path(tmp)), "floor INSERT + COMMIT": _floor(Path(tmp))}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
        for rep in range(args.reps):
            order = list(systems) if rep % 2 == 0 else list(systems)[::-1]
            for name in order:
                results[name].append(_time(systems[name], rep * args.writes, args.writes))
    medians = {
        name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
        for name, r in results.items()
    }
    print(f"SQLite {sqlite3.sqlite_version}, bare sqlite3, medians of {args.reps} x {args.writes}")
    for name, (wall, cpu) in medians.items():
        print(f"  {name:24s} wall {wall:7.1f} us  cpu {cpu:7.1f} us per write")
    (ours_wall, _), (floor_wall, _) = medians.values()
    print(f"  writes/s ratio, step statements / floor: {floor_wall / ours_wall:.2f}")


if __name__ == "__main__":
    main()
