"""Rendering: rich tables for people (stdout), one JSON document for scripts (stdout), and
the pieces both show (error documents, example signal payloads, the command that sends one).

Every value printed comes from the client's records; nothing here reads the database.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import backends
from ..logs import ACTING, visible
from ..records import ExecutionInfo, HistoryRecord, Outcome, PendingSignal, WorkflowEntry


def _console() -> Console:
    """Stdout for people. Piped, it is wide rather than 80 columns, so ids are not folded."""
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 0) or 200
    return Console(highlight=False, width=width, soft_wrap=False)


out = _console()


def plain(value: Any) -> Any:
    """A JSON-ready form of a record (dataclasses as dicts, datetimes as ISO-8601)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def emit_json(document: Any, *, indent: int | None = 2) -> None:
    """Print one JSON document (``indent=None``: on one line, as JSON Lines)."""
    typer.echo(visible(json.dumps(plain(document), indent=indent, ensure_ascii=False)))


def compact(value: Any, limit: int | None = None) -> str:
    """A value as one line of JSON, cut at ``limit`` characters."""
    text = visible(json.dumps(plain(value), ensure_ascii=False))
    if limit is not None and len(text) > limit:
        return text[: limit - 1] + "…"
    return text


def add_row(table: Table, *cells: str | None) -> None:
    """Add cells as plain text: values are data, never read as rich markup, nor as
    terminal controls."""
    table.add_row(*(Text(visible(cell or "")) for cell in cells))


def when(value: dt.datetime | None) -> str:
    """A time to the second, in UTC (``--json`` keeps the full ISO-8601 value)."""
    return "" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# the catalog ------------------------------------------------------------------------------


def workflows_table(entries: Iterable[WorkflowEntry]) -> Table:
    table = Table(title="Workflows")
    table.add_column("name", no_wrap=True)
    table.add_column("version", justify="right")
    table.add_column("source hash", no_wrap=True)
    table.add_column("registered at", no_wrap=True)
    table.add_column("input schema")
    table.add_column("output schema")
    for e in entries:
        add_row(
            table,
            e.name,
            str(e.version),
            e.source_hash[:12],
            when(e.registered_at),
            schema_summary(e.input_schema),
            schema_summary(e.output_schema),
        )
    return table


