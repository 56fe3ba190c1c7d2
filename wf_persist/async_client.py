"""The client for asyncio applications: :class:`AsyncClient`.

It is the thin :class:`~wf_persist.Client` driven through SQLAlchemy's asyncio extension:
every operation runs the same code (the same validation, the same store functions, the same
statements) in a greenlet of SQLAlchemy's, whose database I/O is awaited on the application's
event loop through an asyncio driver (psycopg 3's async mode, aiosqlite, aiomysql: the
``async`` extra). Nothing blocks the loop and no thread is used, so a web app's handlers can
start and await runs directly. A start may join the application's own ``AsyncSession`` (or
``AsyncConnection``) transaction: the run exists only if the application commits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.util import greenlet_spawn

from . import arguments, clocks
from .authoring import Workflow
from .backends import backend_type, describe_url, resolve_url
from .backends.connections import retire_pool
from .client import Client
from .errors import (
    ClosedError,
    EventNotSetError,
    InvalidArgumentError,
    ResultTimeoutError,
    UnsupportedDatabaseError,
)
from .records import (
    ExecutionHandle,
    ExecutionInfo,
    HistoryRecord,
    Outcome,
    Page,
    PendingSignal,
    WorkflowEntry,
)
from .runtime import Clock, utc_now
from .timeouts import positive
from .wakeups import ANY_END, HEAR_END, Wakeups

T = TypeVar("T")


class AsyncClient:
    """Starts, signals, cancels, awaits and inspects runs from asyncio code; never runs
    workflow code (workers do). The methods of :class:`~wf_persist.Client`, awaited.

    Args:
        bind: a database URL (its asyncio driver is chosen: ``sqlite+aiosqlite``,
            ``postgresql+psycopg``, ``mysql+aiomysql``) or an application's ``AsyncEngine``.
        schema, auto_migrate, poll_interval, clock: as for :class:`~wf_persist.Client`.

    Use ``async with AsyncClient(url) as client:`` or call :meth:`close`. A client serves
    one event loop (the one it is first used on): make one per loop.
    """

    def __init__(
        self,
        bind: str | URL | AsyncEngine | None = None,
        *,
        schema: str | None = None,
        auto_migrate: bool | None = None,
        poll_interval: float = 0.25,
        clock: Clock = utc_now,
    ) -> None:
        poll_seconds = positive(poll_interval, "poll_interval")
        if isinstance(bind, AsyncEngine):
            self.engine, self._owned = bind, False
        elif bind is None or isinstance(bind, str | URL):
            url = resolve_url(bind)
            kind = backend_type(url.get_backend_name())
            target = kind.async_url(url)
            try:
                self.engine = create_async_engine(target, **kind.async_engine_kwargs(target))
                kind.on_own_async_engine(self.engine.sync_engine)
            except ImportError as exc:
                raise UnsupportedDatabaseError(
                    f"no asyncio driver for {describe_url(target)} ({exc}); "
                    "install it with: pip install 'wf-persist[async]'"
                ) from exc
            except Exception as exc:  # an argument this driver does not take, and the like
                raise UnsupportedDatabaseError(
                    f"cannot create an engine for {describe_url(target)}: {exc}"
                ) from exc
            self._owned = True
            if auto_migrate is None:  # as wp.Client: an embedded database it opens is made
                auto_migrate = kind.embedded
        else:
            raise InvalidArgumentError(
                f"bind must be a database URL or an AsyncEngine, got {bind!r:.80}"
            )
        self._options: dict[str, Any] = {
            "schema": schema,
            "auto_migrate": auto_migrate,
            "poll_interval": poll_seconds,
            "clock": clock,
        }
        self._poll_interval = poll_seconds
        self._client: Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Future[None] | None = None
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._waiters_lock = threading.Lock()
        self._wakeups: Wakeups | None = None
        self._closed = False

    async def _sync(self) -> Client:
        """The thin client doing the work (made on first use: it reads the database)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            # Its pooled connections belong to the first loop (gone, or busy elsewhere).
            raise InvalidArgumentError(
                "an AsyncClient serves the event loop it was first used on: make one per loop"
            )
        if self._closed:  # its engine is disposed: a call would open a pool nobody closes
            raise ClosedError("AsyncClient")
        if self._client is None:
            opening = self._opening
            if opening is None:
                opening = self._opening = asyncio.ensure_future(self._open())
                opening.add_done_callback(_retrieved)
            # Shielded: a first use cancelled while the client reads the database lets the
            # read end and give its connection back (the other first uses wait for it too).
            await asyncio.shield(opening)
        assert self._client is not None
        return self._client

    async def _open(self) -> None:
        try:
            client = await greenlet_spawn(Client, self.engine.sync_engine, **self._options)
            if self._closed:  # closed while it opened: on an engine disposed of since
                client.close()
                if self._owned:  # a pool it may have made after the close's disposal
                    await self.engine.dispose()
                raise ClosedError("AsyncClient")
            self._client = client
        finally:
            self._opening = None  # failed: the next use tries again

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(client, ...)`` in SQLAlchemy's greenlet, shielded from the caller's
        cancellation (see :func:`_shielded`): a call cancelled mid-way runs to its end, its
        write committed or not as it would have been, and gives its connection back."""
        client = await self._sync()
        return await _shielded(greenlet_spawn(fn, client, *args, **kwargs))

    async def close(self) -> None:
        """Stop listening and dispose of the engine if this client created it. Later calls
        raise :class:`~wf_persist.errors.ClosedError`."""
        self._closed = True
        if self._wakeups is not None:
            await asyncio.to_thread(self._wakeups.stop)
        if self._client is not None:
            self._client.close()
        if self._owned:
            old = self.engine.sync_engine.pool
            await self.engine.dispose()
            await greenlet_spawn(retire_pool, old)  # connections still out close when back

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # operations -------------------------------------------------------------------------

    async def start(
        self,
        workflow: Workflow[Any, Any] | str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        actor: str | None = None,
        version: int | None = None,
        session: AsyncSession | AsyncConnection | None = None,
        timeout: Any = None,
    ) -> ExecutionHandle:
        """:meth:`Client.start`; with ``session`` the run is written in the application's
        own transaction (its ``AsyncSession`` or ``AsyncConnection``)."""
        client = await self._sync()
        kwargs: dict[str, Any] = {
            "idempotency_key": idempotency_key,
            "actor": actor,
            "version": version,
            "timeout": timeout,
        }
        if session is None:
            return await self._run(Client.start, workflow, payload, **kwargs)
        if isinstance(session, AsyncSession):
            conn = await session.connection()
        elif isinstance(session, AsyncConnection):
            conn = session
        else:
            raise InvalidArgumentError(
                f"session must be an AsyncSession or AsyncConnection, got {session!r:.80}"
            )
        return await conn.run_sync(
            lambda sync_conn: client.start(workflow, payload, session=sync_conn, **kwargs)
        )

    async def result(self, execution_id: str, timeout: float | None = None) -> Outcome:
        """Wait for the run to end (workers drive it) and return its outcome: it is read
        after 2 ms, then twice as long each time, at most every ``poll_interval``, and at
        once when the database announces its end (PostgreSQL)."""
        execution_id = arguments.check_id(execution_id)
        timeout = arguments.check_timeout(timeout)
        deadline = None if timeout is None else clocks.elapsed() + timeout
        delay = 0.002
        event = asyncio.Event()
        mine = (asyncio.get_running_loop(), event)
        await self._listen()
        with self._waiters_lock:
            self._waiters.setdefault(execution_id, set()).add(mine)
        try:
            while True:
                event.clear()
                found = await self._run(Client.outcome, execution_id)
                if found is not None:
                    return found
                remaining = None if deadline is None else deadline - clocks.elapsed()
                if remaining is not None and remaining <= 0:
                    raise ResultTimeoutError(execution_id, float(timeout or 0))
                wait = min(delay, self._poll_interval)
                if not await _heard_within(
                    event, wait if remaining is None else min(wait, remaining)
                ):
                    delay = min(delay * 2, self._poll_interval)
        finally:
            with self._waiters_lock:
                left = self._waiters.get(execution_id, set())
                left.discard(mine)
                if not left:
                    self._waiters.pop(execution_id, None)

    async def _listen(self) -> None:
        """Hear of ends where the database notifies (a thread of its own, started once)."""
        client = await self._sync()
        if self._wakeups is None and client.backend.can_listen:
            self._wakeups = Wakeups(client.backend, hear=(HEAR_END,))
            self._wakeups.on_end(self._heard)
            await asyncio.to_thread(self._wakeups.start)

    def _heard(self, execution_id: str) -> None:
        """On the listening thread: wake the waits for that run (all, after a reconnect)."""
        with self._waiters_lock:
            if execution_id == ANY_END:
                found = [w for ws in self._waiters.values() for w in ws]
            else:
                found = list(self._waiters.get(execution_id, ()))
        for loop, event in found:
            loop.call_soon_threadsafe(event.set)

    async def signal(self, execution_id: str, name: str, payload: Any = None, **kw: Any) -> str:
        """:meth:`Client.signal`."""
        return await self._run(Client.signal, execution_id, name, payload, **kw)

    async def cancel(
        self, execution_id: str, *, compensate: bool = True, actor: str | None = None
    ) -> None:
        """:meth:`Client.cancel`."""
        await self._run(Client.cancel, execution_id, compensate=compensate, actor=actor)

    async def status(self, execution_id: str) -> str:
        return await self._run(Client.status, execution_id)

    async def describe(self, execution_id: str) -> ExecutionInfo:
        return await self._run(Client.describe, execution_id)

    async def outcome(self, execution_id: str) -> Outcome | None:
        return await self._run(Client.outcome, execution_id)

    async def history(self, execution_id: str) -> Sequence[HistoryRecord]:
        return await self._run(Client.history, execution_id)

    async def pending_signals(self, execution_id: str) -> list[PendingSignal]:
        return await self._run(Client.pending_signals, execution_id)

    async def list(self, workflow: Workflow[Any, Any] | str | None = None, **kw: Any) -> Page:
        """:meth:`Client.list`."""
        return await self._run(Client.list, workflow, **kw)

    async def workflows(self, name: str | None = None) -> Sequence[WorkflowEntry]:
        return await self._run(Client.workflows, name)

    async def events(self, execution_id: str) -> dict[str, Any]:
        """:meth:`Client.events`."""
        return await self._run(Client.events, execution_id)

    async def get_event(self, execution_id: str, key: str, *, timeout: float | None = None) -> Any:
        """:meth:`Client.get_event`: between looks (2 ms, then twice as long each time, at
        most every ``poll_interval``) the loop is free."""
        timeout = arguments.check_timeout(timeout)
        deadline = None if timeout is None else clocks.elapsed() + timeout
        delay = 0.002
        while True:
            try:  # one look
                return await self._run(Client.get_event, execution_id, key, timeout=0)
            except EventNotSetError as exc:
                if exc.finished:
                    raise
            remaining = None if deadline is None else deadline - clocks.elapsed()
            if remaining is not None and remaining <= 0:
                raise EventNotSetError(execution_id, key, finished=False)
            wait = min(delay, self._poll_interval)
            await asyncio.sleep(wait if remaining is None else min(wait, remaining))
            delay = min(delay * 2, self._poll_interval)

    async def purge(self, **kw: Any) -> int:
        """:meth:`Client.purge`."""
        return await self._run(Client.purge, **kw)


async def _heard_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` was set within ``seconds``. Not ``asyncio.wait_for``: on Python
    3.11 it returns, swallowing the cancellation, when the event is set just as its
    caller is cancelled, and a cancelled ``result()`` then waited on for ever."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=seconds)
    finally:
        waiter.cancel()
    return event.is_set()


def _retrieved(done: asyncio.Future[Any]) -> None:
    """What a task nobody may await any more raised: retrieved, not logged as lost."""
    if not done.cancelled():
        done.exception()


async def _shielded(read: Coroutine[Any, Any, T]) -> T:
    """``read`` shielded from its caller's cancellation: a call cancelled mid-way lets its
    statements end and give their connection back (cancelled, the driver's I/O was cut and
    the connection left checked out until the garbage collector found it, aiomysql and
    aiosqlite); what it raises then is retrieved, not logged."""
    task = asyncio.ensure_future(read)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_retrieved)
        raise
