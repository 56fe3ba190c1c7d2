"""Ending a statement another thread waits on, when its connection's answer will never come
(a network fault cut it without either end hearing of it)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("wf_persist.leases")


def shut(fileno: int) -> None:
    """Shut the socket down both ways: a thread blocked reading it reads its end at once
    (and the driver reports a lost connection). Through a duplicate of the descriptor,
    which the driver's own may outlive."""
    try:
        with socket.socket(fileno=os.dup(fileno)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:  # closed meanwhile, or never connected
        log.debug("cutting a stalled connection: %s", exc)