def schema_summary(schema: Any, root: Mapping[str, Any] | None = None, depth: int = 0) -> str:
    """A JSON Schema in a few words (``{employee: string, amount_cents: integer}``) for a
    table cell; ``--json`` has the schema whole."""
    if not isinstance(schema, Mapping):
        return "" if schema is None else "any"
    root = schema if root is None else root
    if depth > 3:
        return "…"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return schema_summary(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(schema_summary(o, root, depth + 1) for o in schema[key])
    kind = schema.get("type")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        if not properties:
            extra = schema.get("additionalProperties")
            return f"object[{schema_summary(extra, root, depth + 1)}]" if extra else "object"
        required = set(schema.get("required") or [])
        return (
            "{"
            + ", ".join(
                f"{name}{'' if name in required else '?'}: {schema_summary(value, root, depth + 1)}"
                for name, value in properties.items()
            )
            + "}"
        )
    if kind == "array":
        items = schema.get("items")
        return f"array[{schema_summary(items, root, depth + 1)}]" if items else "array"
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    return str(kind) if kind else "any"


# runs -------------------------------------------------------------------------------------


def runs_table(items: Iterable[ExecutionInfo]) -> Table:
    table = Table()
    table.add_column("id", no_wrap=True, min_width=36)
    table.add_column("workflow")
    table.add_column("status", no_wrap=True, min_width=9)
    table.add_column("actor")
    table.add_column("created at", no_wrap=True, min_width=20)
    for r in items:
        add_row(
            table,
            r.execution_id,
            f"{r.workflow_name} v{r.version}",
            r.status,
            r.actor or "",
            when(r.created_at),
        )
    return table


def run_table(info: ExecutionInfo) -> Table:
    """One run as field/value rows."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    rows: list[tuple[str, str | None]] = [
        ("id", info.execution_id),
        ("workflow", f"{info.workflow_name} v{info.version}"),
        ("status", info.status),
        ("actor", info.actor),
        ("idempotency key", info.idempotency_key),
        ("created at", when(info.created_at)),
        ("started at", when(info.started_at)),
        ("finished at", when(info.finished_at)),
        ("updated at", when(info.updated_at)),
        ("wakes at", when(info.wake_at)),
        ("lease", info.lease_owner and f"{info.lease_owner} until {when(info.lease_expires_at)}"),
        ("drive failures", str(info.drive_failures) if info.drive_failures else None),
        ("input", compact(info.input)),
    ]
    if info.status == "completed":
        rows.append(("result", compact(info.result)))
    for label, value in rows:
        if value:
            add_row(table, label, value)
    return table


def error_text(error: Mapping[str, Any]) -> str:
    """A stored error document for people: ``Name: message``, its cause, then its traceback
    (as :func:`visible` text)."""
    lines = [f"{error.get('name', 'Error')}: {error.get('message', '')}"]
    cause = error.get("cause")
    if isinstance(cause, Mapping):
        lines.append(f"  caused by {cause.get('name', 'Error')}: {cause.get('message', '')}")
    for failed in error.get("compensationErrors") or []:
        if isinstance(failed, Mapping):
            lines.append(
                f"  compensation failed: {failed.get('name', 'Error')}: {failed.get('message', '')}"
            )
    for doc in (error, cause):
        trace = doc.get("traceback") if isinstance(doc, Mapping) else None
        if isinstance(trace, str) and trace.strip():
            lines.append(trace.rstrip())
    return visible("\n".join(lines))


def outcome_document(outcome: Outcome) -> dict[str, Any]:
    if outcome.status == "completed":
        return {"execution_id": outcome.execution_id, "status": "completed", "value": outcome.value}
    return {"execution_id": outcome.execution_id, "status": "failed", "error": outcome.error}


def history_table(records: Iterable[HistoryRecord]) -> Table:
    table = Table()
    table.add_column("#", justify="right")
    table.add_column("at", no_wrap=True, min_width=20)
    table.add_column("event", no_wrap=True, min_width=18)
    table.add_column("detail")
    for r in records:
        add_row(table, str(r.sequence), when(r.created_at), r.event.get("type", "?"), detail(r))
    return table


def detail(record: HistoryRecord) -> str:
    """What an event says beyond its type and run."""
    rest = {k: v for k, v in record.event.items() if k not in ("type", "executionId")}
    return compact(rest, 160)


def history_line(record: HistoryRecord) -> str:
    """One event as a line (``--follow`` prints events as they land, not as a table)."""
    event = record.event.get("type", "?")
    return f"{record.sequence:>4}  {when(record.created_at)}  {event:<24} {detail(record)}"


def events_table(events: Mapping[str, Any]) -> Table:
    table = Table(title="Published events")
    table.add_column("key", no_wrap=True)
    table.add_column("value")
    for key, value in events.items():
        add_row(table, key, compact(value))
    return table


# signals ----------------------------------------------------------------------------------


def example_value(schema: Any, root: Mapping[str, Any] | None = None, depth: int = 0) -> Any:
    """A value of the shape ``schema`` describes, to edit before sending: object properties
    by type (string "", integer/number 0, boolean false, array [], null), recursively."""
    if not isinstance(schema, Mapping) or depth > 20:
        return None
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return example_value(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            chosen = next((o for o in options if o.get("type") != "null"), options[0])
            return example_value(chosen, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None and "properties" in schema:
        kind = "object"
    if kind == "object":
        properties = schema.get("properties") or {}
        required = [p for p in schema.get("required") or [] if p in properties]
        names = required + [p for p in properties if p not in required]
        return {p: example_value(properties[p], root, depth + 1) for p in names}
    return {"string": "", "integer": 0, "number": 0, "boolean": False, "array": []}.get(str(kind))


def signal_command(
    execution_id: str, wait: PendingSignal, url: str | None, schema: str | None
) -> str:
    """The ``wf-persist runs signal`` command that answers ``wait``, ready to paste.

    It names ``--url`` only when the database was given on the command line and has no
    password to hide (otherwise the environment that named it must name it again).
    """
    payload = example_value(wait.payload_schema)
    arguments = [execution_id, wait.name, compact(payload)]
    options: list[str] = []
    if url is not None and url != os.environ.get(backends.DATABASE_URL_ENV):
        resolved = backends.resolve_url(url)
        whole = resolved.render_as_string(hide_password=False)
        if backends.describe_url(resolved) == whole:  # nothing hidden: no password in it
            options += ["--url", whole]
    if schema is not None:
        options += ["--schema", schema]
    if any(word.startswith("-") for word in arguments):  # a name like -x: not an option
        words = [*options, "--", *arguments]
    else:
        words = [*arguments, *options]
    return " ".join(shell_word(word) for word in ["wf-persist", "runs", "signal", *words])


def shell_word(word: str) -> str:
    """``word`` quoted for a POSIX shell. A word with characters a terminal would act on is
    ANSI-C quoted (``$'\\u202e'``, bash, zsh and ksh93): printed it stays inert, and pasted
    it names the same characters again (a plain quoted escape would name others)."""
    if not ACTING.search(word):
        return shlex.quote(word)
    inner = word.replace("\\", "\\\\").replace("'", "\\'")
    return "$'" + visible(inner) + "'"


def pending_table(waits: Iterable[PendingSignal]) -> Table:
    table = Table(title="Waiting for signals")
    table.add_column("signal", no_wrap=True)
    table.add_column("activity", no_wrap=True)
    table.add_column("timeout", justify="right")
    table.add_column("payload schema")
    for wait in waits:
        add_row(
            table,
            wait.name,
            wait.activity_name,
            "" if wait.timeout is None else f"{wait.timeout:g}s",
            compact(wait.payload_schema),
        )
    return table
