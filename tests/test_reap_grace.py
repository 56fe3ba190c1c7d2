"""A renewal is not undone by a reap that began before it.

A reaper makes a dead owner's runs due ``grace`` seconds after it found the owner's presence
lock free, and the owner (alive, its listening connection silently dead) may trust a renewal
of its own for less than that grace. The reap once computed its due time once, before
reaching the rows: held up on one run's row lock (an application's transaction, or just
many rows), it then overwrote a renewal committed meanwhile with a due time already past,
and any worker could claim the run at once. Each row's due time is now counted when the row
is reached.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import text

import wf_persist as wp
from wf_persist.backends import Backend

pytestmark = pytest.mark.needs("presence")

OWNER = "t-reap-host:1:dead!"


@wp.workflow(name="t-reap-grace", version=1)
def _reap_grace_wf(ctx: wp.Context) -> str:
    return "x"


def test_a_renewal_is_not_undone_by_a_reap_that_began_before_it(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(lease_ttl=30)
    rt.register(_reap_grace_wf)
    rt.wakeups()  # presence probed: the backend reaps
    client = rt.client()
    backend = rt.backend
    workflows = [("t-reap-grace", 1)]
    # Two runs held by OWNER (whose presence lock nobody holds: its listener died).
    first = client.start(_reap_grace_wf).execution_id
    second = client.start(_reap_grace_wf).execution_id
    claims = {}
    for run in (first, second):
        claim = backend.claim_to_drive(run, OWNER, 30.0, workflows)
        assert claim is not None
        claims[run] = claim.epoch
    engine = backend.engine
    holder = engine.connect()
    holder_tx = holder.begin()
    reaped: list[list[str]] = []
    try:
        # An application's transaction holds the row lock of one run (a signal sent in it,
        # say). Which run the REAP reaches first is the planner's business: lock the one it
        # reaches first (try both).
        blocked: str | None = None
        for locked, other in ((first, second), (second, first)):
            holder.execute(
                text("SELECT id FROM wf_executions WHERE id = :i FOR UPDATE"), {"i": locked}
            )
            reaper = threading.Thread(
                target=lambda: reaped.append(backend.reap("t-reap-graceer!", 0.2)), daemon=True
            )
            reaper.start()
            time.sleep(0.5)  # past the grace; the REAP waits on the locked row
            # The owner (alive, its listener silently dead) renews the other run now.
            done: list[set[str]] = []
            renewer = threading.Thread(
                target=lambda: done.append(  # noqa: B023
                    _renew(backend, other, claims[other])  # noqa: B023
                ),
                daemon=True,
            )
            renewer.start()
            renewer.join(1.0)
            if done:  # the REAP had not reached it yet: the case under test
                blocked = other
                with engine.connect() as conn:
                    renewed_at = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
                break
            # The REAP locked the other run first: undo and try the other order.
            holder_tx.rollback()
            reaper.join(10)
            renewer.join(10)
            reaped.clear()
            holder_tx = holder.begin()
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "UPDATE wf_executions SET lease_expires_at = clock_timestamp() + "
                        "interval '30 seconds', wake_at = clock_timestamp() + "
                        "interval '30 seconds' WHERE id IN (:a, :b)"
                    ),
                    {"a": first, "b": second},
                )
        assert blocked is not None, "could not stage the REAP ahead of the renewal"
        assert done == [{blocked}], "the renewal (fenced by the epoch) did not find the run"
    finally:
        holder_tx.commit()
        holder.close()
    reaper.join(10)
    assert reaped and blocked in reaped[0], reaped
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT wake_at, lease_expires_at, wake_at <= clock_timestamp() AS due_now "
                "FROM wf_executions WHERE id = :i"
            ),
            {"i": blocked},
        ).one()
    late_by = (renewed_at - row.wake_at).total_seconds()
    # A run renewed at T is not claimable before T + grace.
    assert not row.due_now and late_by <= -0.2 + 0.05, (
        f"renewed at {renewed_at}, yet due at {row.wake_at} ({late_by:+.3f}s before the "
        "renewal): claimable at once by any worker"
    )


def _renew(backend: Backend, run: str, epoch: int) -> set[str]:
    with backend.engine.connect() as conn:
        return backend.renew_alone(conn, {run: epoch}, 30.0)
