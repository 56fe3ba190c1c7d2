"""``wf-persist runs ...``: start, inspect, signal, cancel and await runs from any machine.

Everything goes through :class:`~wf_persist.Client`, which never runs workflow code: a
worker (``wf-persist worker``) that has the code drives the runs started here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer

from .. import arguments, clocks, lifecycle
from ..client import Client
from ..errors import InvalidArgumentError, ResultTimeoutError, WfPersistError
from ..logs import visible
from ..records import HistoryRecord
from .common import (
    EXIT_EPILOG,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    OUTCOME_EPILOG,
    JsonOption,
    SchemaOption,
    UrlOption,
    cutoff,
    err,
    open_client,
    read_json,
)
from .output import (
    compact,
    emit_json,
    error_text,
    events_table,
    example_value,
    history_line,
    history_table,
    out,
    outcome_document,
    pending_table,
    plain,
    run_table,
    runs_table,
    signal_command,
)

app = typer.Typer(
    help="Start, inspect, signal, cancel and await runs (no workflow code needed).",
    no_args_is_help=True,
)

#: Seconds between two looks at a run that is followed.
FOLLOW_INTERVAL = 0.25

IdArgument = Annotated[str, typer.Argument(help="The run's execution id.")]
ActorOption = Annotated[
    str | None, typer.Option("--actor", help="Who does this (recorded with the event).")
]
TimeoutOption = Annotated[
    float | None,
    typer.Option("--timeout", help="Seconds to wait at most (default: until the run ends)."),
]


@app.command("list", epilog=EXIT_EPILOG)
def list_runs(
    workflow: Annotated[str | None, typer.Argument(help="Only runs of this workflow.")] = None,
    status: Annotated[
        str | None,
        typer.Option(help="running, suspended, compensating, completed or failed."),
    ] = None,
    version: Annotated[
        int | None, typer.Option(help="Only runs pinned to this version (needs WORKFLOW).")
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Created within this age (7d, 12h, 15m, 90s) or after an ISO time."),
    ] = None,
    actor: Annotated[str | None, typer.Option(help="Only runs started by this actor.")] = None,
    limit: Annotated[int, typer.Option(help="Runs per page.")] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="Where the previous page ended (its next_cursor).")
    ] = None,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """List runs, oldest first, a page at a time.

    The next page's cursor is printed to stderr (with --json: 'next_cursor', null on the last
    page).
    """
    created_after = None if since is None else cutoff(since, "--since")
    with open_client(url, schema) as client:
        page = client.list(
            workflow,
            status=status,
            version=version,
            limit=limit,
            cursor=cursor,
            created_after=created_after,
            actor=actor,
        )
    if json_:
        emit_json({"items": page.items, "next_cursor": page.next_cursor})
        return
    if page.items:
        out.print(runs_table(page.items))
    else:
        err.print("no runs", markup=False)
    if page.next_cursor is not None:
        err.print(f"more: --cursor {page.next_cursor}", markup=False, soft_wrap=True)


@app.command(epilog=EXIT_EPILOG)
def show(
    execution_id: IdArgument,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Show a run: status, times, input, result or error, pending signals, events.

    An error shows with its traceback; each signal the run waits for shows with its JSON
    Schema and a ready-to-paste 'wf-persist runs signal' command (edit the payload first).
    """
    with open_client(url, schema) as client:
        info = client.describe(execution_id)
        waits = client.pending_signals(execution_id)
        events = client.events(execution_id)
    commands = [signal_command(execution_id, w, url, schema) for w in waits]
    if json_:
        document = plain(info)
        document["pending_signals"] = [
            {**plain(w), "example_payload": example_value(w.payload_schema), "command": c}
            for w, c in zip(waits, commands, strict=True)
        ]
        document["events"] = events
        emit_json(document)
        return
    out.print(run_table(info))
    if info.error:
        out.print()
        out.print("error", style="bold")
        out.print(error_text(info.error), markup=False, highlight=False)
    if waits:
        out.print()
        out.print(pending_table(waits))
        out.print("Send one with (edit the payload first):")
        for command in commands:
            typer.echo(f"  {visible(command)}")
    if events:
        out.print()
        out.print(events_table(events))


