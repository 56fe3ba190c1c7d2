"""The cost of OpenTelemetry on the step hot path: steps/s and CPU µs per step of one
``--steps``-step workflow, with the ``otel`` packages absent, installed but off, tracing on,
and tracing and metrics on.

Each mode runs in a fresh interpreter (absent means the import fails; providers are
process-wide); the modes are interleaved, and a figure is the median of ``--reps``. Spans go
through the SDK's ``BatchSpanProcessor`` to an exporter that drops them (no network), so the
cost measured is ours and the SDK's, not a collector's.

Run: ``.venv/bin/python bench/bench_telemetry.py --backend sqlite`` (or ``postgresql``, with
``$WF_PERSIST_BENCH_POSTGRES_URL``, default the local ``postgres`` database; a scratch
database ``wf_persist_bench_otel`` is created and dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import wf_persist as wp
from wf_persist import telemetry

MODES: Final = ("absent", "off", "traces", "traces+metrics")
PG_URL_ENV: Final = "WF_PERSIST_BENCH_POSTGRES_URL"
DEFAULT_PG_ADMIN_URL: Final = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SCRATCH_DB: Final = "wf_persist_bench_otel"


@wp.step()
def bench_step(i: int) -> dict[str, Any]:
    return {"i": i}


@wp.workflow(name="otel-bench", version=1)
def many(ctx: wp.Context, n: int) -> int:
    for i in range(n):
        ctx.run(bench_step, i)
    return n


def child(mode: str, url: str, steps: int) -> None:
    """One measurement, in this (fresh) interpreter; prints JSON."""
    if mode == "absent":  # wf_persist imports OpenTelemetry on first use, not before
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    if mode in ("traces", "traces+metrics"):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(Drop()))
        meter_provider = None
        if mode == "traces+metrics":
            meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        telemetry.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    with wp.Runtime(url, auto_migrate=True) as rt:
        rt.register(many)
        client = rt.client()
        client.result(client.start(many, 10).execution_id, timeout=60)  # warm up
        cpu, wall = time.process_time(), time.perf_counter()
        client.result(client.start(many, steps).execution_id, timeout=600).unwrap()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(json.dumps({"steps_s": steps / wall, "cpu_us": cpu / steps * 1e6}))


def measure(mode: str, url: str, steps: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--url", url, "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--url")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.url, args.steps)
        return 0
    admin = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.backend == "sqlite":
            url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        else:
            from sqlalchemy import create_engine, text
            from sqlalchemy.engine import make_url

            admin_url = os.environ.get(PG_URL_ENV, DEFAULT_PG_ADMIN_URL)
            admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)"))
                conn.execute(text(f"CREATE DATABASE {SCRATCH_DB}"))
            url = make_url(admin_url).set(database=SCRATCH_DB).render_as_string(False)
            from wf_persist import migrate

            migrate.upgrade(url)
        results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        try:
            for rep in range(args.reps):
                order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
                for mode in order:
                    results[mode].append(measure(mode, url, args.steps))
        finally:
            if admin is not None:
                from sqlalchemy import text

                with admin.connect() as conn:
                    conn.execute(text(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)"))
                admin.dispose()
    print(f"{args.backend}: one {args.steps:,}-step workflow, medians of {args.reps}")
    print("| mode | steps/s | range | CPU µs/step | range |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        rates = [r["steps_s"] for r in results[mode]]
        cpus = [r["cpu_us"] for r in results[mode]]
        print(
            f"| {mode} | {statistics.median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
            f"| {statistics.median(cpus):,.0f} | {min(cpus):,.0f}-{max(cpus):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
