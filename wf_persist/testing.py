"""A test kit for people who write workflows: the real engine on a private SQLite file.

:class:`TestRuntime` is a :class:`~wf_persist.Runtime` (same store, same replay, same
history; no fake store) on a temporary SQLite database whose clock is virtual: with time
skipping (the default) a durable sleep, a parked retry or a signal timeout completes as
soon as nothing else can happen, and :meth:`TestRuntime.advance` moves time on by hand.
Steps can be stood in for (:meth:`~TestRuntime.mock_step`), made to fail once
(:meth:`~TestRuntime.fail_step_once`), secrets set (:meth:`~TestRuntime.set_secret`), and
every run replayed against the current code (:meth:`~TestRuntime.replay`,
:func:`check_replay`). The pytest plugin (registered by the package) provides the fixture
``wf_runtime``.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import select

from . import backends
from .authoring import Step, Workflow
from .awaiting import _AGAIN, _WAIT
from .backends.clock import db_now, use_virtual_clock
from .client import Outcome
from .control import raisable
from .embedded import WorkflowClient
from .error_documents import shown
from .errors import InvalidArgumentError, WfPersistError
from .gate import without_cataloging
from .records import ExecutionHandle, HistoryRecord
from .replaycheck import ReplayReport, check_replay
from .runtime import Runtime, utc_now
from .secrets import SecretError
from .timeouts import MAX_DURATION_SECONDS, duration_seconds

__all__ = [
    "ReplayReport",
    "RunBlockedError",
    "TestClient",
    "TestRuntime",
    "check_replay",
    "without_cataloging",
]

#: How far the virtual clock may move ahead in all (a datetime ends at year 9999).
_MAX_SHIFT = 4 * MAX_DURATION_SECONDS
#: Long enough that skipping time never expires a lease of the test runtime itself.
_TEST_LEASE_TTL = 10 * 365 * 24 * 3600.0


class RunBlockedError(WfPersistError):
    """The run waits for a signal, or for a child run that waits for one, and nothing else
    can happen (time skipping is on, no timer is due later): send the signal, or give the
    wait a timeout. ``signals`` are the run's own waits (none: a child's)."""

    def __init__(self, execution_id: str, signals: Sequence[str]) -> None:
        self.execution_id = execution_id
        self.signals = list(signals)
        if self.signals:
            waiting = f"waits for signal(s) {', '.join(self.signals)}"
        else:  # its children wait (for a signal, or a workflow this runtime lacks)
            waiting = "waits for child runs that cannot go on"
        super().__init__(f"Execution {execution_id} {waiting} and no timer is due")


class TestClient(WorkflowClient):
    """The embedded client of a :class:`TestRuntime`: ``result`` drives the run in the
    calling thread and skips time whenever the run only waits for a timer."""

    __test__ = False  # not a test class, whatever pytest's name rules say
    runtime: TestRuntime

    def _try_drive(self, row: Any, deadline: float | None) -> Outcome | bool:
        got = super()._try_drive(row, deadline)
        rt = self.runtime
        if got is not _WAIT or not rt.time_skipping:
            return got
        with rt._lock:
            if rt._driving:  # something else can still happen
                return got
        seconds = rt.seconds_to_next_wake()
        if seconds is None:
            raise RunBlockedError(row.id, [p.name for p in self.pending_signals(row.id)])
        if seconds > 0:
            rt.advance(seconds + 0.001)
        else:  # due already (its timer fell due just now, or a run this wait does not drive)
            time.sleep(0.002)
        return _AGAIN

    def result(self, execution_id: str, timeout: float | None = None) -> Outcome:
        outcome = super().result(execution_id, timeout)
        self.runtime._collect(execution_id)
        return outcome

    def execute(self, *args: Any, **kwargs: Any) -> Outcome:
        outcome = super().execute(*args, **kwargs)
        self.runtime._collect(outcome.execution_id)
        return outcome


class TestRuntime(Runtime):
    """A runtime on a private, temporary SQLite database with a virtual clock.

    Args:
        workflows: registered at once.
        time_skipping: durable sleeps, parked retries, in-thread retry backoffs and signal
            timeouts complete as soon as nothing else can happen (``False``: they take
            real time, unless :meth:`advance` moves the clock).
        secrets: values for ``secret:<name>`` references (see :meth:`set_secret`).
    """

    __test__ = False

    def __init__(
        self,
        *workflows: Workflow[Any, Any],
        time_skipping: bool = True,
        secrets: Mapping[str, str] | None = None,
    ) -> None:
        self._shift = 0.0
        self.time_skipping = time_skipping
        self._secrets = dict(secrets or {})
        self._compensation_logs: list[list[dict[str, Any]]] = []
        self._collected: set[str] = set()
        engine = backends.create_engine("sqlite://")  # a private temporary file
        try:
            use_virtual_clock(engine, self.time_shift)
            super().__init__(
                engine,
                auto_migrate=True,
                lease_ttl=_TEST_LEASE_TTL,
                poll_interval=0.01,
                secret_resolver=self._resolve_secret,
                # What a start records (created_at, a timeout's deadline) by the virtual
                # clock too: a deadline counted from the wall clock would already have
                # passed once time was skipped.
                clock=self._virtual_now,
            )
        except BaseException:
            backends.dispose_engine(engine)
            raise
        self._test_engine = engine
        if workflows:
            self.register(*workflows)

    # time -------------------------------------------------------------------------------

    def time_shift(self) -> float:
        return self._shift

    def _virtual_now(self) -> dt.datetime:
        return utc_now() + dt.timedelta(seconds=self._shift)

    def pause(self, seconds: float) -> None:
        if self.time_skipping:
            self.advance(seconds)
        else:
            time.sleep(seconds)

    def advance(self, duration: dt.timedelta | float) -> None:
        """Move the database's clock ahead by ``duration``: timers that fall due wake their
        runs (driven by the next :meth:`result`, or a worker)."""
        self._check_open()
        seconds = duration_seconds(duration, "advance")
        with self._lock:
            if self._shift + seconds > _MAX_SHIFT:
                # Dates a run records (a timer, a deadline 1000 years on) must stay in range.
                raise InvalidArgumentError(
                    f"the virtual clock moves at most {_MAX_SHIFT:.0f} seconds (4000 years) "
                    f"ahead in all; it is {self._shift:.0f} ahead, advance({duration!r}) is more"
                )
            self._shift += seconds
        self._notify()

    def now(self) -> dt.datetime:
        """The database's (virtual) current time."""
        self._check_open()
        with self.backend.read() as conn:
            value: dt.datetime = conn.execute(select(db_now())).scalar_one()
        return value

    # steps and secrets ------------------------------------------------------------------

    def mock_step(self, step: Step[Any], fn: Callable[..., Any]) -> None:
        """Call ``fn`` (same arguments) instead of ``step``'s function from now on; its
        exceptions follow the step's retry and ``errors=`` rules, as the real one's would."""
        self._check_open()
        if not isinstance(step, Step) or not callable(fn):
            raise InvalidArgumentError("mock_step takes a @wp.step and a callable")
        self.step_overrides[step] = fn

    def unmock_step(self, step: Step[Any]) -> None:
        self.step_overrides.pop(step, None)

    def fail_step_once(
        self, step: Step[Any], error: BaseException | type[BaseException] | None = None
    ) -> None:
        """Make the next attempt of ``step`` raise ``error``, an exception or an exception
        class (default: ``RuntimeError("Injected failure for step <name>")``); later
        attempts call the function again."""
        self._check_open()
        if not isinstance(step, Step):
            raise InvalidArgumentError("fail_step_once takes a @wp.step")
        if error is not None and not raisable(error):
            raise InvalidArgumentError(f"fail_step_once takes an exception, got {shown(error)}")
        current = self.step_overrides.get(step, step.fn)
        failed = threading.Event()

        def once(*args: Any, **kwargs: Any) -> Any:
            if not failed.is_set():
                failed.set()
                raise error or RuntimeError(f"Injected failure for step {step.name}")
            return current(*args, **kwargs)

        self.step_overrides[step] = once

    def set_secret(self, name: str, value: str) -> None:
        """The value ``secret(name)`` resolves to inside steps."""
        self._check_open()
        self._secrets[name] = value

    def _resolve_secret(self, name: str) -> str:
        if name not in self._secrets:
            raise SecretError(name, f"Secret {name!r} not set: call set_secret({name!r}, ...)")
        return self._secrets[name]

    # compensations ----------------------------------------------------------------------

    def record_compensations(self) -> list[dict[str, Any]]:
        """A list that collects ``{"execution_id", "step", "result"}`` for each compensation
        started by runs whose :meth:`result` is read from now on, in order."""
        log: list[dict[str, Any]] = []
        self._compensation_logs.append(log)
        return log

    def _collect(self, execution_id: str) -> None:
        if not self._compensation_logs or execution_id in self._collected:
            return
        self._collected.add(execution_id)
        started = [
            {"execution_id": execution_id, "step": e["stepName"], "result": e.get("result")}
            for e in (r.event for r in self.client().history(execution_id))
            if e["type"] == "compensation.started"
        ]
        for log in self._compensation_logs:
            log.extend(started)

    # shortcuts --------------------------------------------------------------------------

    def client(self) -> TestClient:
        return TestClient(self)

    def start(self, workflow: Workflow[Any, Any] | str, payload: Any = None, **kw: Any) -> str:
        """Start a run; its execution id."""
        handle: ExecutionHandle = self.client().start(workflow, payload, **kw)
        return handle.execution_id

    def result(self, execution_id: str, timeout: float | None = 30.0) -> Outcome:
        """Drive the run to its end (skipping time); ``timeout`` is real seconds."""
        return self.client().result(execution_id, timeout)

    def status(self, execution_id: str) -> str:
        return self.client().status(execution_id)

    def history(self, execution_id: str) -> Sequence[HistoryRecord]:
        return self.client().history(execution_id)

    def send_signal(
        self, execution_id: str, name: str, payload: Any, *, actor: str | None = None
    ) -> str:
        """Deliver a signal, or buffer it for the run's next wait on ``name``."""
        return self.client().signal(execution_id, name, payload, actor=actor, buffer=True)

    def cancel(self, execution_id: str, *, compensate: bool = True) -> None:
        self.client().cancel(execution_id, compensate=compensate)

    def replay(self, execution_id: str) -> ReplayReport:
        """Replay the run's history against the current code (see :func:`check_replay`)."""
        reports = check_replay(self, [execution_id])
        if not reports:
            raise InvalidArgumentError(f"no run {execution_id} of a registered version")
        return reports[0]

    def __enter__(self) -> TestRuntime:
        return self

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        backends.dispose_engine(self._test_engine)
