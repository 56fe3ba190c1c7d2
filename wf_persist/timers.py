"""One timer thread per runtime: cheap enough to arm for every step attempt.

A step attempt arms a timer that records its start if it is still running after a threshold
(so a crash mid-step leaves a visible attempt); nearly every timer is cancelled long before
it fires. A heap with lazy cancellation costs a push and a flag per step, not a thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("wf_persist.runtime")


class _Entry:
    __slots__ = ("cancelled", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """Calls functions after a delay on one daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Entry]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def after(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` in ``delay`` seconds unless the returned cancel is called first."""
        entry = _Entry(fn)
        due = time.monotonic() + delay
        with self._cond:
            if self._stopped:
                return entry.cancel
            earliest = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, next(self._order), entry))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="wf-persist-timers", daemon=True
                )
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return entry.cancel

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopped:
                    return
                entry = heapq.heappop(self._heap)[2]
            if entry.cancelled:
                continue
            try:
                entry.fn()
            except Exception:  # a timer must never kill the thread that serves the others
                log.exception("a wf_persist timer failed")
