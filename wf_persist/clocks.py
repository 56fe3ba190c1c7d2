"""The clock every elapsed time in wf_persist is read from (leases, heartbeats, deadlines,
waits).

On Linux it is ``CLOCK_BOOTTIME``, which goes on while the machine is suspended, as the
database's clock and other workers' do. ``time.monotonic()`` (``CLOCK_MONOTONIC``) stops
then: a lease confirmed just before a suspend would still look fresh after it, and a step
would start on it although the lease had long lapsed and another worker may have taken the
run and recorded that step. Elsewhere (no such clock) it is ``time.monotonic()``.

Values of this clock are compared only with each other: one taken from another clock
would be off by the time the machine has spent suspended since it booted.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Final


def _boot_time_clock() -> Callable[[], float]:
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return time.monotonic
    try:
        time.clock_gettime(clock_id)
    except OSError:  # a kernel that does not know it
        return time.monotonic
    return functools.partial(time.clock_gettime, clock_id)


#: Seconds since an arbitrary moment, counting time spent suspended where the system can.
elapsed: Final[Callable[[], float]] = _boot_time_clock()
