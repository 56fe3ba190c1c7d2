"""Children whose workflow another process serves: a parent starts them by name from the
database's catalog (a rolling deploy; services that split parent and child workflows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

import wf_persist as wp
from wf_persist.replaycheck import check_replay

from .helpers import history_types


class Order(BaseModel):
    sku: str
    qty: int


@wp.workflow(name="elsewhere-kid", version=1)
def kid_v1(ctx: wp.Context, order: Order) -> str:
    return f"v1:{order.sku}x{order.qty}"


@wp.workflow(name="elsewhere-kid", version=2)
def kid_v2(ctx: wp.Context, order: Order) -> dict[str, Any]:
    return {"v": 2, "sku": order.sku, "qty": order.qty}


@wp.workflow(name="elsewhere-parent", version=1)
def parent(ctx: wp.Context, pin: int | None) -> list[Any]:
    """A child pinned (or the version the start picks), then one with a plain dict input."""
    first = ctx.start_child("elsewhere-kid", Order(sku="a", qty=1), version=pin)
    second = ctx.start_child("elsewhere-kid", {"sku": "b", "qty": 2}, version=pin)
    return [first.version, ctx.child_result(first), ctx.child_result(second)]


@wp.workflow(name="elsewhere-bad-input", version=1)
def bad_input(ctx: wp.Context) -> str:
    try:
        ctx.start_child("elsewhere-kid", {"sku": "a", "qty": "many"}, version=2)
    except wp.InvalidPayloadError as exc:
        return f"refused: {exc.errors[0]['loc']}"
    return "started"


@wp.workflow(name="elsewhere-missing", version=1)
def missing(ctx: wp.Context) -> str:
    ctx.start_child("elsewhere-kid", {"sku": "a", "qty": 1}, version=7)
    return "started"


def _two(make_runtime: Callable[..., wp.Runtime], *local: wp.Workflow[Any, Any]) -> wp.Runtime:
    """Runtime B serves both versions of the child; the returned runtime A serves the
    parents (and ``local``), with a worker each."""
    b = make_runtime()
    b.register(kid_v1, kid_v2)
    b.start_worker(concurrency=4, poll_interval=0.05)
    a = make_runtime()
    a.register(parent, bad_input, missing, *local)
    a.start_worker(concurrency=4, poll_interval=0.05)
    return a


def test_a_child_served_only_elsewhere_starts_from_the_catalog_and_is_driven_there(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    a = _two(make_runtime)
    client = a.client()
    pinned = client.start(parent, 2).execution_id
    newest = client.start(parent, None).execution_id
    want = [2, {"v": 2, "sku": "a", "qty": 1}, {"v": 2, "sku": "b", "qty": 2}]
    assert client.result(pinned, timeout=30).unwrap() == want
    assert client.result(newest, timeout=30).unwrap() == want  # the newest cataloged
    kids = [
        r.event["childExecutionId"]
        for r in client.history(pinned)
        if r.event["type"] == "child.started"
    ]
    assert [(client.describe(k).version, client.describe(k).parent_id) for k in kids] == [
        (2, pinned),
        (2, pinned),
    ]
    (report,) = check_replay(a, [pinned])
    assert report.divergence is None


def test_a_version_registered_here_is_still_preferred_and_a_pinned_one_may_be_elsewhere(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Mid-deploy: this process has the child's v1, another has v2."""
    a = _two(make_runtime, kid_v1)
    client = a.client()
    local = client.start(parent, None).execution_id  # the highest registered HERE: v1
    assert client.result(local, timeout=30).unwrap() == [1, "v1:ax1", "v1:bx2"]
    remote = client.start(parent, 2).execution_id
    assert client.result(remote, timeout=30).unwrap()[0] == 2


def test_a_payload_the_cataloged_schema_refuses_raises_in_the_parent_and_starts_nothing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    a = _two(make_runtime)
    client = a.client()
    run = client.start(bad_input).execution_id
    assert client.result(run, timeout=30).unwrap() == "refused: ('qty',)"
    assert "child.started" not in history_types(client, run)
    assert client.list("elsewhere-kid").items == []


def test_a_version_cataloged_nowhere_fails_the_parent_with_a_typed_error(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    a = _two(make_runtime)
    client = a.client()
    run = client.start(missing).execution_id
    outcome = client.result(run, timeout=30)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "MissingWorkflowVersionError"
    assert "elsewhere-kid@v7 is not cataloged" in outcome.error["message"]
    assert client.list("elsewhere-kid").items == []
