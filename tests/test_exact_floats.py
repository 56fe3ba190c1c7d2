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


SEEN: list[str] = []


@wp.step
def key_map() -> dict[str, int]:
    return {"bb": 1, "a": 2, "ccc": 3}


@wp.step
def handle_key(key: str) -> str:
    SEEN.append(key)
    return key


@wp.step
def signed_zero() -> Any:
    return {"z": -0.0}


@wp.workflow(name="replayed-key-order", version=1)
def key_order_wf(ctx: wp.Context) -> list[Any]:
    seen = []
    for key in ctx.run(key_map):
        seen.append(ctx.run(handle_key, key))
        ctx.sleep(0.001)  # parks: what follows is a replay
    zero = ctx.run(signed_zero)["z"]
    ctx.sleep(0.001)
    return [seen, repr(zero), repr(ctx.run(signed_zero)["z"])]


def test_a_recorded_dict_is_seen_by_its_run_as_its_replays_read_it(runtime: wp.Runtime) -> None:
    """PostgreSQL's JSONB reorders an object's keys (shortest first) and drops the sign of
    -0.0: a run looping over a step's dict saw one order, its replay another, and called the
    next step with a key it had already handled (recorded results matched by position)."""
    SEEN.clear()
    runtime.register(key_order_wf)
    client = runtime.client()
    run = client.start(key_order_wf).execution_id
    while runtime.drive(run) and client.status(run) != "completed":
        pass
    seen, zero_then, zero_again = client.result(run, timeout=20).unwrap()
    assert sorted(seen) == ["a", "bb", "ccc"]  # each key handled once
    assert seen == SEEN, "a step ran with another key than its run had recorded"
    assert zero_then == zero_again  # the same value before and after a replay


@wp.workflow(name="whole-floats", version=1)
def whole_floats_wf(ctx: wp.Context, x: float) -> float:
    assert type(x) is float, type(x)
    return x * 1.0


def test_a_whole_number_float_input_and_result_stay_floats(runtime: wp.Runtime) -> None:
    """A run's input or result that is a whole-number float itself (not inside a list or
    an object) was stored by SQLite's NUMERIC affinity as an INTEGER: the run got ``1``
    for ``1.0``, and a client other than the one that saw the run finish read ``1``."""
    runtime.register(whole_floats_wf)
    client = runtime.client()
    # And any float of a far exponent: SQLite's own parsing of the text is not exact there.
    far = (-3.131546820234317e-307, 1.15922888512027e-308, 1.2345678901234567e297)
    for value in (1.0, 1e16, -0.0, 2.5, 1e300, *far):
        run = client.start(whole_floats_wf, value).execution_id
        runtime.drive(run)
        with wp.Client(runtime.engine) as fresh:
            found = fresh.result(run, timeout=10).unwrap()
            assert (type(found), found) == (float, value), value
            assert type(fresh.describe(run).input) is float, value
            assert fresh.describe(run).input == value or value == 0.0, value
            assert client.result(run, timeout=10).unwrap() == found


@wp.workflow(name="keyed-output", version=1)
def keyed_output_wf(ctx: wp.Context) -> Any:
    return {"user_id": 1, "b": 2, "ccc": {"zz": 1, "a": 2}}


def test_a_runs_outcome_has_the_same_key_order_in_every_process(runtime: wp.Runtime) -> None:
    """On PostgreSQL the process that ran a workflow returned its output in the order the
    body built it; every other process reads JSONB's order."""
    runtime.register(keyed_output_wf)
    client = runtime.client()
    here = client.execute(keyed_output_wf).unwrap()
    run = client.start(keyed_output_wf).execution_id
    runtime.drive(run)
    with wp.Client(runtime.engine) as fresh:
        elsewhere = fresh.result(run, timeout=10).unwrap()
    assert json.dumps(here) == json.dumps(elsewhere)
    assert json.dumps(client.result(run, timeout=10).unwrap()) == json.dumps(elsewhere)
