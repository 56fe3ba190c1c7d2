"""``wp.AsyncClient``: the thin client on SQLAlchemy's asyncio extension and async drivers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import wf_persist as wp
from wf_persist.backends import backend_type, normalize_url

from .fixtures import messaging
from .fixtures import workflows as w
from .helpers import wait_until


def _async_url(db_url: str) -> str:
    url = normalize_url(db_url)
    return backend_type(url.get_backend_name()).async_url(url).render_as_string(False)


def test_an_async_app_starts_signals_cancels_and_awaits_runs(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*w.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)

    async def app() -> None:
        async with wp.AsyncClient(db_url) as client:
            handle = await client.start("echo", 3, actor="web")
            done = await client.result(handle.execution_id, timeout=30)
            assert done.unwrap() == [1, 2, 3]
            assert await client.status(handle.execution_id) == "completed"
            info = await client.describe(handle.execution_id)
            assert info.actor == "web"
            assert [r.event["type"] for r in await client.history(handle.execution_id)][-1] == (
                "workflow.completed"
            )
            waiting = (await client.start("approval", None)).execution_id
            while not await client.pending_signals(waiting):
                await asyncio.sleep(0.02)
            await client.signal(waiting, "approval", {"approved": True})
            assert (await client.result(waiting, timeout=30)).unwrap() == "approved"
            doomed = (await client.start("approval", None)).execution_id
            while not await client.pending_signals(doomed):
                await asyncio.sleep(0.02)
            await client.cancel(doomed, compensate=False)
            failed = await client.result(doomed, timeout=30)
            assert isinstance(failed, wp.Failed) and failed.error["name"] == "Cancelled"
            page = await client.list("echo")
            assert [i.execution_id for i in page.items] == [handle.execution_id]
            assert await client.outcome(handle.execution_id) == done

    asyncio.run(app())


def _threads() -> int:
    """Threads other than the worker's own (its slots start as runs come)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("wf-persist"))


def test_many_waits_share_the_event_loop_without_a_thread_each(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*w.ALL)
    runtime.start_worker(concurrency=8, poll_interval=0.05)

    async def app() -> int:
        async with wp.AsyncClient(db_url) as client:
            handles = await asyncio.gather(*(client.start("echo", 2) for _ in range(60)))
            before = _threads()
            results = asyncio.gather(*(client.result(h.execution_id, timeout=60) for h in handles))
            await asyncio.sleep(0.05)
            during = _threads()
            outcomes = await results
            assert during - before < 20, (
                "no thread per waiting call (aiosqlite: one per pooled connection)"
            )
            return sum(1 for o in outcomes if o.unwrap() == [1, 2])

    assert asyncio.run(app()) == 60


def test_a_start_in_the_apps_async_session_exists_only_if_it_commits(
    runtime: wp.Runtime, db_url: str, make_engine: Callable[..., Any], host_tables: Any
) -> None:
    runtime.register(*w.ALL)
    orders = Table("async_orders", MetaData(), Column("id", Integer, primary_key=True))
    host_tables.create(make_engine(db_url), orders)

    async def app() -> tuple[str, str]:
        engine = create_async_engine(_async_url(db_url))
        try:
            client = wp.AsyncClient(engine)  # the app's engine: not disposed by close()
            async with AsyncSession(engine) as session:
                await session.execute(orders.insert().values(id=1))
                kept = await client.start("echo", 1, session=session)
                await session.commit()
            async with AsyncSession(engine) as session:
                await session.execute(orders.insert().values(id=2))
                lost = await client.start("echo", 1, session=session)
                await session.rollback()
            await client.close()
            async with engine.connect() as conn:  # still usable
                count = (await conn.execute(select(func.count()).select_from(orders))).scalar()
            assert count == 1
            return kept.execution_id, lost.execution_id
        finally:
            await engine.dispose()

    kept, lost = asyncio.run(app())
    client = runtime.client()
    assert client.result(kept, timeout=30).status == "completed"
    with pytest.raises(wp.UnknownExecutionError):
        client.status(lost)


