"""Synchronous drive code on one event loop: the async worker's bridge.

The async worker (``wf-persist worker --async``) drives each run of an ``async def``
workflow in a greenlet on one event loop, through the very code the thread worker runs
(claims, leases, fencing, replay: one implementation). Where that code would block, it asks
this module instead:

- :func:`wait` suspends the run's greenlet until an awaitable is done (the workflow body, an
  ``async def`` step, a pause), and the loop serves other runs meanwhile;
- :func:`off_loop` runs a short blocking call (a database write) on a thread, and
  :func:`in_thread` user code that may block for long (a synchronous step, a wait for a
  concurrency slot) on another pool, suspending the greenlet until it returns.

Outside a bridged greenlet both behave as plain calls, so the thread worker is untouched.
Greenlets share the loop's thread: bridged code never blocks on a lock another bridged
greenlet may hold (its locks are taken inside :func:`off_loop` calls, on real threads).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any, TypeVar

from .control import Halt

T = TypeVar("T")


@dataclass(frozen=True)
class Pools:
    """The threads of bridged code: ``io`` for database work (short, and never waiting
    behind user code), ``user`` for user code that may block for long."""

    io: Executor | None = None
    user: Executor | None = None


try:
    from greenlet import getcurrent, greenlet
except ImportError:  # without the ``async`` extra nothing is ever bridged

    def bridged() -> bool:
        return False

else:

    class _Bridged(greenlet):  # type: ignore[misc]
        """A greenlet running synchronous drive code for a coroutine on the loop."""

        def __init__(self, fn: Callable[..., Any], parent: Any, pools: Pools) -> None:
            super().__init__(fn, parent)
            self.pools = pools

    def bridged() -> bool:
        """Whether this code runs in a bridged greenlet (the async worker's)."""
        return isinstance(getcurrent(), _Bridged)


async def spawn(fn: Callable[..., T], *args: Any, pools: Pools | None = None) -> T:
    """Run ``fn(*args)`` in a greenlet of its own on this loop, in a copy of the current
    context; its :func:`wait`, :func:`off_loop` and :func:`in_thread` calls suspend it,
    not the loop."""
    context = contextvars.copy_context()
    child = _Bridged(functools.partial(context.run, fn, *args), getcurrent(), pools or Pools())
    try:
        request = child.switch()
        while not child.dead:
            try:
                value = await request
            except BaseException as exc:  # raised where the greenlet waits
                request = child.throw(exc)
            else:
                request = child.switch(value)
    except (KeyboardInterrupt, SystemExit) as exc:
        # No signal raises these on this loop's thread: user code did. asyncio would let
        # them out of the loop, which would stop serving every run on it.
        raise RuntimeError(f"a drive on the event loop raised {type(exc).__name__}") from exc
    result: T = request
    return result


def pools() -> Pools:
    """The pools of this bridged greenlet (the loop's default executor elsewhere)."""
    found: Pools = getcurrent().pools if bridged() else Pools()
    return found


def wait(awaitable: Awaitable[T]) -> T:
    """The value of ``awaitable``, awaited on the loop while this greenlet is suspended.
    Only in a bridged greenlet (see :func:`bridged`)."""
    if not bridged():
        raise RuntimeError("wait() outside a bridged greenlet")
    current = getcurrent()
    value: T = current.parent.switch(awaitable)
    return value


def _run_on(executor: Executor | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return wait(hand_over(executor, call))


def hand_over(executor: Executor | None, call: Callable[[], T]) -> asyncio.Future[T]:
    """``call`` on ``executor``'s threads, as a future of this loop. A pool that cannot take
    it (shut down at exit, no thread to be had) stops the drive (:class:`Halt`): it is
    the runtime's failure, never the workflow's."""
    try:
        return asyncio.get_running_loop().run_in_executor(executor, call)
    except RuntimeError as exc:
        raise Halt(exc) from exc


def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, short database work: on an ``io`` thread (this greenlet
    suspended meanwhile) when bridged, else here and now."""
    if not bridged():
        return fn(*args, **kwargs)
    return _run_on(getcurrent().pools.io, fn, *args, **kwargs)


def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, user code that may block: on a ``user`` thread when
    bridged, else here and now."""
    if not bridged():
        return fn(*args, **kwargs)
    return _run_on(getcurrent().pools.user, fn, *args, **kwargs)


def checked_first(check: Callable[[], None], fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, calling ``check()`` (the lease) first on whichever thread runs it."""

    def checked(*args: Any, **kwargs: Any) -> T:
        check()
        return fn(*args, **kwargs)

    return checked


def checked_in_thread(check: Callable[[], None], fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` as :func:`in_thread` does, ``check()`` (the lease) right before it on
    the thread that makes the call: when bridged, a check made on the loop may be long past
    once a ``user`` thread is free (and the run another worker's meanwhile)."""
    return in_thread(checked_first(check, fn), *args)


def on_threads(
    fn: Callable[[int], T], count: int, limit: int | None, prefix: str
) -> list[Future[T]]:
    """``fn(i)`` for each ``i`` below ``count``, on threads of their own (at most ``limit``
    at once), each with this thread's context (an async body's loop, for async steps);
    returns once every one settled, having waited on the loop when bridged (which serves
    async branches meanwhile) and never blocked it."""
    pool = ThreadPoolExecutor(min(count, limit or count) or 1, prefix)
    try:
        futures = [pool.submit(contextvars.copy_context().run, fn, i) for i in range(count)]
        if not bridged():
            wait_all(futures)
        else:
            wrapped = [asyncio.wrap_future(f) for f in futures]
            wait(asyncio.gather(*wrapped, return_exceptions=True))
    finally:
        pool.shutdown(wait=not bridged())
    return futures


def settled_here(fn: Callable[[int], T], i: int) -> Future[T]:
    """``fn(i)`` run in this thread, as a settled future: as :func:`on_threads` leaves it
    (its exception kept, control flow included, for the caller to sort)."""
    future: Future[T] = Future()
    try:
        future.set_result(fn(i))
    except BaseException as exc:
        future.set_exception(exc)
    return future


def pause(seconds: float, blocking: Callable[[float], None]) -> None:
    """Sleep ``seconds``: on the loop when bridged, else with ``blocking``."""
    if bridged():
        wait(asyncio.sleep(seconds))
    else:
        blocking(seconds)
