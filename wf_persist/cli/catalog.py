"""``wf-persist workflows``: the catalog, read from the database (no workflow code needed)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import JsonOption, SchemaOption, UrlOption, err, open_client
from .output import emit_json, out, workflows_table


def workflows(
    name: Annotated[str | None, typer.Argument(help="Only the versions of this workflow.")] = None,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """List the cataloged workflows: name, version, source hash, registration time, schemas.

    The table shortens hashes and schemas; --json has them whole.
    """
    with open_client(url, schema) as client:
        entries = client.workflows(name)
    if json_:
        emit_json(entries)
    elif entries:
        out.print(workflows_table(entries))
    else:
        err.print("no workflow is cataloged" + (f" under {name!r}" if name else ""), markup=False)
