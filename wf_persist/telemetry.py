"""OpenTelemetry traces and metrics of runs, for an application that asks for them.

Off unless configured: without ``opentelemetry-api``, or with no tracer (meter) provider
given to :func:`instrument` or installed globally, each hook here is one check that returns
at once, and nothing is stored. The standard ``OTEL_*`` variables configure the SDK for a
process that configures nothing itself (:func:`configure`, :mod:`.telemetry_sdk`).

A run's trace crosses processes: ``start()`` stores its span's context (W3C ``traceparent``
and ``tracestate``) in the run's ``execution.started`` event, and each drive of the run, in
whichever worker, is a ``wf.drive`` span continuing it; step attempts are children of their
drive's span. No schema change is needed: the worker reads that event with the history it
loads anyway (a run's first drive reads it on its own, and only while tracing).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from types import ModuleType

    from opentelemetry.metrics import Counter, Histogram, MeterProvider, Observation
    from opentelemetry.trace import Span, Tracer, TracerProvider


log = logging.getLogger("wf_persist.telemetry")

#: The instrumentation scope of every span and metric.
SCOPE: Final = "wf_persist"
#: The key of the stored trace context in ``execution.started``.
TRACE_KEY: Final = "trace"

#: The run a drive's spans belong to (attributes every step span repeats).
RUN: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "wf_run", default=None
)
_NOTHING: Final = contextlib.nullcontext(None)


class _Api:
    """The OpenTelemetry API, imported on first use (never when no hook is reached)."""

    def __init__(self) -> None:
        from opentelemetry import context, metrics, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.context: ModuleType = context
        self.metrics: ModuleType = metrics
        self.trace: ModuleType = trace
        self.propagator = TraceContextTextMapPropagator()
        self.noop_tracers = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        # The installed providers, read where the API keeps them (None: none installed):
        # get_*_provider() looks at the environment on every call, too slow for each step.
        internal: Any = getattr(metrics, "_internal", None)
        self.global_tracer_provider: Callable[[], Any] = (
            (lambda: trace._TRACER_PROVIDER)
            if hasattr(trace, "_TRACER_PROVIDER")
            else trace.get_tracer_provider
        )
        self.global_meter_provider: Callable[[], Any] = (
            (lambda: internal._METER_PROVIDER)
            if hasattr(internal, "_METER_PROVIDER")
            else metrics.get_meter_provider
        )
        # The proxy the API hands out before a provider is installed has no public name.
        proxy = getattr(getattr(metrics, "_internal", None), "_ProxyMeterProvider", None)
        self.noop_meters: tuple[type, ...] = (metrics.NoOpMeterProvider,) + (
            (proxy,) if isinstance(proxy, type) else ()
        )


@dataclass(slots=True)
class Instruments:
    """The metric instruments, made once per meter provider."""

    started: Counter
    completed: Counter
    failed: Counter
    step_duration: Histogram
    claim_latency: Histogram
    takeovers: Counter


class _State:
    """What this process uses: providers given to :func:`instrument` (else the global
    ones), and the tracer and instruments made from them (remade when they change)."""

    def __init__(self) -> None:
        self.api: _Api | None = None
        self.absent = False
        self.tracer_provider: TracerProvider | None = None
        self.meter_provider: MeterProvider | None = None
        self.tracer_of: object = None
        self.tracer: Tracer | None = None
        self.meters_of: object = None
        self.instruments: Instruments | None = None
        self.lock = threading.Lock()
        self.configured = False
        #: Providers that raised when asked for (logged once each).
        self.refused: set[str] = set()
        #: Runtimes whose due backlog the gauge reports (their workers run here).
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()


STATE = _State()


def _api() -> _Api | None:
    api = STATE.api
    if api is None and not STATE.absent:
        try:
            api = STATE.api = _Api()
        except ImportError:
            STATE.absent = True
    return api


def current_tracer() -> Tracer | None:
    """The tracer, or ``None`` while tracing is off (the hot path's one check)."""
    api = STATE.api if STATE.api is not None else _api()
    if api is None:
        return None
    try:
        provider = STATE.tracer_provider or api.global_tracer_provider()
    except Exception as exc:  # a provider named in OTEL_* that does not load, say
        _off_once("tracer provider", exc)
        return None
    if provider is not STATE.tracer_of:
        # A provider whose get_tracer raises leaves tracing off (said once), not every
        # start and drive failing with its error.
        STATE.tracer = (
            None
            if provider is None or isinstance(provider, api.noop_tracers)
            else quietly(
                "make a tracer (tracing stays off)", provider.get_tracer, SCOPE, _version()
            )
        )
        STATE.tracer_of = provider
    return STATE.tracer


def current_instruments() -> Instruments | None:
    """The metric instruments, or ``None`` while metrics are off."""
    api = STATE.api if STATE.api is not None else _api()
    if api is None:
        return None
    try:
        provider = STATE.meter_provider or api.global_meter_provider()
    except Exception as exc:
        _off_once("meter provider", exc)
        return None
    if provider is not STATE.meters_of:
        with STATE.lock:
            if provider is not STATE.meters_of:
                STATE.instruments = (
                    None
                    if provider is None or isinstance(provider, api.noop_meters)
                    else quietly(
                        "make its instruments (metrics stay off)", _make_instruments, provider
                    )
                )
                STATE.meters_of = provider
    return STATE.instruments


def _off_once(what: str, exc: Exception) -> None:
    """Log, once per process and kind, that a provider could not be had (telemetry off)."""
    with STATE.lock:
        if what in STATE.refused:
            return
        STATE.refused.add(what)
    log.warning("OpenTelemetry's %s could not be had (%s): off for wf_persist", what, exc)


def _make_instruments(provider: MeterProvider) -> Instruments:
    meter = provider.get_meter(SCOPE, _version())
    meter.create_observable_gauge(
        "wf.runs.due",
        callbacks=[_due_backlog],
        unit="{run}",
        description="Runs due now and not claimed (one index read per collection)",
    )
    return Instruments(
        started=meter.create_counter("wf.runs.started", "{run}", "Runs started"),
        completed=meter.create_counter("wf.runs.completed", "{run}", "Runs that completed"),
        failed=meter.create_counter("wf.runs.failed", "{run}", "Runs that failed"),
        step_duration=meter.create_histogram(
            "wf.step.duration", "s", "Duration of one step attempt"
        ),
        claim_latency=meter.create_histogram(
            "wf.claim.latency", "s", "From a run's creation to its first claim"
        ),
        takeovers=meter.create_counter(
            "wf.lease.takeovers",
            "{run}",
            "Runs resumed after their previous driver stopped mid-drive",
        ),
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wf-persist")
    except PackageNotFoundError:
        return "0"


# configuration -----------------------------------------------------------------------


def instrument(
    *, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
) -> None:
    """Use these providers for wf_persist's spans and metrics instead of the global ones
    (``None`` for either: the global one, as when this is never called)."""
    STATE.tracer_provider = tracer_provider
    STATE.meter_provider = meter_provider


def configure() -> None:
    """Once per process: install the SDK's providers as the standard ``OTEL_*`` variables
    say, if they ask for telemetry and no provider is installed yet (see
    :mod:`.telemetry_sdk`). Runtimes and clients call it when they open."""
    if STATE.configured:
        return
    with STATE.lock:
        if STATE.configured:
            return
        STATE.configured = True
    from . import telemetry_sdk

    telemetry_sdk.configure_from_environment()
    named = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")
    api = _api() if any(n in os.environ for n in named) else None
    if api is not None:  # a provider named so loads on the first ask for it
        # A name that does not load is a refused setting: telemetry off, not a failure.
        quietly("load OTEL_PYTHON_TRACER_PROVIDER", api.trace.get_tracer_provider)
        quietly("load OTEL_PYTHON_METER_PROVIDER", api.metrics.get_meter_provider)


# the trace context stored with a run ----------------------------------------------------


def carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers, to store with a run (``None`` while
    tracing is off or no span is current)."""
    if current_tracer() is None:
        return None
    api = STATE.api
    assert api is not None
    if not api.trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    api.propagator.inject(headers)
    return headers or None


#: The W3C headers a stored trace context may hold, and the longest value of each kept.
_TRACE_HEADERS: Final = {"traceparent": 512, "tracestate": 8192}


def stored_trace(started: Mapping[str, Any]) -> Mapping[str, str] | None:
    """The trace context an ``execution.started`` event carries: its W3C headers that are
    text of a sane length (anyone may write that event: a wrong type or a huge value is
    ignored, never a reason for a drive to fail)."""
    found = started.get(TRACE_KEY)
    if not isinstance(found, Mapping):
        return None
    kept = {
        key: value
        for key, most in _TRACE_HEADERS.items()
        if isinstance(value := found.get(key), str) and len(value) <= most
    }
    return kept if "traceparent" in kept else None


def quietly(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, a call into the tracer: whatever it raises is logged, never the run's
    or the caller's failure (``None`` then)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        log.warning("OpenTelemetry failed to %s (ignored): %s", what, exc, exc_info=True)
        return None


# spans of clients ---------------------------------------------------------------------


def operation(name: str, attributes: Mapping[str, Any]) -> AbstractContextManager[Span | None]:
    """A client operation's span (``wf.start``, ``wf.signal``), current while it lasts;
    an exception ends it with an error status. A tracer that raises changes nothing of the
    operation (a start it made is not reported as failed)."""
    tracer = current_tracer()
    if tracer is None:
        return _NOTHING
    return _operation(tracer, name, dict(attributes))


@contextlib.contextmanager
def _operation(tracer: Tracer, name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
    api = STATE.api
    assert api is not None
    kind = api.trace.SpanKind.PRODUCER
    span = quietly("start a span", tracer.start_span, name, kind=kind, attributes=attributes)
    if span is None:
        yield None
        return
    token = quietly("attach a span", api.context.attach, api.trace.set_span_in_context(span))
    try:
        yield span
    except BaseException as exc:
        record_error(span, exc, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if token is not None:
            quietly("detach a span", api.context.detach, token)
        quietly("end a span", span.end)


def run_started(workflow: str, version: int) -> None:
    found = current_instruments()
    if found is not None:
        attributes = {"wf.workflow.name": workflow, "wf.workflow.version": version}
        quietly("count a metric", found.started.add, 1, attributes)


def run_ended(workflow: str, version: int, ok: bool) -> None:
    found = current_instruments()
    if found is not None:
        counter = found.completed if ok else found.failed
        attributes = {"wf.workflow.name": workflow, "wf.workflow.version": version}
        quietly("count a metric", counter.add, 1, attributes)


# the due backlog ------------------------------------------------------------------------


def watch_backlog(runtime: Any) -> None:
    """Report ``runtime``'s due backlog while metrics are on (its worker runs here)."""
    with STATE.lock:  # the metric reader's thread copies the set under it
        STATE.watched.add(runtime)
    current_instruments()


def _due_backlog(options: Any) -> Iterable[Observation]:
    """One count per database watched here (the metric reader's thread)."""
    from opentelemetry.metrics import Observation

    seen: dict[str, Callable[[], int]] = {}
    with STATE.lock:  # a WeakSet is copied one item at a time: not atomic
        watched = list(STATE.watched)
    for runtime in watched:
        if runtime.closing:
            continue
        url = runtime.engine.url
        seen.setdefault(f"{url.get_backend_name()}/{url.database}", runtime.due_backlog)
    found = []
    for database, count in seen.items():
        try:
            found.append(Observation(count(), {"wf.database": database}))
        except Exception as exc:  # an outage: no figure this time
            log.debug("counting due runs failed: %s", exc)
    return found


def record_error(
    span: Span, exc: BaseException, description: str, redact: Callable[[str], Any] | None = None
) -> None:
    """Record ``exc`` on ``span`` and mark the span failed, quietly. ``redact``: a drive's
    secrets, scrubbed from the message and the stack trace as from what the drive stores
    (spans leave the process for a collector)."""
    quietly("record an exception", _record, span, exc, redact)
    quietly("set a status", set_error, span, description)


def _record(span: Span, exc: BaseException, redact: Callable[[str], Any] | None) -> None:
    from .error_documents import traceback_text

    attributes = None
    if redact is not None:
        try:
            message = str(exc)
        except Exception:  # a __str__ that raises
            message = type(exc).__name__
        attributes = {"exception.message": str(redact(message))}
        stack = traceback_text(exc, lambda text: str(redact(text)))
        if stack is not None:
            attributes["exception.stacktrace"] = stack
    span.record_exception(exc, attributes)


def set_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
