"""An interrupted ``result()`` gives back a claim whose answer was lost by the lease's
owner name: never a claim another part of the same runtime holds (its worker's, a start's),
nor one it never sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, select

import wf_persist as wp
from wf_persist.models import executions_table as ex

from .fixtures import workflows as w
from .helpers import pause_calls, wait_until


def _lease(rt: wp.Runtime) -> tuple[Any, int, bool]:
    with rt.backend.read() as conn:
        row = conn.execute(select(ex.c.lease_owner, ex.c.claim_epoch, ex.c.lease_expires_at)).one()
    return row[0], int(row[1]), row[2] is not None


def test_an_interrupted_result_spares_a_claim_its_worker_just_made(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's claim loop (``claim_due``) has committed a claim of the run and not yet
    handed it to the lease keeper, as ``result()`` in another thread is interrupted before
    its own claim was even sent (a signal handler's TimeoutError). The run's lease carries
    this runtime's name, so the give-back by owner name releases the *worker's* claim: its
    drive goes on under a lease that is no longer there (the run is due for every other
    worker at once; the keeper's next renewal finds it gone)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    run = rt.client().start(w.echo_wf, 2).execution_id
    rt.wakeups()  # the owner name settled
    # Stopped once the worker's claim is committed, before the keeper has got it.
    committed, go_on = pause_calls(monkeypatch, rt.keeper(), "hold")
    claimed: list[Any] = []
    worker = threading.Thread(target=lambda: claimed.extend(rt.claim_due(1)))
    worker.start()
    try:
        assert committed.wait(20)

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError("the request timed out")  # before anything was sent

        monkeypatch.setattr(rt.backend, "claim_to_drive", interrupted)
        with pytest.raises(TimeoutError):
            rt.client().result(run, timeout=30)
    finally:
        go_on.set()
        worker.join(20)
        monkeypatch.undo()
    assert len(claimed) == 1
    owner, epoch, leased = _lease(rt)
    try:
        assert (owner, epoch, leased) == (rt.owner, claimed[0].epoch, True), (
            "result() released a claim its runtime's worker had just made"
        )
    finally:
        rt.keeper().forget_run(run, claimed[0].epoch)
        rt.give_back(claimed[0])


def test_a_result_that_got_no_pool_connection_waits_the_pool_once(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``result()``'s claim that timed out waiting for the pool sent nothing; the give-back
    by owner name that follows reads the run on the same exhausted pool and waits the pool
    timeout a second time (as a start's give-back did, fixed in 31bf530)."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=1)
    with wp.Runtime(engine, lease_ttl=300) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.execute(w.echo_wf, 1).unwrap() == [1, 2]
        run = client.start(w.echo_wf, 2).execution_id
        with engine.connect():  # the pool's one connection, taken
            began = time.monotonic()
            with pytest.raises(Exception, match="QueuePool limit"):
                client.result(run, timeout=30)
            took = time.monotonic() - began
        assert took < 1.8, f"{took:.2f}s: the pool timeout was waited twice"
        assert client.result(run, timeout=30).unwrap() == [1, 2]


def test_an_interrupted_result_spares_a_claim_its_worker_made_as_it_gave_back(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking the worker first is not enough: a claim batch of the worker already under
    way (its list of runs to leave out taken before ``result()`` marked the run as driven
    here) commits, and the keeper holds it, between ``_worker_has`` and the read of the
    lease. The give-back by owner name then releases a claim the keeper holds and a drive
    of this runtime is about to run."""
    from wf_persist.store import executions

    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    run = rt.client().start(w.echo_wf, 2).execution_id
    rt.wakeups()
    claimed: list[Any] = []
    real_look = executions.look

    def worker_claims_first(*args: Any, **kwargs: Any) -> Any:
        if not claimed:  # the worker's batch (exclude taken earlier: empty) lands now
            asked = time.monotonic()
            got = rt.backend.claim_batch(rt.owner, 300, 1, rt.runnable_workflows(), [])
            claimed.extend(got)
            for claim in got:
                rt.keeper().hold(claim.execution_id, claim.epoch, asked)
        return real_look(*args, **kwargs)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("the request timed out")

    monkeypatch.setattr(executions, "look", worker_claims_first)
    monkeypatch.setattr(rt.backend, "claim_to_drive", interrupted)
    with pytest.raises(TimeoutError):
        rt.client().result(run, timeout=30)
    monkeypatch.undo()
    assert len(claimed) == 1
    try:
        assert rt.keeper().held() == {run: claimed[0].epoch}
        assert _lease(rt) == (rt.owner, claimed[0].epoch, True), (
            "result() released a claim its runtime's lease keeper holds"
        )
    finally:
        rt.keeper().forget_run(run, claimed[0].epoch)
        rt.give_back(claimed[0])


def test_an_interrupted_result_spares_a_run_execute_started_claimed_here(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``execute()`` in one thread creates its run claimed (epoch 1, this runtime's name)
    and is about to drive it (``drive_started``: it waits up to half a second there while
    another thread here holds the run). A request in the main thread with the same
    idempotency key gets the same run and awaits it; its claim is interrupted (a signal
    handler's TimeoutError). The give-back by owner name releases execute()'s claim, which
    no lease keeper, worker claim or dispatch marks yet: execute() then drives the run
    under a lease that is gone (due for every other worker at once)."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    rt.wakeups()
    reached, go_on = pause_calls(monkeypatch, rt, "drive_started")
    outcome: list[Any] = []
    first = threading.Thread(
        target=lambda: outcome.append(client.execute(w.echo_wf, 2, idempotency_key="k"))
    )
    first.start()
    try:
        assert reached.wait(20)
        run = client.start(w.echo_wf, 2, idempotency_key="k").execution_id

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError("the request timed out")

        monkeypatch.setattr(rt.backend, "claim_to_drive", interrupted)
        with pytest.raises(TimeoutError):
            client.result(run, timeout=30)
        lease = _lease(rt)
    finally:
        go_on.set()
        first.join(20)
        monkeypatch.undo()
    assert lease == (rt.owner, 1, True), "result() released the claim execute() made here"
    assert len(outcome) == 1 and outcome[0].unwrap() == [1, 2]


def test_an_interrupted_result_spares_a_run_started_claimed_for_the_worker(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start()`` with a worker slot free creates its run claimed (epoch 1, this
    runtime's name) and has committed it, not yet handed it to the worker (``dispatch``).
    A request with the same idempotency key awaits the same run; its claim is interrupted.
    The give-back by owner name must not release the claim the start is handing on."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    worker = rt.start_worker(concurrency=2, poll_interval=30)
    wait_until(lambda: worker._pool is not None, what="the worker's slots")
    # The start that created the run stops (not the one that finds it).
    reached, go_on = pause_calls(monkeypatch, rt, "dispatch", lambda claim, *a: claim is not None)
    first = threading.Thread(target=lambda: client.start(w.echo_wf, 2, idempotency_key="k"))
    first.start()
    try:
        assert reached.wait(20)
        run = client.start(w.echo_wf, 2, idempotency_key="k").execution_id

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError("the request timed out")

        monkeypatch.setattr(rt.backend, "claim_to_drive", interrupted)
        with pytest.raises(TimeoutError):
            client.result(run, timeout=30)
        lease = _lease(rt)
    finally:
        go_on.set()
        first.join(20)
        monkeypatch.undo()
    assert lease == (rt.owner, 1, True), "result() released the claim a start made here"
    assert client.result(run, timeout=20).unwrap() == [1, 2]