def test_bad_input_gets_one_typed_error_and_writes_nothing(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*w.ALL)

    async def app() -> None:
        async with wp.AsyncClient(db_url, poll_interval=0.05) as client:
            with pytest.raises(wp.InvalidPayloadError):
                await client.start("order", {"sku": 5})
            with pytest.raises(wp.UnknownWorkflowError):
                await client.start("no-such-workflow")
            with pytest.raises(wp.UnknownExecutionError):
                await client.result("0d5e9c4e-9a7b-4a7e-9d8b-1c2d3e4f5a6b", timeout=1)
            with pytest.raises(wp.InvalidArgumentError):
                await client.result("not an id\0", timeout=1)
            with pytest.raises(wp.InvalidArgumentError):
                await client.start("echo", 1, session=object())  # type: ignore[arg-type]
            waiting = (await client.start("approval", None)).execution_id
            with pytest.raises(wp.ResultTimeoutError):
                await client.result(waiting, timeout=0.2)
            assert [i.workflow_name for i in (await client.list()).items] == ["approval"]

    asyncio.run(app())
    with pytest.raises(wp.InvalidArgumentError):
        wp.AsyncClient(42)  # type: ignore[arg-type]


def test_an_embedded_sqlite_file_it_opens_is_created_and_migrated(tmp_path: Path) -> None:
    """As ``wp.Client``: a SQLite URL the client opens itself gets its schema."""

    async def app() -> list[str]:
        async with wp.AsyncClient(f"sqlite:///{tmp_path / 'new.sqlite3'}") as client:
            return [e.name for e in await client.workflows()]

    assert asyncio.run(app()) == []
    assert (tmp_path / "new.sqlite3").exists()


