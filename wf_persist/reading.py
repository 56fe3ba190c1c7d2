"""Reading runs: status, records, history, pages, pending signals, published events and
the catalog. Shared by both clients; needs nothing but the database."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Row

from . import arguments, clocks, lifecycle, refusals
from .authoring import Workflow
from .backends import Backend
from .error_documents import shown
from .errors import EventNotSetError, InvalidArgumentError, UnknownExecutionError
from .models import CALL_NAME_WIDTH
from .records import (
    ExecutionInfo,
    HistoryRecord,
    Page,
    PendingSignal,
    WorkflowEntry,
    decode_cursor,
    encode_cursor,
)
from .store import Executor, catalog, executions, history, signals


class RunReader:
    """The read side of a client: never writes, never waits on a lock."""

    backend: Backend
    _poll_interval: float

    def _poll(self) -> float:
        """The longest pause between two looks at a run being waited for."""
        return self._poll_interval

    def _wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def _check_open(self) -> None:
        """Raise :class:`~wf_persist.errors.ClosedError` once the client was closed."""
        raise NotImplementedError

    # plumbing ---------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self.backend.read() as conn:
            yield conn

    def _row(self, conn: Executor, execution_id: str) -> Row[Any]:
        row = executions.get(conn, arguments.check_id(execution_id))
        if row is None:
            raise UnknownExecutionError(execution_id)
        return row

    def _look(self, execution_id: str) -> Row[Any]:
        """The run's row, read on its own (see :func:`executions.look`); once more on a
        fresh connection if the server ended the one it took (a wait for a run looks many
        times: each look gets that second try)."""
        execution_id = arguments.check_id(execution_id)
        row = refusals.again_if_reset(
            self.backend, lambda: executions.look(self.backend, execution_id)
        )
        if row is None:
            raise UnknownExecutionError(execution_id)
        return row

    @refusals.typed  # its look is tried again itself
    def describe(self, execution_id: str) -> ExecutionInfo:
        """The stored record of a run."""
        return ExecutionInfo.from_row(self._look(execution_id))

    @refusals.typed
    def status(self, execution_id: str) -> str:
        """The run's status: running, suspended, compensating, completed or failed."""
        return self.describe(execution_id).status

    @refusals.typed_read
    def pending_signals(self, execution_id: str) -> list[PendingSignal]:
        """The waits the run is parked on (or about to be), oldest first."""
        with self._reading() as conn:
            # The run first: its id exactly (history rows match other spellings of it where
            # ids compare case-insensitively).
            waits = signals.pending(conn, str(self._row(conn, execution_id).id))
        return [PendingSignal.from_event(w) for w in waits]

    @refusals.typed  # each look is tried again itself
    def get_event(self, execution_id: str, key: str, *, timeout: float | None = None) -> Any:
        """The latest value the run published under ``key`` with ``ctx.set_event``, waiting
        up to ``timeout`` seconds (``None``: until it is set or the run ends) for a first.

        Raises:
            EventNotSetError: the run ended, or ``timeout`` passed, without ``key`` set.
            UnknownExecutionError.
        """
        key = arguments.required_text("event key", key, CALL_NAME_WIDTH)
        timeout = arguments.check_timeout(timeout)
        deadline = None if timeout is None else clocks.elapsed() + timeout
        delay = 0.002
        while True:
            row, (found, value) = refusals.again_if_reset(
                self.backend, lambda: self._event_of(execution_id, key)
            )
            if found:
                return value
            if row.status in lifecycle.TERMINAL:
                raise EventNotSetError(execution_id, key, finished=True)
            remaining = None if deadline is None else deadline - clocks.elapsed()
            if remaining is not None and remaining <= 0:
                raise EventNotSetError(execution_id, key, finished=False)
            wait = min(delay, self._poll())
            self._wait(wait if remaining is None else min(wait, remaining))
            delay = min(delay * 2, self._poll())

    @refusals.typed_read
    def events(self, execution_id: str) -> dict[str, Any]:
        """Every key the run published with ``ctx.set_event``, with its latest value."""
        return self._events_of(execution_id)[1]

    def _event_of(self, execution_id: str, key: str) -> tuple[Row[Any], tuple[bool, Any]]:
        """The run's row and whether it set ``key`` (with the value)."""
        with self._reading() as conn:
            row = self._row(conn, execution_id)
            found = history.event_set(conn, execution_id, key)
            if not found[0]:
                self._still_there(conn, row)
            return row, found

    def _events_of(self, execution_id: str) -> tuple[Row[Any], dict[str, Any]]:
        """The run's row and the events it set."""
        with self._reading() as conn:
            row = self._row(conn, execution_id)
            found = history.events_set(conn, execution_id)
            self._still_there(conn, row)
            return row, found

    def _still_there(self, conn: Connection, row: Row[Any]) -> None:
        """After reading a finished run's history: the run not purged meanwhile (two reads
        are two snapshots where reads autocommit; a purge between them left a history
        without the events the run had set)."""
        if row.status in lifecycle.TERMINAL:
            self._row(conn, row.id)

    @refusals.typed_read
    def workflows(self, name: str | None = None) -> list[WorkflowEntry]:
        """The catalog: every registered (name, version), or the versions of ``name``, with
        source hash, registration time and input/output JSON Schemas."""
        if name is not None:
            arguments.workflow_name(name)
        with self._reading() as conn:
            rows = catalog.entries(conn, self.backend, name)
        return [WorkflowEntry.from_row(r) for r in rows]

    @refusals.typed_read
    def list(
        self,
        workflow: Workflow[Any, Any] | str | None = None,
        *,
        status: str | None = None,
        version: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
        actor: str | None = None,
    ) -> Page:
        """Runs of one workflow (``None``: of every workflow), oldest first, ``limit`` at a
        time (keyset pagination).

        Filters: ``status``, ``version`` (with a workflow), creation time in
        ``[created_after, created_before)`` (timezone-aware) and ``actor``.
        """
        if created_after is not None:
            created_after = arguments.utc(created_after, "created_after")
        if created_before is not None:
            created_before = arguments.utc(created_before, "created_before")
        name = None if workflow is None else arguments.workflow_name(workflow)
        actor = arguments.check_text("actor", actor)
        version = arguments.check_version(version)
        if version is not None and name is None:
            raise InvalidArgumentError("version filters the runs of one workflow: name it")
        if status is not None:
            known = arguments.plain_text(status)
            if known not in lifecycle.STATUSES:
                raise InvalidArgumentError(
                    f"unknown status {shown(status)}; expected one of {lifecycle.STATUSES}"
                )
            status = known
        if limit is not None and (
            # Below 2**31: the page size (plus one) is bound as a database integer.
            isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit < 2**31
        ):
            raise InvalidArgumentError(f"limit must be a positive integer, got {limit!r}")
        after = None if cursor is None else decode_cursor(cursor)
        with self._reading() as conn:
            rows = executions.list_page(
                conn,
                self.backend,
                name,
                status=status,
                version=version,
                after=after,
                limit=None if limit is None else limit + 1,
                created_after=created_after,
                created_before=created_before,
                actor=actor,
            )
        items = [ExecutionInfo.from_row(r) for r in rows[: limit if limit is not None else None]]
        more = limit is not None and len(rows) > limit
        next_cursor = encode_cursor(items[-1].created_at, items[-1].execution_id) if more else None
        return Page(items, next_cursor)

    @refusals.typed_read
    def history(self, execution_id: str) -> Sequence[HistoryRecord]:
        """Every event of the run in sequence order."""
        with self._reading() as conn:
            # Its id exactly, as for pending_signals.
            rows = history.load(conn, str(self._row(conn, execution_id).id))
        return [HistoryRecord(int(r.sequence), r.created_at, dict(r.event)) for r in rows]
