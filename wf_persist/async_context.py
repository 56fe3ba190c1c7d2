"""``async def`` workflows: the context they get, and how their body is run.

The body runs on an event loop of the drive's own. Each durable call it awaits is made by
the same synchronous machinery a plain workflow uses (:class:`~wf_persist.context.Context`),
on a helper thread, one call at a time in the order the body made them (an
``asyncio.Lock``): the history, the activity names and the replay rules are exactly those
of a synchronous workflow. An ``async def`` step is awaited back on the body's loop (its
``timeout`` cancels it); a synchronous step runs on the helper thread. Run steps
concurrently with ``await ctx.all([...])``: its branches run at once (async ones as tasks
on the body's loop), while calls awaited together with ``asyncio.gather`` take turns.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import functools
import uuid as _uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from . import bridge
from .authoring import Call, Step, Workflow, inside_body
from .children import ChildHandle
from .control import Halt, Reload, Suspended
from .loops import BODY_LOOP, on_own_loop
from .replay import Received, TimedOut

if TYPE_CHECKING:
    from .context import Context

R = TypeVar("R")
T = TypeVar("T")
Out = TypeVar("Out")


class AsyncContext:
    """Handed to an ``async def`` workflow as ``ctx``: the methods of
    :class:`~wf_persist.Context`, awaited."""

    def __init__(self, sync: Context, pools: bridge.Pools | None = None) -> None:
        self._sync = sync
        #: In the async worker (``pools`` given): each call runs in a greenlet on the
        #: body's loop (its blocking parts on the pools' threads), not on a thread.
        self._pools = pools
        self._turn = asyncio.Lock()
        #: Set once a call stopped this replay (it parked, reloads, lost the run): the
        #: calls awaiting their turn (``asyncio.gather``) must not start anything after it.
        self._stopped: BaseException | None = None

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async with self._turn:
            if self._stopped is not None:
                raise self._stopped.with_traceback(None)
            try:
                if self._pools is not None:
                    call = functools.partial(fn, *args, **kwargs)
                    return await bridge.spawn(call, pools=self._pools)
                context = contextvars.copy_context()  # carries the body's loop to the thread
                call = functools.partial(context.run, fn, *args, **kwargs)
                return await bridge.hand_over(None, call)
            except (Suspended, Reload, Halt) as stop:
                # Before the next call's turn; and for the runtime, which stops the body's
                # outcome too (a stop raised before the sync call began: a hand-over refused).
                self._stopped = self._sync._stopped = stop
                raise

    @property
    def execution_id(self) -> str:
        return self._sync.execution_id

    async def run(self, step: Step[R], *args: Any, **kwargs: Any) -> R:
        """:meth:`Context.run`."""
        return await self._call(self._sync.run, step, *args, **kwargs)

    async def all(
        self, calls: Sequence[Call[Any]], *, concurrency: int | None = None, name: str = "all"
    ) -> list[Any]:
        """:meth:`Context.all`: the branches run at once."""
        return await self._call(self._sync.all, calls, concurrency=concurrency, name=name)

    async def sleep(self, duration: dt.timedelta | float, *, name: str | None = None) -> None:
        """:meth:`Context.sleep`."""
        await self._call(self._sync.sleep, duration, name=name)

    async def wait_for_signal(
        self, name: str, payload_type: Any = Any, *, timeout: dt.timedelta | float | None = None
    ) -> Received[Any] | TimedOut:
        """:meth:`Context.wait_for_signal`."""
        return await self._call(self._sync.wait_for_signal, name, payload_type, timeout=timeout)

    async def code(
        self, name: str, fn: Callable[[], Any], *, output: Any = Any, reason: str | None = None
    ) -> Any:
        """:meth:`Context.code` (``fn`` may be ``async def``)."""
        return await self._call(self._sync.code, name, fn, output=output, reason=reason)

    async def now(self) -> dt.datetime:
        return await self._call(self._sync.now)

    async def random(self) -> float:
        return await self._call(self._sync.random)

    async def uuid(self) -> _uuid.UUID:
        return await self._call(self._sync.uuid)

    async def set_event(self, key: str, value: Any) -> None:
        await self._call(self._sync.set_event, key, value)

    async def start_child(
        self,
        workflow: Workflow[Any, Out] | str,
        payload: Any = None,
        *,
        version: int | None = None,
        cancel_with_parent: bool = True,
    ) -> ChildHandle[Out]:
        """:meth:`Context.start_child`."""
        return await self._call(
            self._sync.start_child,
            workflow,
            payload,
            version=version,
            cancel_with_parent=cancel_with_parent,
        )

    async def child_result(self, handle: ChildHandle[Out]) -> Out:
        """:meth:`Context.child_result`."""
        return await self._call(self._sync.child_result, handle)

    async def run_child(
        self,
        workflow: Workflow[Any, Out] | str,
        payload: Any = None,
        *,
        version: int | None = None,
        cancel_with_parent: bool = True,
    ) -> Out:
        handle = await self.start_child(
            workflow, payload, version=version, cancel_with_parent=cancel_with_parent
        )
        return await self.child_result(handle)

    def fail(self, error: BaseException) -> NoReturn:
        raise error


def call_body(wf: Workflow[Any, Any], ctx: Context, value: Any) -> Any:
    """Run the workflow function on ``ctx`` (and its input): a plain one here, an
    ``async def`` one on an event loop of its own (in this thread, or in a thread of its
    own when this thread already runs a loop, e.g. a caller inside an async app)."""
    args = (value,) if wf.takes_input else ()
    if not wf.is_async:
        with inside_body():
            return wf.fn(ctx, *args)

    bridged = bridge.bridged()
    pools = bridge.pools() if bridged else None

    async def main() -> Any:
        BODY_LOOP.set(asyncio.get_running_loop())
        with inside_body():
            return await wf.fn(AsyncContext(ctx, pools), *args)

    if bridged:  # the async worker's loop runs it (this drive's greenlet waits)
        # As a task in this drive's context (its trace), not the loop's waiting one.
        body = asyncio.get_running_loop().create_task(main(), context=contextvars.copy_context())
        return bridge.wait(body)
    return on_own_loop(main(), "wf-persist-async-body")
