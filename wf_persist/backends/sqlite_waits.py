"""How wf_persist's work on SQLite waits for the database's one write lock: a turn per
process for its writers, and a busy timeout of at least :data:`MIN_BUSY_TIMEOUT_MS` for its
transactions and its reads of the schema, whatever the host engine's connections say."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

from sqlalchemy import Connection

from .. import clocks

#: The least a transaction of wf_persist's waits for SQLite's lock (and its turn), whatever
#: the host's connections say: at 0 its own connections failed each other at once. A
#: host's longer timeout is kept, and with it how soon a start gives up on a lock another
#: process holds.
MIN_BUSY_TIMEOUT_MS: Final = 1_000
#: A connection's busy timeout (ms), read once (see :func:`queued`).
_BUSY_TIMEOUT: Final = "wf_persist_busy_timeout_ms"
#: A wait for the turn this long (ms) or longer is taken off SQLite's busy timeout.
_SHORTEN_AFTER_MS: Final = 50


def patient(conn: Connection) -> contextlib.AbstractContextManager[None]:
    """A busy timeout of at least :data:`MIN_BUSY_TIMEOUT_MS` for the block, as
    :func:`queued` gives a transaction (without a turn): a host engine's shorter one (0:
    fail at once) failed a runtime's opening while another process wrote."""
    return queued(conn, None, False)


@contextlib.contextmanager
def queued(
    conn: Connection,
    writers: threading.RLock | None,
    turn: bool,
    failure: Callable[..., Exception] | None = None,
) -> Iterator[None]:
    """Hold this process's turn to write (``turn``) while a transaction of wf_persist's
    runs, and give SQLite at least :data:`MIN_BUSY_TIMEOUT_MS` to wait for its lock.

    SQLite takes one writer at a time, and a connection that finds the database locked
    sleeps in its busy handler, for up to 100 ms between tries, however soon the lock
    is free: with many threads writing (a worker finishing hundreds of runs at once),
    most of their time went to those sleeps. Queued here, the next writer starts the
    moment the last one commits. Writers of other processes (and an application's own
    transactions) still meet at SQLite's lock. The turn and the lock share the
    connection's busy timeout: a writer that waited long for its turn gives SQLite only
    what is left of it. A host's timeout below the floor (0: fail at once) is raised
    for wf_persist's transactions only, and put back after: its writes and reads come
    from several connections at once, and would fail each other with SQLite's "database
    is locked". ``wp.AsyncClient``'s connections (aiosqlite, one event loop's) take no
    turn: they wait in SQLite as before."""
    raw: Any = conn.connection.driver_connection
    if not isinstance(raw, sqlite3.Connection):
        yield
        return
    info = conn.connection.info
    got = changed = False
    try:
        host = info.get(_BUSY_TIMEOUT)
        if host is None or host < MIN_BUSY_TIMEOUT_MS:
            # Read each time where it is raised: the host may have changed it since.
            host = info[_BUSY_TIMEOUT] = int(raw.execute("PRAGMA busy_timeout").fetchone()[0])
        budget = max(host, MIN_BUSY_TIMEOUT_MS)
        if turn or budget != host:  # else a read with time enough: nothing to do
            began = clocks.elapsed()
            got = writers.acquire(timeout=budget / 1000) if turn and writers else False
            waited = int((clocks.elapsed() - began) * 1000)
            changed = budget != host or waited >= _SHORTEN_AFTER_MS
            if changed:
                raw.execute(f"PRAGMA busy_timeout = {max(0, budget - waited)}")
    except sqlite3.Error as exc:
        if got and writers:
            writers.release()
        if failure is None:
            raise
        raise failure(conn, exc, "PRAGMA busy_timeout", None) from exc
    try:
        yield
    finally:
        try:
            if changed:
                with contextlib.suppress(sqlite3.Error):  # a dead connection is dropped
                    raw.execute(f"PRAGMA busy_timeout = {host}")
        finally:
            if got and writers:
                writers.release()
