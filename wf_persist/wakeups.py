"""Wake-ups without polling, and a process's presence, where the database offers them.

On PostgreSQL a process keeps ONE connection of its own that ``LISTEN``s: a start, a
signal, a cancellation, a released lease or a near timer notifies workers at once, and a
finished run wakes the callers waiting for its result (their backend writes the
notifications in the same transaction, so nothing is announced that did not commit). The
same connection holds a session-level advisory lock named after the runtime's owner: the
server releases it when the process dies, so other workers take its runs over at once
instead of waiting for the leases to lapse (:meth:`Backend.reap`).

Both are capabilities the backend detects when the listener connects (PostgreSQL-compatible
distributed databases lack them): without them, or while the connection is down, polling
and lease expiry keep every guarantee. After an outage every subscriber is woken once,
since notifications sent meanwhile are lost.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final, Literal, Protocol

from . import clocks
from .leases import Outage

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("wf_persist.worker")

#: Notification payloads: a run is due now; a run will be due at a time; a run ended.
DUE: Final = "due"
WAKE: Final = "wake "
END: Final = "end "
#: What ``on_end`` subscribers hear on (re)connecting: any run may have ended unheard.
ANY_END: Final = ""
#: What a process listens for, each on a channel of its own (see :meth:`Wakeups.hear`): runs
#: due (a worker's business: starts, signals, cancellations, released leases, near timers) and
#: runs ended (a waiting caller's). A web process awaiting results is not woken by every
#: start, nor a worker by every end.
HEAR_DUE: Final = "due"
HEAR_END: Final = "end"
Hearing = Literal["due", "end"]
#: What ``on_due`` subscribers hear for a run due now (a start, a signal, a released lease),
#: as opposed to a timer's time or ``None`` (a (re)connection: anything may be due, timers too).
DUE_NOW: Final = "now"
#: What an ``on_due`` subscriber hears (see :data:`DUE_NOW`).
Due = dt.datetime | Literal["now"] | None
#: Runs a client remembers it started and will await (see :meth:`Ends.expect`), at most.
MAX_EXPECTED: Final = 1_000
#: How long one wait for notifications lasts (the listener looks at its stop flag between).
LISTEN_TICK: Final = 0.2
#: Presence, as far as it can be trusted: the listening connection may die without a word
#: reaching this process (see :mod:`wf_persist.backends.pg_presence`), so a drive trusts its
#: lock only while the last heartbeat (a round trip on that connection) was sent less than
#: :data:`PRESENCE_TRUST` seconds ago, and a reaper makes a free lock's runs due only
#: :data:`PRESENCE_GRACE` seconds after it found it free. The difference is the margin for a
#: drive's thread between its check and the step it starts.
HEARTBEAT: Final = 0.025
PRESENCE_TRUST: Final = 0.1
PRESENCE_GRACE: Final = 0.2
#: Heartbeats go on this long (seconds) after the listener connects or a drive last asked
#: for its presence: a process that drives nothing sends none. The first drive after a
#: quiet spell asks the database once, and wakes the listener to beat again.
BEAT_FOR: Final = 5.0
#: The safety-net poll of a worker that notifications reach (seconds): it looks for due
#: runs this often in case a notification was lost; a timer nearer than this is announced.
NOTIFIED_POLL_INTERVAL: Final = 5.0


class Listener(Protocol):
    """A backend's listening connection (see :meth:`Backend.listener`)."""

    #: Whether this connection holds the runtime's presence lock.
    present: bool
    #: When (monotonic) the last round trip that found the lock held was sent.
    heard: float

    def wait(self, timeout: float, beat: bool = False) -> list[str]:
        """Payloads received within ``timeout`` seconds (at once if some are pending);
        ``beat``: a heartbeat, if the lock is held (its answer updates :attr:`heard`)."""

    def hear(self, kinds: frozenset[Hearing]) -> bool:
        """Listen for these kinds too (on this listener's thread); False: not now (a
        heartbeat is on its way), ask again after the next :meth:`wait`."""

    def interrupt(self) -> None:
        """End the current (or next) :meth:`wait` early; safe from any thread."""

    def close(self) -> None:
        """Close the connection (the presence lock goes with it)."""


