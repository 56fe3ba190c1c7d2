"""A signal the sender could judge only by the wait's JSON Schema, which the wait's type
refuses, no longer fails the run.

A wait on a type that is not a class (``dict[int, str]``), or a client without the
workflow's code, judges a payload by the JSON Schema the wait recorded. A payload the schema
passes and the type refuses (a key that is not a number) was delivered, and the run then
failed with ``InvalidPayloadError``: anyone who could signal could fail the run. Now the wait
records ``signal.rejected`` for the delivery and waits on; the next signal sent to it is
buffered for it (one at a time, as a delivery is), taken if it fits.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import wf_persist as wp
from wf_persist.testing import check_replay


@wp.workflow(name="misfit_wait", version=1)
def misfit_wait_wf(ctx: wp.Context) -> dict[int, str]:
    got = ctx.wait_for_signal("labels", dict[int, str], timeout=3600)
    assert isinstance(got, wp.Received)
    return dict(got.value)


def _types(client: wp.WorkflowClient | wp.Client, run: str) -> list[str]:
    return [r.event["type"] for r in client.history(run)]


@pytest.mark.parametrize("sender", ["embedded", "thin"])
def test_a_misfit_the_schema_let_through_is_rejected_and_the_wait_goes_on(
    make_runtime: Callable[..., wp.Runtime], db_url: str, sender: str
) -> None:
    rt = make_runtime()
    rt.register(misfit_wait_wf)
    client = rt.client()
    send = client if sender == "embedded" else wp.Client(db_url)
    try:
        run = client.start(misfit_wait_wf).execution_id
        assert rt.drive(run)  # parked on the wait
        assert send.signal(run, "labels", {"one": "a"}) == "delivered"  # the schema passes it
        assert rt.drive(run)
        assert client.status(run) == "suspended"  # refused by the type: waits on
        [pending] = client.pending_signals(run)
        assert pending.activity_name == "labels#1"
        rejected = [r.event for r in client.history(run) if r.event["type"] == "signal.rejected"]
        assert [e.get("delivery") for e in rejected] == [True]
        # The next one is buffered for the wait, one at a time: the wait is not pending
        # while it is in; a signal sent with buffer=True waits behind it (first in, first
        # out), and the wait refuses the misfit and takes the one that fits.
        assert send.signal(run, "labels", {"two": "b"}) == "delivered"
        assert client.pending_signals(run) == []
        with pytest.raises(wp.SignalAlreadyDeliveredError):
            send.signal(run, "labels", {"3": "c"})
        assert send.signal(run, "labels", {"3": "c"}, buffer=True) == "buffered"
        assert rt.drive(run)
        assert client.result(run, timeout=0).unwrap() == {3: "c"}
        kinds = _types(client, run)
        assert kinds.count("signal.rejected") == 2 and kinds.count("signal.received") == 1
        [report] = check_replay(rt, [run])
        assert report.ok, report
        # Settled: no more signals for it.
        with pytest.raises(wp.SignalNotWaitingError):
            send.signal(run, "labels", {"1": "x"})
    finally:
        if isinstance(send, wp.Client):
            send.close()


@wp.workflow(name="misfit_timeout", version=1)
def misfit_timeout_wf(ctx: wp.Context) -> str:
    got = ctx.wait_for_signal("labels", dict[int, str], timeout=0.5)
    return "timed out" if isinstance(got, wp.TimedOut) else "received"


def test_a_refused_delivery_leaves_the_waits_timeout_as_it_was(runtime: wp.Runtime) -> None:
    runtime.register(misfit_timeout_wf)
    client = runtime.client()
    run = client.start(misfit_timeout_wf).execution_id
    assert runtime.drive(run)
    assert client.signal(run, "labels", {"x": "y"}) == "delivered"
    runtime.start_worker(concurrency=1, poll_interval=0.05)
    assert client.result(run, timeout=30).unwrap() == "timed out"
    kinds = _types(client, run)
    assert kinds.index("signal.rejected") < kinds.index("signal.timeout")