def _follow(
    client: Client,
    execution_id: str,
    on_record: Callable[[HistoryRecord], None],
    timeout: float | None,
) -> bool:
    """Hand each new event to ``on_record`` once, until the run ends (True) or ``timeout``
    passes (False). The status is read before the history, so the last read has every event
    of a run seen finished."""
    deadline = None if timeout is None else clocks.elapsed() + timeout
    seen = 0
    while True:
        status = client.status(execution_id)
        for record in client.history(execution_id):
            if record.sequence > seen:
                on_record(record)
                seen = record.sequence
        if status in lifecycle.TERMINAL:
            return True
        if deadline is not None and clocks.elapsed() >= deadline:
            return False
        pause = FOLLOW_INTERVAL
        if deadline is not None:
            pause = max(0.0, min(pause, deadline - clocks.elapsed()))
        time.sleep(pause)


def _streamer(json_: bool) -> Callable[[HistoryRecord], None]:
    """Print an event as it lands: a line for people, a JSON Lines document for scripts."""

    def stream(record: HistoryRecord) -> None:
        if json_:
            emit_json(record, indent=None)
        else:
            typer.echo(visible(history_line(record)))

    return stream


@app.command(
    epilog="Exit status: 0 ok (with --follow: the run ended); 1 an error (one line "
    "'error: ...'); 2 a usage error."
)
def history(
    execution_id: IdArgument,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Print events as they land until the run ends.")
    ] = False,
    json_: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON document (a list of events); with --follow one document per event "
            "and line (JSON Lines).",
        ),
    ] = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Print a run's events in order (with --follow, also the ones still to come)."""
    with open_client(url, schema) as client:
        if follow:
            _follow(client, execution_id, _streamer(json_), None)
            return
        records = client.history(execution_id)
    if json_:
        emit_json(records)
    else:
        out.print(history_table(records))


def _workflow_and_version(workflow: str, version: int | None) -> tuple[str, int | None]:
    """``name@version`` or ``name`` (with ``--version``)."""
    name, at, pinned = workflow.rpartition("@")
    if not at or not name:
        return workflow, version
    if not (pinned.isascii() and pinned.isdigit()):  # isdigit alone takes '²', int() does not
        raise InvalidArgumentError(f"WORKFLOW is 'name' or 'name@version', got {workflow!r}")
    if version is not None and version != int(pinned):
        raise InvalidArgumentError(f"{workflow!r} and --version {version} name two versions")
    return name, int(pinned)


def _finish(client: Client, execution_id: str, timeout: float | None, json_: bool) -> None:
    """Wait for the run's outcome and print it; exit 3 when it failed, 4 on timeout."""
    try:
        outcome = client.result(execution_id, timeout=timeout)
    except ResultTimeoutError:
        _timed_out(client, execution_id, timeout, json_)
    _print_outcome(outcome, json_)


def _timed_out(
    client: Client, execution_id: str, timeout: float | None, json_: bool, *, lines: bool = False
) -> NoReturn:
    status = client.status(execution_id)
    if json_:
        document = {"execution_id": execution_id, "status": status, "timed_out": True}
        emit_json(document, indent=None if lines else 2)
    err.print(
        f"timeout: run {execution_id} is still {status} after {timeout or 0:g}s", markup=False
    )
    raise typer.Exit(EXIT_TIMEOUT)


def _print_outcome(outcome: Any, json_: bool, *, lines: bool = False) -> None:
    """The value on stdout, or the error on stderr and exit 3 (``lines``: as JSON Lines)."""
    if json_:
        emit_json(outcome_document(outcome), indent=None if lines else 2)
    elif outcome.status == "completed":
        typer.echo(compact(outcome.value))
    if outcome.status == "failed":
        if not json_:
            err.print(f"run {outcome.execution_id} failed", markup=False)
            err.print(error_text(outcome.error), markup=False, highlight=False)
        raise typer.Exit(EXIT_FAILED)