def test_a_client_serves_one_event_loop_and_says_so_on_another(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(*w.ALL)
    client = wp.AsyncClient(db_url)

    async def first() -> str:
        try:
            return (await client.start("echo", 1)).execution_id
        finally:
            await client.close()  # its connections end with their loop

    async def second() -> None:
        await client.status(started)

    started = asyncio.run(first())
    with pytest.raises(wp.InvalidArgumentError, match="one per loop"):
        asyncio.run(second())
    assert runtime.client().result(started, timeout=30).status == "completed"


def test_waits_cancelled_at_any_moment_end_and_give_their_connections_back(
    runtime: wp.Runtime, db_url: str
) -> None:
    """Tasks awaiting ``result()`` cancelled at any moment, a read in flight or an end
    heard among them: every one ends cancelled (on Python 3.11 ``asyncio.wait_for`` let a
    cancellation go when its event was set at that moment, and that wait went on for
    ever), and the reads give their connections back (else left checked out until the
    garbage collector found them)."""
    runtime.register(*w.ALL)
    handle = runtime.client().start(w.approval_wf, None)  # no worker: never ends

    async def app() -> tuple[list[str], int]:
        outcomes: list[str] = []
        async with wp.AsyncClient(db_url, poll_interval=0.01) as client:
            for rep in range(20):
                waits = [asyncio.create_task(client.result(handle.execution_id)) for _ in range(20)]
                await asyncio.sleep(0.001 * rep)
                for task in waits:
                    task.cancel()
                async with asyncio.timeout(30):  # the old wait never ended
                    done = await asyncio.gather(*waits, return_exceptions=True)
                outcomes += sorted({type(d).__name__ for d in done})
            pool: Any = client.engine.sync_engine.pool
            for _ in range(250):  # the reads cancelled mid-way end meanwhile (5 s at most)
                if pool.checkedout() == 0:
                    break
                await asyncio.sleep(0.02)
            return sorted(set(outcomes)), int(pool.checkedout())

    assert asyncio.run(app()) == (["CancelledError"], 0)


def test_a_close_racing_the_first_results_listener_closes_everything(
    runtime: wp.Runtime, db_url: str
) -> None:
    """``close()`` while the first ``result()`` starts listening (on PostgreSQL): the
    listener's thread was made but not started, ``close()`` raised a bare ``RuntimeError``
    joining it, and left the engine's connections and the listening thread behind."""
    runtime.register(*w.ALL)
    handle = runtime.client().start(w.approval_wf, None)  # no worker: never ends

    async def attempt(turns: int) -> tuple[str, Any]:
        client = wp.AsyncClient(db_url)
        await client.workflows()
        waiting = asyncio.ensure_future(client.result(handle.execution_id, timeout=5))
        for _ in range(turns):
            await asyncio.sleep(0)
        await client.close()  # raises nothing
        (ended,) = await asyncio.gather(waiting, return_exceptions=True)
        return type(ended).__name__, client.engine.sync_engine.pool

    async def app() -> list[tuple[str, Any]]:
        return [await attempt(turns) for turns in range(12)]

    before = set(threading.enumerate())
    ended = asyncio.run(app())
    assert {name for name, _ in ended} == {"ClosedError"}
    assert all(pool.checkedout() == 0 for _, pool in ended)

    def quiet() -> bool:
        return not [
            t for t in set(threading.enumerate()) - before if t.name == "wf-persist-wakeups"
        ]

    wait_until(quiet, what="every listening thread ended", timeout=15)


def test_every_call_cancelled_mid_way_gives_its_connection_back(
    runtime: wp.Runtime, db_url: str
) -> None:
    """Only ``result()``'s reads were shielded: ``status``, ``list``, ``signal``, ``start``
    and the rest cancelled mid-statement (``asyncio.wait_for`` with a tiny timeout) left
    their connection checked out, found later by the garbage collector (aiomysql,
    aiosqlite). A cancelled start still ends as it would have: its run is there or not."""
    runtime.register(*w.ALL)
    waiting = runtime.client().start(w.approval_wf, None).execution_id

    async def app() -> tuple[int, int, int]:
        started = 0
        async with wp.AsyncClient(db_url, poll_interval=0.01) as client:
            await client.list(limit=1)  # opened: its first use is shielded already
            calls: list[Callable[[], Any]] = [
                lambda: client.status(waiting),
                lambda: client.list(),
                lambda: client.history(waiting),
                lambda: client.signal(waiting, "nope", 1, buffer=True),
                lambda: client.start(w.echo_wf.name, 2),
                lambda: client.workflows(),
            ]
            for rep in range(12):
                for call in calls:
                    with contextlib.suppress(TimeoutError, wp.WfPersistError):
                        await asyncio.wait_for(call(), 0.0005 * rep)
            pool: Any = client.engine.sync_engine.pool
            for _ in range(250):  # calls cancelled mid-way end meanwhile (5 s at most)
                if pool.checkedout() == 0:
                    break
                await asyncio.sleep(0.02)
            left = int(pool.checkedout())
            started = (await client.list(w.echo_wf.name, limit=100)).items.__len__()
            return left, started, len(await client.history(waiting))

    left, started, events = asyncio.run(app())
    assert left == 0
    assert 0 <= started <= 12 and events >= 2  # cancelled or not, each start whole


def test_it_has_every_method_of_the_thin_client_and_waits_for_an_event_off_the_loop(
    runtime: wp.Runtime, db_url: str
) -> None:
    """``events``, ``get_event`` and ``purge`` too; ``get_event`` waits with the loop free
    (another task ticks meanwhile)."""
    public = {n for n in dir(wp.Client) if not n.startswith("_")}
    assert public <= {n for n in dir(wp.AsyncClient) if not n.startswith("_")}
    runtime.register(*messaging.ALL)
    run = runtime.client().start(messaging.publisher_wf, 7).execution_id

    async def app() -> tuple[Any, dict[str, Any], int, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async with wp.AsyncClient(db_url) as client:
            ticker = asyncio.create_task(tick())
            with pytest.raises(wp.EventNotSetError):
                await client.get_event(run, "value", timeout=0.3)
            seen = ticks
            threading.Thread(target=runtime.drive, args=(run,)).start()
            value = await client.get_event(run, "value", timeout=30)
            everything = await client.events(run)
            ticker.cancel()
            await client.result(run, timeout=30)
            purged = await client.purge(older_than=dt.timedelta(0))
            return value, everything, seen, purged

    value, everything, seen, purged = asyncio.run(app())
    assert (value, everything, purged) == (7, {"value": 7}, 1)
    assert seen >= 10  # the loop ticked while get_event waited
