"""Closing lets go of every connection: one checked out while its runtime or client closes
(a read in another thread, a renewal outliving the keeper's wait) is closed when it is given
back, not left in the replaced pool to be garbage-collected open."""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

import wf_persist as wp
from wf_persist import backends
from wf_persist.leases import LeaseKeeper
from wf_persist.worker import Worker


def _closed(raw: Any) -> bool:
    """Whether a DBAPI connection is closed (every driver refuses a statement on one)."""
    try:
        raw.cursor().execute("SELECT 1")
    except Exception:
        return True
    return False


def test_a_connection_out_when_its_runtime_closes_is_closed_when_given_back(db_url: str) -> None:
    rt = wp.Runtime(db_url)
    conn = rt.engine.connect()
    raw = conn.connection.dbapi_connection
    rt.close()
    assert not _closed(raw)  # still the borrower's until given back
    conn.close()
    assert _closed(raw)
    del conn, raw
    gc.collect()  # nothing open left to collect (psycopg would warn, failing the test)


def test_a_connection_out_when_its_client_closes_is_closed_when_given_back(db_url: str) -> None:
    client = wp.Client(db_url)
    conn = client.engine.connect()
    raw = conn.connection.dbapi_connection
    client.close()
    conn.close()
    assert _closed(raw)


def test_an_engine_disposed_twice_with_a_connection_out_closes_it_once(db_url: str) -> None:
    engine = backends.create_engine(db_url)
    conn = engine.connect()
    raw = conn.connection.dbapi_connection
    backends.dispose_engine(engine)
    backends.dispose_engine(engine)
    conn.close()
    assert _closed(raw)
    with engine.connect() as fresh:  # the engine itself goes on, on a new pool
        assert fresh.exec_driver_sql("SELECT 1").scalar() == 1
        again = fresh.connection.dbapi_connection
    assert not _closed(again)  # a connection of the new pool goes back into it, open
    backends.dispose_engine(engine)
    assert _closed(again)


def test_a_stopped_lease_keeper_makes_no_engine_of_its_own_again(db_url: str) -> None:
    """A renewal that outlived stop()'s wait would make a pool nothing disposes of."""
    with wp.Runtime(db_url) as rt:
        keeper = rt.keeper()
        keeper.engine()
        keeper.stop()
        with pytest.raises(wp.WfPersistError, match="stopped"):
            keeper.engine()


def test_a_connection_out_when_an_async_client_closes_is_closed_when_given_back(
    db_url: str,
) -> None:
    async def app() -> tuple[bool, bool]:
        client = wp.AsyncClient(db_url)
        conn = await client.engine.connect()
        raw = (await conn.get_raw_connection()).dbapi_connection
        await client.close()
        assert raw is not None
        before = _closed_async(raw)
        await conn.close()
        return before, _closed_async(raw)

    before, after = asyncio.run(app())
    assert (before, after) == (False, True)


def _closed_async(adapted: Any) -> bool:
    """Whether an asyncio driver's connection (behind SQLAlchemy's adapter) is closed."""
    driver = adapted.driver_connection
    if isinstance(getattr(driver, "closed", None), bool):  # psycopg, aiomysql
        return bool(driver.closed)
    return driver._connection is None  # aiosqlite drops its sqlite3 connection


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wf-persist-worker" and t.is_alive()]


def _new_workers_after_settling(before: set[threading.Thread]) -> set[threading.Thread]:
    """Worker threads not in ``before`` still alive after up to 10 s for them to end."""
    deadline = time.monotonic() + 10
    while set(_workers_alive()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return set(_workers_alive()) - before


def test_a_closed_runtime_starts_no_worker(db_url: str) -> None:
    """Before, start_worker() after close() started a loop that polled for good, on a pool
    the close had disposed of (new connections nothing closed)."""
    before = _workers_alive()
    rt = wp.Runtime(db_url)
    rt.close()
    with pytest.raises(wp.WfPersistError, match="closed"):
        rt.start_worker(poll_interval=0.05)
    with pytest.raises(wp.WfPersistError, match="closed"):
        Worker(rt, poll_interval=0.05).run()  # a loop run directly, as the CLI does
    assert _workers_alive() == before
    with pytest.raises(wp.WfPersistError, match="stopped"):
        rt.keeper().engine()


def test_close_racing_start_worker_leaves_no_loop_running(db_url: str) -> None:
    before = set(_workers_alive())
    failures: list[BaseException] = []
    for _ in range(20):
        rt = wp.Runtime(db_url)
        ready = threading.Barrier(2)

        def start(rt: wp.Runtime = rt, ready: threading.Barrier = ready) -> None:
            ready.wait()
            try:
                rt.start_worker(poll_interval=0.05)
            except wp.WfPersistError:
                pass  # closed first
            except BaseException as exc:
                failures.append(exc)

        starter = threading.Thread(target=start)
        starter.start()
        ready.wait()
        rt.close(timeout=5)
        starter.join(10)
    assert failures == []
    assert _new_workers_after_settling(before) == set()


def test_disposing_while_a_host_checkin_listener_runs_still_closes_the_connection(
    db_url: str,
) -> None:
    """A pool's checkin listeners are iterated unlocked: adding one of ours while another
    thread ran a host's (copied into a side engine's pool) failed that thread's close()
    ("deque mutated during iteration") and left its connection open."""
    engine = backends.create_engine(db_url)
    inside = threading.Event()

    @event.listens_for(engine, "checkin")
    def metrics(_dbapi: Any, _record: Any) -> None:
        inside.set()
        time.sleep(0.3)

    conn = engine.connect()
    raw = conn.connection.dbapi_connection
    failures: list[BaseException] = []

    def give_back() -> None:
        try:
            conn.close()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=give_back)
    thread.start()
    assert inside.wait(10)
    backends.dispose_engine(engine)
    thread.join(10)
    assert failures == []
    assert _closed(raw)