@app.command(
    epilog=OUTCOME_EPILOG.replace(
        "0 the run completed", "0 started (with --wait or --follow: the run completed)"
    )
)
def start(
    workflow: Annotated[
        str, typer.Argument(help="A cataloged workflow: 'name' or 'name@version'.")
    ],
    input_: Annotated[
        str,
        typer.Option("--input", help="The input as JSON, or @file to read it from a file."),
    ] = "null",
    version: Annotated[
        int | None, typer.Option(help="The version to pin (default: the newest cataloged).")
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="The same key for the same workflow returns the same run."),
    ] = None,
    actor: ActorOption = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait for the run to end and print its outcome.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", help="Print events as they land, then the outcome.")
    ] = False,
    timeout: TimeoutOption = None,
    json_: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON document (the run, or with --wait its outcome); with --follow one "
            "per event and line, the outcome last (JSON Lines).",
        ),
    ] = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Start a run of WORKFLOW; a worker that has the workflow's code executes it.

    The input is validated against the JSON Schema the version cataloged; nothing is written
    if it does not fit. Prints the run's id (with --wait or --follow: its result).
    """
    name, pinned = _workflow_and_version(workflow, version)
    payload = read_json(input_, "--input")
    # Before the run is written: a bad --timeout must not leave a started run behind.
    arguments.check_timeout(timeout)
    with open_client(url, schema) as client:
        handle = client.start(
            name, payload, idempotency_key=idempotency_key, actor=actor, version=pinned
        )
        found = "started" if handle.created else "found (same idempotency key)"
        err.print(
            f"{found} {handle.workflow_name} v{handle.version} run {handle.execution_id}",
            markup=False,
        )
        try:
            if follow:
                if not _follow(client, handle.execution_id, _streamer(json_), timeout):
                    _timed_out(client, handle.execution_id, timeout, json_, lines=True)
                _print_outcome(client.result(handle.execution_id), json_, lines=True)
            elif wait:
                _finish(client, handle.execution_id, timeout, json_)
        except WfPersistError:
            # Written already: a script must not take the error for "nothing happened".
            err.print(
                f"run {handle.execution_id} was started and goes on; waiting for it failed "
                f"(`wf-persist runs result {handle.execution_id}` waits again)",
                markup=False,
            )
            raise
        if follow or wait:
            return
        if json_:
            emit_json(handle)
        else:
            typer.echo(handle.execution_id)


@app.command(epilog=EXIT_EPILOG)
def signal(
    execution_id: IdArgument,
    name: Annotated[str, typer.Argument(help="The signal's name.")],
    payload: Annotated[
        str, typer.Argument(help="The payload as JSON, or @file to read it from a file.")
    ],
    actor: ActorOption = None,
    buffer: Annotated[
        bool,
        typer.Option(
            "--buffer", help="Keep it for the run's next wait on NAME if it is not waiting yet."
        ),
    ] = False,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Send a signal to a run; the payload is validated against the wait's JSON Schema first.

    Prints 'delivered' (to a waiting call) or 'buffered'.
    """
    value = read_json(payload, "the payload")
    with open_client(url, schema) as client:
        result = client.signal(execution_id, name, value, actor=actor, buffer=buffer)
    if json_:
        emit_json({"execution_id": execution_id, "signal": name, "outcome": result})
        return
    typer.echo(result)
    err.print(f"signal {name!r} {result} to run {execution_id}", markup=False)


@app.command(epilog=EXIT_EPILOG)
def cancel(
    execution_id: IdArgument,
    no_compensate: Annotated[
        bool,
        typer.Option(
            "--no-compensate", help="End the run at once, without running its compensations."
        ),
    ] = False,
    actor: ActorOption = None,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Cancel a running or suspended run, or end a compensating one (--no-compensate).

    It ends failed, with a Cancelled error. With compensation (default) a worker unwinds
    the run's completed steps first. --no-compensate ends the run at once, also a run being
    compensated (one no worker unwinds); its children's own unwinds run their course.
    """
    with open_client(url, schema) as client:
        client.cancel(execution_id, compensate=not no_compensate, actor=actor)
        status = client.status(execution_id)
    if json_:
        emit_json({"execution_id": execution_id, "status": status})
        return
    typer.echo(status)
    err.print(f"cancelled run {execution_id} (now {status})", markup=False)


@app.command(epilog=OUTCOME_EPILOG)
def result(
    execution_id: IdArgument,
    timeout: TimeoutOption = None,
    json_: JsonOption = False,
    url: UrlOption = None,
    schema: SchemaOption = None,
) -> None:
    """Wait for a run to end and print its result (JSON), or its error to stderr."""
    with open_client(url, schema) as client:
        _finish(client, execution_id, timeout, json_)
