"""One timer thread per runtime: cheap enough to arm for every step attempt.

A step attempt arms a timer that records its start if it is still running after a threshold
(so a crash mid-step leaves a visible attempt); nearly every timer is cancelled long before
it fires. Arming and cancelling are a dict insert and delete; the thread looks at what is
armed twenty times a second, so a thousand short steps a second cost no wake-ups at all.

A timer that may block (a write that waits for a pooled connection or a row lock) runs on a
few threads of its own: on the timer thread it would hold up the others, among them the
timers that give lent connections back to the pool it is waiting for.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from . import clocks

log = logging.getLogger("wf_persist.runtime")

#: How often armed timers are looked at: a timer fires up to this much late.
TICK: Final = 0.05
#: Threads for timers that may block (see :meth:`Timers.after`).
BLOCKING_THREADS: Final = 1


class Timers:
    """Calls functions after a delay on one daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._armed: dict[int, tuple[float, Callable[[], None], bool]] = {}
        self._blocking: ThreadPoolExecutor | None = None
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def after(
        self, delay: float, fn: Callable[[], None], blocking: bool = False
    ) -> Callable[[], None]:
        """Call ``fn`` in about ``delay`` seconds unless the returned cancel is called first;
        ``blocking``: ``fn`` may wait (for the database), so it runs off the timer thread."""
        if self._stopped:
            return _nothing
        key = next(self._ids)
        # A dict insert and pop are atomic: no lock (and no wake-up) on the hot path.
        self._armed[key] = (clocks.elapsed() + delay, fn, blocking)
        if self._thread is None:
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="wf-persist-timers", daemon=True
                    )
                    self._thread.start()

        def cancel() -> None:
            self._armed.pop(key, None)

        return cancel

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._armed.clear()
            blocking, self._blocking = self._blocking, None
        if blocking is not None:
            blocking.shutdown(wait=False)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _due(self) -> list[tuple[Callable[[], None], bool]]:
        now = clocks.elapsed()
        # Copied, not iterated: iterating allocates, an allocation may collect garbage, and a
        # finalizer (or another thread, once the collector ran Python code) may arm a timer in
        # between ("dictionary changed size during iteration" killed this thread). ``copy``
        # clones the table before it allocates anything that can collect.
        due = [k for k, (at, _, _) in self._armed.copy().items() if at <= now]
        fns = []
        for key in due:
            found = self._armed.pop(key, None)
            if found is not None:
                fns.append((found[1], found[2]))
        return fns

    def _run(self) -> None:
        while not self._stopped:
            time.sleep(TICK)
            try:
                due = self._due()
            except Exception:  # looked at again next tick rather than never
                log.exception("wf_persist timers could not be looked at")
                continue
            for fn, blocking in due:
                if blocking:
                    try:
                        self._blocking_pool().submit(_call, fn)
                    except RuntimeError:  # stopped meanwhile: so are its timers
                        return
                else:
                    _call(fn)

    def _blocking_pool(self) -> ThreadPoolExecutor:
        with self._cond:
            if self._stopped:
                raise RuntimeError("stopped")
            if self._blocking is None:
                self._blocking = ThreadPoolExecutor(
                    BLOCKING_THREADS, thread_name_prefix="wf-persist-timer-io"
                )
            return self._blocking


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # a timer must never kill the thread that serves the others
        log.exception("a wf_persist timer failed")


def _nothing() -> None:
    return None
