"""Logging: the logger hierarchy, the fields a log pipeline filters on, and a JSON format.

Every record about a run carries ``execution_id`` and ``workflow`` (and ``step`` and
``attempt`` for a step attempt) as attributes, besides saying them in the message, so a
pipeline indexes them without parsing text. The loggers, all under ``wf_persist``:

- ``wf_persist.runtime``: drives — a run resumed from an earlier driver, a lost lease, a
  failed drive, a run failed after too many, a workflow that failed;
- ``wf_persist.steps``: step attempts that failed (and are retried, or not), compensations
  that failed;
- ``wf_persist.leases``: the lease keeper — outages, leases found lost;
- ``wf_persist.worker``: the claim loop — outages, unexpected errors;
- ``wf_persist.telemetry``: OpenTelemetry asked for by ``OTEL_*`` variables but not installed.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import re
import sys
from typing import Any, Final, Literal

#: The record attributes this library sets, as they appear in JSON output.
RUN_FIELDS: Final = ("execution_id", "workflow", "step", "attempt")

#: Characters a terminal may act on rather than show: C0 and C1 controls (ESC starts the
#: sequences that retitle a window, clear a screen or rewrite what was printed), DEL, and the
#: bidirectional overrides and isolates that reorder what follows them on screen, and the
#: line and paragraph separators that viewers break lines at.
ACTING: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)


def visible(text: str) -> str:
    """``text`` with every character a terminal would act on shown as its escape
    (``\x1b``, ``\u202e``): stored values are data, never instructions to the terminal.
    Within a JSON string the escape reads back as the same character."""
    return ACTING.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def run_fields(
    execution_id: str, workflow: str, step: str | None = None, attempt: int | None = None
) -> dict[str, Any]:
    """``extra=`` for a record about a run (or one step attempt of it)."""
    fields: dict[str, Any] = {"execution_id": execution_id, "workflow": workflow}
    if step is not None:
        fields["step"] = step
    if attempt is not None:
        fields["attempt"] = attempt
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO-8601), level, logger, message, the run's
    fields when the record has them, and the formatted exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in RUN_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """One record per line for a terminal: a message carries user values (a step's
    exception, a run's input in it), so what a terminal would act on, line breaks
    included, is shown as its escape; a traceback keeps its lines, its text made inert."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        # A copy: the record is shared with any other handler, and a traceback another
        # formatter cached on it (``exc_text``) is formatted again here, made inert.
        shown = copy.copy(record)
        shown.msg, shown.args = visible(record.getMessage()).replace("\n", "\\n"), None
        shown.exc_text = None if record.exc_info else visible(record.exc_text or "") or None
        return super().format(shown)

    def formatException(self, ei: Any) -> str:
        return visible(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return visible(super().formatStack(stack_info))


def configure(fmt: Literal["text", "json"] = "text", level: int = logging.INFO) -> None:
    """Send ``wf_persist`` records to stderr as text or JSON lines (for ``wf-persist
    worker``; an application configures logging its own way)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger("wf_persist")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
