"""DBOS running the same two workloads as ``bench_steps.py``, for a peer comparison.

Runs in its own process (``bench_steps.py`` starts it once per repetition) so DBOS's global
state and background threads never run beside our own measurement. Prints one JSON line:
``{"steps_per_s": ..., "wf_per_s": ...}``; on a missing ``dbos`` package it prints
``{"error": "dbos not installed"}`` and exits with status 3.

The timed part is only the workload: import, ``DBOS.launch()`` (which migrates the system
database on first use) and a warm-up run come before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_NOT_INSTALLED = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), required=True)
    parser.add_argument("--url", required=True, help="DBOS system database URL")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workflows", type=int, default=200)
    args = parser.parse_args(argv)

    try:
        # dbos is an optional extra: type-check the same with or without it installed.
        from dbos import DBOS, DBOSConfig  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print(json.dumps({"error": "dbos not installed"}), flush=True)
        return EXIT_NOT_INSTALLED

    # Decorators applied as calls: without dbos's types an untyped decorator is an error
    # under mypy --strict.
    def bench_step(i: int) -> dict[str, Any]:
        return {"i": i, "ok": True, "msg": "hello"}

    step = DBOS.step()(bench_step)

    def many_steps(n: int) -> int:
        for i in range(n):
            step(i)
        return n

    def three_steps(n: int) -> int:
        for i in range(3):
            step(i)
        return n

    many = DBOS.workflow()(many_steps)
    wf3 = DBOS.workflow()(three_steps)

    config: DBOSConfig = {
        "name": "wf-bench",
        "system_database_url": args.url,
        "application_version": "bench-v1",
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    try:
        many(3)  # warm-up: connection pool, statement caches
        wf3(0)

        began = time.perf_counter()
        out = many(args.steps)
        steps_elapsed = time.perf_counter() - began
        assert out == args.steps

        began = time.perf_counter()
        for n in range(args.workflows):
            assert wf3(n) == n
        wf_elapsed = time.perf_counter() - began
    finally:
        DBOS.destroy()

    result = {
        "backend": args.backend,
        "steps_per_s": args.steps / steps_elapsed,
        "wf_per_s": args.workflows / wf_elapsed,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
