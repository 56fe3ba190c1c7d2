"""Diagnostics: stored tracebacks, and log records that name the run, step and attempt."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any, Literal

import pytest

import wf_persist as wp
from wf_persist import logs
from wf_persist.error_documents import MAX_TRACEBACK, error_document
from wf_persist.logs import JsonFormatter

from .fixtures import fencing as f
from .fixtures import saga as s
from .fixtures import workflows as w


@contextlib.contextmanager
def _configured(fmt: Literal["text", "json"]) -> Iterator[None]:
    """``logs.configure(fmt)`` for one test: the ``wf_persist`` logger is put back after."""
    logs.configure(fmt)
    try:
        yield
    finally:
        root = logging.getLogger("wf_persist")
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.propagate = True
        root.setLevel(logging.NOTSET)


def _records(caplog: pytest.LogCaptureFixture, execution_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "execution_id", None) == execution_id]


def test_a_failed_step_and_run_store_the_traceback(runtime: wp.Runtime) -> None:
    runtime.register(w.explode_wf)
    client = runtime.client()
    handle = client.start(w.explode_wf, "kaboom")
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    trace = outcome.error["traceback"]
    assert trace.startswith("Traceback (most recent call last)")
    assert "in explode" in trace and "RuntimeError: kaboom" in trace
    failed = next(
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.failed"
    )
    assert "RuntimeError: kaboom" in failed["error"]["traceback"]
    assert client.describe(handle.execution_id).error == outcome.error


def test_an_error_never_raised_has_no_traceback_and_long_ones_keep_their_end(
    runtime: wp.Runtime,
) -> None:
    assert "traceback" not in error_document(ValueError("never raised"))

    try:
        raise ValueError("x" * (2 * MAX_TRACEBACK) + " the end")
    except ValueError as exc:
        doc = error_document(exc)
    assert doc["traceback"].startswith("...\n") and len(doc["traceback"]) <= MAX_TRACEBACK + 4
    assert doc["traceback"].rstrip().endswith("x the end")
    runtime.register(w.approval_wf)
    client = runtime.client()
    handle = client.start(w.approval_wf, None)
    client.cancel(handle.execution_id, compensate=False)
    cancelled = client.result(handle.execution_id, timeout=10)
    assert isinstance(cancelled, wp.Failed) and "traceback" not in cancelled.error


def test_failures_are_logged_with_the_run_step_and_attempt(
    runtime: wp.Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    s.reset()
    runtime.register(*s.ALL)
    client = runtime.client()
    caplog.set_level(logging.INFO, logger="wf_persist")
    flaky = client.start(s.flaky_wf).execution_id
    client.result(flaky, timeout=20)
    retried = [r for r in _records(caplog, flaky) if r.name == "wf_persist.steps"]
    assert [(r.levelname, r.step, r.attempt) for r in retried] == [  # type: ignore[attr-defined]
        ("WARNING", "flaky", 1),
        ("WARNING", "flaky", 2),
    ]
    assert all(r.workflow == "flaky" for r in retried)  # type: ignore[attr-defined]
    assert "retried at" in retried[0].getMessage() and flaky in retried[0].getMessage()

    runtime.register(w.explode_wf)
    exploded = client.start(w.explode_wf, "kaboom").execution_id
    assert isinstance(client.result(exploded, timeout=20), wp.Failed)
    mine = _records(caplog, exploded)
    steps = [(r.levelname, r.attempt) for r in mine if r.name == "wf_persist.steps"]  # type: ignore[attr-defined]
    assert steps[-1][0] == "ERROR" and all(level == "WARNING" for level, _ in steps[:-1])
    assert [a for _, a in steps] == list(range(1, len(steps) + 1))
    assert "not retried" in next(r for r in mine if r.levelname == "ERROR").getMessage()
    run_failed = [
        r for r in mine if r.name == "wf_persist.runtime" and " failed: " in r.getMessage()
    ]
    assert [r.levelname for r in run_failed] == ["WARNING"]
    line = json.loads(JsonFormatter().format(run_failed[0]))
    assert line["execution_id"] == exploded and line["workflow"] == "explode"
    assert line["logger"] == "wf_persist.runtime" and line["level"] == "WARNING"


def test_a_run_resumed_after_its_driver_died_is_logged(
    runtime: wp.Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    f.reset()
    runtime.register(*f.ALL)
    client = runtime.client()
    caplog.set_level(logging.INFO, logger="wf_persist")
    crashed = client.start(f.crashes_once_wf, 0.0).execution_id
    with pytest.raises(f.SimulatedCrash):
        client.result(crashed)
    assert not [r for r in _records(caplog, crashed) if "resuming" in r.getMessage()]
    assert client.result(crashed, timeout=10).unwrap() == "done"
    resumed = [r for r in _records(caplog, crashed) if "resuming" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].levelname == "INFO"
    # A run woken by its signal is not "resumed from a dead driver".
    runtime.register(w.two_approvals_wf)
    waiting = client.start(w.two_approvals_wf).execution_id
    for _ in range(2):
        assert runtime.drive(waiting)
        client.signal(waiting, "approval", {"approved": True})
    assert client.result(waiting, timeout=10).unwrap() == [True, True]
    assert not [r for r in _records(caplog, waiting) if "resuming" in r.getMessage()]


def test_the_json_log_format_is_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    with _configured("json"):
        logger = logging.getLogger("wf_persist.steps")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.error("step failed", exc_info=True, extra=logs.run_fields("id-1", "wf", "s", 2))
        line: dict[str, Any] = json.loads(capsys.readouterr().err.strip())
    assert {
        k: line[k]
        for k in ("level", "logger", "message", "execution_id", "workflow", "step", "attempt")
    } == {
        "level": "ERROR",
        "logger": "wf_persist.steps",
        "message": "step failed",
        "execution_id": "id-1",
        "workflow": "wf",
        "step": "s",
        "attempt": 2,
    }
    assert "RuntimeError: boom" in line["exception"] and line["time"].endswith("+00:00")


def test_a_secret_where_the_traceback_is_cut_leaves_no_part_of_it(
    make_runtime: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The traceback is scrubbed before it is cut: a secret straddling the cut would
    otherwise be stored as a fragment the redactor no longer recognises."""
    secret = "sk_live_0123456789abcdef-very-secret"
    monkeypatch.setenv("STRIPE_KEY", secret)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())
    rt.register(f.leaky_padded_wf)
    client = rt.client()
    pad = MAX_TRACEBACK - 1 - len(secret) // 2  # the last line ends with the pad and "\n"
    handle = client.start(f.leaky_padded_wf, {"api_key": wp.secret("stripe-key"), "pad": pad})
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "LeakyError"
    stored = json.dumps([r.event for r in client.history(handle.execution_id)])
    for text in (json.dumps(outcome.error), stored):
        assert secret[len(secret) // 2 :] not in text
        assert "secret:stripe-key" in text


def test_the_text_log_format_shows_user_values_inert(
    runtime: wp.Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step's exception echoes a run's input: in the worker's text log, what a terminal
    would act on (ESC retitling the window and clearing the screen, BEL, a right-to-left
    override, a line break forging a record) is shown as its escape, traceback included."""
    hostile = (
        "ref\x1b]0;PWNED\x07\x1b[2J\u202eevil\u2028\n2026-01-01 INFO wf_persist.runtime: forged"
    )
    runtime.register(w.explode_wf)
    with _configured("text"):
        client = runtime.client()
        exploded = client.start(w.explode_wf, hostile).execution_id
        assert isinstance(client.result(exploded, timeout=20), wp.Failed)
        logging.getLogger("wf_persist.steps").error(
            "step failed: %s", hostile, exc_info=(RuntimeError, RuntimeError(hostile), None)
        )
        err = capsys.readouterr().err
    assert exploded in err and "\\u001b]0;PWNED\\u0007" in err and "\\u202eevil" in err
    for raw in ("\x1b", "\x07", "\u202e", "\u2028"):
        assert raw not in err
    # A traceback another handler's formatter cached on the record raw is made inert too,
    # and the record is left as it was for the others.
    record = logging.LogRecord(
        "wf_persist.steps", logging.ERROR, __file__, 1, "failed: %s", (hostile,),
        (RuntimeError, RuntimeError(hostile), None),
    )  # fmt: skip
    raw = logging.Formatter().format(record)
    assert "\x1b" in raw and "\x1b" in (record.exc_text or "")
    shown = logs.TextFormatter().format(record)
    assert not [c for c in ("\x1b", "\x07", "\u202e") if c in shown]
    assert record.getMessage() == f"failed: {hostile}" and "\x1b" in (record.exc_text or "")
    # A message stays on its record's line: the input forges no record there (a traceback
    # keeps its lines, the exception's message among them).
    assert "evil\\u2028\\n2026-01-01 INFO wf_persist.runtime: forged" in err
