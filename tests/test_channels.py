"""What each process listens for on PostgreSQL: runs due (a worker's business) and runs ended
(a waiting caller's) come on channels of their own, so a process that starts runs and awaits
them is not woken by every start, nor a worker by every end. Each test polls every 30 s:
only a notification explains an answer within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import wf_persist as wp
from wf_persist.backends.postgresql import PostgreSQLBackend
from wf_persist.wakeups import HEAR_DUE, HEAR_END, Wakeups

from .helpers import wait_until

SLOW = 30  # poll interval of every runtime and client here


@wp.step
def _hold(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@wp.workflow(name="test_channels_hold", version=1)
def _holding(ctx: wp.Context, seconds: float) -> float:
    return ctx.run(_hold, seconds)


def _heard(wakeups: Wakeups | None) -> set[str]:
    assert wakeups is not None
    return {kind for kind in (HEAR_DUE, HEAR_END) if wakeups.hears(kind)}


@pytest.mark.needs("notify")
def test_a_worker_hears_runs_due_and_a_thin_client_hears_ends(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    worker = make_runtime(poll_interval=SLOW)
    worker.register(_holding)
    worker.start_worker()
    wait_until(worker.hears_due, what="the worker listening")
    with wp.Client(db_url, poll_interval=SLOW) as thin:
        for _ in range(3):
            began = time.monotonic()
            handle = thin.start("test_channels_hold", 0.0)
            assert thin.result(handle.execution_id, timeout=30).unwrap() == 0.0
            assert time.monotonic() - began < 5, "picked up or ended unheard"
        assert _heard(thin._wakeups) == {HEAR_END}
    assert _heard(worker._wakeups) == {HEAR_DUE}


@pytest.mark.needs("notify")
def test_a_caller_that_drives_its_runs_listens_for_nothing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Its starts and ends are its own: it holds the presence lock, hears nothing."""
    rt = make_runtime(poll_interval=SLOW)
    rt.register(_holding)
    client = rt.client()
    for _ in range(3):
        handle = client.start(_holding, 0.0)
        assert client.result(handle.execution_id, timeout=30).unwrap() == 0.0
    found = rt._wakeups
    assert found is not None and found.listening and found.present
    assert _heard(found) == set()


@pytest.mark.needs("notify")
def test_an_embedded_wait_for_a_run_driven_elsewhere_is_woken_by_its_end(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The runtime listens for ends from its first wait for a run it cannot drive (another
    process holds it): the end wakes the wait, which by then looked only every few seconds."""
    elsewhere = make_runtime(poll_interval=SLOW)
    elsewhere.register(_holding)
    elsewhere.start_worker()
    wait_until(elsewhere.hears_due, what="the worker listening")
    here = make_runtime(poll_interval=SLOW)
    here.register(_holding)
    client = here.client()
    handle = wp.Client(elsewhere.engine).start("test_channels_hold", 5.0)
    wait_until(
        lambda: client.status(handle.execution_id) == "running", what="the other worker's drive"
    )
    began = time.monotonic()
    assert client.result(handle.execution_id, timeout=30).unwrap() == 5.0
    # Looks 2 ms apart, doubling: without the end heard, the look after it came at ~8 s.
    assert time.monotonic() - began < 6.5, "the end went unheard"
    assert HEAR_END in _heard(here._wakeups)


@pytest.mark.needs("notify")
def test_a_worker_started_after_its_runtime_listened_hears_runs_due(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """The listener began without a worker (a caller's drive took the presence lock): the
    worker started later makes it listen for runs due too."""
    rt = make_runtime(poll_interval=SLOW)
    rt.register(_holding)
    client = rt.client()
    handle = client.start(_holding, 0.0)
    assert client.result(handle.execution_id, timeout=30).unwrap() == 0.0
    assert _heard(rt._wakeups) == set()
    rt.start_worker()
    wait_until(rt.hears_due, what="the worker listening")
    time.sleep(0.5)  # past the worker's first look
    with wp.Client(db_url, poll_interval=SLOW) as thin:
        began = time.monotonic()
        handle = thin.start("test_channels_hold", 0.0)
        assert thin.result(handle.execution_id, timeout=30).unwrap() == 0.0
        assert time.monotonic() - began < 5, "the start went unheard"


@pytest.mark.needs("notify")
def test_due_and_end_channels_differ_whatever_the_schema(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    backend = make_runtime().backend
    assert isinstance(backend, PostgreSQLBackend)
    assert backend.channel() == "wf_persist"
    assert backend.end_channel() == "wf_persist_end"
    backend._channel = backend._end_channel = None
    backend.schema = "s" * 63  # hashed: the server refuses names of 64 bytes or more
    due, end = backend.channel(), backend.end_channel()
    assert due != end and due.startswith("wf_persist.") and end.startswith("wf_persist_end.")
    assert max(len(due.encode()), len(end.encode())) < 64
