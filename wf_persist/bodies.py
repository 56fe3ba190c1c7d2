"""How one replay of a workflow body ends: its value stored as the outcome, or the failure
that ended it (a divergence over how the body ended, compensations run, children of a
cancelled run cancelled), or a stop the body caught and went past (the run parks, replays,
or halts: no outcome)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from .async_context import call_body
from .authoring import Workflow
from .context import Context
from .control import stops_drive
from .driver import RunDriver
from .errors import Cancelled, CancelledCallError, NonDeterminismError
from .logs import run_fields
from .replay import Journal
from .values import from_json, to_json

log = logging.getLogger("wf_persist.runtime")


def _still_going(ctx: Context) -> None:
    """Raise the stop a durable call of the body raised, if the body caught it and ended
    anyway: the run parked, must be replayed again, or cannot go on (no outcome, no
    compensation)."""
    if ctx._stopped is not None:
        raise ctx._stopped.with_traceback(None)


def run_body(driver: RunDriver, wf: Workflow[Any, Any], payload: Any, journal: Journal) -> None:
    """Replay the body once against ``journal``: finish the run, or park, or raise
    :class:`Reload` / :class:`Halt`."""
    ctx = Context(driver.execution_id, journal, driver)
    try:
        value = from_json(wf.input_adapter, payload, f"input of workflow {wf.name}")
        out = call_body(wf, ctx, value)
        _still_going(ctx)
        ctx._ended()
        # Cancelled after its last durable call: the cancellation still wins.
        ctx._before_new_call(ending=True)
        what = f"output of workflow {wf.name}"
        stored = to_json(wf.output_adapter, out, what)
        driver.check_size(what, stored)
    except BaseException as exc:
        if stops_drive(exc):
            raise  # the runtime's stop, a signal: not how the body ended
        _still_going(ctx)  # a stop the body caught wins over how it ended
        raised: BaseException = exc
        if isinstance(ctx.divergence, CancelledCallError) and not isinstance(exc, Cancelled):
            # Later calls were refused before they looked for a cancellation: one that came
            # meanwhile still wins (read afresh: Reload), as over a value.
            driver.check_run()
            try:
                ctx._before_new_call(ending=True)
            except Cancelled as cancelled:
                raised = cancelled
        if not isinstance(raised, Cancelled):
            # A body that raises before replaying every recorded call diverged too.
            with contextlib.suppress(NonDeterminismError):
                ctx._ended(raised)
        failure = ctx.failure(raised)
        reason = ctx.error_document(failure)
        if isinstance(failure, Cancelled):  # a cancellation or a timeout: children go too
            driver.cancel_children(ctx.children_to_cancel(), failure.compensate)
        if not (isinstance(failure, Cancelled) and not failure.compensate):
            errors = ctx.compensate(reason)
            if errors:
                reason = {**reason, "compensationErrors": errors}
        driver.finish(wf, ok=False, value=reason)
        log.warning(
            "run %s (%s) failed: %s: %s",
            driver.execution_id,
            wf.name,
            reason.get("name"),
            reason.get("message"),
            extra=run_fields(driver.execution_id, wf.name),
        )
        return
    driver.finish(wf, ok=True, value=stored)
