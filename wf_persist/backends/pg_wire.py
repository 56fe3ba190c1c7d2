"""One of our statements on an idle psycopg connection through libpq itself (``pgconn``):
prepared once per connection, its values dumped and its rows loaded by psycopg's own
adapters, one blocking ``PQexecPrepared`` (which lets go of the GIL) in between.

A statement sent without BEGIN commits on its own, so no switch to autocommit and back is
needed, and none of the cursor's per-execution work is done: together about a fifth of a
step's client CPU. Only for an idle connection (nothing of a transaction open, psycopg's or
the server's) and a synchronous one; everything else goes through a cursor as before.
"""

from __future__ import annotations

import functools
import hashlib
import re
import select
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

from psycopg import errors, pq
from psycopg.adapt import PyFormat, Transformer

from .pg_json import Context

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s|%%")
#: The server forgot a statement we prepared (``DEALLOCATE``/``DISCARD ALL`` by the host).
_UNKNOWN_STATEMENT: Final = "26000"
_ALREADY_PREPARED: Final = "42P05"
_OK: Final = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)


class _Session:
    """What one connection keeps between our statements: the names it has prepared (each
    with how many more executions its plan serves), and a transformer (its dumpers and
    loaders found once per type, as a cursor keeps one) made for the session's settings that
    loading and dumping follow (client encoding, time zone, date style): a new one if the
    host changes any of them. JSON is loaded with ``json.loads`` whatever the host's
    loaders (:mod:`.pg_json`)."""

    __slots__ = ("names", "settings", "tx")

    def __init__(self) -> None:
        self.names: dict[bytes, int] = {}
        self.settings: tuple[bytes | None, ...] = ()
        self.tx: Any = None

    def transformer(self, raw: Any) -> Any:
        status = raw.pgconn.parameter_status
        settings = (status(b"client_encoding"), status(b"TimeZone"), status(b"DateStyle"))
        if self.tx is None or settings != self.settings:
            self.tx = Transformer.from_context(Context(raw))
            self.settings = settings
        return self.tx


#: Statements prepared per connection at most; past it a new one is parsed each time
#: (the few write shapes of ordinary runs stay far below).
MAX_PREPARED: Final = 64
#: Executions of a prepared statement before it is prepared again. The server keeps the
#: plan it settled on after a few executions for as long as the statement lives, and a plan
#: made while a table was tiny (a new database) scans the whole table: without autovacuum,
#: whose statistics would make the server plan again, that would go on as the table grows
#: to millions of rows. Preparing again costs two round trips per this many executions.
REPLAN_AFTER: Final = 1000
#: The key of a connection's session in its pool entry's ``info``: kept as long as that
#: DBAPI connection, dropped with it (and when the pool reconnects the entry).
_SESSION: Final = "wf_persist.pg_wire"
#: Every statement named so far, by name: what a protocol trace shows only as a name.
named: Final[dict[bytes, bytes]] = {}


@functools.lru_cache(maxsize=256)
def converted(sql: str) -> tuple[bytes, bytes, tuple[str, ...], list[PyFormat]]:
    """``sql`` with ``%(name)s`` placeholders numbered ``$n`` (a name used twice is one
    parameter), its prepared statement's name (from its text: the same statement has the
    same name in every process and runtime), the parameters' names in order and their
    formats (text: the server infers each type from the statement)."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    text = _PLACEHOLDER.sub(number, sql)
    name = b"wfp_" + hashlib.sha1(text.encode()).hexdigest()[:20].encode()
    named[name] = text.encode()
    return text.encode(), name, tuple(order), [PyFormat.TEXT] * len(order)


def usable(raw: Any) -> bool:
    """Whether ``raw`` (a psycopg Connection) is idle: no transaction of psycopg's or the
    server's, no pipeline, nothing pending."""
    pgconn = raw.pgconn
    return bool(
        pgconn.transaction_status == pq.TransactionStatus.IDLE
        and pgconn.status == pq.ConnStatus.OK
        and pgconn.pipeline_status == pq.PipelineStatus.OFF
    )


