"""OpenTelemetry: a run's spans continue its starter's trace across processes, metrics
count runs and steps, and with telemetry off nothing is recorded or stored."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import wf_persist as wp
from wf_persist import telemetry, telemetry_sdk

from .fixtures import traced as tf
from .helpers import Processes, wait_status


class Recorded:
    """What wf_persist recorded through the providers a test gave it."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        found = self.exporter.get_finished_spans()
        return [s for s in found if name is None or s.name == name]

    def metrics(self) -> dict[str, list[Any]]:
        """Data points by metric name."""
        points: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    points.setdefault(metric.name, []).extend(metric.data.data_points)
        return points


@pytest.fixture
def otel() -> Iterator[Recorded]:
    recorded = Recorded()
    telemetry.instrument(
        tracer_provider=recorded.tracer_provider, meter_provider=recorded.meter_provider
    )
    try:
        yield recorded
    finally:
        telemetry.instrument()
        recorded.meter_provider.shutdown()


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def test_a_worker_process_continues_the_starters_trace(
    runtime: wp.Runtime, otel: Recorded, procs: Processes, db_url: str, tmp_path: Path
) -> None:
    runtime.register(*tf.ALL)
    client = runtime.client()  # no worker here: the run waits for the worker process
    caller = otel.tracer_provider.get_tracer("test")
    with caller.start_as_current_span("POST /orders") as request:
        handle = client.start(tf.traced, 1)
    out = tmp_path / "spans.json"
    worker = procs.python("-m", "tests.fixtures.traced", db_url, str(out), handle.execution_id)
    wait_status(client, handle.execution_id, "suspended")
    with caller.start_as_current_span("POST /approve"):
        assert client.signal(handle.execution_id, "go", 5) == "delivered"
    procs.finish(worker)
    assert client.result(handle.execution_id, timeout=10).unwrap() == 7

    trace_id = _hex(request.get_span_context().trace_id, 32)
    (start,) = otel.spans("wf.start")
    assert start.parent is not None and start.parent.span_id == request.get_span_context().span_id
    assert dict(start.attributes or {}) == {
        "wf.execution.id": handle.execution_id,
        "wf.workflow.name": "traced",
        "wf.workflow.version": 1,
    }
    (signalled,) = otel.spans("wf.signal")
    assert (signalled.attributes or {})["wf.signal.outcome"] == "delivered"

    spans = json.loads(out.read_text())
    drives = [s for s in spans if s["name"] == "wf.drive"]
    steps = [s for s in spans if s["name"] == "wf.step"]
    assert [d["attributes"]["wf.drive.outcome"] for d in drives] == ["suspended", "completed"]
    for d in drives:  # in another process, each drive is a child of the start
        assert d["trace_id"] == trace_id
        assert d["parent_id"] == _hex(start.context.span_id, 16)
        assert d["attributes"]["wf.execution.id"] == handle.execution_id
        assert d["attributes"]["wf.workflow.version"] == 1
    assert drives[0]["events"] == ["wf.park"]
    assert [s["attributes"]["wf.activity"] for s in steps] == ["add#1", "add#2"]
    for step, d in zip(steps, drives, strict=True):
        assert step["trace_id"] == trace_id
        assert step["parent_id"] == d["span_id"]
        assert step["attributes"]["wf.step.attempt"] == 1
        assert step["attributes"]["wf.step.outcome"] == "completed"
        assert step["attributes"]["wf.workflow.name"] == "traced"


