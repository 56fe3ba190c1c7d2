"""The runtime's timer thread: one timer armed while the thread looks at the others must
never kill the thread that serves every step attempt's timer."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from wf_persist.timers import Timers


@pytest.fixture
def eager_gc() -> Iterator[None]:
    """A collection at nearly every allocation, as a busy process gets now and then."""
    before = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    yield
    gc.set_threshold(*before)


class _ArmsWhenCollected:
    """Garbage in a cycle whose finalizer arms a timer and leaves the same garbage again, so
    every collection (in the middle of whatever allocation triggered it, as any finalizer or
    weakref callback may run) arms one more timer."""

    active = True

    def __init__(self, timers: Timers) -> None:
        self.timers = timers
        self.me = self

    def __del__(self) -> None:
        if _ArmsWhenCollected.active:
            self.timers.after(60, lambda: None)
            _ArmsWhenCollected(self.timers)


def test_a_timer_armed_while_the_thread_looks_does_not_kill_it(eager_gc: None) -> None:
    """CI saw 'dictionary changed size during iteration' in the timer thread: copying the
    armed timers allocates, an allocation can collect garbage, and a finalizer (or another
    thread, once the collector has run Python code) can arm a timer in between."""
    timers = Timers()
    fired = threading.Event()
    timers.after(0, fired.set)
    for _ in range(200):
        timers.after(60, lambda: None)
    _ArmsWhenCollected.active = True
    _ArmsWhenCollected(timers)
    try:
        for _ in range(20):
            for fn in timers._due():
                fn()
        assert fired.is_set()
    finally:
        _ArmsWhenCollected.active = False
        gc.collect()
        timers.stop()
