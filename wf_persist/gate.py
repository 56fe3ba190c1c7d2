"""Opening a database for a deploy gate: the next release's code is loaded to be checked
against the runs a fleet recorded, and must leave no trace the fleet would meet."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_open_blocks = 0


@contextlib.contextmanager
def without_cataloging() -> Iterator[None]:
    """Runtimes built while this block runs, in any thread of the process (an application
    may build its runtime on a thread of its own), catalog nothing for as long as they
    live; they, and clients opened meanwhile, create the schema only in a database holding
    none and never upgrade one (the release still serving it could no longer open it).

    A release that is checked and then not deployed must leave no version behind: starts
    by name would pin runs to it, which no worker serves. A definition such a runtime
    registers is still checked against the catalog (another source under the same version
    is refused), and is cataloged by the first start that needs it."""
    global _open_blocks
    with _lock:
        _open_blocks += 1
    try:
        yield
    finally:
        with _lock:
            _open_blocks -= 1


def gating() -> bool:
    """Whether a :func:`without_cataloging` block is running in this process."""
    return _open_blocks > 0
