"""OpenTelemetry spans and metrics of drives and step attempts (see :mod:`.telemetry`).

A drive of a run, in whichever worker, is a ``wf.drive`` span continuing the trace its
start stored with the run; each step attempt is a child of its drive's span. Every hook
here costs one check when telemetry is off.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from .telemetry import (
    RUN,
    STATE,
    Instruments,
    current_instruments,
    current_tracer,
    quietly,
    record_error,
    set_error,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from .backends import Claim
    from .events import NewEvent

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
        api = STATE.api
        assert api is not None
        claim = self._claim
        run = {
            "wf.execution.id": claim.execution_id,
            "wf.workflow.name": claim.workflow_name,
            "wf.workflow.version": claim.workflow_version,
        }
        context = (
            quietly("read a stored trace context", api.propagator.extract, parent)
            if parent
            else None
        ) or api.context.Context()
        attributes: dict[str, Any] = {
            **run,
            "wf.claim.epoch": claim.epoch,
            "wf.takeover": takeover,
            "wf.drive.outcome": "stopped",
        }
        span = quietly(
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
            quietly("add a span event", span.add_event, "wf.takeover")
        self._span = span
        token = quietly("attach a span", api.context.attach, api.trace.set_span_in_context(span))
        self._tokens = (token, RUN.set(run))

    def finished(self, outcome: tuple[bool, Any] | None) -> None:
        """The run finished in this drive (``(ok, stored value)``), or not (``None``)."""
        if outcome is None or self._span is None:
            return
        ok, value = outcome
        span = self._span
        quietly("set an attribute", span.set_attribute, "wf.drive.outcome", _ENDED[ok])
        if not ok:
            doc = value if isinstance(value, Mapping) else {}
            quietly("set a status", set_error, span, f"{doc.get('name')}: {doc.get('message')}")

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self._span is None:
            self.open(None, False)
        span = self._span
        assert span is not None
        if exc is not None:  # an interruption (a shutdown): its chain may hold a step's
            # error, with a secret the drive resolved: its type only.
            quietly("set a status", set_error, span, type(exc).__name__)
        if self._tokens is not None:
            token, run = self._tokens
            RUN.reset(run)
            if token is not None:
                quietly("detach a span", STATE.api.context.detach, token)  # type: ignore[union-attr]
        quietly("end a span", span.end)


_ENDED: Final = {True: "completed", False: "failed"}


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
        found = current_instruments()
        if found is not None:
            waited = max(0.0, (claim.db_now - claim.created_at).total_seconds())
            attributes = {"wf.workflow.name": claim.workflow_name}
            quietly("record a metric", found.claim_latency.record, waited, attributes)
    tracer = current_tracer()
    return NO_DRIVE if tracer is None else DriveTrace(tracer, claim)


def drive_outcome(
    outcome: str, exc: BaseException | None = None, redact: Callable[[str], Any] | None = None
) -> None:
    """How the current drive ended when it did not finish the run (``suspended``,
    ``lease_lost``, ``handed_over``, ``drive_failed``: then ``exc`` is why, its text passed
    through ``redact``)."""
    if current_tracer() is None:
        return
    span = STATE.api.trace.get_current_span()  # type: ignore[union-attr]
    quietly("set an attribute", span.set_attribute, "wf.drive.outcome", outcome)
    if exc is not None:
        record_error(span, exc, type(exc).__name__, redact)


def took_over(workflow: str) -> None:
    found = current_instruments()
    if found is not None:
        quietly("count a metric", found.takeovers.add, 1, {"wf.workflow.name": workflow})


def parked(evs: Sequence[NewEvent], wake_at: Any) -> None:
    """The run parks: an event on the drive's span saying for what and until when."""
    if current_tracer() is None:
        return
    types = {e.type for e in evs}
    reason = next(
        (r for t, r in _PARK_REASONS if t in types),
        "retry" if not evs else "wait",
    )
    attributes: dict[str, Any] = {"wf.park.reason": reason}
    if wake_at is not None:
        attributes["wf.wake_at"] = wake_at.isoformat()
    span = STATE.api.trace.get_current_span()  # type: ignore[union-attr]
    quietly("add a span event", span.add_event, "wf.park", attributes)
    quietly("set an attribute", span.set_attribute, "wf.drive.outcome", "suspended")


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
            api = STATE.api
            assert api is not None
            self._span = quietly(
                "start a span", tracer.start_span, "wf.step", attributes=attributes
            )
            if self._span is not None:
                in_context = api.trace.set_span_in_context(self._span)
                self._token = quietly("attach a span", api.context.attach, in_context)
        self._t0 = time.perf_counter()

    def end(
        self,
        outcome: str,
        exc: BaseException | None = None,
        redact: Callable[[str], Any] | None = None,
    ) -> None:
        """``completed``, ``retrying`` (failed, tried again), ``failed`` (not retried) or
        ``interrupted`` (the drive stopped); ``exc``'s text passed through ``redact`` (the
        drive's secrets)."""
        elapsed = time.perf_counter() - self._t0
        span = self._span
        if span is not None:
            quietly("set an attribute", span.set_attribute, "wf.step.outcome", outcome)
            if exc is not None:
                record_error(span, exc, type(exc).__name__, redact)
            if self._token is not None:
                quietly("detach a span", STATE.api.context.detach, self._token)  # type: ignore[union-attr]
            quietly("end a span", span.end)
        if self._instruments is not None:
            self._metric["wf.step.outcome"] = outcome
            quietly(
                "record a metric", self._instruments.step_duration.record, elapsed, self._metric
            )


def step_attempt(
    execution_id: str, workflow: str, activity: str, step: str, attempt: int
) -> StepTrace | None:
    """The trace of an attempt about to run (``None`` while tracing and metrics are off)."""
    tracer = current_tracer()
    found = current_instruments()
    if tracer is None and found is None:
        return None
    attributes: dict[str, Any] = {
        **(RUN.get() or {}),
        "wf.execution.id": execution_id,
        "wf.workflow.name": workflow,
        "wf.activity": activity,
        "wf.step.name": step,
        "wf.step.attempt": attempt,
    }
    return StepTrace(tracer, found, attributes)
