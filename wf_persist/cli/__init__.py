"""``wf-persist``: migrations and purges, the worker process, and operating runs.

Every command but ``worker`` works without the workflows' code, on any database wf_persist
supports: ``--url`` or ``$WF_PERSIST_DATABASE_URL`` (default: ./wf_persist.sqlite3).
Tables go to stdout for people, ``--json`` prints one JSON document for scripts; messages
and errors go to stderr. A typed error is one line, ``error: ...``, and exit status 1.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer
from sqlalchemy.exc import DBAPIError

from ..errors import WfPersistError
from ..logs import visible
from . import catalog, db, replay, runs, web
from .common import EXIT_EPILOG, EXIT_ERROR, SERVE_EPILOG, parse_age
from .worker import load_runtime, worker

__all__ = ["app", "load_runtime", "main", "parse_age"]

app = typer.Typer(help="wf_persist: durable workflows on SQLAlchemy.", no_args_is_help=True)
app.add_typer(db.app, name="db")
app.add_typer(runs.app, name="runs")
app.command(epilog=EXIT_EPILOG)(db.purge)
app.command(epilog=EXIT_EPILOG)(catalog.workflows)
app.command(epilog=SERVE_EPILOG)(worker)
app.command("replay-check", epilog=replay.REPLAY_EPILOG)(replay.replay_check)
app.command(epilog=SERVE_EPILOG)(web.web)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"wf-persist {metadata.version('wf-persist')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """wf_persist: durable workflows on SQLAlchemy."""


def _one_line(text: str) -> None:
    # Plain text on one line: no wrapping to the terminal, no markup read into the message.
    typer.echo(f"error: {visible(' '.join(text.split()))}", err=True)


def main() -> None:
    """Console entry point: typed errors and database errors become one line, exit 1."""
    try:
        app()
    except WfPersistError as exc:
        _one_line(str(exc))
        raise SystemExit(EXIT_ERROR) from exc
    except DBAPIError as exc:  # a command that did not name its URL: still no traceback
        _one_line(f"database error: {exc.orig if exc.orig is not None else exc}")
        raise SystemExit(EXIT_ERROR) from exc
