"""Regression tests for findings of a review of the hot path (lent connections, deferred
step outcomes, PostgreSQL's raw statements, presence and wake-ups, embedded hand-over)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, func, select, text
from sqlalchemy.exc import DBAPIError

import wf_persist as wp
from wf_persist.events import NewEvent

from .fixtures import fencing as f
from .fixtures import workflows as w
from .helpers import wait_until


def test_host_autocommit_connections_stay_autocommit(
    backend: str, db_url: str, make_engine: Callable[..., Engine], host_tables: Any
) -> None:
    """A host engine in AUTOCOMMIT gets its connections back in AUTOCOMMIT after wf_persist
    used them (a start, a result): a host write without commit() stays written."""
    engine = make_engine(db_url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    table = Table("review_host_rows", MetaData(), Column("n", Integer))
    host_tables.create(engine, table)
    other = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(*w.ALL)
        client = rt.client()
        for i in range(3):
            execution_id = client.start(w.echo_wf, 2).execution_id
            with engine.connect() as conn:  # the host's next use of its one connection
                conn.execute(table.insert().values(n=i))  # no commit(): AUTOCOMMIT
            with other.connect() as conn:
                assert conn.execute(select(func.count()).select_from(table)).scalar() == i + 1
            assert client.result(execution_id, timeout=20).unwrap() == [1, 2]


def test_reloading_drives_do_not_exhaust_a_two_connection_pool(
    backend: str, db_url: str, make_engine: Callable[..., Engine], saga_reset: None
) -> None:
    """A pool of 2 is enough for a worker (check_pool): two drives that each keep their
    connection and then need a second one to read history again (a cancellation seen by
    their write) must not wait on each other for the pool's timeout."""
    from .fixtures import saga as s

    engine = make_engine(db_url, pool_size=2, max_overflow=0, pool_timeout=3)
    with wp.Runtime(engine, lease_ttl=30) as rt:
        rt.register(*s.ALL)
        client = rt.client()
        ids = [client.start(s.gated_wf).execution_id for _ in range(2)]
        rt.start_worker(concurrency=2, poll_interval=0.05)
        wait_until(lambda: s.CALLS["gated:g"] == 2, what="both runs in their gated step")
        time.sleep(0.2)  # the steps run past RELEASE_AFTER: the drives lent their connection
        for execution_id in ids:
            client.cancel(execution_id)
        began = time.monotonic()
        s.GATE.set()
        for execution_id in ids:
            outcome = client.result(execution_id, timeout=60)
            assert isinstance(outcome, wp.Failed)
        took = time.monotonic() - began
        assert took < 2.5, f"the cancelled runs took {took:.1f}s to unwind"
        assert s.CALLS["after_gate"] == 0


