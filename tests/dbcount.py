"""Counting what the database executes for a runtime, whatever path the statements took.

SQLAlchemy's ``before_cursor_execute`` event (what its own ``assert_sql_count`` uses) does not
see wf_persist's hot path: on PostgreSQL and SQLite a step's write is sent straight to the
driver. So :class:`DatabaseCounter` counts below SQLAlchemy, on every connection the
runtime's engine hands out while it is active, as close to the database as each backend
allows, and without statistics that are flushed asynchronously or shared with other clients:

* **PostgreSQL**: libpq's protocol trace (``PQtrace``, via psycopg's ``pgconn.trace``) of
  each connection, in a file of its own. Every ``CommandComplete`` message is a statement the
  server executed (its tag says which: ``INSERT 0 2``, ``BEGIN``, ``COMMIT``), and the
  ``ReadyForQuery`` status after it says whether a transaction is still open, so an
  autocommitted statement counts as a transaction of its own. (``pg_stat_database`` counts
  are reported by each backend up to a second late, and include autovacuum's work.)
* **SQLite**: ``sqlite3.Connection.set_trace_callback``: SQLite itself reports each statement
  it runs (``BEGIN IMMEDIATE``, ``COMMIT`` included), in order, per connection (a DELETE
  whose ``ON DELETE CASCADE`` action runs is reported once more per row: counted once).
* **MySQL/MariaDB**: the server's per-session counters (``SHOW SESSION STATUS``: ``Questions``
  and ``Com_*``), read on the connection itself when the pool hands it out and when it comes
  back; the difference is what the session ran meanwhile (less the one ``SHOW`` that reads
  it). Global status would include every other client of the server.

A statement inside a transaction counts once; ``transactions`` counts commits (a ``COMMIT``,
or a write run in autocommit); ``writes`` counts INSERT/UPDATE/DELETE statements as the
database executed them (SQLite runs an ``executemany`` INSERT once per row).
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

_WRITE_VERBS = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE"})
_MYSQL_STATUS = (
    "Questions",
    "Com_commit",
    "Com_rollback",
    "Com_insert",
    "Com_insert_select",
    "Com_update",
    "Com_delete",
    "Com_select",
)


@dataclass
class Counts:
    """What the database executed: statements by verb, and the transactions committed."""

    statements: int = 0
    transactions: int = 0
    rollbacks: int = 0
    verbs: Counter[str] = field(default_factory=Counter)

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.verbs.items() if verb in _WRITE_VERBS)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.statements - other.statements,
            self.transactions - other.transactions,
            self.rollbacks - other.rollbacks,
            Counter({k: self.verbs[k] - other.verbs[k] for k in self.verbs | other.verbs}),
        )

    def add_statement(self, verb: str, *, autocommit: bool) -> None:
        """One statement the database ran (BEGIN/COMMIT/ROLLBACK included)."""
        self.statements += 1
        self.verbs[verb] += 1
        if verb in ("COMMIT", "END"):
            self.transactions += 1
        elif verb == "ROLLBACK":
            self.rollbacks += 1
        elif autocommit and verb not in ("BEGIN", "SET", "SHOW"):
            self.transactions += 1


def _verb(sql: str) -> str:
    words = re.sub(r"^(\s|--[^\n]*\n|/\*.*?\*/)+", "", sql, flags=re.S).split(None, 1)
    return words[0].upper() if words else ""


class DatabaseCounter:
    """Counts what the database runs for connections of ``engine`` (and of engines sharing
    its pool) between ``start()`` and ``stop()``. Take readings while the runtime is idle:
    PostgreSQL's trace files are complete only once each connection's trace is flushed."""

    def __init__(self, engine: Engine, directory: Path) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._active = False
        self._sqlite: dict[int, list[str]] = {}
        self._traced: dict[int, tuple[Any, Path]] = {}
        self._pg_fds: dict[int, int] = {}
        self._mysql_open: dict[int, dict[str, int]] = {}
        self._mysql = Counts()

    # lifecycle ---------------------------------------------------------------------

    def start(self) -> DatabaseCounter:
        self._active = True
        event.listen(self.engine, "checkout", self._checkout)
        event.listen(self.engine, "checkin", self._checkin)
        return self

    def stop(self) -> Counts:
        """Stop counting; what was counted."""
        counts = self.counts()
        self._active = False
        event.remove(self.engine, "checkout", self._checkout)
        event.remove(self.engine, "checkin", self._checkin)
        with self._lock:
            for raw, _path in self._traced.values():
                if self.dialect == "sqlite":
                    with contextlib.suppress(sqlite3.ProgrammingError):  # closed meanwhile
                        raw.set_trace_callback(None)
                else:
                    self._pg_stop(raw)
        return counts

    # hooks -------------------------------------------------------------------------

    def _checkout(self, raw: Any, _record: ConnectionPoolEntry, _proxy: Any) -> None:
        if not self._active:
            return
        key = id(raw)
        with self._lock:
            if self.dialect == "sqlite":
                if key not in self._traced:
                    log = self._sqlite.setdefault(key, [])
                    self._traced[key] = (raw, Path())

                    def trace(sql: str, log: list[str] = log) -> None:
                        if self._active:
                            log.append(sql)

                    raw.set_trace_callback(trace)
            elif self.dialect == "postgresql":
                self._trace_pg(raw)
            else:
                self._mysql_open[key] = self._mysql_status(raw)

    def _checkin(self, raw: Any, _record: ConnectionPoolEntry) -> None:
        if raw is None or self.dialect not in ("mysql", "mariadb"):
            return
        with self._lock:
            before = self._mysql_open.pop(id(raw), None)
            if before is None or not self._active:
                return
            after = self._mysql_status(raw)
        delta = {k: after[k] - before[k] for k in _MYSQL_STATUS}
        counted = self._mysql
        # Less the SHOW STATUS that read ``after`` (``before`` counted its own).
        counted.statements += delta["Questions"] - 1
        counted.transactions += delta["Com_commit"]
        counted.rollbacks += delta["Com_rollback"]
        counted.verbs["COMMIT"] += delta["Com_commit"]
        counted.verbs["ROLLBACK"] += delta["Com_rollback"]
        counted.verbs["INSERT"] += delta["Com_insert"] + delta["Com_insert_select"]
        counted.verbs["UPDATE"] += delta["Com_update"]
        counted.verbs["DELETE"] += delta["Com_delete"]
        counted.verbs["SELECT"] += delta["Com_select"]

    @staticmethod
    def _mysql_status(raw: Any) -> dict[str, int]:
        cursor = raw.cursor()
        try:
            names = ", ".join(f"'{n}'" for n in _MYSQL_STATUS)
            cursor.execute(f"SHOW SESSION STATUS WHERE Variable_name IN ({names})")
            found = {str(k): int(v) for k, v in cursor.fetchall()}
        finally:
            cursor.close()
        return {n: found.get(n, 0) for n in _MYSQL_STATUS}

    def _trace_pg(self, raw: Any) -> None:
        key = id(raw)
        known = self._traced.get(key)
        if known is not None and known[0] is raw and key in self._pg_fds:
            return  # tracing already
        path = known[1] if known is not None and known[0] is raw else None
        if path is None:
            path = self.directory / f"pg-{len(self._traced) + 1}.trace"
        self._traced[key] = (raw, path)
        self._pg_start(raw, path)

    def _pg_start(self, raw: Any, path: Path) -> None:
        from psycopg import pq

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        raw.pgconn.trace(fd)
        raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        self._pg_fds[id(raw)] = fd

    def _pg_stop(self, raw: Any) -> None:
        """Flush and end the trace. libpq keeps the FILE psycopg made from our descriptor
        but never writes to it again; closing the descriptor is ours to do."""
        fd = self._pg_fds.pop(id(raw), None)
        if fd is None:
            return
        if not raw.closed:
            raw.pgconn.untrace()
        os.close(fd)

    # readings ----------------------------------------------------------------------

    def counts(self) -> Counts:
        """Everything counted so far (PostgreSQL: flushes each connection's trace)."""
        with self._lock:
            if self.dialect == "sqlite":
                return self._count_sqlite()
            if self.dialect == "postgresql":
                return self._count_pg()
            return Counts(
                self._mysql.statements,
                self._mysql.transactions,
                self._mysql.rollbacks,
                Counter(self._mysql.verbs),
            )

    def _count_sqlite(self) -> Counts:
        counts = Counts()
        for log in self._sqlite.values():
            in_tx = False
            previous = None
            for sql in list(log):
                verb = _verb(sql)
                if verb == "DELETE" and sql == previous:
                    # Python's trace callback reports a DELETE again for each row its
                    # foreign-key action (ON DELETE CASCADE) runs for: not a new statement.
                    continue
                previous = sql
                counts.add_statement(verb, autocommit=not in_tx)
                if verb == "BEGIN":
                    in_tx = True
                elif verb in ("COMMIT", "END", "ROLLBACK"):
                    in_tx = False
        return counts

    def sent(self) -> list[str]:
        """PostgreSQL: the SQL of every statement executed, in order per connection (one
        per ``Bind`` of a parsed or prepared statement, or per simple ``Query``), from the
        protocol trace: what statement hooks cannot see of the raw driver paths."""
        assert self.dialect == "postgresql"
        from wf_persist.backends import pg_wire

        self.counts()  # flushes each connection's trace
        executed: list[str] = []
        with self._lock:
            paths = [path for _raw, path in self._traced.values()]
        for path in paths:
            text = path.read_text(errors="replace")
            # One entry per message; a statement's SQL may span lines.
            entries = re.split(r"\n(?=[FB]\t\d+\t)", text)
            parsed: dict[str, str] = {}
            for entry in entries:
                found = re.match(r"F\t\d+\t(Parse|Bind|Query)\t (.*)", entry, re.S)
                if found is None:
                    continue
                kind, rest = found.groups()
                if kind == "Parse":
                    m = re.match(r'"([^"]*)" "(.*)" \d+', rest, re.S)
                    if m:
                        parsed[m.group(1)] = m.group(2)
                elif kind == "Bind":
                    m = re.match(r'"[^"]*" "([^"]*)"', rest)
                    if m and m.group(1) in parsed:
                        executed.append(parsed[m.group(1)])
                    elif m and m.group(1).encode() in pg_wire.named:
                        # Prepared on this connection before the trace began.
                        executed.append(pg_wire.named[m.group(1).encode()].decode())
                else:
                    executed.append(rest.strip().strip('"'))
        return executed

    def _count_pg(self) -> Counts:
        counts = Counts()
        for raw, path in self._traced.values():
            if id(raw) in self._pg_fds:  # flush, then go on tracing into the same file
                self._pg_stop(raw)
                if not raw.closed:
                    self._pg_start(raw, path)
            pending: list[str] = []
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split("\t")
                if len(parts) < 3 or parts[0] != "B":
                    continue
                message, rest = parts[2], (parts[3].strip() if len(parts) > 3 else "")
                if message == "CommandComplete":
                    pending.append(_verb(rest.strip('"')))
                elif message == "ReadyForQuery" and pending:
                    # Several commands before one ReadyForQuery run in one transaction.
                    for verb in pending[:-1]:
                        counts.add_statement(verb, autocommit=False)
                    counts.add_statement(pending[-1], autocommit=rest == "I")
                    pending = []
        return counts


@contextmanager
def counting(engine: Engine, directory: Path) -> Iterator[DatabaseCounter]:
    """Count what the database runs for ``engine``'s connections inside the block."""
    counter = DatabaseCounter(engine, directory).start()
    try:
        yield counter
    finally:
        counter.stop()
