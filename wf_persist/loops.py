"""The event loop an ``async def`` workflow body runs on, and running user coroutines there.

An async body runs on an event loop of its drive's own; its durable calls are made by the
synchronous machinery on a helper thread (:mod:`wf_persist.async_context`). An ``async
def`` step, compensation or code block is awaited back on the body's loop from that thread,
so it shares the loop with the body (and with the other branches of ``ctx.all``). A
synchronous workflow has no such loop: an async step called from one is refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Final

from . import bridge
from .errors import StepTimeoutError, WorkflowDefinitionError

#: Set while an async body runs (copied to the helper threads its calls run on).
BODY_LOOP: Final[contextvars.ContextVar[asyncio.AbstractEventLoop | None]] = contextvars.ContextVar(
    "wf_persist_body_loop", default=None
)


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)


def check_can_await(fn: Callable[..., Any], what: str) -> None:
    """Refuse an async function where no async body runs (a synchronous workflow)."""
    if is_async(fn) and BODY_LOOP.get() is None:
        raise WorkflowDefinitionError(
            f"{what} is async and the workflow is not: call it from an async def workflow "
            "(a synchronous step may be called from either)"
        )


def settle(
    result: Any, timeout: float | None = None, step: str | None = None, *, own_loop: bool = False
) -> Any:
    """``result`` itself, or, if it is a coroutine, its value awaited on the body's loop
    (cancelled after ``timeout`` seconds as :class:`StepTimeoutError` of ``step``).

    ``own_loop``: with no body loop (a compensation: the unwind runs after the body and its
    loop ended), await it on an event loop of its own instead of refusing it."""
    if not inspect.iscoroutine(result):
        return result
    if bridge.bridged():  # the async worker's: this greenlet waits, the loop goes on
        return bridge.wait(_bounded(result, timeout, step))
    loop = BODY_LOOP.get()
    if loop is None and own_loop:
        return on_own_loop(_bounded(result, timeout, step))
    if loop is None:
        result.close()
        raise WorkflowDefinitionError("a coroutine was returned outside an async workflow")
    future = asyncio.run_coroutine_threadsafe(_bounded(result, timeout, step), loop)
    return future.result()


def on_own_loop(coro: Coroutine[Any, Any, Any], name: str = "wf-persist-async") -> Any:
    """Run ``coro`` to its end on a new event loop: in this thread, or in a thread of its
    own when this thread already runs a loop (a caller inside an async app)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    outcome: list[tuple[bool, Any]] = []
    context = contextvars.copy_context()  # the caller's (its drive's trace, say)

    def own_thread() -> None:
        try:
            outcome.append((True, asyncio.run(coro)))
        except BaseException as exc:  # raised in the caller's thread below
            outcome.append((False, exc))

    thread = threading.Thread(target=context.run, args=(own_thread,), name=name)
    thread.start()
    thread.join()
    ok, found = outcome[0]
    if not ok:
        raise found
    return found


async def _bounded(coro: Coroutine[Any, Any, Any], timeout: float | None, step: str | None) -> Any:
    if timeout is None:
        return await coro
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        result = await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise StepTimeoutError(step or "?", timeout) from None
    if loop.time() - began > timeout:
        # It caught its cancellation and returned anyway: a late result is never recorded.
        raise StepTimeoutError(step or "?", timeout)
    return result