class _StopsAsItRenews(threading.Event):
    """The keeper's stop event, made to lose the race once: the renewal passes its wait
    just as stop() begins (a close() at that instant)."""

    def __init__(self, keeper: Callable[[], Any]) -> None:
        super().__init__()
        self.keeper = keeper
        self.armed = True

    def wait(self, timeout: float | None = None) -> bool:
        if self.armed and not self.is_set():
            self.armed = False
            threading.Thread(target=self.keeper().stop).start()
            time.sleep(0.2)  # the renewal goes on meanwhile
            return False
        return super().wait(timeout)


def test_a_keeper_stopped_during_a_renewal_ends_without_reporting_an_outage(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with wp.Runtime(db_url) as rt:
        keeper = LeaseKeeper(rt.backend, 30.0)
        keeper._stop_event = _StopsAsItRenews(lambda: keeper)
        keeper.hold("00000000-0000-0000-0000-000000000001", 1)
        with caplog.at_level(logging.WARNING, logger="wf_persist"):
            keeper.start()
            keeper.join(10)
            keeper.warm()  # a worker starting as its runtime closes
        assert not keeper.is_alive()
        assert [r.getMessage() for r in caplog.records] == []


def test_close_between_a_workers_registration_and_its_thread_start_closes_fully(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() joined a worker thread not started yet: RuntimeError half-way through,
    the keeper left running and the engine not disposed of."""
    start = threading.Thread.start

    def late_start(thread: threading.Thread) -> None:
        if thread.name == "wf-persist-worker":
            time.sleep(0.3)  # the gap between the worker's registration and its start
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", late_start)
    before = set(_workers_alive())
    rt = wp.Runtime(db_url)
    keeper = rt.keeper()
    starter = threading.Thread(target=rt.start_worker, kwargs={"poll_interval": 0.05})
    start(starter)
    time.sleep(0.1)
    rt.close(timeout=2)
    starter.join(10)
    assert _new_workers_after_settling(before) == set()
    assert not keeper.is_alive()


def test_a_second_worker_loop_on_a_runtime_is_refused(db_url: str) -> None:
    """close() stops the loop the runtime knows; a second one ran on after it."""
    with wp.Runtime(db_url) as rt:
        rt.start_worker(poll_interval=0.05)
        with pytest.raises(wp.WfPersistError, match="worker already"):
            Worker(rt, poll_interval=0.05).run()


@wp.workflow(name="dispose-one", version=1)
def _one(ctx: wp.Context) -> int:
    return 1


_RUN = "00000000-0000-4000-8000-000000000000"

#: Every public call of a client, with arguments it would take.
_CALLS: dict[str, Callable[[Any], Any]] = {
    "start": lambda c: c.start("dispose-one"),
    "result": lambda c: c.result(_RUN, timeout=0.1),
    "outcome": lambda c: c.outcome(_RUN),
    "status": lambda c: c.status(_RUN),
    "describe": lambda c: c.describe(_RUN),
    "history": lambda c: c.history(_RUN),
    "list": lambda c: c.list("dispose-one"),
    "pending_signals": lambda c: c.pending_signals(_RUN),
    "events": lambda c: c.events(_RUN),
    "get_event": lambda c: c.get_event(_RUN, "e"),
    "signal": lambda c: c.signal(_RUN, "s", 1),
    "cancel": lambda c: c.cancel(_RUN),
    "purge": lambda c: c.purge(older_than=datetime.timedelta(days=1)),
    "workflows": lambda c: c.workflows(),
}


def _execute(client: Any) -> Any:
    return client.execute(_one)


def _checkouts(engine: Any) -> list[object]:
    seen: list[object] = []
    event.listen(engine, "checkout", lambda *a: seen.append(a[0]))
    return seen


def test_every_call_of_a_closed_runtimes_client_or_a_closed_client_is_closed_error(
    db_url: str,
) -> None:
    """Before, a client of a closed runtime (and a closed ``wp.Client``) went on working
    through a new pool of the disposed engine, whose connections nothing closed."""
    rt = wp.Runtime(db_url)
    rt.register(_one)
    embedded = rt.client()
    rt.close()
    thin = wp.Client(db_url)
    thin.close()
    for client, what in ((embedded, "Workflow runtime"), (thin, "Client")):
        seen = _checkouts(client.engine)
        calls = dict(_CALLS)
        if client is embedded:
            calls["execute"] = _execute
        for name, call in calls.items():
            with pytest.raises(wp.ClosedError, match=f"^{what} has been closed$"):
                call(client)
            assert seen == [], name
    with pytest.raises(wp.ClosedError):
        rt.register(_one)


def test_every_call_of_a_closed_async_client_is_closed_error(db_url: str) -> None:
    """Also one closed before its first call (which made its thin client, on a new pool)."""

    async def app() -> None:
        used = wp.AsyncClient(db_url)
        await used.workflows()
        fresh = wp.AsyncClient(db_url)
        for client in (used, fresh):
            await client.close()
            seen = _checkouts(client.engine.sync_engine)
            for name in _CALLS:
                with pytest.raises(wp.ClosedError, match=r"^AsyncClient has been closed$"):
                    await _CALLS[name](client)
                assert seen == [], name
            await client.close()  # idempotent

    asyncio.run(app())


_STEP_GATE = threading.Event()
_STEP_IN = threading.Event()
_CLOSING: list[wp.Runtime] = []


@wp.workflow(name="dispose-other", version=1)
def _other(ctx: wp.Context) -> int:
    return 1


@wp.step(retry=wp.Retry(attempts=1))
def _starts_another() -> str:
    _STEP_IN.set()
    _STEP_GATE.wait(10)
    return _CLOSING[0].client().start(_other, idempotency_key="other").execution_id


@wp.workflow(name="dispose-main", version=1)
def _main(ctx: wp.Context) -> str:
    return ctx.run(_starts_another)


def test_a_step_in_flight_while_its_runtime_closes_may_still_use_its_client(db_url: str) -> None:
    """Graceful shutdown lets runs in flight stop at their next step: such a step that
    starts a run through the runtime's client had that refused (ClosedError recorded as
    the step's failure, the run failed for good) once the client checked for a close."""
    _STEP_GATE.clear()
    _STEP_IN.clear()
    rt = wp.Runtime(db_url)
    _CLOSING[:] = [rt]
    rt.register(_main, _other)
    handle = rt.client().start(_main)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    assert _STEP_IN.wait(10)
    closing = threading.Thread(target=rt.close, kwargs={"timeout": 10})
    closing.start()
    time.sleep(0.3)
    _STEP_GATE.set()
    closing.join()
    with wp.Client(db_url) as thin:
        kinds = [r.event["type"] for r in thin.history(handle.execution_id)]
        assert "step.completed" in kinds and "step.failed" not in kinds, kinds
        assert thin.status(handle.execution_id) == "running"  # handed over, not failed
        assert thin.list("dispose-other").items  # the step's start went through


def test_a_wait_in_flight_when_its_client_closes_ends_with_closed_error(db_url: str) -> None:
    """A ``result()`` waiting in another thread went on looking through a new pool of the
    disposed engine (a connection checked out at every look) until its timeout."""
    rt = wp.Runtime(db_url)
    rt.register(_main, _other)
    run = rt.client().start(_other).execution_id  # nobody drives it
    rt.close()
    thin = wp.Client(db_url, poll_interval=0.02)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            thin.result(run, timeout=30)
        except BaseException as exc:
            raised.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.3)
    thin.close()
    seen = _checkouts(thin.engine)
    waiting.join(10)
    assert not waiting.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], wp.ClosedError), raised
    assert len(seen) <= 1  # at most a look that was under way


def test_an_async_client_closed_while_its_first_call_opens_it_keeps_no_pool(db_url: str) -> None:
    """The first call opened the thin client on the engine the close had disposed of, and
    went on through a new pool that nothing closed (a server session left open)."""

    async def app() -> None:
        client = wp.AsyncClient(db_url)
        call = asyncio.ensure_future(client.workflows())
        await asyncio.sleep(0)  # the first call is opening the thin client
        await asyncio.sleep(0)
        await client.close()
        with pytest.raises(wp.ClosedError):
            await call
        pool = client.engine.sync_engine.pool
        assert pool.checkedout() == 0 and pool.checkedin() == 0, pool.status()  # type: ignore[attr-defined]

    asyncio.run(app())
