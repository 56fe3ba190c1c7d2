"""Regressions: cancellation races, values a database rejects, replayed error types,
secrets in errors, swallowed divergence, Annotated constraints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import wf_persist as wp

from .fixtures import saga as s
from .fixtures.workflows import SimulatedCrash
from .helpers import wait_until
from .test_limits_secrets import SECRET_VALUE, _raw_bytes, queued_behind_the_limit

pytestmark = pytest.mark.usefixtures("saga_reset")


def test_cancelled_run_that_makes_no_further_call_still_unwinds(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.no_calls_wf)
    client.cancel(handle.execution_id, actor="ops")
    outcome = client.result(handle.execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"


def test_cancel_during_the_last_step(rt: wp.Runtime) -> None:
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    handle = client.start(s.gated_last_wf)
    wait_until(lambda: s.CALLS["gated:last"] > 0, what="the last step")
    client.cancel(handle.execution_id)
    s.GATE.set()
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    assert s.CALLS["undo_first"] == 1, "the reservation is compensated"
    assert client.status(handle.execution_id) == "failed"


def test_default_cancel_of_a_run_queued_behind_a_limit(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(record_start_after=0)
    rt.register(*s.ALL)
    rt.start_worker(concurrency=4, poll_interval=0.02)
    client = rt.client()
    holder = client.start(s.exclusive_wf, "holder")
    wait_until(lambda: s.CALLS["exclusive:holder"] > 0, what="the holder's step")
    queued = client.start(s.exclusive_wf, "queued")
    queued_behind_the_limit(rt, queued.execution_id)
    client.cancel(queued.execution_id)
    outcome = client.result(queued.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    s.GATE.set()
    assert client.result(holder.execution_id, timeout=10).unwrap() == "holder"
    assert s.CALLS["exclusive:queued"] == 0


@pytest.mark.parametrize("text", ["\x00", "\ud800"])
def test_text_a_database_would_reject_is_a_typed_failure(rt: wp.Runtime, text: str) -> None:
    client = rt.client()
    with pytest.raises(wp.NotSerializableError):  # refused before anything is written
        client.start(s.nul_wf, f"x{text}")
    s.CONTROL["suffix"] = text
    outcome = client.result(client.start(s.nul_wf, "abc").execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["cause"]["name"] == "NotSerializableError"
    assert "databases reject" in outcome.error["cause"]["message"]
    assert s.CALLS["nul_result"] == 1, "not retried forever"


def test_terminal_subclass_error_replays_as_itself(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.subclass_error_wf)
    assert client.result(handle.execution_id, timeout=10).unwrap() == "CardDeclined 4242"
    assert s.CALLS["pay_card"] == 1


def test_secret_never_reaches_a_stored_error(
    make_runtime: object, db_url: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRIPE_KEY", SECRET_VALUE)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())  # type: ignore[operator]
    rt.register(*s.ALL)
    client = rt.client()
    handle = client.start(s.short_key_wf, {"api_key": wp.secret("stripe-key")})
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed)
    assert s.CALLS["use_short_key"] == 0
    assert SECRET_VALUE not in str(outcome.error)
    rt.close()
    assert SECRET_VALUE.encode() not in _raw_bytes(db_url, backend, tmp_path)


def test_swallowed_divergence_runs_nothing_new(rt: wp.Runtime) -> None:
    client = rt.client()
    handle = client.start(s.swallow_divergence_wf)
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id)
    s.CONTROL["diverge"] = True
    outcome = client.result(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert s.CALLS["plain_step"] == 0 and s.CALLS["second_step"] == 0


def test_annotated_constraints_are_enforced(rt: wp.Runtime) -> None:
    client = rt.client()
    with pytest.raises(wp.InvalidPayloadError):
        client.start(s.annotated_wf, -5)
    assert client.result(client.start(s.annotated_wf, 5).execution_id).unwrap() == 5


def test_error_text_a_database_would_reject_is_still_recorded(rt: wp.Runtime) -> None:
    client = rt.client()
    outcome = client.result(client.start(s.garbled_failure_wf).execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["cause"]["message"] == "bad \\0 and \\ud800 text"
