"""``wf-persist``: schema migrations for deploy pipelines, and the worker process.

The database is ``--url`` or ``$WF_PERSIST_DATABASE_URL``. ``--sql`` renders the DDL instead of
running it, for review. ``wf-persist worker --app module:runtime`` serves a runtime's workflows.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import signal
import sys
from typing import Annotated

import typer
from rich.console import Console

from . import backends, migrate
from .errors import (
    InvalidArgumentError,
    SchemaTooNewError,
    SchemaVersionConflictError,
    WfPersistError,
)
from .runtime import Runtime
from .worker import Worker

app = typer.Typer(help="wf_persist: durable workflows on SQLAlchemy.", no_args_is_help=True)
db = typer.Typer(help="Schema migrations (Alembic, own version table).", no_args_is_help=True)
app.add_typer(db, name="db")

err = Console(stderr=True)

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar=backends.DATABASE_URL_ENV,
        help="Database URL (default: $WF_PERSIST_DATABASE_URL, else ./wf_persist.sqlite3).",
    ),
]
SqlOption = Annotated[bool, typer.Option("--sql", help="Print the SQL instead of running it.")]
SchemaOption = Annotated[
    str | None,
    typer.Option("--schema", help="PostgreSQL schema for the wf_ tables (created if missing)."),
]


def _url(url: str | None) -> str:
    return backends.describe_url(backends.resolve_url(url))


def _report(script: str | None, url: str | None, schema: str | None) -> None:
    """Print the rendered SQL (``--sql``), or where the schema stands now."""
    if script is not None:
        typer.echo(script, nl=False)
        return
    found = migrate.state(backends.resolve_url(url), schema=schema)
    where = found.revision or "base"
    if found.mode == "merged":
        where += f" in {migrate.HOST_VERSION_TABLE} (merged: {migrate.HOST_UPGRADE_COMMAND})"
    err.print(f"wf_persist schema at {where} ({_url(url)})", markup=False)


@db.command()
def upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "heads",
    url: UrlOption = None,
    sql: SqlOption = False,
    schema: SchemaOption = None,
) -> None:
    """Upgrade the wf_persist schema (default: to the newest revision).

    Refuses a merged database (ours in your alembic_version) unless it is at head:
    migrate that with your application's 'alembic upgrade heads'.
    """
    _report(
        migrate.upgrade(backends.resolve_url(url), revision, sql=sql, schema=schema), url, schema
    )


@db.command()
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' drops every table).")],
    url: UrlOption = None,
    sql: SqlOption = False,
    schema: SchemaOption = None,
) -> None:
    """Downgrade the wf_persist schema to REVISION."""
    script = migrate.downgrade(backends.resolve_url(url), revision, sql=sql, schema=schema)
    _report(script, url, schema)


#: ``db current`` exit status when the database is behind head (or never migrated).
EXIT_BEHIND = 3
#: ``db current`` exit status when a newer wf_persist migrated the database.
EXIT_TOO_NEW = 4


@db.command(
    epilog="Exit status: 0 at head; 3 behind head or never migrated; 4 migrated by a newer "
    "wf_persist; 1 an error (e.g. revisions recorded in both version tables); 2 a usage error."
)
def current(url: UrlOption = None, schema: SchemaOption = None) -> None:
    """Print the revision the database is at ('none' if never migrated).

    In merged mode that is the wf_ rows of your alembic_version.
    Creates nothing: a missing SQLite file prints 'none' and stays missing.
    """
    found = migrate.state(backends.resolve_url(url), schema=schema)
    problem = found.error()
    if isinstance(problem, SchemaVersionConflictError):
        raise problem
    typer.echo(found.revision or "none")
    if found.missing:
        err.print(f"no database file at {_url(url)}", markup=False)
    if problem is not None:
        err.print(f"not at head: {problem}", markup=False)
        raise typer.Exit(EXIT_TOO_NEW if isinstance(problem, SchemaTooNewError) else EXIT_BEHIND)


def parse_age(text: str) -> dt.timedelta | dt.datetime:
    """``30d``, ``12h``, ``15m``, ``90s`` (an age) or an ISO-8601 time with offset (a cutoff)."""
    units = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}
    when: dt.timedelta | dt.datetime | None
    try:
        if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
            return dt.timedelta(**{units[text[-1]]: float(text[:-1])})
        when = dt.datetime.fromisoformat(text)
    except (ValueError, OverflowError):  # not a time, or an age beyond any date
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidArgumentError(
            f"--older-than takes an age like 30d, 12h, 15m, 90s or an ISO time with offset, "
            f"got {text!r}"
        )
    return when


@app.command()
def purge(
    older_than: Annotated[
        str, typer.Option(help="Age (30d, 12h, 15m, 90s) or ISO cutoff time of finished runs.")
    ],
    status: Annotated[
        list[str] | None, typer.Option(help="Statuses to delete (default: completed, failed).")
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Runs deleted per transaction.")] = 1000,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Delete finished runs and their history; running or suspended runs are never touched."""
    cutoff = parse_age(older_than)
    with Runtime(url, auto_migrate=False, schema=schema) as runtime:
        deleted = runtime.client().purge(
            older_than=cutoff,
            statuses=tuple(status or ("completed", "failed")),
            batch_size=batch_size,
        )
    typer.echo(deleted)
    err.print(f"deleted {deleted} finished run(s) ({_url(url)})")


def load_runtime(reference: str) -> Runtime:
    """Import ``module:attribute`` (a Runtime, or a callable returning one)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(
            f"--app must look like 'package.module:runtime', got {reference!r}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        target = getattr(target, part, None)
    if callable(target) and not isinstance(target, Runtime):
        target = target()
    if not isinstance(target, Runtime):
        raise InvalidArgumentError(f"{reference} is not a wf_persist Runtime")
    return target


@app.command()
def worker(
    app_ref: Annotated[
        str, typer.Option("--app", help="The runtime to serve, as 'package.module:runtime'.")
    ],
    concurrency: Annotated[int, typer.Option(help="Runs driven at once.")] = 4,
    poll_interval: Annotated[
        float | None, typer.Option(help="Seconds between looks for due work (default 0.25).")
    ] = None,
) -> None:
    """Claim and drive due runs of the runtime's workflows until SIGINT/SIGTERM."""
    runtime = load_runtime(app_ref)
    loop = Worker(runtime, concurrency=concurrency, poll_interval=poll_interval)

    def stop(signum: int, _frame: object) -> None:
        err.print(f"worker {runtime.owner}: stopping ({signal.Signals(signum).name})")
        # As close() does first: runs in flight stop before their next step and are handed
        # over, rather than driven to their end while the loop waits for them.
        runtime.closing = True
        loop.stop(timeout=0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    err.print(
        f"worker {runtime.owner}: serving {len(runtime.runnable_workflows())} workflow "
        f"version(s), concurrency {concurrency}"
    )
    try:
        loop.run()
    finally:
        runtime.close()


def main() -> None:
    """Console entry point: typed errors become a one-line message and exit status 1."""
    try:
        app()
    except WfPersistError as exc:
        # Plain text on one line: no wrapping to the terminal, no markup read into the message.
        message = " ".join(str(exc).split())
        typer.echo(f"error: {message}", err=True)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
