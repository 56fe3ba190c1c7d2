"""``wf-persist db ...`` (schema migrations for deploy pipelines) and ``wf-persist purge``.

``--sql`` renders the DDL instead of running it, for review.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .. import backends, migrate
from ..errors import SchemaTooNewError, SchemaVersionConflictError
from .common import (
    EXIT_EPILOG,
    SchemaOption,
    UrlOption,
    database_errors,
    describe,
    err,
    open_client,
    parse_age,
)

app = typer.Typer(help="Schema migrations (Alembic, own version table).", no_args_is_help=True)

SqlOption = Annotated[bool, typer.Option("--sql", help="Print the SQL instead of running it.")]
MigrateSchemaOption = Annotated[
    str | None,
    typer.Option("--schema", help="PostgreSQL schema for the wf_ tables (created if missing)."),
]

#: ``db current`` exit status when the database is behind head (or never migrated).
EXIT_BEHIND = 3
#: ``db current`` exit status when a newer wf_persist migrated the database.
EXIT_TOO_NEW = 4


def _report(script: str | None, url: str | None, schema: str | None) -> None:
    """Print the rendered SQL (``--sql``), or where the schema stands now."""
    if script is not None:
        typer.echo(script, nl=False)
        return
    with database_errors(url):
        found = migrate.state(backends.resolve_url(url), schema=schema)
    where = found.revision or "base"
    if found.mode == "merged":
        where += f" in {found.host_table} (merged: {migrate.HOST_UPGRADE_COMMAND})"
    err.print(f"wf_persist schema at {where} ({describe(url)})", markup=False)


def _working(message: str) -> contextlib.AbstractContextManager[object]:
    """A spinner while long work runs, only on a terminal (logs and pipes stay clean)."""
    if err.is_terminal:
        return err.status(message)
    return contextlib.nullcontext()


@app.command(epilog=EXIT_EPILOG)
def upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "heads",
    url: UrlOption = None,
    sql: SqlOption = False,
    schema: MigrateSchemaOption = None,
) -> None:
    """Upgrade the wf_persist schema (default: to the newest revision).

    Refuses a merged database (ours in your alembic_version) unless it is at head:
    migrate that with your application's 'alembic upgrade heads'.
    """
    with database_errors(url), _working(f"upgrading {describe(url)} to {revision}"):
        script = migrate.upgrade(backends.resolve_url(url), revision, sql=sql, schema=schema)
    _report(script, url, schema)


@app.command(epilog=EXIT_EPILOG)
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' drops every table).")],
    url: UrlOption = None,
    sql: SqlOption = False,
    schema: MigrateSchemaOption = None,
) -> None:
    """Downgrade the wf_persist schema to REVISION."""
    with database_errors(url), _working(f"downgrading {describe(url)} to {revision}"):
        script = migrate.downgrade(backends.resolve_url(url), revision, sql=sql, schema=schema)
    _report(script, url, schema)


@app.command(
    epilog="Exit status: 0 at head; 3 behind head or never migrated; 4 migrated by a newer "
    "wf_persist; 1 an error (e.g. revisions recorded in both version tables); 2 a usage error."
)
def current(url: UrlOption = None, schema: SchemaOption = None) -> None:
    """Print the revision the database is at ('none' if never migrated).

    In merged mode that is the wf_ rows of your alembic_version.
    Creates nothing: a missing SQLite file prints 'none' and stays missing.
    """
    with database_errors(url):
        found = migrate.state(backends.resolve_url(url), schema=schema)
    problem = found.error()
    if isinstance(problem, SchemaVersionConflictError):
        raise problem
    typer.echo(found.revision or "none")
    if found.missing:
        err.print(f"no database file at {describe(url)}", markup=False)
    if problem is not None:
        err.print(f"not at head: {problem}", markup=False)
        raise typer.Exit(EXIT_TOO_NEW if isinstance(problem, SchemaTooNewError) else EXIT_BEHIND)


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
    """Delete finished runs and their history; running or suspended runs are never touched.

    Prints the number deleted; on a terminal, a progress line counts the batches.
    """
    cutoff = parse_age(older_than)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(open_client(url, schema))
        on_batch = None
        if err.is_terminal:
            progress = stack.enter_context(
                Progress(
                    SpinnerColumn(),
                    TextColumn("purging: {task.completed:.0f} run(s) deleted"),
                    TimeElapsedColumn(),
                    console=err,
                    transient=True,
                )
            )
            task = progress.add_task("purge", total=None)

            def on_batch(deleted: int) -> None:
                progress.advance(task, deleted)

        deleted = client.purge(
            older_than=cutoff,
            statuses=tuple(status or ("completed", "failed")),
            batch_size=batch_size,
            on_batch=on_batch,
        )
    typer.echo(deleted)
    err.print(f"deleted {deleted} finished run(s) ({describe(url)})", markup=False)