def test_a_child_runs_trace_continues_its_parents_drive(
    runtime: wp.Runtime, otel: Recorded
) -> None:
    tf.FLAKY["failures"] = 1
    runtime.register(*tf.ALL)
    runtime.start_worker(concurrency=2)
    client = runtime.client()
    handle = client.start(tf.traced_parent, 1)
    assert client.result(handle.execution_id, timeout=30).unwrap() == 11

    (start,) = otel.spans("wf.start")
    drives = otel.spans("wf.drive")
    by_run: dict[str, list[ReadableSpan]] = {}
    for d in drives:
        by_run.setdefault(str((d.attributes or {})["wf.execution.id"]), []).append(d)
    parent_drives = by_run.pop(handle.execution_id)
    ((child_id, child_drives),) = by_run.items()
    assert all(d.parent is not None for d in drives)
    assert {d.parent.span_id for d in parent_drives if d.parent} == {start.context.span_id}
    assert {d.parent.span_id for d in child_drives if d.parent} <= {
        d.context.span_id for d in parent_drives
    }
    assert {d.context.trace_id for d in drives} == {start.context.trace_id}

    attempts = [s for s in otel.spans("wf.step") if (s.attributes or {})["wf.step.name"] == "flaky"]
    attrs = [dict(s.attributes or {}) for s in attempts]
    outcomes = [(a["wf.step.attempt"], a["wf.step.outcome"]) for a in attrs]
    assert outcomes == [(1, "retrying"), (2, "completed")]
    assert attempts[0].status.status_code.name == "ERROR"
    assert [e.name for e in attempts[0].events] == ["exception"]

    points = otel.metrics()
    started = {p.attributes["wf.workflow.name"]: p.value for p in points["wf.runs.started"]}
    assert started == {"traced-parent": 1, "traced-child": 1}
    completed = {p.attributes["wf.workflow.name"]: p.value for p in points["wf.runs.completed"]}
    assert completed == {"traced-parent": 1, "traced-child": 1}
    durations = {
        (p.attributes["wf.step.name"], p.attributes["wf.step.outcome"]): p.count
        for p in points["wf.step.duration"]
    }
    assert durations == {
        ("flaky", "retrying"): 1,
        ("flaky", "completed"): 1,
        ("add", "completed"): 1,
    }
    assert sum(p.count for p in points["wf.claim.latency"]) == 2
    assert "wf.runs.due" in points
    assert child_id


def test_a_failed_run_and_a_takeover(
    make_runtime: Callable[..., wp.Runtime], otel: Recorded
) -> None:
    first = make_runtime()
    first.register(*tf.ALL)
    handle = first.client().start(tf.traced_parent, 2)
    # Handed over at its first step boundary: due again, left in flight.
    assert first.drive_for_outcome(handle.execution_id, until=0.0) is None
    second = make_runtime()
    second.register(*tf.ALL)
    tf.FLAKY["failures"] = 5
    assert second.drive(handle.execution_id)
    outcome = second.client().result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)

    handed, took = otel.spans("wf.drive")
    assert (handed.attributes or {})["wf.drive.outcome"] == "handed_over"
    assert (took.attributes or {})["wf.takeover"] is True
    assert [e.name for e in took.events] == ["wf.takeover"]
    assert (took.attributes or {})["wf.drive.outcome"] == "failed"
    assert took.status.status_code.name == "ERROR"
    points = otel.metrics()
    assert [p.value for p in points["wf.lease.takeovers"]] == [1]
    assert [p.value for p in points["wf.runs.failed"]] == [1]


def test_due_backlog_gauge_counts_runs_due(runtime: wp.Runtime, otel: Recorded) -> None:
    runtime.register(*tf.ALL)
    client = runtime.client()
    for n in range(3):
        client.start(tf.traced, n)
    telemetry.watch_backlog(runtime)
    (point,) = otel.metrics()["wf.runs.due"]
    assert point.value == 3


def test_off_records_nothing_and_stores_nothing(
    runtime: wp.Runtime, procs: Processes, db_url: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    caller = provider.get_tracer("test")
    runtime.register(*tf.ALL)
    runtime.start_worker()
    client = runtime.client()
    with caller.start_as_current_span("request"):  # the application traces; we are off
        handle = client.start(tf.traced, 1)
        wait_status(client, handle.execution_id, "suspended")
        client.signal(handle.execution_id, "go", 1)
    assert client.result(handle.execution_id, timeout=10).unwrap() == 3
    assert "trace" not in client.history(handle.execution_id)[0].event
    assert [s.name for s in exporter.get_finished_spans()] == ["request"]


def test_without_opentelemetry_installed(procs: Processes, db_url: str) -> None:
    """The extra absent: a run starts, drives and finishes; no ``trace`` is stored."""
    script = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import wf_persist as wp\n"
        "from tests.fixtures import traced as tf\n"
        f"rt = wp.Runtime({db_url!r})\n"
        "rt.register(*tf.ALL)\n"
        "c = rt.client()\n"
        "h = c.start(tf.traced_child, 1)\n"
        "assert c.result(h.execution_id, timeout=30).unwrap() == 11\n"
        "assert 'trace' not in c.history(h.execution_id)[0].event\n"
        "assert 'opentelemetry.trace' not in sys.modules\n"
        "rt.close()\n"
    )
    procs.run([sys.executable, "-c", script])


