"""Workers: claim due runs with a lease and drive them on a thread pool.

A run is *due* when it is new, its timer passed, a signal was delivered, or the lease of the
runtime driving it expired (that runtime died or stalled), all by the database's clock.
Claims are one compare-and-set per run (``FOR UPDATE SKIP LOCKED`` where the database has
it), so many workers on many machines share one database without queueing behind each other
and two never drive a run at once; a worker never claims a run its own process still drives.

The same loop serves the embedded mode (:meth:`Runtime.start_worker`) and the separate worker
process (``wf-persist worker --app module:runtime``). When the database is unreachable the
loop backs off and says so once, and once more when it is back.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError
from .leases import Outage

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("wf_persist.worker")


class Worker:
    """Drives due runs of the workflows registered in ``runtime``.

    Args:
        runtime: the runtime whose registered workflow versions this worker runs.
        concurrency: runs driven at once (threads). The engine's pool must give at least
            ``concurrency + 1`` connections (:class:`~wf_persist.errors.PoolTooSmallError`).
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
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval < float("inf")
        ):
            raise InvalidArgumentError(f"poll_interval must be a positive number, got {interval!r}")
        runtime.check_pool(concurrency)
        self.runtime = runtime
        self.concurrency = concurrency
        self.poll_interval = float(interval)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._inflight: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._outage = Outage(log, "claiming due runs", self.poll_interval)

    def wake(self) -> None:
        """Look for work now (a run finished or parked here, a signal was sent from here)."""
        self._wake.set()

    def start(self) -> Worker:
        """Run the loop in a background thread."""
        self._thread = threading.Thread(target=self.run, name="wf-persist-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30) -> None:
        """Stop claiming; wait up to ``timeout`` for runs in flight (they stop at their next
        step once the runtime closes; their leases are released or lapse)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)
        exc = fut.exception()
        if exc is not None:
            log.error("driving a run failed unexpectedly", exc_info=exc)
        self._wake.set()

    def run(self) -> None:
        """Claim and drive due runs until :meth:`stop` is called."""
        rt = self.runtime
        rt.keeper().warm()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="wf-persist-run") as pool:
            while not self._stopping.is_set():
                self._wake.clear()
                with self._lock:
                    free = self.concurrency - len(self._inflight)
                claimed = []
                if free > 0:
                    try:
                        claimed = rt.claim_due(free)
                    except Exception as exc:
                        self._wake.wait(self._outage.failed(exc))
                        continue
                    self._outage.succeeded()
                for claim in claimed:
                    fut = pool.submit(rt.drive_claim, claim)
                    with self._lock:
                        self._inflight.add(fut)
                    fut.add_done_callback(self._done)
                if claimed and len(claimed) == free:
                    continue  # maybe more is due
                self._wake.wait(self._idle_wait())
            self._wake.set()

    def _idle_wait(self) -> float:
        try:
            until = self.runtime.seconds_to_next_wake()
        except Exception:
            return self.poll_interval
        if until is None:
            return self.poll_interval
        return max(0.005, min(self.poll_interval, until))
