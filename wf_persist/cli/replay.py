"""``wf-persist replay-check``: replay stored runs against the code about to be deployed.

Like ``worker`` it imports the application (``--app``) for its workflow definitions, but it
runs no step and writes nothing: a deploy gate that fails (exit 3) when the new code would
not replay some stored run the way it was recorded.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .. import backends
from ..gate import without_cataloging
from ..replaycheck import check_replay
from .common import (
    EXIT_FAILED,
    JsonOption,
    SchemaOption,
    cutoff,
    database_errors,
    err,
    open_client,
)
from .output import add_row, emit_json, out
from .worker import load_runtime

#: The epilog of ``replay-check``.
#: Unlike every other command's, the default is the app runtime's database, not the file.
ReplayUrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar=backends.DATABASE_URL_ENV,
        help="Database URL of the runs (default: $WF_PERSIST_DATABASE_URL, else the app "
        "runtime's own database).",
    ),
]
REPLAY_EPILOG = (
    "Exit status: 0 every run replays; 3 some run diverges (listed); 1 an error (one line "
    "'error: ...'); 2 a usage error."
)


def replay_check(
    app_ref: Annotated[
        str, typer.Option("--app", help="The new code's runtime, as 'package.module:runtime'.")
    ],
    since: Annotated[
        str | None,
        typer.Option(help="Only runs created since: an age (7d, 12h) or an ISO time."),
    ] = None,
    json_: JsonOption = False,
    url: ReplayUrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Replay the stored runs of the app's workflows against its code; list divergences.

    The runs are read from --url (default: $WF_PERSIST_DATABASE_URL, else the app
    runtime's own database).
    """
    start = None if since is None else cutoff(since, "--since")
    with without_cataloging():  # a release checked and then not deployed leaves no trace
        runtime = load_runtime(app_ref)
    try:
        if url is None and schema is None:
            with database_errors(None):
                reports = check_replay(runtime, since=start)
        else:
            with open_client(url, schema) as client, database_errors(url):
                reports = check_replay(runtime, since=start, database=client)
    finally:
        runtime.close()
    diverged = [r for r in reports if not r.ok]
    if json_:
        emit_json({"checked": len(reports), "diverged": diverged})
    elif diverged:
        table = Table("run", "workflow", "status", "divergence")
        for r in diverged:
            add_row(
                table, r.execution_id, f"{r.workflow_name}@v{r.version}", r.status, r.divergence
            )
        out.print(table)
    err.print(f"{len(reports)} run(s) replayed, {len(diverged)} diverge", markup=False)
    if diverged:
        raise typer.Exit(EXIT_FAILED)
