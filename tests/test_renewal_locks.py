"""A run whose row an application holds locked delays only that run's renewal, not every
lease of the process.

The keeper renews all of a process's leases in one statement. If it waited for a row an
application's transaction holds (a signal or cancel sent inside a long transaction, a
``SELECT ... FOR UPDATE`` of its own), every other lease of the process would lapse
meanwhile: other workers would take those runs over and run their steps in flight again,
and on MySQL/MariaDB the wait ends in a lock-wait timeout that failed the renewal
altogether. Rows locked by others are skipped, and renewed at the next turn.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Connection, Engine, text

import wf_persist as wp
from wf_persist.backends import Backend

from .helpers import wait_until

pytestmark = pytest.mark.needs("skip_locked")  # row locks: PostgreSQL, MySQL/MariaDB

RAN: list[str] = []
GO = threading.Event()
TTL = 2.0


@wp.step
def _held_step(name: str) -> str:
    RAN.append(name)
    GO.wait(30)
    return name


@wp.workflow(name="renewal_locks", version=1)
def renewal_locks_wf(ctx: wp.Context, name: str) -> str:
    return str(ctx.run(_held_step, name))


def _expiry(engine: Engine, run: str) -> object:
    with engine.connect() as conn:
        query = "SELECT lease_expires_at FROM wf_executions WHERE id = :i"
        return conn.execute(text(query), {"i": run}).scalar()


def test_a_locked_row_delays_only_its_own_renewal(
    make_runtime: Callable[..., wp.Runtime], make_engine: Callable[..., Engine], db_url: str
) -> None:
    RAN.clear()
    GO.clear()
    runtime = make_runtime(lease_ttl=TTL)
    runtime.register(renewal_locks_wf)
    runtime.start_worker(concurrency=4)
    client = runtime.client()
    locked = client.start(renewal_locks_wf, "locked").execution_id
    free = client.start(renewal_locks_wf, "free").execution_id
    wait_until(lambda: sorted(RAN) == ["free", "locked"], what="both steps", timeout=30)
    reader = make_engine(db_url)
    try:
        with make_engine(db_url).connect() as host:
            # The application holds the row of one run for longer than the lease.
            lock = "SELECT id FROM wf_executions WHERE id = :i FOR UPDATE"
            host.execute(text(lock), {"i": locked})
            time.sleep(TTL / 2)
            before = _expiry(reader, free)
            time.sleep(TTL * 1.5)
            after = _expiry(reader, free)
            host.commit()
        assert before is not None and after is not None
        assert after > before  # type: ignore[operator]  # the free run's lease was renewed
        time.sleep(TTL / 2)  # the locked run is renewed again once its row is free
        with reader.connect() as conn:
            epochs = conn.execute(
                text("SELECT id, claim_epoch FROM wf_executions WHERE id IN (:a, :b)"),
                {"a": locked, "b": free},
            ).all()
        assert {str(i): int(e) for i, e in epochs} == {locked: 1, free: 1}
    finally:
        GO.set()
    assert client.result(locked, timeout=60).unwrap() == "locked"
    assert client.result(free, timeout=60).unwrap() == "free"
    assert sorted(RAN) == ["free", "locked"]  # neither step ran again
    for run in (locked, free):
        assert client.describe(run).drive_failures == 0


def test_renew_free_skips_locked_rows_and_other_epochs(
    runtime: wp.Runtime, make_engine: Callable[..., Engine], db_url: str
) -> None:
    """The statement itself: a row another transaction holds is skipped at once (not
    waited for), a run at another epoch is not renewed, and the rest are."""
    _check_renew_free(runtime, runtime.backend.renew_free, make_engine(db_url))


@pytest.mark.needs("libpq")
def test_the_generic_renew_free_skips_locked_rows_too(
    runtime: wp.Runtime, make_engine: Callable[..., Engine], db_url: str
) -> None:
    """The same of the form a backend with row locks inherits (PostgreSQL on a driver
    other than psycopg's)."""
    generic = functools.partial(Backend.renew_free, runtime.backend)
    _check_renew_free(runtime, generic, make_engine(db_url))


def _check_renew_free(
    runtime: wp.Runtime,
    renew: Callable[[Connection, dict[str, int], float], set[str]],
    host_engine: Engine,
) -> None:
    runtime.register(renewal_locks_wf)
    backend = runtime.backend
    runs = [runtime.client().start(renewal_locks_wf, n).execution_id for n in "abc"]
    epochs = {}
    for run in runs:
        claim = backend.claim_to_drive(run, "renewal-test", 3600, [("renewal_locks", 1)])
        assert claim is not None
        epochs[run] = claim.epoch
    locked, taken, free = runs
    held = {locked: epochs[locked], taken: epochs[taken] + 1, free: epochs[free]}
    with host_engine.connect() as host:
        lock = "SELECT id FROM wf_executions WHERE id = :i FOR UPDATE"
        host.execute(text(lock), {"i": locked})
        began = time.monotonic()
        with backend.engine.connect() as conn:
            assert renew(conn, held, 60) == {free}
        assert time.monotonic() - began < 5  # skipped, not waited for
        host.commit()
    with backend.engine.connect() as conn:
        assert renew(conn, held, 60) == {locked, free}
        assert renew(conn, {}, 60) == set()


@pytest.mark.needs("libpq")
def test_a_foreign_key_checks_lock_skips_no_renewal(
    runtime: wp.Runtime, make_engine: Callable[..., Engine], db_url: str
) -> None:
    """PostgreSQL: an open transaction that wrote a history row of the run holds its row
    with KEY SHARE (the foreign key's check), which does not hold up the renewal's UPDATE:
    the renewal's skip does not skip it either (FOR NO KEY UPDATE, not FOR UPDATE)."""
    runtime.register(renewal_locks_wf)
    backend = runtime.backend
    run = runtime.client().start(renewal_locks_wf, "k").execution_id
    claim = backend.claim_to_drive(run, "renewal-test", 3600, [("renewal_locks", 1)])
    assert claim is not None
    held = {run: claim.epoch}
    generic = functools.partial(Backend.renew_free, backend)
    with make_engine(db_url).connect() as host:
        share = "SELECT id FROM wf_executions WHERE id = :i FOR KEY SHARE"
        host.execute(text(share), {"i": run})
        with backend.engine.connect() as conn:
            assert backend.renew_free(conn, held, 60) == {run}
            assert generic(conn, held, 60) == {run}
        host.rollback()