@pytest.mark.parametrize(
    ("env", "traces", "metrics"),
    [
        ({}, [], []),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"], []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"], ["otlp"]),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"},
            ["otlp"],
            [],
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, [], []),
    ],
)
def test_the_environment_decides(
    env: dict[str, str], traces: list[str], metrics: list[str]
) -> None:
    assert telemetry_sdk.wanted(env, "TRACES") == traces
    assert telemetry_sdk.wanted(env, "METRICS") == metrics


def test_the_standard_variables_turn_it_on(procs: Processes, db_url: str) -> None:
    """``OTEL_TRACES_EXPORTER=console``: the first runtime installs the SDK; its spans
    print to stderr when the process exits."""
    script = (
        "import wf_persist as wp\n"
        "from tests.fixtures import traced as tf\n"
        f"rt = wp.Runtime({db_url!r})\n"
        "rt.register(*tf.ALL)\n"
        "c = rt.client()\n"
        "h = c.start(tf.traced_child, 1)\n"
        "assert c.result(h.execution_id, timeout=30).unwrap() == 11\n"
        "assert 'traceparent' in c.history(h.execution_id)[0].event['trace']\n"
        "rt.close()\n"
    )
    done = procs.run(
        [sys.executable, "-c", script],
        env={"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "wf-test"},
    )
    names = {json.loads(s)["name"] for s in _console_spans(done.stderr)}  # not stdout
    assert names == {"wf.start", "wf.drive", "wf.step"}
    assert '"service.name": "wf-test"' in done.stderr and done.stdout == ""


def _console_spans(out: str) -> list[str]:
    """The JSON documents the console exporter printed, one per span."""
    found, depth, begun = [], 0, 0
    for i, ch in enumerate(out):
        if ch == "{":
            begun = i if depth == 0 else begun
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                found.append(out[begun : i + 1])
    return found


@wp.workflow(name="metered_sleeper", version=1)
def metered_sleeper(ctx: wp.Context) -> int:
    ctx.sleep(3600)
    return 1


@wp.workflow(name="metered_parent", version=1)
def metered_parent(ctx: wp.Context) -> int:
    return ctx.run_child(metered_sleeper)


def test_runs_a_cancel_ends_are_counted_failed_once(runtime: wp.Runtime, otel: Recorded) -> None:
    """A cancel without compensation ends the run (and its children) with no drive, and
    nothing counted them: started minus completed minus failed crept up."""
    runtime.register(metered_sleeper, metered_parent)
    client = runtime.client()
    parent = client.start(metered_parent).execution_id
    alone = client.start(metered_sleeper).execution_id
    unwound = client.start(metered_sleeper).execution_id
    for run in (parent, alone, unwound):
        assert runtime.drive(run)
    child = next(
        r.execution_id
        for r in client.list("metered_sleeper").items
        if r.execution_id not in (alone, unwound)
    )
    assert runtime.drive(child)
    client.cancel(parent, compensate=False)  # the parent and its child
    client.cancel(alone, compensate=False)
    client.cancel(unwound, compensate=True)  # ended by the drive that unwinds it
    assert runtime.drive(unwound)
    for run in (parent, child, alone, unwound):
        assert client.status(run) == "failed"
    points = otel.metrics()
    assert sum(p.value for p in points["wf.runs.started"]) == 4
    assert sum(p.value for p in points["wf.runs.failed"]) == 4
