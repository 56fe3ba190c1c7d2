"""A step's PostgreSQL statement with no wf_persist code around it, against the floor's.

What part of the PostgreSQL steps ratio is the database's own work? This sends, with a bare
psycopg loop (autocommit, prepared, no SQLAlchemy execution, no wf_persist), exactly the
statement a step write sends (the fenced ``UPDATE`` of the run and its history ``INSERT`` in
one statement, rendered by wf_persist itself) on a scratch database wf_persist's migrations
made, and the floor's autocommitted ``INSERT`` of one small row, alternating per repetition.
The statement is sent with two history rows (a step's ``step.started`` and
``step.completed``, as wf_persist writes them) and with one (what a single row would cost).
It prints writes/s per system and each one's ratio to the floor.

Run: ``.venv/bin/python -m bench.pg_statements [--writes 3000] [--reps 5] [--pg-url URL]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

import wf_persist as wp
from bench.scratch import libpq_url, scratch
from bench.suite import DEFAULT_PG_ADMIN_URL, PG_URL_ENV
from wf_persist.backends import pg_sql
from wf_persist.backends.sql import WriteShape


def _ours(url: str, n: int) -> Callable[[int], None]:
    """A run row in a database migrated by wf_persist, and one step write per call."""

    @wp.workflow(name="bench_pg_statements", version=1)
    def noop(ctx: wp.Context) -> None:
        return None

    stmt = pg_sql.write_statement(WriteShape(n, ("updated_at",), None))
    with wp.Runtime(url, auto_migrate=True) as runtime:
        runtime.register(noop)
        run = runtime.client().start(noop).execution_id
        sql = str(stmt.compile(dialect=runtime.engine.dialect))  # psycopg's %(name)s style
    conn = psycopg.connect(libpq_url(url), autocommit=True)
    conn.execute("UPDATE wf_executions SET claim_epoch = 1 WHERE id = %s", (run,))
    types = ("step.started", "step.completed")[-n:]

    def write(i: int) -> None:
        now = dt.datetime.now(dt.UTC)
        params: dict[str, Any] = {"p_eid": run, "p_epoch": 1, "v_updated_at": now}
        for k, kind in enumerate(types):
            activity = f"bench_step#{i}"
            event = {"type": kind, "activityName": activity, "result": {"i": i, "ok": True}}
            params.update({f"type{k}": kind, f"act{k}": activity, f"dk{k}": None, f"at{k}": now})
            params[f"ev{k}"] = json.dumps(event)
        conn.execute(sql, params, prepare=True).fetchall()

    return write


def _floor(url: str) -> Callable[[int], None]:
    conn = psycopg.connect(libpq_url(url), autocommit=True)
    conn.execute("CREATE TABLE bench_floor (id BIGINT PRIMARY KEY, doc TEXT NOT NULL)")

    def write(i: int) -> None:
        doc = json.dumps({"i": i, "ok": True, "msg": "hello"})
        conn.execute("INSERT INTO bench_floor VALUES (%s, %s)", (i, doc), prepare=True)

    return write


def _rate(write: Callable[[int], None], start: int, count: int) -> float:
    began = time.perf_counter()
    for i in range(start, start + count):
        write(i)
    return count / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--writes", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pg-url", default=os.environ.get(PG_URL_ENV) or DEFAULT_PG_ADMIN_URL)
    args = parser.parse_args()
    with scratch("postgresql", args.pg_url) as where:
        systems = {
            "step statement, 2 rows": _ours(where.url("ours"), 2),
            "step statement, 1 row": _ours(where.url("dbos"), 1),
            "floor autocommit INSERT": _floor(where.url("floor")),
        }
        rates: dict[str, list[float]] = {name: [] for name in systems}
        names = list(systems)
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                rates[name].append(_rate(systems[name], rep * args.writes, args.writes))
    floor = rates["floor autocommit INSERT"]
    print(f"PostgreSQL, bare psycopg, medians of {args.reps} x {args.writes} writes")
    for name, found in rates.items():
        ratios = [r / f for r, f in zip(found, floor, strict=True)]
        print(
            f"  {name:26s} {statistics.median(found):8,.0f} writes/s"
            f"  ÷ floor {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
