"""The OpenTelemetry SDK configured from the standard ``OTEL_*`` variables (the ``otel``
extra), for a process that configures nothing itself, such as ``wf-persist worker``.

Traces are wanted when ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``, or an
OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._TRACES_ENDPOINT``); metrics
likewise (``OTEL_METRICS_EXPORTER``, ``..._METRICS_ENDPOINT``). ``OTEL_SDK_DISABLED=true``
turns both off. A provider the application installed first is left alone: its spans and
metrics then go where it sends them. The exporters themselves read the rest of the standard
variables (endpoint, headers, timeouts; ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("wf_persist.telemetry")

#: Exporters this module knows by name (``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``).
KNOWN = ("otlp", "console")


def wanted(env: Mapping[str, str], signal: str) -> list[str]:
    """The exporters the environment asks for, for ``TRACES`` or ``METRICS``."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get(f"OTEL_{signal}_EXPORTER", "").strip()
    if named:
        return [n.strip() for n in named.split(",") if n.strip() and n.strip() != "none"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
        return ["otlp"]
    return []


def configure_from_environment(env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    traces, metrics = wanted(env, "TRACES"), wanted(env, "METRICS")
    if not traces and not metrics:
        return
    try:
        from opentelemetry import metrics as metrics_api
        from opentelemetry import trace as trace_api
        from opentelemetry.sdk.resources import Resource
    except ImportError:
        log.warning(
            "OTEL_* variables ask for telemetry but the OpenTelemetry SDK is not installed: "
            "pip install 'wf-persist[otel]'"
        )
        return
    attributes: dict[str, Any] = {}
    if "OTEL_SERVICE_NAME" not in env and "service.name" not in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = "wf-persist"
    resource = Resource.create(attributes)
    try:
        if traces and isinstance(trace_api.get_tracer_provider(), trace_api.ProxyTracerProvider):
            trace_api.set_tracer_provider(_tracer_provider(traces, env, resource))
        if metrics and type(metrics_api.get_meter_provider()).__name__ == "_ProxyMeterProvider":
            metrics_api.set_meter_provider(_meter_provider(metrics, env, resource))
    except ImportError as exc:
        log.warning("an OpenTelemetry exporter is not installed (%s): telemetry stays off", exc)
    except (ValueError, TypeError) as exc:  # the SDK's refusal of an OTEL_BSP_* value, say
        log.warning("OpenTelemetry refused its OTEL_* settings (%s): telemetry stays off", exc)


def flush(timeout_millis: int = 5000) -> None:
    """Export what the global providers hold (a process about to end without running its
    exit handlers, which would have: ``wf-persist worker`` past a step that does not end)."""
    try:
        from opentelemetry import metrics as metrics_api
        from opentelemetry import trace as trace_api
    except ImportError:
        return
    for provider in (trace_api.get_tracer_provider(), metrics_api.get_meter_provider()):
        force = getattr(provider, "force_flush", None)
        if force is not None:
            try:
                force(timeout_millis=timeout_millis)
            except Exception:  # an exporter that fails: the process ends regardless
                log.warning("flushing telemetry failed", exc_info=True)


def _protocol(env: Mapping[str, str], signal: str) -> str:
    return (
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()


def _tracer_provider(names: list[str], env: Mapping[str, str], resource: Any) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource)
    for name in names:
        exporter: Any
        if name == "console":
            exporter = ConsoleSpanExporter(out=sys.stderr)  # stdout is a command's output
        elif name == "otlp" and _protocol(env, "TRACES") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpSpanExporter,
            )

            exporter = HttpSpanExporter()
        else:
            log.warning("unknown OTEL_TRACES_EXPORTER %r (known: %s)", name, ", ".join(KNOWN))
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meter_provider(names: list[str], env: Mapping[str, str], resource: Any) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )

    readers: list[MetricReader] = []
    for name in names:
        exporter: Any
        if name == "console":
            exporter = ConsoleMetricExporter(out=sys.stderr)
        elif name == "otlp" and _protocol(env, "METRICS") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter()
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter as HttpMetricExporter,
            )

            exporter = HttpMetricExporter()
        else:
            log.warning("unknown OTEL_METRICS_EXPORTER %r (known: %s)", name, ", ".join(KNOWN))
            continue
        readers.append(PeriodicExportingMetricReader(exporter))
    return MeterProvider(resource=resource, metric_readers=readers)
