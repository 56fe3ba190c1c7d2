"""What every command shares: the ``--url``/``--schema``/``--json`` options, exit codes, the
client a command works through, and reading JSON arguments.

Database errors are turned into one line here (naming the URL, password masked), so no
driver exception reaches the user as a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from .. import backends
from ..client import Client
from ..errors import InvalidArgumentError, WfPersistError

#: Messages, progress and errors: never on stdout, which carries the data.
err = Console(stderr=True, highlight=False)

#: Exit status of every command: success.
EXIT_OK = 0
#: A typed error (``error: ...`` on one line), a database that cannot be used.
EXIT_ERROR = 1
#: Bad usage (an unknown option, a missing argument): typer's own.
EXIT_USAGE = 2
#: ``runs result``, ``runs start --wait/--follow``: the run ended ``failed``.
EXIT_FAILED = 3
#: ``runs result --timeout``, ``runs start --wait --timeout``: the time passed first.
EXIT_TIMEOUT = 4

#: The epilog of commands that only report success or an error.
EXIT_EPILOG = "Exit status: 0 ok; 1 an error (one line 'error: ...'); 2 a usage error."
#: The epilog of commands that serve until stopped (a worker, the web view).
SERVE_EPILOG = (
    "Exit status: 0 stopped by SIGINT or SIGTERM; 1 an error (one line 'error: ...'); 2 a "
    "usage error."
)
#: The epilog of commands that wait for a run's outcome.
OUTCOME_EPILOG = (
    "Exit status: 0 the run completed; 3 the run failed; 4 --timeout passed before it "
    "ended; 1 an error (one line 'error: ...'); 2 a usage error."
)

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar=backends.DATABASE_URL_ENV,
        help="Database URL (default: $WF_PERSIST_DATABASE_URL, else ./wf_persist.sqlite3).",
    ),
]
SchemaOption = Annotated[
    str | None,
    typer.Option("--schema", help="PostgreSQL schema of the wf_ tables."),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON document to stdout instead of tables.")
]


class DatabaseUnusable(WfPersistError):
    """The database at a URL could not be used (refused, wrong password, gone away)."""

    def __init__(self, url: URL, exc: DBAPIError) -> None:
        cause = backends.reason(url, exc)  # passwords hidden, also one in the query
        super().__init__(f"cannot use the database at {backends.describe_url(url)}: {cause}")


def describe(url: str | None) -> str:
    """The database a command works on, as messages show it (password masked)."""
    return backends.describe_url(backends.resolve_url(url))


@contextmanager
def database_errors(url: str | URL | None) -> Iterator[None]:
    """Turn a driver's error into :class:`DatabaseUnusable`, which names the URL."""
    try:
        yield
    except DBAPIError as exc:
        raise DatabaseUnusable(backends.resolve_url(url), exc) from exc


@contextmanager
def open_client(url: str | None, schema: str | None) -> Iterator[Client]:
    """A thin client on a database at head; never migrates, never creates a SQLite file
    (a missing one gets the ``SchemaVersionError`` that says what to run)."""
    resolved = backends.resolve_url(url)
    with database_errors(resolved), Client(resolved, schema=schema, auto_migrate=False) as client:
        yield client


#: The most of a ``@file`` argument read: a JSONB value holds at most 256 MiB.
MAX_FILE_BYTES: Final = 256 * 2**20


def read_json(text: str, what: str) -> Any:
    """A JSON argument, or with ``@path`` the JSON in that file (whose text errors do not
    quote: it may be anything the user can read). A key given twice is refused."""
    source, shown = what, True
    if text.startswith("@"):
        shown = False
        path = Path(text[1:])
        source = f"{what} file {path}"
        try:
            with path.open("rb") as file:  # a device or a pipe may never end
                data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read {source}: {exc.strerror or exc}") from None
        if len(data) > MAX_FILE_BYTES:
            raise InvalidArgumentError(
                f"{source} is larger than any value a database stores "
                f"({MAX_FILE_BYTES // 2**20} MiB)"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{source} is not UTF-8 text: {exc}") from None
    quoted = f": {text!r:.80}" if shown else ""
    try:
        return json.loads(text, object_pairs_hook=_once_each)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{source} is not JSON ({exc}){quoted}") from None
    except _TwiceError as exc:
        key = f" {exc.key!r:.40}" if shown else ""
        raise InvalidArgumentError(f"{source} gives a key{key} twice") from None
    except RecursionError:  # valid JSON nested deeper than the parser's recursion limit
        raise InvalidArgumentError(f"{source} is nested too deeply{quoted}") from None
    except ValueError as exc:  # valid JSON Python refuses to read: an integer of 4,300+ digits
        raise InvalidArgumentError(f"{source} cannot be read ({exc}){quoted}") from None


class _TwiceError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused if it gives a key twice (json keeps the last one silently)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _TwiceError(key)
        seen.add(key)
    return dict(pairs)


def parse_age(text: str, option: str = "--older-than") -> dt.timedelta | dt.datetime:
    """``30d``, ``12h``, ``15m``, ``90s`` (an age) or an ISO-8601 time with offset (a cutoff)."""
    units = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}
    when: dt.timedelta | dt.datetime | None
    try:
        number = text[:-1].replace(".", "", 1)
        if text[-1:] in units and number.isascii() and number.isdigit():  # not "٣d"
            return dt.timedelta(**{units[text[-1]]: float(text[:-1])})
        when = dt.datetime.fromisoformat(text)
    except (ValueError, OverflowError):  # not a time, or an age beyond any date
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidArgumentError(
            f"{option} takes an age like 30d, 12h, 15m, 90s or an ISO time with offset, "
            f"got {text!r}"
        )
    return when


def cutoff(text: str, option: str) -> dt.datetime:
    """The time ``text`` names: an age before now, or the ISO time itself."""
    found = parse_age(text, option)
    if isinstance(found, dt.datetime):
        return found
    try:
        return dt.datetime.now(dt.UTC) - found
    except OverflowError:
        raise InvalidArgumentError(f"{option} is out of range: {text!r}") from None
