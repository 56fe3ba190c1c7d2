"""When a drive's word that its lease holds is young enough to start something new on.

A drive checks its lease right before each new step (see ``RunDriver.check_lease``): on the
lease keeper's last renewal while it is young, else on the database's answer to a renewal of
its own, fenced by the claim epoch. Either word is only as good as its age: another worker
may claim the run once the lease has lapsed, or on PostgreSQL soon after this process's
presence lock is found free. An answer that came late (a lock wait, or this process was
paused while it came) is asked again, never trusted.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from typing import Final

from . import bridge, clocks
from .wakeups import PRESENCE_GRACE, PRESENCE_TRUST

#: How often a drive asks the database to confirm its lease before it gives up waiting for a
#: timely answer and hands the run over, due again after ``LATE_HAND_OVER_DELAY`` seconds.
CONFIRM_TRIES: Final = 3
LATE_HAND_OVER_DELAY: Final = 1.0
#: How long a check waits for a heartbeat to vouch for the presence lock again (asking
#: sends one) before it takes the lock as in doubt.
PRESENCE_SETTLE: Final = PRESENCE_TRUST / 2

_checked_at: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "wf_persist_lease_checked_at", default=None
)


def lease_checked_at() -> float | None:
    """When (``time.time()``) the drive last found its lease good in this context (the
    step's own call runs in it), taken before the finding: a step then called ran on that
    word. A process paused after it and thawed past the lease may run the step after
    another worker recorded it (README, "At-least-once for the step in flight"); a pause
    before it may not. For diagnosing a re-run from inside the step."""
    return _checked_at.get()


def found_good(at: float) -> None:
    """Record that the lease was found good, on a word read at ``at`` (``time.time()``)."""
    _checked_at.set(at)


def settled(presence: Callable[[], float | None]) -> float | None:
    """``presence()`` (see ``Runtime.presence_since``), given a moment to be vouched for:
    heartbeats pause after a quiet spell, and asking sends one at once. A lock still in
    doubt after it (the connection died, or a round trip outlasts a heartbeat's trust) gets
    the lease renamed; one whose heartbeat merely paused keeps its quick takeover."""
    found = presence()
    until = clocks.elapsed() + PRESENCE_SETTLE
    while found == math.inf and clocks.elapsed() < until:
        bridge.pause(0.002, time.sleep)
        found = presence()
    return found


def kept_word(confirmed: float, ttl: float, held_since: float | None) -> bool:
    """Whether the keeper's last confirmation (asked at ``confirmed``, monotonic) vouches
    for the lease now: for half the TTL, and where a presence lock stands for this process
    (``held_since`` not None) only if it was held when the confirmation was asked and ever
    since, as a heartbeat sent moments ago vouches (a connection may die without a word)."""
    trusted = held_since is None or held_since <= confirmed
    return trusted and clocks.elapsed() - confirmed <= ttl / 2


def timely(asked: float, ttl: float, held_since: float | None) -> bool:
    """Whether the database's answer to a renewal asked at ``asked`` (monotonic) came soon
    enough to vouch for the lease: within half the TTL or, if the presence lock the lease
    is named after came in doubt since the ask (others may take the run ``PRESENCE_GRACE``
    after they find it free), within the margin between a heartbeat's trust and that
    grace; the next ask then renames the lease (see ``RunDriver.check_lease``)."""
    age = clocks.elapsed() - asked
    if held_since is not None and held_since > asked:
        return age <= PRESENCE_GRACE - PRESENCE_TRUST
    return age <= ttl / 2
