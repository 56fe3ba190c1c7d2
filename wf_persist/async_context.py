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
import contextlib
import contextvars
import datetime as dt
import functools
import logging
import threading
import uuid as _uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from . import bridge
from .authoring import Call, Step, Workflow, inside_body
from .children import ChildHandle
from .control import Halt, Reload, Suspended, fail_with
from .errors import Cancelled
from .logs import run_fields
from .loops import BODY_LOOP, on_own_loop
from .replay import Received, TimedOut

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger("wf_persist.runtime")

#: Seconds between the log lines of a body waiting for a call it cancelled to end.
SETTLE_NOTICE = 60.0

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
        #: The durable call under way, if one is.
        self._flying: _Flight | None = None
        #: Set once the body ended: a call made after (a task it left behind) never begins.
        self._over = False

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        flight = _Flight(fn, args)
        try:
            waited = self._turn.locked()
            async with self._turn:
                if waited:
                    # The call before this one ended just now: a cancel on its way (from a
                    # TaskGroup whose task that call failed) lands before this one begins.
                    await asyncio.sleep(0)
                if self._over:
                    raise asyncio.CancelledError
                if self._stopped is not None:
                    raise self._stopped.with_traceback(None)
                if self._sync.divergence is not None:  # a cancel before: nothing new may run
                    raise self._sync.divergence.with_traceback(None)
                try:
                    return await self._in_flight(flight, functools.partial(fn, *args, **kwargs))
                except Exception as error:  # the call's own failure (a failed step's)
                    self._sync._raised_by_calls.append(error)
                    raise
                except (Suspended, Reload, Halt) as stop:
                    # Before the next call's turn; and for the runtime, which stops the body's
                    # outcome too (a stop raised before the sync call began: a hand-over
                    # refused).
                    self._stopped = self._sync._stopped = stop
                    raise
        except asyncio.CancelledError:
            if not self._over and not flight.cancel_began():  # a replay's might begin
                self._sync._cancelled(flight.described(), "cancelled it before it began")
            raise

    async def _in_flight(self, flight: _Flight, call: Callable[[], T]) -> T:
        """``call`` made by the sync machinery. A cancel of the body's await (its own
        ``wait_for``, ``timeout``, ``task.cancel``) cannot stop it: it runs to its end, and
        records in order, before the body hears ``CancelledError``. A cancel that lands
        before the call began drops it: nothing runs. Either way the run fails (see
        :class:`CancelledCallError`)."""
        gated = flight.gated(call)
        if self._pools is not None:
            started: asyncio.Future[T] = asyncio.ensure_future(
                bridge.spawn(gated, pools=self._pools)
            )
        else:
            context = contextvars.copy_context()  # carries the body's loop to the thread
            started = bridge.hand_over(None, functools.partial(context.run, gated))
        flight.started = started
        self._flying = flight
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            if flight.cancel_began() and not flight.cancelled_itself():
                ended = await self._settle(flight, "cancelled it while it ran")
                if ended is not None:  # a stop, or the run's cancellation: as if not cut
                    raise ended.with_traceback(None) from None
            raise
        finally:
            self._flying = None

    async def _settle(self, flight: _Flight, how: str) -> BaseException | None:
        """Wait for a call the body cancelled, or left behind, to end (more cancels wait
        too: its records must come before anything after it), then fail the run with
        :class:`CancelledCallError`, unless the call stopped the replay itself or met the
        run's cancellation (returned: the body gets it instead). A call that waits for the
        body in turn never ends: said in the log every :data:`SETTLE_NOTICE` seconds."""
        started = flight.started
        while not started.done():
            with contextlib.suppress(asyncio.CancelledError):
                done, _ = await asyncio.wait((started,), timeout=SETTLE_NOTICE)
                if not done:
                    run, workflow = self._sync.execution_id, self._sync._driver.workflow
                    log.warning(
                        "run %s (%s): %s: the workflow body %s; it has not ended yet, "
                        "and the body waits for it",
                        run,
                        workflow,
                        flight.described(),
                        how,
                        extra=run_fields(run, workflow),
                    )
        outcome = None if started.cancelled() else started.exception()
        if isinstance(outcome, (Suspended, Reload, Halt, Cancelled)):
            return outcome
        self._sync._cancelled(flight.described(), how)
        return None

    async def _ended(self) -> None:
        """The body ended: calls it left behind (in tasks it never awaited) never begin,
        and one under way ends before the body's outcome is taken, and fails the run."""
        self._over = True
        flight = self._flying
        if flight is not None and flight.cancel_began():
            ended = await self._settle(flight, "ended while it still ran")
            if isinstance(ended, (Suspended, Reload, Halt)):
                self._stopped = self._sync._stopped = ended  # wins over the body's end

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

    def fail(self, error: BaseException | type[BaseException]) -> NoReturn:
        fail_with(error)


@dataclass(eq=False)  # one per call, told apart by identity
class _Flight:
    """A durable call under way: whether it began is decided once, under a lock (it starts
    on another thread): a cancel that lands first drops it."""

    fn: Callable[..., Any]
    args: Any
    started: asyncio.Future[Any] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str | None = None  # "began" or "dropped"

    def gated(self, call: Callable[[], T]) -> Callable[[], T]:
        def gated() -> T:
            with self.lock:
                if self.state == "dropped":  # its await was cancelled: nobody reads this
                    return cast(T, None)
                self.state = "began"
            return call()

        return gated

    def cancel_began(self) -> bool:
        """Drop the call unless it began; whether it had."""
        with self.lock:
            if self.state is None:
                self.state = "dropped"
            return self.state == "began"

    def cancelled_itself(self) -> bool:
        """Whether the call ended in a cancellation of its own (the loop shutting down)."""
        started = self.started
        return started.done() and (
            started.cancelled() or isinstance(started.exception(), asyncio.CancelledError)
        )

    def described(self) -> str:
        """How the body made the call, for an error: ``ctx.run('charge')``."""
        first = self.args[0] if self.args else None
        label = getattr(first, "name", first)
        shown = repr(label) if isinstance(label, str) else ""
        return f"ctx.{getattr(self.fn, '__name__', 'call')}({shown})"


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
        actx = AsyncContext(ctx, pools)
        try:
            with inside_body():
                return await wf.fn(actx, *args)
        finally:
            await actx._ended()

    if bridged:  # the async worker's loop runs it (this drive's greenlet waits)
        # As a task in this drive's context (its trace), not the loop's waiting one.
        body = asyncio.get_running_loop().create_task(main(), context=contextvars.copy_context())
        return bridge.wait(body)
    return on_own_loop(main(), "wf-persist-async-body")
