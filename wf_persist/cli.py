"""``wf-persist``: schema migrations from a shell or a deploy pipeline.

The database is ``--url`` or ``$WF_PERSIST_DATABASE_URL``. ``--sql`` renders the DDL instead of
running it, for review.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from . import _dialect, migrate
from .errors import WfPersistError

app = typer.Typer(help="wf_persist: durable workflows on SQLAlchemy.", no_args_is_help=True)
db = typer.Typer(help="Schema migrations (Alembic, own version table).", no_args_is_help=True)
app.add_typer(db, name="db")

err = Console(stderr=True)

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar=_dialect.DATABASE_URL_ENV,
        help="Database URL (default: $WF_PERSIST_DATABASE_URL, else ./wf_persist.sqlite3).",
    ),
]
SqlOption = Annotated[bool, typer.Option("--sql", help="Print the SQL instead of running it.")]


def _url(url: str | None) -> str:
    return _dialect.describe_url(_dialect.resolve_url(url))


@db.command()
def upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "heads",
    url: UrlOption = None,
    sql: SqlOption = False,
) -> None:
    """Upgrade the wf_persist schema (default: to the newest revision)."""
    script = migrate.upgrade(_dialect.resolve_url(url), revision, sql=sql)
    if script is not None:
        typer.echo(script, nl=False)
        return
    err.print(f"wf_persist schema at {migrate.current(_dialect.resolve_url(url))} ({_url(url)})")


@db.command()
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision ('base' drops every table).")],
    url: UrlOption = None,
    sql: SqlOption = False,
) -> None:
    """Downgrade the wf_persist schema to REVISION."""
    script = migrate.downgrade(_dialect.resolve_url(url), revision, sql=sql)
    if script is not None:
        typer.echo(script, nl=False)
        return
    now = migrate.current(_dialect.resolve_url(url))
    err.print(f"wf_persist schema at {now or 'base'} ({_url(url)})")


@db.command()
def current(url: UrlOption = None) -> None:
    """Print the revision the database is at ('none' if never migrated)."""
    found = migrate.current(_dialect.resolve_url(url))
    typer.echo(found or "none")
    if found != migrate.SCHEMA_HEAD:
        err.print(f"not at head ({migrate.SCHEMA_HEAD}); run: wf-persist db upgrade")


def main() -> None:
    """Console entry point: typed errors become a one-line message and exit status 1."""
    try:
        app()
    except WfPersistError as exc:
        err.print(f"error: {exc}")
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