class Wakeups:
    """The listening thread of one runtime or client.

    Subscribers are called on the listening thread and must be quick (set an event, notify a
    condition). ``on_due`` hears of runs due now or soon (a worker's claim loop), ``on_end``
    of runs that ended (callers waiting for results): their ids, or :data:`ANY_END` when
    the connection was (re)made and ends may have gone unheard. Each is heard only once
    asked for (``hear`` at construction, or :meth:`hear` later).
    """

    def __init__(
        self, backend: Backend, presence: str | None = None, hear: tuple[Hearing, ...] = ()
    ) -> None:
        self.backend = backend
        self.presence = presence
        #: What this process asked to hear, and what the connection listens for now.
        self._wanted: frozenset[Hearing] = frozenset(hear)
        self._hearing: frozenset[Hearing] = frozenset()
        self._heard_cond = threading.Condition(threading.Lock())
        self._due: list[Callable[[Due], None]] = []
        self._end: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: Listener | None = None
        #: Whether notifications arrive now (else subscribers must poll).
        self.listening = False
        #: Whether the presence lock is held now.
        self.present = False
        #: Since when (monotonic) it has been held without a break; +inf while it is not.
        self.held_since = math.inf
        self._beat_until = 0.0
        #: How many times a listening connection was made (a reconnection adds one).
        self.connections = 0
        self._outage = Outage(log, "listening for wake-ups", 0.1)

    def on_due(self, fn: Callable[[Due], None]) -> None:
        with self._lock:
            self._due.append(fn)

    def on_end(self, fn: Callable[[str], None]) -> None:
        with self._lock:
            self._end.append(fn)

    def start(self, wait: float = 5.0) -> bool:
        """Start listening (once) and wait up to ``wait`` seconds for the first connection;
        returns whether notifications (and presence, if asked for) are in place."""
        with self._lock:
            if self._thread is None and self.backend.can_listen and not self._stop.is_set():
                started = threading.Thread(target=self._run, name="wf-persist-wakeups", daemon=True)
                started.start()
                # Seen by stop() only once started (it joins it, and may run meanwhile:
                # an AsyncClient closed while its first result() starts listening).
                self._thread = started
            thread = self._thread
        if thread is None:
            return False
        self._ready.wait(wait)
        return self.listening

    def hear(self, kind: Hearing, wait: float = 5.0) -> bool:
        """Listen for ``kind`` from now on (for this process's life); waits up to ``wait``
        seconds for the connection to listen, so a caller that looks after this misses
        nothing. Returns whether it is heard now (cheap once asked)."""
        if kind not in self._wanted:
            with self._heard_cond:
                self._wanted = self._wanted | {kind}
            listener = self._listener
            if listener is not None:
                listener.interrupt()
            deadline = clocks.elapsed() + wait
            with self._heard_cond:
                while not self.hears(kind) and self._listener is not None:
                    left = deadline - clocks.elapsed()
                    if left <= 0:
                        break
                    self._heard_cond.wait(left)
        return self.hears(kind)

    def hears(self, kind: Hearing) -> bool:
        """Whether notifications of ``kind`` reach this process now (else poll)."""
        return self.listening and kind in self._hearing

    def _listen_for(self, listener: Listener) -> frozenset[Hearing]:
        """Listen for what was asked and is not listened for yet (on the listening thread);
        returns what is newly heard."""
        wanted = self._wanted
        new = wanted - self._hearing
        if not new or not listener.hear(new):
            return frozenset()
        with self._heard_cond:
            self._hearing = self._hearing | new
            self._heard_cond.notify_all()
        return new

    def stop(self) -> None:
        self._stop.set()
        listener = self._listener
        if listener is not None:
            listener.interrupt()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=LISTEN_TICK + 5)

    # the thread ------------------------------------------------------------------------

    def _connect(self) -> Listener | None:
        try:
            wanted = self._wanted
            listener = self.backend.listener(self.presence, wanted)
        except Exception as exc:
            time.sleep(self._outage.failed(exc))
            return None
        self._outage.succeeded()
        with self._heard_cond:
            self._hearing = wanted
        return listener

    def _run(self) -> None:
        while not self._stop.is_set():
            listener = self._connect()
            if listener is None:
                self._ready.set()  # callers go on polling meanwhile
                continue
            if listener is NOT_AVAILABLE:
                self._ready.set()
                return
            failure: Exception | None = None
            try:  # the listener is closed whatever happens from here
                self._listener = listener
                self._beat_until = clocks.elapsed() + BEAT_FOR
                self._presence(listener)
                self.connections += 1
                with self._heard_cond:
                    self.listening = True
                    self._heard_cond.notify_all()
                self._ready.set()
                # Whatever was sent before (or during an outage) went unheard.
                self._announce_due(None)
                self._announce_end(ANY_END)
                while not self._stop.is_set():
                    payloads = listener.wait(*self._tick())
                    self._presence(listener)  # retaken after a reconnection
                    for payload in payloads:
                        self._dispatch(payload)
                    if self._wanted != self._hearing:
                        new = self._listen_for(listener)
                        if HEAR_DUE in new:
                            self._announce_due(None)  # sent before: unheard
                        if HEAR_END in new:
                            self._announce_end(ANY_END)
            except Exception as exc:
                failure = exc
            finally:
                # Not listening from the moment the connection failed: callers poll meanwhile.
                self.listening = False
                self._presence(None)
                with self._heard_cond:
                    self._listener = None
                    self._hearing = frozenset()
                    self._heard_cond.notify_all()
                listener.close()
            if failure is not None:
                time.sleep(self._outage.failed(failure))

    def trusted_since(self) -> float:
        """Since when (monotonic) the presence lock has been held without a break, as far
        as a heartbeat sent less than :data:`PRESENCE_TRUST` ago vouches for it (+inf
        otherwise: the caller asks the database). Asking keeps the heartbeats going."""
        now = clocks.elapsed()
        quiet = now >= self._beat_until
        self._beat_until = now + BEAT_FOR
        listener = self._listener
        if quiet and listener is not None:
            listener.interrupt()  # beat now, not at the end of a long tick
        # Read before held_since: between a failure and the next connection's presence
        # held_since is +inf, so a new connection's heartbeat never vouches for an old lock.
        heard = self.heard
        return self.held_since if now - heard < PRESENCE_TRUST else math.inf

    @property
    def heard(self) -> float:
        """When (monotonic) the last heartbeat that found the lock held was sent (as the
        listener saw it answered, not at the end of its wait)."""
        listener = self._listener
        return listener.heard if listener is not None else -math.inf

    def _tick(self) -> tuple[float, bool]:
        """The next wait on the listening connection: how long, and whether a heartbeat
        goes first (due every :data:`HEARTBEAT` while the lock is held and wanted)."""
        now = clocks.elapsed()
        if not self.present or now >= self._beat_until:
            return LISTEN_TICK, False
        due = self.heard + HEARTBEAT - now  # an answer still on its way: due again
        if due <= 0:
            return HEARTBEAT, True
        return min(due, LISTEN_TICK), False

    def _presence(self, listener: Listener | None) -> None:
        """Whether the presence lock is held (``None``: the connection failed); once it was
        lost, others may take this runtime's runs (see :meth:`Runtime.presence_since`)."""
        held = listener is not None and listener.present
        if held and not self.present:
            self.held_since = clocks.elapsed()  # after it was taken: errs towards asking
        elif not held:
            self.held_since = math.inf
        self.present = held

    def _dispatch(self, payload: str) -> None:
        if payload == DUE:
            self._announce_due(DUE_NOW)
        elif payload.startswith(WAKE):
            try:
                at = dt.datetime.fromisoformat(payload[len(WAKE) :])
            except ValueError:
                at = None
            self._announce_due(at)
        elif payload.startswith(END) and len(payload) > len(END):
            # The id alone: an end is a hint to look at the run, whatever else follows.
            execution_id = payload[len(END) :].partition(" ")[0]
            if execution_id:
                self._announce_end(execution_id)

    def _announce_end(self, execution_id: str) -> None:
        with self._lock:
            subscribers = list(self._end)
        for fn in subscribers:
            fn(execution_id)

    def _announce_due(self, at: Due) -> None:
        with self._lock:
            subscribers = list(self._due)
        for fn in subscribers:
            fn(at)


