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
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from types import ModuleType

    from opentelemetry.metrics import Counter, Histogram, MeterProvider, Observation
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from .backends import Claim
    from .events import NewEvent

log = logging.getLogger("wf_persist.telemetry")

#: The instrumentation scope of every span and metric.
SCOPE: Final = "wf_persist"
#: The key of the stored trace context in ``execution.started``.
TRACE_KEY: Final = "trace"

#: The run a drive's spans belong to (attributes every step span repeats).
_RUN: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
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
        #: Runtimes whose due backlog the gauge reports (their workers run here).
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()


_STATE = _State()


def _api() -> _Api | None:
    api = _STATE.api
    if api is None and not _STATE.absent:
        try:
            api = _STATE.api = _Api()
        except ImportError:
            _STATE.absent = True
    return api


def _tracer() -> Tracer | None:
    """The tracer, or ``None`` while tracing is off (the hot path's one check)."""
    api = _STATE.api if _STATE.api is not None else _api()
    if api is None:
        return None
    provider = _STATE.tracer_provider or api.global_tracer_provider()
    if provider is not _STATE.tracer_of:
        _STATE.tracer = (
            None
            if provider is None or isinstance(provider, api.noop_tracers)
            else provider.get_tracer(SCOPE, _version())
        )
        _STATE.tracer_of = provider
    return _STATE.tracer


def _instruments() -> Instruments | None:
    """The metric instruments, or ``None`` while metrics are off."""
    api = _STATE.api if _STATE.api is not None else _api()
    if api is None:
        return None
    provider = _STATE.meter_provider or api.global_meter_provider()
    if provider is not _STATE.meters_of:
        with _STATE.lock:
            if provider is not _STATE.meters_of:
                _STATE.instruments = (
                    None
                    if provider is None or isinstance(provider, api.noop_meters)
                    else _make_instruments(provider)
                )
                _STATE.meters_of = provider
    return _STATE.instruments


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
    _STATE.tracer_provider = tracer_provider
    _STATE.meter_provider = meter_provider


def configure() -> None:
    """Once per process: install the SDK's providers as the standard ``OTEL_*`` variables
    say, if they ask for telemetry and no provider is installed yet (see
    :mod:`.telemetry_sdk`). Runtimes and clients call it when they open."""
    if _STATE.configured:
        return
    with _STATE.lock:
        if _STATE.configured:
            return
        _STATE.configured = True
    from . import telemetry_sdk

    telemetry_sdk.configure_from_environment()
    named = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")
    api = _api() if any(n in os.environ for n in named) else None
    if api is not None:  # a provider named so loads on the first ask for it
        api.trace.get_tracer_provider()
        api.metrics.get_meter_provider()


# the trace context stored with a run ----------------------------------------------------


def carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers, to store with a run (``None`` while
    tracing is off or no span is current)."""
    if _tracer() is None:
        return None
    api = _STATE.api
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


def _quietly(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
    tracer = _tracer()
    if tracer is None:
        return _NOTHING
    return _operation(tracer, name, dict(attributes))


@contextlib.contextmanager
def _operation(tracer: Tracer, name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
    api = _STATE.api
    assert api is not None
    kind = api.trace.SpanKind.PRODUCER
    span = _quietly("start a span", tracer.start_span, name, kind=kind, attributes=attributes)
    if span is None:
        yield None
        return
    token = _quietly("attach a span", api.context.attach, api.trace.set_span_in_context(span))
    try:
        yield span
    except BaseException as exc:
        _quietly("record an exception", span.record_exception, exc)
        _quietly("set a status", _error, span, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if token is not None:
            api.context.detach(token)
        _quietly("end a span", span.end)


def run_started(workflow: str, version: int) -> None:
    found = _instruments()
    if found is not None:
        found.started.add(1, {"wf.workflow.name": workflow, "wf.workflow.version": version})


def run_ended(workflow: str, version: int, ok: bool) -> None:
    found = _instruments()
    if found is not None:
        counter = found.completed if ok else found.failed
        counter.add(1, {"wf.workflow.name": workflow, "wf.workflow.version": version})


# drives -------------------------------------------------------------------------------


class DriveTrace:
    """One drive's ``wf.drive`` span. It starts once the claim is open (its parent is the
    context stored with the run, read with the history) backdated to the drive's start,
    and is current until the drive ends, so step spans are its children."""

    def __init__(self, tracer: Tracer, claim: Claim) -> None:
        self._tracer = tracer
        self._claim = claim
        self._t0 = time.time_ns()
        self._span: Span | None = None
        self._tokens: tuple[object, contextvars.Token[Mapping[str, Any] | None]] | None = None

    #: Whether the drive should find the run's stored trace context for :meth:`open`.
    wanted = True

    def __enter__(self) -> DriveTrace:
        return self

    def open(self, parent: Mapping[str, str] | None, takeover: bool) -> None:
        api = _STATE.api
        assert api is not None
        claim = self._claim
        run = {
            "wf.execution.id": claim.execution_id,
            "wf.workflow.name": claim.workflow_name,
            "wf.workflow.version": claim.workflow_version,
        }
        context = (
            _quietly("read a stored trace context", api.propagator.extract, parent)
            if parent
            else None
        ) or api.context.Context()
        attributes: dict[str, Any] = {
            **run,
            "wf.claim.epoch": claim.epoch,
            "wf.takeover": takeover,
            "wf.drive.outcome": "stopped",
        }
        span = _quietly(
            "start a span",
            self._tracer.start_span,
            "wf.drive",
            context=context,
            kind=api.trace.SpanKind.CONSUMER,
            attributes=attributes,
            start_time=self._t0,
        )
        if span is None:  # a tracer that raises: this drive goes untraced
            span = api.trace.INVALID_SPAN
        if takeover:
            span.add_event("wf.takeover")
        self._span = span
        token = api.context.attach(api.trace.set_span_in_context(span))
        self._tokens = (token, _RUN.set(run))

    def finished(self, outcome: tuple[bool, Any] | None) -> None:
        """The run finished in this drive (``(ok, stored value)``), or not (``None``)."""
        if outcome is None or self._span is None:
            return
        ok, value = outcome
        self._span.set_attribute("wf.drive.outcome", "completed" if ok else "failed")
        if not ok:
            doc = value if isinstance(value, Mapping) else {}
            _error(self._span, f"{doc.get('name')}: {doc.get('message')}")

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self._span is None:
            self.open(None, False)
        span = self._span
        assert span is not None
        if exc is not None:
            span.record_exception(exc)
            _error(span, type(exc).__name__)
        if self._tokens is not None:
            token, run = self._tokens
            _RUN.reset(run)
            _STATE.api.context.detach(token)  # type: ignore[union-attr]
        _quietly("end a span", span.end)


class NoDrive:
    """A drive while tracing is off."""

    wanted = False

    def __enter__(self) -> NoDrive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def open(self, parent: Mapping[str, str] | None, takeover: bool) -> None:
        return None

    def finished(self, outcome: tuple[bool, Any] | None) -> None:
        return None


NO_DRIVE: Final = NoDrive()


def drive(claim: Claim) -> DriveTrace | NoDrive:
    """The trace of a drive of ``claim`` (and its claim latency, for a first claim)."""
    if claim.epoch == 1:
        found = _instruments()
        if found is not None:
            waited = max(0.0, (claim.db_now - claim.created_at).total_seconds())
            found.claim_latency.record(waited, {"wf.workflow.name": claim.workflow_name})
    tracer = _tracer()
    return NO_DRIVE if tracer is None else DriveTrace(tracer, claim)


def drive_outcome(outcome: str, exc: BaseException | None = None) -> None:
    """How the current drive ended when it did not finish the run (``suspended``,
    ``lease_lost``, ``handed_over``, ``drive_failed``: then ``exc`` is why)."""
    if _tracer() is None:
        return
    span = _STATE.api.trace.get_current_span()  # type: ignore[union-attr]
    span.set_attribute("wf.drive.outcome", outcome)
    if exc is not None:
        span.record_exception(exc)
        _error(span, type(exc).__name__)


def took_over(workflow: str) -> None:
    found = _instruments()
    if found is not None:
        found.takeovers.add(1, {"wf.workflow.name": workflow})


def parked(evs: Sequence[NewEvent], wake_at: Any) -> None:
    """The run parks: an event on the drive's span saying for what and until when."""
    if _tracer() is None:
        return
    types = {e.type for e in evs}
    reason = next(
        (r for t, r in _PARK_REASONS if t in types),
        "retry" if not evs else "wait",
    )
    attributes: dict[str, Any] = {"wf.park.reason": reason}
    if wake_at is not None:
        attributes["wf.wake_at"] = wake_at.isoformat()
    span = _STATE.api.trace.get_current_span()  # type: ignore[union-attr]
    span.add_event("wf.park", attributes)
    span.set_attribute("wf.drive.outcome", "suspended")


