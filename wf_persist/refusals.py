"""The database refusing this engine's user (a privilege not granted, or revoked while a
process runs; a host's SQLite authorizer) or its writes (a read-only server, a primary
demoted to a standby after a failover), reported at every public entry point as one
typed :class:`~wf_persist.errors.UnsupportedDatabaseError` instead of the driver's error;
the database out of reach (a connection lost or not made) as
:class:`~wf_persist.errors.DatabaseUnavailableError`; a statement the database cancelled (a
statement or lock timeout of the engine's settings) as
:class:`~wf_persist.errors.StatementCancelledError`; a call in an application's PostgreSQL
transaction that had already failed as :class:`~wf_persist.errors.InvalidArgumentError`.

No privilege is probed in advance: a probe would have to write (firing a host's triggers,
waiting on its locks) or read each backend's grant tables, and would refuse legal grants
that omit what wf_persist never does (UPDATE on its append-only history, DELETE where
nobody purges). What the server refuses is reported where it is refused; a statement
refused rolls its transaction back, so nothing is half-written.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from .errors import (
    DatabaseUnavailableError,
    InvalidArgumentError,
    PoolExhaustedError,
    StatementCancelledError,
    UnsupportedDatabaseError,
    WfPersistError,
)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
F_ = TypeVar("F_", DatabaseUnavailableError, StatementCancelledError)


class _Refuses(Protocol):
    def refused(self, exc: BaseException) -> bool: ...

    def unreachable(self, exc: BaseException) -> bool: ...

    def cancelled(self, exc: BaseException) -> bool: ...

    def aborted(self, exc: BaseException) -> bool: ...

    def missing_schema(self, exc: BaseException) -> bool: ...

    def serialization_failure(self, exc: BaseException) -> bool: ...

    def deadlocked(self, exc: BaseException) -> bool: ...


def _said(exc: BaseException) -> tuple[BaseException | None, str]:
    """The driver's exception behind ``exc`` and the first line of what it said."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    lines = str(orig).strip().splitlines() if orig is not None else []
    return orig, lines[0][:300] if lines else type(exc).__name__


def refusal(exc: BaseException) -> UnsupportedDatabaseError:
    """The typed error for the server's refusal ``exc``, in the server's own words."""
    return UnsupportedDatabaseError(f"the database refused this engine: {_said(exc)[1]}")


def _failure(kind: type[F_], exc: BaseException, what: str, after: str = "") -> F_:
    """``kind`` for the driver's ``exc``, in its own words, its fields kept."""
    orig, said = _said(exc)
    invalidated = isinstance(exc, DBAPIError) and exc.connection_invalidated
    return kind(f"{what}: {said}{after}", orig, invalidated)


def unavailable(exc: BaseException) -> DatabaseUnavailableError:
    """The typed error for the database out of reach, in the driver's own words."""
    return _failure(
        DatabaseUnavailableError,
        exc,
        "the database could not be reached",
        "; a write this call made committed whole or not at all (only a loss during its "
        "commit leaves which one unknown)",
    )


