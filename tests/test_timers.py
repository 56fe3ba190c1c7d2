"""Threads that serve the others must not trip over what other threads add meanwhile: the
runtime's timer thread (every step attempt's timer) and the metric reader's backlog gauge."""

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
            for fn, _ in timers._due():
                fn()
        assert fired.is_set()
    finally:
        _ArmsWhenCollected.active = False
        gc.collect()
        timers.stop()


def test_the_backlog_gauge_copies_the_watched_runtimes_under_the_lock_adding_takes() -> None:
    """The metric reader's thread copies the set of runtimes it reports while a worker's
    thread may add one: a WeakSet is copied one item at a time, so an add in between raised
    'Set changed size during iteration' and lost that collection. Both take one lock: an
    add waits while the reader holds it."""
    from wf_persist import telemetry

    class Watched:
        closing = True  # not counted: only the copying is under test

    runtime = Watched()
    added = threading.Event()

    def add() -> None:
        telemetry.watch_backlog(runtime)
        added.set()

    with telemetry.STATE.lock:  # as the reader holds it while it copies
        adder = threading.Thread(target=add)
        adder.start()
        assert not added.wait(0.2)
    assert added.wait(5)
    adder.join(5)
    assert runtime in telemetry.STATE.watched
    assert list(telemetry._due_backlog(None)) == []  # copies under the lock, no deadlock
    telemetry.STATE.watched.discard(runtime)


def test_a_timer_that_blocks_does_not_hold_up_the_others() -> None:
    """A step's start record may wait for a pooled connection; on the timer thread it held up
    every other timer, among them those that give lent connections back to that pool (a
    drive in user code holds its connection until its release timer fires)."""
    timers = Timers()
    release = threading.Event()
    blocked = threading.Event()
    fired = threading.Event()

    def wait_for_a_connection() -> None:
        blocked.set()
        release.wait(10)

    try:
        timers.after(0, wait_for_a_connection, blocking=True)
        assert blocked.wait(5), "the blocking timer ran"
        timers.after(0, fired.set)
        assert fired.wait(2), "a timer due meanwhile fired while the other one waited"
    finally:
        release.set()
        timers.stop()


def test_a_blocking_timer_after_stop_is_dropped() -> None:
    timers = Timers()
    timers.stop()
    ran = threading.Event()
    timers.after(0, ran.set, blocking=True)
    assert not ran.wait(0.3)
