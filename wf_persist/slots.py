"""Step concurrency slots: ``Limit(n, key=...)`` on a step, held in the database.

A slot is a row of ``wf_slots`` (see :class:`~wf_persist.models.ConcurrencySlot`), so a
limit holds across every process sharing the database, on every backend, and outlives what
a session lock did not: a database restart, a failover, a killed session. The row is held
while its expiry is ahead of the database's clock; this process pushes the expiry of all
its slots in one statement every quarter of its lease TTL while it holds any (on the lease
keeper's connections, which busy runs cannot starve), and deletes a slot's row when its
step ends. A worker that dies or freezes stops pushing: its slots lapse one lease TTL
later, as its runs' leases do, and the next taker overwrites them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine

from . import clocks
from .errors import WfPersistError
from .store import slots as store

if TYPE_CHECKING:
    from .backends import Backend

log = logging.getLogger("wf_persist.worker")

#: How many times :meth:`Holding.fresh` asks the database before it gives up on a slot
#: whose confirmations keep coming back too late to vouch for it.
FRESH_TRIES = 3


class Holding:
    """What :meth:`Slots.slot` yields: ``acquire()`` tries once, without blocking (True
    once a slot is held); ``fresh()``, right before the step's own code, whether the slot
    is still this holding's for a while yet."""

    def __init__(self, acquire: Callable[[], bool], fresh: Callable[[], bool]) -> None:
        self._acquire = acquire
        self.fresh = fresh

    def __call__(self) -> bool:
        return self._acquire()


