"""The PostgreSQL reaper's look, against the runs in flight.

Every worker on PostgreSQL looks ten times a second for runs whose owner's process is gone
(its presence lock free). This times that look (``Runtime.reap``, as a worker calls it) on a
database holding 200,000 finished runs and 1,000, 10,000 or 50,000 runs in flight, leased by
20 owners whose processes are alive (this script holds their presence locks, as their
listening connections would): the steady state, where the look finds nobody to take over.
The sizes are interleaved per repetition. It prints the median per size and the ratio of
the largest to the smallest.

Run: ``.venv/bin/python -m bench.bench_reap [--reps 5] [--looks 200] [--pg-url URL]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from sqlalchemy import Connection, create_engine, text

import wf_persist as wp
from bench.app import three_steps
from bench.scratch import scratch
from bench.suite import DEFAULT_PG_ADMIN_URL, PG_URL_ENV

OWNERS = 20
FINISHED = 200_000
SIZES = (1_000, 10_000, 50_000)


def _owner(i: int) -> str:
    return f"bench-host-{i}-cafe!"


def _load(conn: Connection, in_flight: int) -> None:
    """Replace the runs in flight with ``in_flight`` running runs across :data:`OWNERS`."""
    conn.execute(text("DELETE FROM wf_executions WHERE status = 'running'"))
    conn.execute(
        text(
            "INSERT INTO wf_executions (id, workflow_name, workflow_version, status, next_seq,"
            " wake_at, lease_owner, lease_expires_at, claim_epoch, created_at, updated_at)"
            " SELECT 'flight-' || g, :name, 1, 'running', 2, now() + interval '30 s',"
            " 'bench-host-' || (g % :owners) || '-cafe!'"
            ", now() + interval '30 s', 1, now(), now()"
            " FROM generate_series(1, :n) AS g"
        ),
        {"name": three_steps.name, "owners": OWNERS, "n": in_flight},
    )
    conn.commit()
    conn.execute(text("VACUUM ANALYZE wf_executions"))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--looks", type=int, default=200)
    parser.add_argument("--pg-url", default=os.environ.get(PG_URL_ENV) or DEFAULT_PG_ADMIN_URL)
    args = parser.parse_args()
    with scratch("postgresql", args.pg_url) as where:
        url = where.url("ours")
        raw = create_engine(url, isolation_level="AUTOCOMMIT")
        with wp.Runtime(url) as runtime:
            runtime.register(three_steps)
            with raw.connect() as conn:
                conn.execute(
                    text(
                        "INSERT INTO wf_executions (id, workflow_name, workflow_version,"
                        " status, next_seq, claim_epoch, created_at, updated_at, finished_at)"
                        " SELECT 'done-' || g, :name, 1, 'completed', 2, 1, now(), now(), now()"
                        " FROM generate_series(1, :n) AS g"
                    ),
                    {"name": three_steps.name, "n": FINISHED},
                )
            holder = raw.connect()  # the owners' processes: their presence locks held
            for i in range(OWNERS):
                holder.execute(
                    text("SELECT pg_advisory_lock(hashtextextended(:o, 0))"), {"o": _owner(i)}
                )
            runtime.wakeups()  # the listener: this runtime's own presence, and reap() on
            times: dict[int, list[float]] = {n: [] for n in SIZES}
            for rep in range(args.reps):
                shift = rep % len(SIZES)
                for n in SIZES[shift:] + SIZES[:shift]:
                    with raw.connect() as conn:
                        _load(conn, n)
                    runtime.reap()  # warm: the statement prepared
                    began = time.perf_counter()
                    for _ in range(args.looks):
                        if runtime.reap():
                            raise RuntimeError("a live owner's runs were reaped")
                    times[n].append((time.perf_counter() - began) / args.looks * 1000)
            holder.close()
        raw.dispose()
    print(
        f"PostgreSQL reaper's look, {FINISHED:,} finished runs, {OWNERS} live owners, "
        f"medians of {args.reps} x {args.looks} looks"
    )
    for n in SIZES:
        print(f"  {n:>7,} runs in flight  {statistics.median(times[n]):6.3f} ms a look")
    ratio = statistics.median(times[SIZES[-1]]) / statistics.median(times[SIZES[0]])
    print(f"  {SIZES[-1]:,} ÷ {SIZES[0]:,}: {ratio:.2f}")


if __name__ == "__main__":
    main()