@pytest.mark.needs("server")
def test_a_session_default_above_read_committed_does_not_fail_claims(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Sessions whose default isolation is SERIALIZABLE: a claim that waits on a concurrent
    update of its run (a host's, a signal, another claimer) re-checks the run and claims it,
    instead of raising a serialization failure out of ``drive()`` / ``result()``."""
    from .conftest import has

    connect_args = (
        {"init_command": "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"}
        if has(backend, "sql_mode")
        else {"options": "-c default_transaction_isolation=serializable"}
    )
    engine = make_engine(db_url, connect_args=connect_args)
    holder = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=30) as rt:
        rt.register(*w.ALL)
        client = rt.client()
        execution_id = client.start(w.echo_wf, 2).execution_id
        outcome: list[Any] = []

        def drive() -> None:
            try:
                outcome.append(rt.drive(execution_id))
            except Exception as exc:
                outcome.append(exc)

        with holder.begin() as conn:  # the run's row changes while the claim waits
            conn.execute(
                text("UPDATE wf_executions SET updated_at = updated_at WHERE id = :i"),
                {"i": execution_id},
            )
            driving = threading.Thread(target=drive)
            driving.start()
            time.sleep(0.5)
        driving.join(30)
        assert outcome == [True]
        assert client.result(execution_id, timeout=20).unwrap() == [1, 2]


@pytest.mark.needs("presence")
def test_a_live_runtime_whose_listener_reconnected_is_never_reaped(
    make_runtime: Callable[..., wp.Runtime], db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The listening connection drops and, when it reconnects, its presence lock is not free
    yet (the old session lingers on the server, or a reaper is trying it at that moment).
    The runtime's claims still carry the present owner's name: once the lock is free, the
    runtime must take it again, or every other worker reaps a live runtime's runs."""

    holder, other = make_runtime(lease_ttl=30), make_runtime(lease_ttl=30)
    holder.register(*f.ALL)
    other.register(*f.ALL)
    wakeups = holder.wakeups()
    assert holder.owner.endswith("!")
    handle = holder.client().start(f.nap_wf, 3600)
    with holder.backend.begin() as conn:
        claim = holder.backend.claim(conn, handle.execution_id, holder.owner, 30)
    assert claim is not None
    admin = make_engine(db_url)
    with admin.connect() as blocker:
        blocker.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'wf_persist listener' AND datname = current_database()"
            )
        )
        blocker.commit()
        key = "hashtextextended(:o, 0)"

        def taken() -> bool:  # the lock, the moment the server frees it
            got = blocker.execute(text(f"SELECT pg_try_advisory_lock({key})"), {"o": holder.owner})
            return bool(got.scalar())

        wait_until(taken, what="the presence lock free", timeout=10)
        wait_until(lambda: wakeups.connections >= 2, what="the listener back", timeout=20)
        blocker.execute(text(f"SELECT pg_advisory_unlock({key})"), {"o": holder.owner})
        blocker.commit()
    wait_until(lambda: wakeups.present, what="the presence lock taken again", timeout=10)
    assert other.reap() == []
    assert other.drive(handle.execution_id) is False