def execute(
    raw: Any, info: MutableMapping[Any, Any], sql: str, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Run ``sql`` (psycopg's ``%(name)s`` style) on the idle connection ``raw``, committed
    on its own; its rows as psycopg would load them. Failures raise psycopg's errors.
    ``info`` is the ``info`` of ``raw``'s pool entry, where what it keeps between
    statements lives and dies with it.

    A connection whose ``prepare_threshold`` is None (the setting for a transaction-mode
    pooler that cannot keep prepared statements) gets each statement parsed anew."""
    query, name, order, formats = converted(sql)
    pgconn = raw.pgconn
    session = info.get(_SESSION)
    if session is None:
        session = info[_SESSION] = _Session()
    with raw.lock:  # as psycopg's own execution: one statement at a time per connection
        tx = session.transformer(raw)
        values = tx.dump_sequence([params[k] for k in order], formats)
        names = session.names
        if raw.prepare_threshold is None or (name not in names and len(names) >= MAX_PREPARED):
            result = pgconn.exec_params(query, values)
        else:
            left = names.get(name)
            if left is None or left <= 0:
                if left is not None:  # planned for the tables as they were: plan anew
                    _deallocate(raw, name)
                _prepare(raw, name, query)
                left = REPLAN_AFTER
            names[name] = left - 1
            result = pgconn.exec_prepared(name, values)
            if result.status not in _OK and _sqlstate(result) == _UNKNOWN_STATEMENT:
                # Deallocated behind our back (DEALLOCATE ALL, DISCARD ALL): the others
                # are likely gone too, and are prepared again as they come.
                names.clear()
                _prepare(raw, name, query)
                names[name] = REPLAN_AFTER - 1
                result = pgconn.exec_prepared(name, values)
        if result.status not in _OK:
            raise failure(raw, result)
        tx.set_pgresult(result)
        try:
            return list(tx.load_rows(0, result.ntuples, tuple))
        finally:
            tx.set_pgresult(None)  # the session keeps no result (a claim's history)


def _prepare(raw: Any, name: bytes, query: bytes) -> None:
    result = raw.pgconn.prepare(name, query)
    if result.status != pq.ExecStatus.COMMAND_OK and _sqlstate(result) != _ALREADY_PREPARED:
        raise failure(raw, result)


def _deallocate(raw: Any, name: bytes) -> None:
    """Forget a statement we prepared: by the protocol's Close where libpq has it (17+), as
    a pooler that keeps prepared statements itself expects, else by ``DEALLOCATE``. The
    Close is sent and awaited here (libpq's blocking call holds the interpreter's lock for
    the whole round trip: every thread of the process would stop meanwhile)."""
    pgconn = raw.pgconn
    try:
        pgconn.send_close_prepared(name)
    except (AttributeError, errors.NotSupportedError):  # psycopg < 3.2, libpq < 17
        result = pgconn.exec_(b"DEALLOCATE " + name)  # a name of ours: wfp_, hex digits
    else:
        result = _awaited(pgconn)
    if result.status != pq.ExecStatus.COMMAND_OK and _sqlstate(result) != _UNKNOWN_STATEMENT:
        raise failure(raw, result)


def flushed(pgconn: Any, timeout: float | None = None) -> None:
    """Send what libpq holds for ``pgconn`` (nonblocking, as psycopg leaves it), waiting in
    ``poll`` for the socket to take more (each wait at most ``timeout`` seconds)."""
    writable = select.poll()
    writable.register(pgconn.socket, select.POLLOUT)
    while pgconn.flush():
        writable.poll(None if timeout is None else timeout * 1000)


def _awaited(pgconn: Any) -> Any:
    """The result of the command just sent on ``pgconn`` (nonblocking, as psycopg leaves
    it), waiting in ``poll`` (which lets other threads run, and takes any descriptor, not
    only those below 1024 as ``select`` does); its last result if several."""
    flushed(pgconn)
    readable = select.poll()
    readable.register(pgconn.socket, select.POLLIN)
    found = None
    while True:
        while pgconn.is_busy():
            readable.poll()
            pgconn.consume_input()  # raises if the connection is lost
        result = pgconn.get_result()
        if result is None:
            return found
        found = result


def failure(raw: Any, result: Any) -> Exception:
    """psycopg's error for a failed ``result``, as its own execution would raise it."""
    encoding = raw.info.encoding
    if raw.pgconn.status != pq.ConnStatus.OK:  # the connection was lost
        return errors.OperationalError(raw.pgconn.get_error_message(encoding))
    return errors.error_from_result(result, encoding=encoding)


def _sqlstate(result: Any) -> str | None:
    code = result.error_field(pq.DiagnosticField.SQLSTATE)
    return code.decode() if code else None
