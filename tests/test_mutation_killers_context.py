"""Mutant killers for ``wf_persist/context.py`` and ``replay.py``: buffered signals taken
(or rejected) by a wait and across replays, ``all.failed``, a code block's size check and
the replay checker naming the code block it would run.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no selected test
asserted (buffered signals are otherwise tested by ``tests/test_messages.py``, which the
selection leaves out), and its docstring names the mutants it kills.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter

import wf_persist as wp
from wf_persist.testing import check_replay

from .helpers import history_types

# buffered signals taken by a wait ---------------------------------------------------------


class Ticket(BaseModel):
    seat: int
    note: str = "none"


TICKET_REF = f"{Ticket.__module__}:{Ticket.__qualname__}"


@wp.workflow(name="mutation-buffered-tickets", version=1)
def tickets_wf(ctx: wp.Context) -> list[list[Any]]:
    got: list[list[Any]] = []
    for _ in range(2):
        received = ctx.wait_for_signal("ticket", Ticket)
        assert isinstance(received, wp.Received)
        got.append([received.value.seat, received.value.note])
    return got


def _events(client: wp.WorkflowClient, execution_id: str, kind: str) -> list[dict[str, Any]]:
    return [r.event for r in client.history(execution_id) if r.event["type"] == kind]


def test_buffered_signals_are_taken_oldest_first_and_misfits_rejected_on_the_way(
    runtime: wp.Runtime,
) -> None:
    """README: a wait takes the oldest buffered signal "without suspending (first in, first
    out per run and name)"; one that does not fit is recorded as ``signal.rejected`` (with
    its ``signalId`` and ``errors``: ``loc`` and ``msg``) and the wait goes on to the next.
    docs/sql.md: the wait records ``signal.received`` with the ``signalId`` and the wait's
    ``payloadSchema`` (and ``payloadType``, by which later sends are validated); the payload
    stored is the one validated by the wait's type (its defaults filled in). Kills
    ``Context._take_buffered`` 1-9, 13-17, 20-28, 30-34, 36, 38-70 (an empty queue, the
    wrong end of it, the wait's type lost, the stored payload or the rejection's errors
    changed or dropped, stopping at the first misfit, fields or times of either event),
    ``wait_for_signal``
    43, 45-48, 55, 56 (the buffered signal not looked for, or its value lost) and
    ``Journal.from_events`` 176, 177, 183, 184, 186-189, 192, 193, 198 (the queue of
    buffered signals by name, their ids and payloads)."""
    runtime.register(tickets_wf)
    client = runtime.client()
    execution_id = client.start(tickets_wf).execution_id
    for payload in ({"seat": "A1"}, {"seat": 1}, {"seat": 2, "note": "aisle"}):
        # No wait on "ticket" recorded yet: nothing judges them before a wait takes them.
        assert client.signal(execution_id, "ticket", payload, buffer=True) == "buffered"
    misfit, first, second = (
        e["signalId"] for e in _events(client, execution_id, "signal.buffered")
    )
    assert runtime.drive(execution_id)
    assert client.status(execution_id) == "completed", "taken in one drive, never parked"
    assert client.result(execution_id, timeout=5).unwrap() == [[1, "none"], [2, "aisle"]]
    signal_events = [t for t in history_types(client, execution_id) if t.startswith("signal.")]
    assert signal_events == [  # never waiting: the misfit rejected on the way to the next
        *["signal.buffered"] * 3,
        "signal.rejected",
        "signal.received",
        "signal.received",
    ]
    records = client.history(execution_id)
    assert all(isinstance(r.created_at, dt.datetime) for r in records)
    assert _events(client, execution_id, "signal.rejected") == [
        {
            "type": "signal.rejected",
            "executionId": execution_id,
            "name": "ticket",
            "invocation": 1,
            "activityName": "ticket#1",
            "signalId": misfit,
            "errors": [{"loc": ["seat"], "msg": "Input should be a valid integer"}],
        }
    ]
    schema = TypeAdapter(Ticket).json_schema()
    assert _events(client, execution_id, "signal.received") == [
        {
            "type": "signal.received",
            "executionId": execution_id,
            "name": "ticket",
            "invocation": n,
            "activityName": f"ticket#{n}",
            "payload": payload,
            "signalId": signal_id,
            "payloadSchema": schema,
            "payloadType": TICKET_REF,
        }
        for n, payload, signal_id in (
            (1, {"seat": 1, "note": "none"}, first),
            (2, {"seat": 2, "note": "aisle"}, second),
        )
    ]


@wp.workflow(name="mutation-buffered-dates", version=1)
def buffered_dates_wf(ctx: wp.Context) -> list[str]:
    received = ctx.wait_for_signal("dates", list[dt.datetime])
    assert isinstance(received, wp.Received)
    return [d.isoformat() for d in received.value]


def test_a_wait_of_a_type_without_a_class_judges_buffered_signals_by_schema_and_type(
    runtime: wp.Runtime,
) -> None:
    """A wait on ``list[datetime]`` (no class to validate with) judges a buffered payload
    strictly by its JSON Schema (an integer is not a date-time string, although lax
    validation would read it as a timestamp), then by the type itself (the schema does not
    assert ``format``); each misfit is rejected with where and what is wrong, and the wait
    takes the next one. Kills ``Context._take_buffered`` 10-12 (the schema not used) and
    29 (pydantic's errors read as the attribute of a ``SignalPayloadError``)."""
    runtime.register(buffered_dates_wf)
    client = runtime.client()
    execution_id = client.start(buffered_dates_wf).execution_id
    for payload in ([1_700_000_000], ["not a date"], ["2026-01-02T03:04:05+00:00"]):
        assert client.signal(execution_id, "dates", payload, buffer=True) == "buffered"
    assert runtime.drive(execution_id)
    assert client.result(execution_id, timeout=5).unwrap() == ["2026-01-02T03:04:05+00:00"]
    rejected = _events(client, execution_id, "signal.rejected")
    assert [[e["loc"] for e in r["errors"]] for r in rejected] == [[[0]], [[0]]]
    assert rejected[0]["errors"][0]["msg"] == "1700000000 is not of type 'string'"
    assert "valid datetime" in rejected[1]["errors"][0]["msg"]
    assert "signal.waiting" not in history_types(client, execution_id)


@wp.workflow(name="mutation-buffered-across-replays", version=1)
def buffered_across_replays_wf(ctx: wp.Context) -> list[Any]:
    first = ctx.wait_for_signal("x", int)
    assert isinstance(first, wp.Received)
    ctx.sleep(0.05)  # the rest runs in a later drive, replayed from the stored history
    second = ctx.wait_for_signal("x", timeout=0.05)  # any payload would fit
    return [first.value, second.value if isinstance(second, wp.Received) else "timed out"]


def test_buffered_signals_a_wait_took_or_rejected_are_gone_after_a_replay(
    runtime: wp.Runtime,
) -> None:
    """A buffered signal is taken once: after a replay from history, neither the one a
    wait received nor the one it rejected is offered to a later wait on the name (docs/
    sql.md: ``signal.received`` and ``signal.rejected`` name it by ``signalId``), so the
    second wait, which any payload fits, times out. Kills ``Journal.from_events`` 159,
    162, 164 and 180."""
    runtime.register(buffered_across_replays_wf)
    client = runtime.client()
    execution_id = client.start(buffered_across_replays_wf).execution_id
    for payload in ("not a number", 5):
        assert client.signal(execution_id, "x", payload, buffer=True) == "buffered"
    assert runtime.drive(execution_id)
    assert client.status(execution_id) == "suspended"  # sleeping, after taking 5
    assert client.result(execution_id, timeout=10).unwrap() == [5, "timed out"]
    types = history_types(client, execution_id)
    assert (types.count("signal.rejected"), types.count("signal.received")) == (1, 1)
    assert types[-3:] == ["signal.waiting", "signal.timeout", "workflow.completed"]


# ctx.all ----------------------------------------------------------------------------------


@wp.step
def mutation_branch_ok(n: int) -> int:
    return n


@wp.step
def mutation_branch_fails(n: int) -> int:
    raise RuntimeError(f"branch {n} fails")


@wp.workflow(name="mutation-all-fails", version=1)
def all_fails_wf(ctx: wp.Context) -> list[int]:
    return ctx.all([wp.call(mutation_branch_ok, 1), wp.call(mutation_branch_fails, 2)], name="pair")


def test_a_failed_ctx_all_records_its_branch_count_and_error(runtime: wp.Runtime) -> None:
    """README: ``ctx.all`` records ``all.started`` (with the branch count), then
    ``all.completed`` or ``all.failed``; ``all.failed`` carries the count too, and the
    failing branch's error. Kills ``Context.all`` 112."""
    runtime.register(all_fails_wf)
    client = runtime.client()
    execution_id = client.start(all_fails_wf).execution_id
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    [failed] = _events(client, execution_id, "all.failed")
    assert (failed["name"], failed["activityName"], failed["branches"]) == ("pair", "pair#1", 2)
    assert "branch 2 fails" in str(failed["error"])


# ctx.code ---------------------------------------------------------------------------------


@wp.workflow(name="mutation-code-too-large", version=1)
def code_too_large_wf(ctx: wp.Context, size: int) -> int:
    return len(ctx.code("big", lambda: "x" * size, output=str))


def test_a_code_block_result_too_large_to_store_fails_the_run_naming_it(
    runtime: wp.Runtime,
) -> None:
    """A code block's result larger than the database takes is refused before it is
    written: the run fails with ``CodeExecutionError`` whose cause, a ``ValueTooLargeError``,
    names "result of code block big". Kills ``Context.code`` 58 and 59 (the check's
    description, or the value checked)."""
    runtime.register(code_too_large_wf)
    runtime.backend.max_value_bytes = 10_000
    client = runtime.client()
    fits = client.start(code_too_large_wf, 5_000).execution_id
    assert client.result(fits, timeout=10).unwrap() == 5_000
    execution_id = client.start(code_too_large_wf, 20_000).execution_id
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "CodeExecutionError"
    [failed] = _events(client, execution_id, "code.failed")
    assert failed["error"]["name"] == "ValueTooLargeError", failed["error"]
    assert "result of code block big" in failed["error"]["message"]


CODE_CONTROL = {"added": False}


@pytest.fixture
def _code_control() -> Iterator[None]:
    CODE_CONTROL["added"] = False
    yield
    CODE_CONTROL["added"] = False


@wp.workflow(name="mutation-code-added", version=1)
def code_added_wf(ctx: wp.Context) -> int:
    value = ctx.code("first", lambda: 1, output=int)
    if CODE_CONTROL["added"]:  # same source hash, one more code block: a helper's edit
        ctx.code("added", lambda: 2, output=int)
    return value


@pytest.mark.usefixtures("_code_control")
def test_the_replay_checker_names_the_code_block_a_finished_run_would_run(
    runtime: wp.Runtime,
) -> None:
    """README (replay checking): a finished run diverges when the code "would record
    something new"; the report names the code block that would run, without running it.
    Kills ``Context.code`` 47 (the code block's name not handed to the driver)."""
    runtime.register(code_added_wf)
    client = runtime.client()
    execution_id = client.start(code_added_wf).execution_id
    assert client.result(execution_id, timeout=10).unwrap() == 1
    [report] = check_replay(runtime, [execution_id])
    assert report.ok
    CODE_CONTROL["added"] = True
    [report] = check_replay(runtime, [execution_id])
    assert report.divergence == "would run code block added, but the run has finished"
