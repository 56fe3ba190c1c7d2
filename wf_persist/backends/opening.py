"""Connecting to a database, and naming it in messages with its passwords hidden: the
first connection of an engine is where a wrong URL, a driver's refusal of its arguments or a
server's cancelled set-up shows, each raised as one typed error."""

from __future__ import annotations

from typing import Final

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL, Dialect
from sqlalchemy.exc import DBAPIError, OperationalError

from ..errors import DatabaseConnectError, UnsupportedDatabaseError
from ..refusals import cancellation

#: Query parameters of a URL that carry a password (libpq's, PyMySQL's, and the passphrases
#: of their client keys).
_PASSWORD_PARAMETERS: Final = frozenset({"password", "passwd", "sslpassword", "ssl_key_password"})
#: Shorter passwords are not looked for in a driver's message (every such run of letters
#: would be masked, the message unreadable, the password's letters hinted at).
_MASKED_FROM: Final = 4


def _passwords(url: URL) -> list[str]:
    found = [str(url.password)] if url.password else []
    for name, value in url.query.items():
        if name.lower() in _PASSWORD_PARAMETERS:
            found.extend([value] if isinstance(value, str) else value)
    return found


def describe_url(url: URL) -> str:
    """The URL as it may appear in messages: passwords hidden (also one in the query)."""
    query = {
        name: "***" if name.lower() in _PASSWORD_PARAMETERS else value
        for name, value in url.query.items()
    }
    return url.set(query=query).render_as_string(hide_password=True)


def connect(engine: Engine) -> Connection:
    """``engine.connect()``, a failure to connect (the driver's ``OperationalError``)
    raised as the typed :class:`~wf_persist.errors.DatabaseConnectError` that names the
    database (passwords hidden) and says the server's or driver's reason; the driver
    refusing the engine's connection arguments (an option it does not know, in the URL or
    ``connect_args``), or the dialect's first reading of the server's answers failing on
    them (text handed over as bytes), as :class:`~wf_persist.errors.UnsupportedDatabaseError`.
    Another error (a host's connect listener failing, say) is raised as it came; a
    statement the database cancelled while the connection was made (its first queries,
    under a host's tiny ``statement_timeout``) as
    :class:`~wf_persist.errors.StatementCancelledError`."""
    try:
        return engine.connect()
    except OperationalError as exc:
        from . import backend_type  # the package's: it imports this module

        if backend_type(engine.dialect.name).cancelled(exc):
            raise cancellation(exc) from exc
        raise DatabaseConnectError(
            f"cannot connect to the database at {describe_url(engine.url)}: "
            f"{reason(engine.url, exc)}",
            exc.orig,
        ) from exc
    except (TypeError, UnicodeError, DBAPIError) as exc:
        where = _in_dialect(exc, engine.dialect)
        if where == "connect":
            raise UnsupportedDatabaseError(
                f"the driver refused the connection arguments for the database at "
                f"{describe_url(engine.url)}: {reason(engine.url, exc)}"
            ) from exc
        if where == "initialize" and not isinstance(exc, DBAPIError):
            # The dialect's first reading of the server's answers (its version, its
            # settings) failed on what it was handed: text the session could not give as
            # text.
            from . import backend_type  # the package's: it imports this module

            hint = backend_type(engine.dialect.name).setup_hint
            raise UnsupportedDatabaseError(
                f"setting up a connection to the database at {describe_url(engine.url)} "
                f"failed reading the server's answers ({type(exc).__name__}: {exc}){hint}"
            ) from exc
        raise


def reason(url: URL, exc: BaseException) -> str:
    """The driver's words for ``exc`` on one line, the URL's passwords hidden."""
    orig = getattr(exc, "orig", None)
    said = " ".join(str(orig if orig is not None else exc).split())
    for password in _passwords(url):
        if len(password) >= _MASKED_FROM:
            said = said.replace(password, "***")
    return said


def _in_dialect(exc: BaseException, dialect: Dialect) -> str | None:
    """Which of ``dialect``'s own steps ``exc`` came out of: ``connect`` (the driver's
    connect call, with the engine's arguments) or ``initialize`` (its first connection's
    reading of the server's version and settings); None for anything else (a host's own
    code, another engine's among it)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_name
        if name in ("connect", "initialize") and frame.f_locals.get("self") is dialect:
            return name
        tb = tb.tb_next
    return None
