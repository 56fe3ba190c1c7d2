"""Flat at a million runs: each operation's time with 10k, 100k and 1M finished runs, and an
idle worker's CPU on the largest database.

One database per size is bulk-loaded in SQL (a recursive CTE on SQLite, ``generate_series``
on PostgreSQL, the sequence engine on MariaDB) with finished runs of ``bench_three_steps`` and
four history events each, as a real run leaves them. PostgreSQL is vacuumed and analyzed
after the load, as autovacuum would leave it; SQLite gets no ``ANALYZE`` (nothing runs one
for its users). Then every operation is timed through the library's own API, the sizes
interleaved within each repetition so drift on a shared machine falls on all of them alike:

* ``claim_none``: a worker's claim when nothing is due; ``claim_one``: one run is due;
* ``list_first`` / ``list_deep``: a page of the workflow's runs at the start and 100 runs
  before the end of the keyset; ``list_all_deep``: the same across workflows;
* ``status``, ``history``: one finished run; ``start``: a new run; ``start_dup``: a start
  whose idempotency key is taken; ``signal``: a delivery to a parked run.

It prints medians per size and the ratio of the largest to the smallest (the target: at
most 2), then starts ``wf-persist worker`` on the largest database and reads the CPU time it
uses in ``--idle-seconds`` (the target: under 2 % of a core).

    python bench/bench_scale.py [--quick] [--backends sqlite,postgresql[,mysql]]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

import wf_persist as wp
from bench.app import WORKFLOWS, three_steps
from bench.measure import Child, ServerCpu, process_cpu_seconds
from wf_persist.records import encode_cursor

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
ADMIN_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    "mysql": "mysql+pymysql://root@127.0.0.1:3306/test",
}
#: Every loaded run was created this long before the next, from T0 on.
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
STEP_MS = 1
RATIO_TARGET = 2.0
IDLE_TARGET = 0.02


@wp.workflow(name="bench_scale_parked", version=1)
def parked(ctx: wp.Context) -> bool:
    """Waits for one signal: the runs the start and signal timings make."""
    return bool(ctx.wait_for_signal("go", bool))


def _id(i: int) -> str:
    return f"{i:08x}-0000-4000-8000-{i:012x}"


# loading ------------------------------------------------------------------------------

_EVENTS = (
    (1, "execution.started", None),
    (2, "workflow.started", "workflow.started"),
    (3, "step.completed", None),
    (4, "workflow.completed", None),
)


def _load_sqlite(path: str, n: int) -> None:
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        raw.execute("PRAGMA synchronous = OFF")
        raw.execute("BEGIN IMMEDIATE")
        at = (
            "strftime('%Y-%m-%d %H:%M:%f', '2026-01-01', "
            "'+' || printf('%.3f', i / 1000.0) || ' seconds') || '000'"
        )
        raw.execute(
            f"""
            WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
            INSERT INTO wf_executions (id, workflow_name, workflow_version, status, input,
                result, idempotency_key, next_seq, claim_epoch, drive_failures, created_at,
                started_at, finished_at, updated_at)
            SELECT printf('%08x-0000-4000-8000-%012x', i, i), ?, 1, 'completed', CAST(i AS TEXT),
                json_object('ok', json('true')), 'k' || i, 5, 1, 0, {at}, {at}, {at}, {at}
            FROM n
            """,
            (n, three_steps.name),
        )
        for seq, kind, dedupe in _EVENTS:
            raw.execute(
                """
                INSERT INTO wf_history (execution_id, sequence, type, activity_name,
                    dedupe_key, created_at, event)
                SELECT id, ?, ?, ?, ?, created_at, json_object('type', ?, 'executionId', id)
                FROM wf_executions WHERE workflow_name = ?
                """,
                (seq, kind, "bench_step#1" if seq == 3 else None, dedupe, kind, three_steps.name),
            )
        raw.execute("COMMIT")
    finally:
        raw.close()


def _load_server(url: str, backend: str, n: int) -> None:
    engine = create_engine(url)
    pg = backend == "postgresql"
    source = "generate_series(1, :n) AS g(i)" if pg else f"seq_1_to_{n} AS g"
    i = "g.i" if pg else "g.seq"
    hexed = (
        f"lpad(to_hex({i}), 8, '0') || '-0000-4000-8000-' || lpad(to_hex({i}), 12, '0')"
        if pg
        else f"CONCAT(LPAD(LOWER(HEX({i})), 8, '0'), '-0000-4000-8000-', "
        f"LPAD(LOWER(HEX({i})), 12, '0'))"
    )
    at = (
        f"(TIMESTAMPTZ '2026-01-01 00:00:00+00' + {i} * INTERVAL '1 millisecond')"
        if pg
        else f"(TIMESTAMP '2026-01-01 00:00:00' + INTERVAL {i} * 1000 MICROSECOND)"
    )
    obj = "jsonb_build_object" if pg else "JSON_OBJECT"
    true = "true" if pg else "TRUE"
    key = f"'k' || {i}" if pg else f"CONCAT('k', {i})"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"""
                INSERT INTO wf_executions (id, workflow_name, workflow_version, status, input,
                    result, idempotency_key, next_seq, claim_epoch, drive_failures,
                    created_at, started_at, finished_at, updated_at)
                SELECT {hexed}, :name, 1, 'completed', {"to_jsonb(g.i)" if pg else i},
                    {obj}('ok', {true}), {key}, 5, 1, 0, {at}, {at}, {at}, {at}
                FROM {source}
                """
            ),
            {"n": n, "name": three_steps.name},
        )
        for seq, kind, dedupe in _EVENTS:  # constants: spelled in the SQL
            act = "'bench_step#1'" if seq == 3 else "NULL"
            key = f"'{dedupe}'" if dedupe else "NULL"
            conn.execute(
                text(
                    f"""
                    INSERT INTO wf_history (execution_id, sequence, type, activity_name,
                        dedupe_key, created_at, event)
                    SELECT id, {seq}, '{kind}', {act}, {key}, created_at,
                        {obj}('type', '{kind}', 'executionId', id)
                    FROM wf_executions WHERE workflow_name = :name
                    """
                ),
                {"name": three_steps.name},
            )
    if pg:
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
    else:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE TABLE wf_executions, wf_history"))
    engine.dispose()


def _count(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM wf_executions")).scalar_one())
    finally:
        engine.dispose()


def _loaded(url: str, n: int) -> bool:
    """Whether a kept database is at head and holds its ``n`` runs."""
    return wp.migrate.current(url) == wp.migrate.SCHEMA_HEAD and _count(url) >= n


def _register(url: str) -> None:
    engine = wp.create_engine(url, pool_size=1, max_overflow=1)
    try:
        with wp.Runtime(engine) as rt:
            rt.register(*WORKFLOWS, parked)
    finally:
        engine.dispose()


def prepare(backend: str, n: int, workdir: Path, reuse: bool) -> str:
    """A migrated database of ``n`` finished runs (kept between invocations with ``reuse``)."""
    name = f"wf_persist_bench_scale_{n}"
    if backend == "sqlite":
        path = workdir / f"{name}.sqlite3"
        url = f"sqlite:///{path}"
        if reuse and path.exists() and _loaded(url, n):
            return url
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    else:
        admin = create_engine(ADMIN_URLS[backend], isolation_level="AUTOCOMMIT")
        url = make_url(ADMIN_URLS[backend]).set(database=name).render_as_string(False)
        with admin.connect() as conn:
            exists = conn.execute(
                text(
                    "SELECT 1 FROM pg_database WHERE datname = :d"
                    if backend == "postgresql"
                    else "SELECT 1 FROM information_schema.schemata WHERE schema_name = :d"
                ),
                {"d": name},
            ).first()
            if reuse and exists and _loaded(url, n):
                admin.dispose()
                return url
            force = " WITH (FORCE)" if backend == "postgresql" else ""
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
            conn.execute(text(f"CREATE DATABASE {name}"))
        admin.dispose()
    began = time.perf_counter()
    wp.migrate.upgrade(url)
    _register(url)
    if backend == "sqlite":
        _load_sqlite(url.removeprefix("sqlite:///"), n)
    else:
        _load_server(url, backend, n)
    print(f"  loaded {_count(url):,} runs in {time.perf_counter() - began:.1f}s", flush=True)
    return url


# timing -------------------------------------------------------------------------------


class Scale:
    """One loaded database, a runtime on it, and the operations to time."""

    def __init__(self, url: str, n: int) -> None:
        self.n = n
        self.engine = wp.create_engine(url, pool_size=2, max_overflow=2)
        self.rt = wp.Runtime(self.engine)
        self.rt.register(*WORKFLOWS, parked)
        self.client = self.rt.client()
        middle = n // 2
        self.some_id = _id(middle)
        deep = n - 100
        at = T0 + dt.timedelta(milliseconds=deep * STEP_MS)
        self.deep_cursor = encode_cursor(at, _id(deep))
        self.parked: str | None = None

    def close(self) -> None:
        self.rt.close()
        self.engine.dispose()

    def claim(self) -> list[Any]:
        """A worker's claim: every workflow version the runtime serves, 8 free slots."""
        return self.rt.claim_due(8)

    def claim_none(self) -> None:
        assert self.claim() == []

    def claim_one(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """Make one run due (untimed): the timed claim, and what drives it to its end."""
        handle = self.client.start(three_steps, 1)
        claims: list[Any] = []

        def timed() -> None:
            claims.extend(self.claim())

        def after() -> None:
            assert [c.execution_id for c in claims] == [handle.execution_id], claims
            self.rt.drive_claim(claims[0])

        return timed, after

    def list_first(self) -> None:
        assert len(self.client.list(three_steps, limit=50).items) == 50

    def list_deep(self) -> None:
        page = self.client.list(three_steps, limit=50, cursor=self.deep_cursor)
        assert len(page.items) == 50

    def list_all_deep(self) -> None:
        page = self.client.list(limit=50, cursor=self.deep_cursor)
        assert len(page.items) == 50

    def status(self) -> None:
        assert self.client.status(self.some_id) == "completed"

    def history(self) -> None:
        assert len(self.client.history(self.some_id)) == 4

    def start_dup(self) -> None:
        handle = self.client.start(three_steps, 5, idempotency_key=f"k{self.n // 3}")
        assert handle.execution_id == _id(self.n // 3)

    def start(self) -> None:
        key = uuid.uuid4().hex  # a key never used: the insert that creates the run
        self.parked = self.client.start(parked, idempotency_key=key).execution_id

    def park(self) -> None:
        assert self.parked is not None
        self.rt.drive(self.parked)

    def signal(self) -> None:
        assert self.parked is not None
        self.client.signal(self.parked, "go", True)

    def finish(self) -> None:
        assert self.parked is not None
        self.rt.drive(self.parked)
        assert self.client.status(self.parked) == "completed"


OPS = (
    "claim_none",
    "claim_one",
    "list_first",
    "list_deep",
    "list_all_deep",
    "status",
    "history",
    "start_dup",
    "start",
    "signal",
)


def _once(scale: Scale, op: str) -> float:
    """One timed call of ``op`` (with its untimed setup and clean-up)."""
    if op == "claim_one":
        work, after = scale.claim_one()
        began = time.perf_counter()
        work()
        took = time.perf_counter() - began
        after()
        return took
    if op == "signal":
        scale.start()
        scale.park()
    began = time.perf_counter()
    getattr(scale, op)()
    took = time.perf_counter() - began
    if op == "start":
        scale.park()
        scale.signal()
    if op in ("start", "signal"):
        scale.finish()
    return took


def measure(scales: list[Scale], reps: int, calls: int) -> dict[tuple[str, int], list[float]]:
    """Per (operation, size): the median of ``calls`` calls in each repetition (ms)."""
    found: dict[tuple[str, int], list[float]] = {}
    for scale in scales:  # warm: statement caches, the pool, the catalog
        for op in OPS:
            _once(scale, op)
    for _ in range(reps):
        for op in OPS:
            for scale in scales:
                times = [_once(scale, op) for _ in range(calls)]
                found.setdefault((op, scale.n), []).append(statistics.median(times) * 1e3)
    return found


def report(backend: str, sizes: list[int], found: dict[tuple[str, int], list[float]]) -> bool:
    small, large = sizes[0], sizes[-1]
    head = "".join(f"{f'{n:,} ms':>14}" for n in sizes)
    print(f"\n{backend}: median ms per operation ({large:,} / {small:,}: target <= 2)")
    print(f"  {'operation':<14}{head}{'ratio':>9}")
    ok = True
    for op in OPS:
        medians = [statistics.median(found[(op, n)]) for n in sizes]
        ratio = medians[-1] / medians[0]
        ok = ok and ratio <= RATIO_TARGET
        cells = "".join(f"{m:>14.3f}" for m in medians)
        print(f"  {op:<14}{cells}{ratio:>8.2f}{'' if ratio <= RATIO_TARGET else ' !'}")
    return ok


def idle_worker(url: str, backend: str, seconds: float) -> bool:
    """``wf-persist worker`` on ``url`` with nothing to do: its CPU share over ``seconds``."""
    env = {**os.environ, "BENCH_DATABASE_URL": url}
    root = Path(__file__).resolve().parent.parent
    child = Child(
        [sys.executable, "-m", "wf_persist.cli", "worker", "--app", "bench.app:make_runtime"],
        marker="serving",
        stream="stderr",
        env=env,
        cwd=root,
    )
    server = ServerCpu(enabled=backend == "postgresql")
    try:
        child.wait_ready()
        time.sleep(2.0)  # past its first looks
        cpu0, server0, wall0 = child.cpu_seconds(), server.seconds(), time.perf_counter()
        time.sleep(seconds)
        cpu1, server1, wall1 = child.cpu_seconds(), server.seconds(), time.perf_counter()
        alive = child.proc.poll() is None
    finally:
        child.stop()
    share = (cpu1 - cpu0) / (wall1 - wall0)
    line = f"  idle worker: {share * 100:.2f} % of a core over {wall1 - wall0:.1f}s"
    if server0 is not None and server1 is not None:
        line += f" (all postgres processes: {(server1 - server0) / (wall1 - wall0) * 100:.2f} %)"
    print(line + ("" if share < IDLE_TARGET else " !") + ("" if alive else f" {child.describe()}"))
    assert process_cpu_seconds(os.getpid()) is not None
    return alive and share < IDLE_TARGET


def run_backend(backend: str, sizes: list[int], args: argparse.Namespace, work: Path) -> bool:
    print(f"{backend}: loading {', '.join(f'{n:,}' for n in sizes)} finished runs", flush=True)
    urls = {n: prepare(backend, n, work, args.reuse) for n in sizes}
    scales = [Scale(urls[n], n) for n in sizes]
    try:
        found = measure(scales, args.reps, args.calls)
    finally:
        for scale in scales:
            scale.close()
    ok = report(backend, sizes, found)
    if args.idle_seconds > 0:
        ok = idle_worker(urls[sizes[-1]], backend, args.idle_seconds) and ok
    if args.json:
        for (op, n), values in sorted(found.items()):
            print(json.dumps({"backend": backend, "op": op, "runs": n, "ms": values}))
    if not args.reuse and backend != "sqlite":  # SQLite files go with the work directory
        drop(backend, sizes)
    return ok


def drop(backend: str, sizes: list[int]) -> None:
    """Drop the server databases :func:`prepare` made."""
    admin = create_engine(ADMIN_URLS[backend], isolation_level="AUTOCOMMIT")
    force = " WITH (FORCE)" if backend == "postgresql" else ""
    with admin.connect() as conn:
        for n in sizes:
            conn.execute(text(f"DROP DATABASE IF EXISTS wf_persist_bench_scale_{n}{force}"))
    admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k runs only")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15, help="timed calls per repetition")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--workdir", help="where SQLite files go (default: a temporary one)")
    parser.add_argument("--reuse", action="store_true", help="keep loaded databases")
    parser.add_argument("--json", action="store_true", help="also print every sample")
    args = parser.parse_args()
    sizes = list(QUICK_SIZES if args.quick else SIZES)
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for backend in args.backends.split(","):
            ok = run_backend(backend.strip(), sizes, args, work) and ok
    print("\nall within target" if ok else "\nsome figures miss their target (marked !)")


if __name__ == "__main__":
    main()