_PARK_REASONS: Final = (
    ("sleep.started", "sleep"),
    ("signal.waiting", "signal"),
    ("child.waiting", "child"),
)


# steps ---------------------------------------------------------------------------------


class StepTrace:
    """One step attempt: its ``wf.step`` span (current while the attempt runs, so spans of
    the step's own code are its children) and its duration."""

    __slots__ = ("_instruments", "_metric", "_span", "_t0", "_token")

    def __init__(
        self,
        tracer: Tracer | None,
        instruments: Instruments | None,
        attributes: dict[str, Any],
    ) -> None:
        self._instruments = instruments
        self._metric = {
            "wf.workflow.name": attributes["wf.workflow.name"],
            "wf.step.name": attributes["wf.step.name"],
        }
        self._span: Span | None = None
        self._token: object = None
        if tracer is not None:
            api = _STATE.api
            assert api is not None
            self._span = _quietly(
                "start a span", tracer.start_span, "wf.step", attributes=attributes
            )
            if self._span is not None:
                self._token = api.context.attach(api.trace.set_span_in_context(self._span))
        self._t0 = time.perf_counter()

    def end(self, outcome: str, exc: BaseException | None = None) -> None:
        """``completed``, ``retrying`` (failed, tried again), ``failed`` (not retried) or
        ``interrupted`` (the drive stopped)."""
        elapsed = time.perf_counter() - self._t0
        span = self._span
        if span is not None:
            span.set_attribute("wf.step.outcome", outcome)
            if exc is not None:
                span.record_exception(exc)
                _error(span, type(exc).__name__)
            _STATE.api.context.detach(self._token)  # type: ignore[union-attr]
            _quietly("end a span", span.end)
        if self._instruments is not None:
            self._metric["wf.step.outcome"] = outcome
            _quietly(
                "record a metric", self._instruments.step_duration.record, elapsed, self._metric
            )


def step_attempt(
    execution_id: str, workflow: str, activity: str, step: str, attempt: int
) -> StepTrace | None:
    """The trace of an attempt about to run (``None`` while tracing and metrics are off)."""
    tracer = _tracer()
    found = _instruments()
    if tracer is None and found is None:
        return None
    attributes: dict[str, Any] = {
        **(_RUN.get() or {}),
        "wf.execution.id": execution_id,
        "wf.workflow.name": workflow,
        "wf.activity": activity,
        "wf.step.name": step,
        "wf.step.attempt": attempt,
    }
    return StepTrace(tracer, found, attributes)


# the due backlog ------------------------------------------------------------------------


def watch_backlog(runtime: Any) -> None:
    """Report ``runtime``'s due backlog while metrics are on (its worker runs here)."""
    with _STATE.lock:  # the metric reader's thread copies the set under it
        _STATE.watched.add(runtime)
    _instruments()


def _due_backlog(options: Any) -> Iterable[Observation]:
    """One count per database watched here (the metric reader's thread)."""
    from opentelemetry.metrics import Observation

    seen: dict[str, Callable[[], int]] = {}
    with _STATE.lock:  # a WeakSet is copied one item at a time: not atomic
        watched = list(_STATE.watched)
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


def _error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
