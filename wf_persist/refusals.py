"""The database refusing this engine's user (a privilege not granted, or revoked while a
process runs; a host's SQLite authorizer) or its writes (a read-only server, a primary
demoted to a standby after a failover), reported at every public entry point as one
typed :class:`~wf_persist.errors.UnsupportedDatabaseError` instead of the driver's error.

No privilege is probed in advance: a probe would have to write (firing a host's triggers,
waiting on its locks) or read each backend's grant tables, and would refuse legal grants
that omit what wf_persist never does (UPDATE on its append-only history, DELETE where
nobody purges). What the server refuses is reported where it is refused; a statement
refused rolls its transaction back, so nothing is half-written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy.exc import DBAPIError

from .errors import DatabaseConnectError, UnsupportedDatabaseError

F = TypeVar("F", bound=Callable[..., Any])


class _Refuses(Protocol):
    def refused(self, exc: BaseException) -> bool: ...


def refusal(exc: DBAPIError) -> UnsupportedDatabaseError:
    """The typed error for the server's refusal ``exc``, in the server's own words."""
    said = str(exc.orig).strip().splitlines()[0][:300] if exc.orig else type(exc).__name__
    return UnsupportedDatabaseError(f"the database refused this engine: {said}")


def translate(backend: _Refuses, exc: DBAPIError) -> None:
    """Raise the typed error if ``exc`` is ``backend``'s server refusing the user (one
    refused at connecting is a :class:`DatabaseConnectError` already)."""
    if not isinstance(exc, DatabaseConnectError) and backend.refused(exc):
        raise refusal(exc) from exc


def typed(method: F) -> F:
    """A public method (of an object with a ``backend``) whose refusals by the server
    raise the typed error."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except DBAPIError as exc:
            translate(self.backend, exc)
            raise

    return cast(F, wrapper)