def slot_key(step_name: str, key: str) -> str:
    """The (step, key) of a limit as a fixed-width column value (a key is any string)."""
    # surrogatepass: a key with a lone surrogate (any str) is a key like another.
    text = f"{step_name}\0{key}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class Slots:
    """One runtime's slots: takes them, keeps them ahead of their expiry, gives them back."""

    def __init__(
        self,
        backend: Backend,
        owner: Callable[[], str],
        ttl: float,
        renewals: Callable[[], Engine] | None = None,
    ) -> None:
        self.backend = backend
        self._owner = owner
        #: The engine renewals go through (the lease keeper's: a pool of its own, which
        #: busy runs cannot starve); the runs' pool without one, or once it has stopped.
        self._renewals = renewals
        #: Seconds a slot outlives its holder's last renewal (the runtime's lease TTL).
        self.ttl = ttl
        self._lock = threading.Lock()
        #: The holdings of this process now (their ``holder`` values).
        self._held: set[str] = set()
        #: When each holding was last known held (monotonic, asked before its take or a
        #: renewal that kept every holding): it is held for a TTL from then, at least.
        self._confirmed: dict[str, float] = {}
        self._renewer: threading.Thread | None = None

    @contextmanager
    def slot(self, step_name: str, key: str, limit: int, execution_id: str) -> Iterator[Holding]:
        """Yields ``acquire()``; the slot (if taken) is given back on exit."""
        row = {
            "slot_key": slot_key(step_name, key),
            "holder": uuid.uuid4().hex,
            "owner": self._owner(),
            "execution_id": execution_id,
            "step_name": step_name,
        }
        held = False
        ending = _Exit()
        holder = row["holder"]

        def hold(asked: float) -> None:
            nonlocal held
            held = True
            with self._lock:
                self._held.add(holder)
                self._confirmed[holder] = asked
                self._keep_renewing()

        def acquire() -> bool:
            if held:
                return True
            asked = clocks.elapsed()
            if not self._take(row, limit):
                return False
            if not ending.keep(lambda: hold(asked)):
                self._give_back(holder)
                return False
            return True

        try:
            yield Holding(acquire, lambda: held and self._fresh(holder))
        finally:
            ending.exit()
            if held:
                with self._lock:
                    self._held.discard(holder)
                    self._confirmed.pop(holder, None)
                self._give_back(holder)

    def _fresh(self, holder: str) -> bool:
        """Whether ``holder`` holds its slot for at least half a TTL more: known held since
        recently, else renewed now (a process kept from running longer than the TTL, its
        renewals late, may find its slot lapsed and taken: its step must not start)."""
        half = self.ttl / 2
        asked = None
        for _ in range(FRESH_TRIES):
            with self._lock:
                confirmed = self._confirmed.get(holder)
            if confirmed is not None and clocks.elapsed() - confirmed <= half:
                return True
            asked = clocks.elapsed()
            with self._renewal() as conn:
                if not store.renew(self.backend, conn, {holder}, self.ttl):
                    return False  # lapsed and taken (or given back)
            with self._lock:
                if holder in self._held:
                    self._confirmed[holder] = max(self._confirmed.get(holder, asked), asked)
        # Every answer came late (a slow database): the last still holds it a while, and
        # giving it up to queue again would meet the same latency.
        return asked is not None and clocks.elapsed() - asked < self.ttl

    def _take(self, row: dict[str, str], limit: int) -> bool:
        """One try: the lowest free slot, if any, taken by one compare-and-set."""
        backend = self.backend
        try:
            with backend.read() as conn:
                free = store.free_slot(backend, conn, row["slot_key"], limit)
            if free is None:
                return False
            with backend.begin() as conn:
                return store.take(backend, conn, {**row, "slot": free}, self.ttl)
        except Exception as exc:
            if backend.contention(exc):  # a racer was in the way: try again later
                return False
            raise

    def _give_back(self, holder: str) -> None:
        """Delete the slot's row. If that fails, the slot lapses one TTL later (it is no
        longer renewed); the step's outcome stands either way."""
        try:
            with self.backend.begin() as conn:
                store.give_back(self.backend, conn, holder)
        except Exception as exc:
            log.warning(
                "giving back a step's concurrency slot failed; it lapses within %.0f s: %s",
                self.ttl,
                exc,
            )

    def _keep_renewing(self) -> None:
        """Start the renewing thread unless it runs (under ``_lock``)."""
        if self._renewer is None or not self._renewer.is_alive():  # or forked
            self._renewer = threading.Thread(
                target=self._renew, name="wf-persist-slot-renewal", daemon=True
            )
            self._renewer.start()

    def _renew(self) -> None:
        """Every quarter of the TTL, push every held slot's expiry, until none is held. A
        slot that lapsed meanwhile (this process kept from running, the database out of
        reach longer than the TTL) and was taken is said: its step runs on."""
        while True:
            time.sleep(self.ttl / 4)
            with self._lock:
                if not self._held:
                    self._renewer = None
                    return
                held = set(self._held)
            asked = clocks.elapsed()
            try:
                with self._renewal() as conn:
                    kept = store.renew(self.backend, conn, held, self.ttl)
            except Exception as exc:  # the next turn tries again
                log.warning("renewing held concurrency slots failed: %s", exc)
                continue
            with self._lock:
                still = len(held & self._held)
                if kept == len(held):  # every one: each is held a TTL from ``asked`` on
                    for holder in held & self._held:
                        self._confirmed[holder] = max(self._confirmed[holder], asked)
            if kept < still:
                log.warning(
                    "%d held concurrency slot(s) lapsed and were taken by another run",
                    still - kept,
                )

    @contextmanager
    def _renewal(self) -> Iterator[Connection]:
        """A transaction on the renewals' engine (see :attr:`_renewals`)."""
        engine = None
        if self._renewals is not None:
            try:
                engine = self._renewals()
            except WfPersistError:  # its runtime closes: the slots still held are renewed
                engine = None
        if engine is None:
            with self.backend.begin() as conn:
                yield conn
            return
        with engine.connect() as own, self.backend.begin(own) as conn:
            yield conn


class _Exit:
    """A slot's exit and a late ``acquire()`` take turns: on the async worker a try runs
    on an io thread, and a cancel of the step's call runs the exit meanwhile; a slot that
    try takes afterwards must be given back at once, never kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exited = False

    def keep(self, hold: Callable[[], None]) -> bool:
        """``hold()`` (recording the slot taken) unless the exit came first; whether it
        did not."""
        with self._lock:
            if self._exited:
                return False
            hold()
            return True

    def exit(self) -> None:
        with self._lock:
            self._exited = True
