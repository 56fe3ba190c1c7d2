"""OpenTelemetry that misbehaves changes nothing of a run, and spans carry no secret.

- A span whose methods raise (``set_attribute``, ``record_exception``, ``add_event``, ...)
  failed runs whose steps never ran, or stored the tracer's error in place of a step's.
- A meter whose counters raise made ``start()`` raise a bare ``RuntimeError`` for a run it
  had written (a caller would start it again).
- A provider whose ``get_tracer`` or ``get_meter`` raises made every start raise a bare
  error (after writing its run), a worker's drives fail in a busy loop without ever counting
  (the run stuck ``running``), and a worker thread die watching the backlog.
- A provider named in ``OTEL_PYTHON_TRACER_PROVIDER`` that does not load made the first
  runtime of the process raise ``StopIteration``.
- A failed step's span recorded its exception's message and stack trace as they were: a
  resolved secret in the message went to the trace collector, while the database, the
  logs and the run's error held only ``secret:<name>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import opentelemetry.context
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import Span, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import wf_persist as wp
from wf_persist import telemetry

KEY = "sk_live_Q7x9Zr2LmN4pW8vT0123456789"


@wp.step
def add_one(x: int) -> int:
    if x < 0:
        raise ValueError("negative input")
    return x + 1


@wp.workflow(name="otel-faults", version=1)
def faults_wf(ctx: wp.Context, x: int) -> int:
    first = ctx.run(add_one, x)
    ctx.sleep(0.01)  # a park: an event on the drive's span
    return ctx.run(add_one, first)


@wp.step
def use_key(key: str) -> str:
    raise RuntimeError(f"auth failed for key {key}")


@wp.workflow(name="otel-secret", version=1)
def secret_wf(ctx: wp.Context) -> str:
    return ctx.run(use_key, wp.secret("api-key"))


@pytest.fixture(autouse=True)
def _untraced() -> Iterator[None]:
    yield
    telemetry.instrument()


def _spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.instrument(tracer_provider=provider)
    return exporter


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the tracer is down")


def _both_outcomes(runtime: wp.Runtime) -> None:
    """A run that completes and one whose step fails end as they would untraced."""
    runtime.register(faults_wf)
    client = runtime.client()
    ok = client.start(faults_wf, 1).execution_id
    bad = client.start(faults_wf, -1).execution_id
    runtime.start_worker(concurrency=2, poll_interval=0.02)
    assert client.result(ok, timeout=30).unwrap() == 3
    failed = client.result(bad, timeout=30)
    assert isinstance(failed, wp.Failed)
    assert "negative input" in failed.message, failed.message
    assert client.describe(ok).drive_failures == 0


@pytest.mark.parametrize(
    "method",
    ["set_attribute", "set_attributes", "add_event", "record_exception", "set_status"],
)
def test_a_span_whose_methods_raise_changes_nothing(
    runtime: wp.Runtime, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    _spans()
    monkeypatch.setattr(Span, method, _raise)
    _both_outcomes(runtime)


@pytest.mark.parametrize("call", ["attach", "detach"])
def test_a_context_that_raises_changes_nothing(
    runtime: wp.Runtime, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    _spans()
    monkeypatch.setattr(opentelemetry.context, call, _raise)
    _both_outcomes(runtime)


class _RaisingInstrument:
    def add(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the meter is down")

    record = add


class _RaisingMeter:
    def __init__(self, meter: Any) -> None:
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)

    def create_counter(self, *args: Any, **kwargs: Any) -> _RaisingInstrument:
        return _RaisingInstrument()

    def create_histogram(self, *args: Any, **kwargs: Any) -> _RaisingInstrument:
        return _RaisingInstrument()


class _RaisingMeterProvider:
    def __init__(self) -> None:
        self._provider = MeterProvider(metric_readers=[InMemoryMetricReader()])

    def get_meter(self, *args: Any, **kwargs: Any) -> _RaisingMeter:
        return _RaisingMeter(self._provider.get_meter(*args, **kwargs))


def test_a_meter_that_raises_changes_nothing(runtime: wp.Runtime) -> None:
    telemetry.instrument(meter_provider=_RaisingMeterProvider())  # type: ignore[arg-type]
    _both_outcomes(runtime)  # start() returns the run it made; both end as untraced


class _NoTracers(TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer provider broken")


class _NoMeters(MeterProvider):
    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("meter provider broken")


@pytest.mark.parametrize("kind", ["tracer", "meter"])
def test_a_provider_that_cannot_make_a_tracer_or_meter_leaves_telemetry_off(
    runtime: wp.Runtime, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    if kind == "tracer":
        telemetry.instrument(tracer_provider=_NoTracers())
    else:
        telemetry.instrument(meter_provider=_NoMeters())
    _both_outcomes(runtime)  # starts return their runs; the worker drives both to the end
    said = [r for r in caplog.records if "OpenTelemetry failed to make" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # once, not per call


def test_a_named_provider_that_does_not_load_leaves_telemetry_off(
    tmp_path: Path,
) -> None:
    """In a process of its own: which provider the OTel API holds is set once per process."""
    script = (
        "import wf_persist as wp\n"
        f"rt = wp.Runtime('sqlite:///{tmp_path}/named.db')\n"
        "@wp.workflow(name='named', version=1)\n"
        "def named(ctx: wp.Context) -> int:\n"
        "    return 7\n"
        "rt.register(named)\n"
        "print(rt.client().execute(named).unwrap())\n"
        "rt.close()\n"
    )
    program = tmp_path / "named.py"  # a workflow's source is read from its file
    program.write_text(script)
    for disabled in ("true", "false"):
        env = {
            **os.environ,
            "OTEL_PYTHON_TRACER_PROVIDER": "no-such-provider",
            "OTEL_PYTHON_METER_PROVIDER": "no-such-provider",
            "OTEL_SDK_DISABLED": disabled,
        }
        done = subprocess.run(
            [sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "7"
        (tmp_path / "named.db").unlink()


def test_a_failed_steps_span_carries_no_secret(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("API_KEY", KEY)
    exporter = _spans()
    runtime = make_runtime(secret_resolver=wp.env_secret_resolver())
    runtime.register(secret_wf)
    outcome = runtime.client().execute(secret_wf)
    assert isinstance(outcome, wp.Failed)
    assert KEY not in outcome.message and "secret:api-key" in outcome.message
    spans = exporter.get_finished_spans()
    events = [e for s in spans for e in s.events if e.name == "exception"]
    assert events, [s.name for s in spans]
    for event in events:
        attributes = dict(event.attributes or {})
        assert "secret:api-key" in str(attributes["exception.message"])
        assert "secret:api-key" in str(attributes["exception.stacktrace"])
    for span in spans:
        seen = repr(dict(span.attributes or {})) + repr(
            [dict(e.attributes or {}) for e in span.events]
        )
        assert KEY not in seen and KEY[:12] not in seen, span.name
