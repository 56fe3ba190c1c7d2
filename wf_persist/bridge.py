"""Synchronous drive code on one event loop: the async worker's bridge.

The async worker (``wf-persist worker --async``) drives each run of an ``async def``
workflow in a greenlet on one event loop, through the very code the thread worker runs
(claims, leases, fencing, replay: one implementation). Where that code would block, it asks
this module instead:

- :func:`wait` suspends the run's greenlet until an awaitable is done (the workflow body, an
  ``async def`` step, a pause), and the loop serves other runs meanwhile;
- :func:`off_loop` runs a blocking call (a database write, a synchronous step) on a thread
  and suspends the greenlet until it returns.

Outside a bridged greenlet both behave as plain calls, so the thread worker is untouched.
Greenlets share the loop's thread: bridged code never blocks on a lock another bridged
greenlet may hold (its locks are taken inside :func:`off_loop` calls, on real threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import sys
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")

try:
    from greenlet import getcurrent, greenlet
except ImportError:  # without the ``async`` extra nothing is ever bridged

    def bridged() -> bool:
        return False

else:

    class _Bridged(greenlet):  # type: ignore[misc]
        """A greenlet running synchronous drive code for a coroutine on the loop."""

        def __init__(self, fn: Callable[..., Any], parent: Any, io: Executor | None) -> None:
            super().__init__(fn, parent)
            self.io = io

    def bridged() -> bool:
        """Whether this code runs in a bridged greenlet (the async worker's)."""
        return isinstance(getcurrent(), _Bridged)


async def spawn(fn: Callable[..., T], *args: Any, io: Executor | None = None) -> T:
    """Run ``fn(*args)`` in a greenlet of its own on this loop, in a copy of the current
    context; its :func:`wait` and :func:`off_loop` calls suspend it, not the loop.
    ``io``: the executor :func:`off_loop` uses (else the loop's default)."""
    context = contextvars.copy_context()
    child = _Bridged(functools.partial(context.run, fn, *args), getcurrent(), io)
    request = child.switch()
    while not child.dead:
        try:
            value = await request
        except BaseException as exc:  # raised where the greenlet waits
            request = child.throw(exc)
        else:
            request = child.switch(value)
    result: T = request
    return result


def wait(awaitable: Awaitable[T]) -> T:
    """The value of ``awaitable``, awaited on the loop while this greenlet is suspended.
    Only in a bridged greenlet (see :func:`bridged`)."""
    if not bridged():
        raise RuntimeError("wait() outside a bridged greenlet")
    current = getcurrent()
    value: T = current.parent.switch(awaitable)
    return value


def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``: on a thread (this greenlet suspended meanwhile) when
    bridged, else here and now."""
    if not bridged():
        return fn(*args, **kwargs)
    current = getcurrent()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    future = asyncio.get_running_loop().run_in_executor(current.io, call)
    return wait(future)


def io() -> Executor | None:
    """The executor :func:`off_loop` uses in this bridged greenlet (None: the default)."""
    return getcurrent().io if bridged() else None


def pause(seconds: float, blocking: Callable[[float], None]) -> None:
    """Sleep ``seconds``: on the loop when bridged, else with ``blocking``."""
    if bridged():
        wait(asyncio.sleep(seconds))
    else:
        blocking(seconds)


@contextlib.contextmanager
def threaded(manager: AbstractContextManager[T]) -> Iterator[T]:
    """``manager`` entered and exited by :func:`off_loop` (a lock it waits for, a
    connection it holds, is taken and given back on threads)."""
    value = off_loop(manager.__enter__)
    try:
        yield value
    except BaseException:
        if not off_loop(manager.__exit__, *sys.exc_info()):
            raise
    else:
        off_loop(manager.__exit__, None, None, None)