def cancellation(exc: BaseException) -> StatementCancelledError:
    """The typed error for a statement the database cancelled, in its own words."""
    return _failure(StatementCancelledError, exc, "the database cancelled a statement")


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a database driver's (PEP 249 ``Error``), raw or as SQLAlchemy
    wrapped it: SQLAlchemy lets a few through unwrapped (one raised while it sets a new
    connection's isolation level, say)."""
    if isinstance(exc, DBAPIError):
        return True
    return any(k.__name__ == "Error" and k.__module__ != "builtins" for k in type(exc).__mro__)


def translate(backend: _Refuses, exc: BaseException) -> None:
    """Raise the typed error if ``exc`` is ``backend``'s server refusing the user or out of
    reach (an error of wf_persist's own, such as one refused at connecting, is typed
    already)."""
    if isinstance(exc, PoolTimeout) and not isinstance(exc, WfPersistError):
        raise _failure(
            PoolExhaustedError,
            exc,
            "no connection of the engine's pool was free within its pool_timeout (all in "
            "use: by the application, or by more calls at once than the pool holds)",
        ) from exc
    if isinstance(exc, WfPersistError) or not is_driver_error(exc):
        return
    if backend.refused(exc):
        raise refusal(exc) from exc
    if backend.unreachable(exc):
        raise unavailable(exc) from exc
    if backend.deadlocked(exc):  # in an application's transaction (ours are sent again)
        raise _failure(
            StatementCancelledError,
            exc,
            "the database cancelled a statement",
            "; it broke a deadlock by rolling back the transaction it was part of (which "
            "waited for rows another held while holding rows that one waited for): retry "
            "it in a new transaction",
        ) from exc
    if backend.cancelled(exc):
        raise cancellation(exc) from exc
    if backend.serialization_failure(exc):  # in an application's transaction
        raise _failure(
            StatementCancelledError,
            exc,
            "the database cancelled a statement",
            "; the transaction it was part of (at REPEATABLE READ or stricter) met a "
            "concurrent change: retry it in a new transaction",
        ) from exc
    if backend.missing_schema(exc):
        raise UnsupportedDatabaseError(
            f"a table or column of wf_persist's is not where this connection looks: "
            f"{_said(exc)[1]} (a session or connection given without the schema, "
            "search_path or schema_translate_map of the runtime's engine? tables dropped? "
            "the schema taken down below this version's? wf-persist db upgrade brings it "
            "to head)"
        ) from exc
    if backend.aborted(exc):  # an application's session, after a statement of its own failed
        raise InvalidArgumentError(
            "the transaction this call was given had already failed (a statement earlier in "
            "it raised): roll it back before using it again"
        ) from exc


def reset(backend: _Refuses, exc: BaseException) -> bool:
    """Whether ``exc`` is a pooled connection the server ended under a statement (an
    operator's kill, an idle timeout, a proxy's reset; the pool has dropped it), not a
    connection that could not be made: a read may be tried once more on a fresh one."""
    return (
        isinstance(exc, DBAPIError)
        and exc.connection_invalidated
        and not isinstance(exc, WfPersistError)
        and backend.unreachable(exc)
    )


def again_if_reset(backend: _Refuses, read: Callable[[], T]) -> T:
    """``read()``, once more if the server ended its connection (:func:`reset`)."""
    try:
        return read()
    except Exception as exc:
        if not reset(backend, exc):
            raise
    return read()


#: How often a write the database rolled back to break a deadlock is sent (in all).
DEADLOCK_TRIES = 4


def again_if_deadlocked(backend: _Refuses, write: Callable[[], T]) -> T:
    """``write()``, sent again (after a pause of a few milliseconds, growing) while the
    database breaks a deadlock by rolling it back: its transaction is gone whole, and a
    drive's writes are fenced and deduplicated. Two of wf_persist's own writes meet so (a
    child telling its parent, locking child then parent, and a lease renewal of both); a
    drive failed, and the step whose result it was writing ran again."""
    for attempt in range(1, DEADLOCK_TRIES):
        try:
            return write()
        except Exception as exc:
            if not backend.deadlocked(exc):
                raise
        time.sleep(random.uniform(0.005, 0.02) * attempt)
    return write()


def typed_read(method: F) -> F:
    """:func:`typed`, for a method that only reads (so may run twice) and calls no other
    such method: a connection the server ended while staying up (:func:`reset`) is met
    again once before the database is reported out of reach."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        try:
            return again_if_reset(self.backend, lambda: method(self, *args, **kwargs))
        except Exception as exc:
            translate(self.backend, exc)
            raise

    return cast(F, wrapper)


def typed(method: F) -> F:
    """A public method (of an object with a ``backend`` and a ``_check_open``: a closed
    one refuses every call) whose refusals by the server, and the database out of reach,
    raise the typed errors."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            translate(self.backend, exc)
            raise

    return cast(F, wrapper)
