"""Floats of magnitude 1e16 and more (``json.dumps`` writes them ``1e+16``) come back as
floats on every backend, through every path a value is written by: a start's input, a
step's result read back on replay, a signal's payload, a run's result. PostgreSQL's JSONB
gave them back as integers (``1e300`` as 301 digits, past 64 bits), so a replay passed a
step another value than the run had, and failed."""

from __future__ import annotations

import json
from typing import Any

import wf_persist as wp
from wf_persist.json_text import json_text

BIG = {"e20": 1e20, "max": 1.7976931348623157e308, "e16": 1e16, "neg": -2.5e17, "small": 1e-7}


@wp.step
def produce(seed: dict[str, Any]) -> dict[str, Any]:
    return {**seed, "list": [1e300, 3.0, 1e16]}


@wp.step
def consume(doc: dict[str, Any]) -> dict[str, Any]:
    return doc


@wp.workflow(name="exact-floats", version=1)
def exact_floats_wf(ctx: wp.Context, seed: dict[str, Any]) -> dict[str, Any]:
    made = ctx.run(produce, seed)
    signalled = ctx.wait_for_signal("more", dict[str, Any])
    assert isinstance(signalled, wp.Received)
    return ctx.run(consume, {"made": made, "seed": seed, "signalled": signalled.value})


def _kinds(doc: Any) -> Any:
    """The document with each number as (type name, repr): equal only if exactly equal."""
    if isinstance(doc, dict):
        return {k: _kinds(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_kinds(v) for v in doc]
    return (type(doc).__name__, repr(doc))


def test_json_text_writes_every_float_so_that_it_reads_back_a_float() -> None:
    doc = {**BIG, "nested": [BIG, {"k": [1e16]}], "text": "1e+16 e+", "int": 10**18}
    text = json_text(doc)
    assert "e+" not in text.replace('"1e+16 e+"', "")
    assert _kinds(json.loads(text)) == _kinds(doc)


def test_big_floats_round_trip_through_starts_replays_signals_and_results(
    runtime: wp.Runtime,
) -> None:
    runtime.register(exact_floats_wf)
    client = runtime.client()
    run = client.start(exact_floats_wf, BIG).execution_id
    assert runtime.drive(run)  # parks at the wait: the step's result is read back next
    client.signal(run, "more", {"sig": 1e20, "list": [1e300]})
    runtime.drive(run)
    got = client.result(run, timeout=20).unwrap()
    expected = {
        "made": {**BIG, "list": [1e300, 3.0, 1e16]},
        "seed": BIG,
        "signalled": {"sig": 1e20, "list": [1e300]},
    }
    assert _kinds(got) == _kinds(expected)
    stored = [r.event for r in client.history(run) if r.event["type"] == "step.completed"]
    assert _kinds(stored[0]["result"]) == _kinds(expected["made"])
