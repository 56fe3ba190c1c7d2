"""Workers: claim due runs with a lease and drive them on a thread pool.

A run is *due* when it is new, its timer passed, a signal was delivered, or the lease of the
runtime driving it expired (that runtime died). Claims use ``FOR UPDATE SKIP LOCKED`` where the
database has it, so many workers on many machines share one database without queueing behind
each other; a claimed run is renewed by its runtime's lease keeper while it is driven.

The same loop serves the embedded mode (:meth:`Runtime.start_worker`) and the separate worker
process (``wf-persist worker --app module:runtime``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("wf_persist.worker")


class Worker:
    """Drives due runs of the workflows registered in ``runtime``.

    Args:
        runtime: the runtime whose registered workflow versions this worker runs.
        concurrency: runs driven at once (threads).
        poll_interval: seconds between looks for due work when nothing in this process
            announced any. Timers known to this worker fire on time; others within one
            interval. Defaults to the runtime's ``poll_interval`` (0.25 s).
    """

    def __init__(
        self, runtime: Runtime, *, concurrency: int = 4, poll_interval: float | None = None
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidArgumentError(
                f"concurrency must be a positive integer, got {concurrency!r}"
            )
        interval = runtime.poll_interval if poll_interval is None else poll_interval
        if interval <= 0:
            raise InvalidArgumentError("poll_interval must be positive")
        self.runtime = runtime
        self.concurrency = concurrency
        self.poll_interval = interval
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._inflight: set[Future[bool]] = set()
        self._lock = threading.Lock()

    def wake(self) -> None:
        """Look for work now (a run finished or parked here, a signal was sent from here)."""
        self._wake.set()

    def start(self) -> Worker:
        """Run the loop in a background thread."""
        self._thread = threading.Thread(target=self.run, name="wf-persist-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30) -> None:
        """Stop claiming; wait up to ``timeout`` for runs in flight (their leases lapse if not)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _done(self, fut: Future[bool]) -> None:
        with self._lock:
            self._inflight.discard(fut)
        exc = fut.exception()
        if exc is not None:
            log.error("driving a run failed; it is retried after its lease expires", exc_info=exc)
        self._wake.set()

    def run(self) -> None:
        """Claim and drive due runs until :meth:`stop` is called."""
        rt = self.runtime
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="wf-persist-run") as pool:
            while not self._stopping.is_set():
                self._wake.clear()
                with self._lock:
                    free = self.concurrency - len(self._inflight)
                claimed: list[str] = []
                if free > 0:
                    try:
                        claimed = rt.claim_due(free)
                    except Exception:
                        log.exception("claiming due runs failed; retrying")
                for execution_id in claimed:
                    fut = pool.submit(rt.drive, execution_id)
                    with self._lock:
                        self._inflight.add(fut)
                    fut.add_done_callback(self._done)
                if claimed and len(claimed) == free:
                    continue  # maybe more is due
                self._wake.wait(self._idle_wait())
            self._wake.set()

    def _idle_wait(self) -> float:
        try:
            due = self.runtime.next_wake()
        except Exception:
            return self.poll_interval
        if due is None:
            return self.poll_interval
        until = (due - self.runtime.clock()).total_seconds()
        return max(0.005, min(self.poll_interval, until))
