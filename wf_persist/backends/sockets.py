"""The TCP connections to a database server: keepalives so a dead peer is noticed, and
ending a statement another thread waits on when its answer will never come.

Without keepalives, a connection whose server vanished without a word (a host crash, a
partition, a failover that black-holes the old primary) waits on a read for as long as the
operating system lets it (hours, with Linux's defaults): a worker's claim loop, a
``result()``, a shutdown. Connections of wf_persist's own engines probe an idle peer
after :data:`IDLE` seconds and give up after :data:`COUNT` unanswered probes
:data:`INTERVAL` seconds apart, or when what they sent goes unacknowledged for
:data:`USER_TIMEOUT_MS`. A host's engine keeps its own settings.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Final

log = logging.getLogger("wf_persist.leases")

IDLE: Final = 10
INTERVAL: Final = 5
COUNT: Final = 3
USER_TIMEOUT_MS: Final = 30_000

#: libpq's connection options for the same (PostgreSQL through psycopg).
LIBPQ: Final = {
    "keepalives": 1,
    "keepalives_idle": IDLE,
    "keepalives_interval": INTERVAL,
    "keepalives_count": COUNT,
    "tcp_user_timeout": USER_TIMEOUT_MS,
}


def keep_alive(
    sock: socket.socket,
    idle: int = IDLE,
    interval: int = INTERVAL,
    count: int = COUNT,
    user_timeout_ms: int = USER_TIMEOUT_MS,
) -> None:
    """Set keepalives and a user timeout on a connected TCP socket (a driver that takes no
    such options: PyMySQL; a connection a host's creator made); nothing on a Unix socket."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
        ("TCP_USER_TIMEOUT", user_timeout_ms),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def shut(fileno: int) -> None:
    """Shut the socket down both ways: a thread blocked reading it reads its end at once
    (and the driver reports a lost connection). Through a duplicate of the descriptor,
    which the driver's own may outlive."""
    try:
        with socket.socket(fileno=os.dup(fileno)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:  # closed meanwhile, or never connected
        log.debug("cutting a stalled connection: %s", exc)