@pytest.mark.needs("presence")
def test_a_host_engine_with_a_pool_of_one_listens_and_is_present(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A client-only runtime on a host engine of one connection (legal: no worker): the
    listener and its presence probe do not need two connections of a pool of one (the
    probe waited for the pool's timeout, and the first result() for the listener)."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=3)
    with wp.Runtime(engine, lease_ttl=30) as rt:
        rt.register(*w.ALL)
        began = time.monotonic()
        rt.wakeups()
        assert time.monotonic() - began < 2.0
        assert rt.listening() and rt.owner.endswith("!")
        client = rt.client()
        assert client.result(client.start(w.echo_wf, 2).execution_id, timeout=20).unwrap() == [1, 2]


_SLOW_CALLS: list[int] = []
_SLOW_STARTS: list[float] = []


@wp.step
def _slow_part(i: int) -> int:
    _SLOW_CALLS.append(i)
    _SLOW_STARTS.append(time.monotonic())
    time.sleep(0.5)
    return i


@wp.workflow(name="review_slow_parts", version=1)
def _slow_parts(ctx: wp.Context, n: int) -> list[int]:
    return [ctx.run(_slow_part, i) for i in range(n)]


def test_a_caller_driving_its_run_stops_at_the_first_step_boundary_past_its_timeout(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``result(timeout=...)`` on the embedded client drives a due run in the calling
    thread: past the timeout it stops at the next step boundary (a step in flight is not
    interrupted) and hands the run over, due at once; a later call goes on from there
    without running a recorded step again."""
    _SLOW_CALLS.clear()
    _SLOW_STARTS.clear()
    rt = make_runtime(lease_ttl=30)
    rt.register(_slow_parts)
    client = rt.client()
    handle = client.start(_slow_parts, 4)
    began = time.monotonic()
    with pytest.raises(wp.ResultTimeoutError):
        client.result(handle.execution_id, timeout=0.7)
    took = time.monotonic() - began
    # Timed from each step's start, not from an assumed pace (a loaded machine is slow to
    # reach the first): no step began past the timeout; the last one was in flight at it,
    # and the call returned as it ended.
    started = [at - began for at in _SLOW_STARTS]
    assert 1 <= len(started) < 4 and all(at < 0.7 for at in started), started
    assert started[-1] + 0.5 >= 0.7, f"stopped before the step boundary past it: {started}"
    assert 0.7 <= took < started[-1] + 0.5 + 0.45, f"returned after {took:.2f}s: {started}"
    called = list(_SLOW_CALLS)
    assert called == list(range(len(started)))
    info = client.describe(handle.execution_id)
    assert info.status == "running" and info.lease_owner is None, "handed over"
    assert client.result(handle.execution_id, timeout=30).unwrap() == [0, 1, 2, 3]
    assert _SLOW_CALLS == [0, 1, 2, 3], "a recorded step ran again"


def test_a_cancel_landing_between_a_batch_claim_and_its_first_drive_is_not_lost(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A worker's batch claim opens a fresh run (records ``workflow.started``) in a later
    transaction. A cancellation committed in between must reach the drive: before, the drive
    counted it as read without reading it, parked on the signal wait, and the run stayed
    ``compensating`` with no wake time forever."""
    from .fixtures import family

    rt = make_runtime(lease_ttl=30)
    rt.register(family.waiting_child_wf)  # waits for a signal first thing
    client = rt.client()
    handle = client.start(family.waiting_child_wf, "w")
    (claim,) = rt.claim_due(1)
    client.cancel(handle.execution_id)  # after the claim, before the drive opens the run
    rt.drive_claim(claim)
    outcome = client.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error["name"] == "Cancelled"


@pytest.mark.needs("presence")
def test_a_runtime_that_lost_its_presence_asks_before_its_next_attempt(
    make_runtime: Callable[..., wp.Runtime], db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A drive waits out a retry's backoff trusting its lease (confirmed moments ago, 30 s
    long) when its listening connection dies (a server restart, a terminated backend): its
    presence lock is free at once, and another worker takes the run over and records the
    retry. The first drive must ask the database before its own retry, not run a step
    whose outcome another process already recorded (seen in the fault suite)."""
    f.PRESENCE_CALLS.clear()
    holder, other = make_runtime(lease_ttl=30), make_runtime(lease_ttl=30)
    for rt in (holder, other):
        rt.register(f.presence_backoff_wf)
    wakeups = holder.wakeups()
    assert holder.owner.endswith("!") and wakeups.present
    execution_id = holder.client().start(f.presence_backoff_wf).execution_id
    driving = threading.Thread(target=holder.drive, args=(execution_id,), name="holder")
    driving.start()
    other.wakeups()  # listening already, as a worker is
    wait_until(lambda: len(f.PRESENCE_CALLS) == 1, what="the first attempt", timeout=10)
    admin = make_engine(db_url)
    with admin.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'wf_persist listener' AND datname = current_database()"
            )
        )
        # What another worker's reaper does the moment the lock is free.
        conn.execute(
            text(
                "UPDATE wf_executions SET wake_at = clock_timestamp(), "
                "lease_expires_at = clock_timestamp() WHERE id = :i"
            ),
            {"i": execution_id},
        )
        conn.commit()

    def drive() -> None:
        assert other.drive(execution_id) is True

    f.presence_taken_over(driving, other, execution_id, drive)


@pytest.mark.needs("embedded")
def test_a_sqlite_write_on_a_connection_closed_under_it_raises_sqlalchemys_error(
    runtime: wp.Runtime,
) -> None:
    """A step write on SQLite goes straight to the driver; on a driver connection closed
    behind SQLAlchemy's back it fails at its first touch (making the cursor): as
    SQLAlchemy's error, the connection invalidated, like every other failure there (it was
    ``sqlite3.ProgrammingError``, unwrapped, and the dead connection went back to the pool)."""
    now = dt.datetime.now(dt.UTC)
    event = NewEvent({"type": "test.closed"}, now)
    with runtime.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        raw.close()
        with pytest.raises(DBAPIError, match="closed database"):
            runtime.backend.write(conn, "no-such-run", 1, [event], now=now)
        assert conn.invalidated