class Ends:
    """Which of the runs awaited in this process have ended, as notifications tell: a
    caller waiting for a result looks at its run again when its end is announced (or any
    end may have gone unheard), not at every tick of a poll.

    Protocol: :meth:`watching` the run for the whole wait; :meth:`mark` just before each
    look at it (an end heard before that look is the look's to see); :meth:`wait` after a
    look that found it unfinished. Ends are counted, not flagged: several callers waiting
    for one run each compare with their own mark, so one caller's next look never hides
    an end from the others.

    A run this client starts while ends are announced is :meth:`expect`-ed (before its
    start is sent): its end is kept even if it comes before anyone waits, so the wait needs
    no look before the end is heard (:meth:`unread`).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: dict[str, int] = {}
        #: Ends heard per watched or expected run (kept while it is either).
        self._ended: dict[str, int] = {}
        #: (Re)connections of the listener: ends may have been missed at each.
        self._resets = 0
        #: Runs started here while ends were announced, with the resets at their start.
        self._expected: OrderedDict[str, int] = OrderedDict()

    def heard(self, execution_id: str) -> None:
        """The ``on_end`` subscriber (see :class:`Wakeups`)."""
        with self._cond:
            if execution_id == ANY_END:
                self._resets += 1
            elif execution_id in self._watched or execution_id in self._expected:
                self._ended[execution_id] = self._ended.get(execution_id, 0) + 1
            else:
                return
            self._cond.notify_all()

    def expect(self, execution_id: str) -> None:
        """A run this client is about to start (its end cannot come before this): keep its
        end for a wait to come. The oldest of more than :data:`MAX_EXPECTED` are forgotten
        (their waits then look first)."""
        with self._cond:
            self._expected[execution_id] = self._resets
            while len(self._expected) > MAX_EXPECTED:
                oldest, _ = self._expected.popitem(last=False)
                if oldest not in self._watched:
                    self._ended.pop(oldest, None)

    def unexpect(self, execution_id: str) -> None:
        """The start did not create that run (it failed, or its key was taken)."""
        with self._cond:
            if (
                self._expected.pop(execution_id, None) is not None
                and execution_id not in self._watched
            ):
                self._ended.pop(execution_id, None)

    def unread(self, execution_id: str) -> tuple[int, int] | None:
        """The mark a wait for an expected run can start from without looking at it
        first: None unless its start was heard-proof (expected, no reconnection since)."""
        with self._cond:
            resets = self._expected.get(execution_id)
            return None if resets is None or resets != self._resets else (resets, 0)

    @contextmanager
    def watching(self, execution_id: str) -> Iterator[None]:
        with self._cond:
            self._watched[execution_id] = self._watched.get(execution_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._watched.pop(execution_id) - 1
                if left:
                    self._watched[execution_id] = left
                else:
                    # Awaited: a later wait for it reads it (or hears a new end).
                    self._expected.pop(execution_id, None)
                    self._ended.pop(execution_id, None)

    def mark(self, execution_id: str) -> tuple[int, int]:
        """Before a look at the run: what :meth:`wait` compares against."""
        with self._cond:
            return self._resets, self._ended.get(execution_id, 0)

    def wait(self, execution_id: str, mark: tuple[int, int], seconds: float) -> None:
        """Up to ``seconds``, until the run's end is heard or the listener reconnected
        since ``mark``."""
        deadline = clocks.elapsed() + seconds
        with self._cond:
            while (self._resets, self._ended.get(execution_id, 0)) == mark:
                left = deadline - clocks.elapsed()
                if left <= 0:
                    return
                self._cond.wait(left)


class _NotAvailable:
    """What :meth:`Backend.listener` returns for a database without notifications."""

    present = False
    heard = -math.inf

    def wait(self, timeout: float, beat: bool = False) -> list[str]:
        return []

    def hear(self, kinds: frozenset[Hearing]) -> bool:
        return True

    def interrupt(self) -> None:
        return None

    def close(self) -> None:
        return None


#: The listener of a database that cannot notify (the thread then ends at once).
NOT_AVAILABLE: Final[Listener] = _NotAvailable()
