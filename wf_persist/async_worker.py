"""The async worker's event loop: runs of ``async def`` workflows driven on one loop.

Each claimed run of an ``async def`` workflow is driven by the ordinary drive code
(:meth:`Runtime.drive_claim`) in a greenlet on this loop (:mod:`wf_persist.bridge`): its
body and its ``async def`` steps are tasks on the loop, and a run holds no thread while
they await. Database writes and synchronous steps run on a small pool of threads, each
only for as long as it takes. Claims, leases and fencing are the thread worker's: the
worker loop claims, this loop drives. Runs of synchronous workflows still get a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from . import bridge
from .errors import InvalidArgumentError

#: Threads for the database writes of the runs on the loop.
IO_THREADS = 16
#: Threads for their synchronous steps (and other user code that may block).
USER_THREADS = 64
#: ``wf-persist worker --async``'s default concurrency.
ASYNC_CONCURRENCY = 1000


def check_available() -> None:
    """The async worker drives runs in greenlets: refuse it at once without them."""
    try:
        import greenlet  # noqa: F401
    except ImportError as exc:
        raise InvalidArgumentError(
            "the async worker needs greenlet: pip install 'wf-persist[async]'"
        ) from exc


class EventLoopDriver:
    """An event loop in a thread of its own, driving runs in greenlets."""

    def __init__(self, io_threads: int = IO_THREADS, user_threads: int = USER_THREADS) -> None:
        check_available()
        self.loop = asyncio.new_event_loop()
        self.pools = bridge.Pools(
            io=concurrent.futures.ThreadPoolExecutor(
                io_threads, thread_name_prefix="wf-persist-io"
            ),
            user=concurrent.futures.ThreadPoolExecutor(
                user_threads, thread_name_prefix="wf-persist-user"
            ),
        )
        self._thread = threading.Thread(
            target=self._serve, name="wf-persist-event-loop", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Drive ``fn(*args)`` in a greenlet on the loop."""
        return asyncio.run_coroutine_threadsafe(
            bridge.spawn(fn, *args, pools=self.pools), self.loop
        )

    def close(self) -> None:
        """Stop the loop (the runs on it have ended) and its threads."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()
        for pool in (self.pools.io, self.pools.user):
            if pool is not None:
                pool.shutdown(wait=True)
