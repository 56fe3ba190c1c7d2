"""Children whose workflow another process serves: a parent starts them by name from the
database's catalog (a rolling deploy; services that split parent and child workflows)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, event

import wf_persist as wp
from wf_persist.replaycheck import check_replay

from .helpers import history_types, wait_until


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
    first: wp.ChildHandle[Any] = ctx.start_child(
        "elsewhere-kid", Order(sku="a", qty=1), version=pin
    )
    second: wp.ChildHandle[Any] = ctx.start_child(
        "elsewhere-kid", {"sku": "b", "qty": 2}, version=pin
    )
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


class Receipt(BaseModel):
    sku: str


@wp.workflow(name="elsewhere-kid", version=3)
def kid_v3(ctx: wp.Context, order: Order) -> Receipt:
    return Receipt(sku=order.sku)


@wp.step
def noted(text: str) -> str:
    return text


@wp.workflow(name="elsewhere-resumed", version=1)
def resumed(ctx: wp.Context) -> str:
    """Its child's result, then a sleep: the run is resumed by whichever process."""
    kid: wp.ChildHandle[Any] = ctx.start_child("elsewhere-kid", {"sku": "r", "qty": 1}, version=3)
    got = ctx.child_result(kid)
    ctx.sleep(0.5)
    return type(got).__name__


@wp.workflow(name="elsewhere-caught", version=1)
def caught(ctx: wp.Context, pin: int) -> str:
    """A refused start caught, then calls whose places a replay must find again."""
    with contextlib.suppress(wp.InvalidPayloadError):
        ctx.start_child("elsewhere-kid", {"sku": "a", "qty": "many"}, version=pin)
    first = ctx.run(noted, "after")
    ctx.sleep(0.2)
    return first + "+" + ctx.run(noted, "slept")


@wp.workflow(name="elsewhere-kid", version=9)
def kid_v9(ctx: wp.Context, order: Order) -> str:
    return f"v9:{order.sku}"


@wp.workflow(name="elsewhere-later", version=1)
def later(ctx: wp.Context) -> list[Any]:
    """A version its service catalogs only after this run first tried to start it."""
    handle: wp.ChildHandle[str] = ctx.start_child(
        "elsewhere-kid", {"sku": "l", "qty": 1}, version=9
    )
    ctx.sleep(0.2)
    return [ctx.run(noted, "slept"), ctx.child_result(handle)]


@wp.workflow(name="elsewhere-by-object", version=1)
def by_object(ctx: wp.Context, pin: int) -> list[Any]:
    """The child named by its (v1) definition, a version pinned that another process has."""
    try:
        kid: wp.ChildHandle[Any] = ctx.start_child(kid_v1, Order(sku="o", qty=3), version=pin)
    except wp.MissingWorkflowVersionError:
        return ["caught in the body"]
    return [kid.version, ctx.child_result(kid)]


def _two(
    make_runtime: Callable[..., wp.Runtime], *local: wp.Workflow[Any, Any], **options: Any
) -> wp.Runtime:
    """Runtime B serves both versions of the child; the returned runtime A serves the
    parents (and ``local``), with a worker each."""
    b = make_runtime()
    b.register(kid_v1, kid_v2, kid_v3)
    b.start_worker(concurrency=4, poll_interval=0.05)
    a = make_runtime(**options)
    a.register(parent, bad_input, missing, resumed, caught, later, by_object, *local)
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
    # The newest cataloged: v3, whose result (a model) comes back as its JSON.
    assert client.result(newest, timeout=30).unwrap() == [3, {"sku": "a"}, {"sku": "b"}]
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


def test_a_version_cataloged_nowhere_is_a_failed_drive_and_fails_the_run_at_the_limit(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Not raised in the body (what the catalog holds changes: a replay must meet what the
    drive met): the drive fails, is retried after a backoff, and the run fails with
    ``DriveFailedError`` at the runtime's limit, having started no child."""
    a = _two(make_runtime, max_drive_failures=2)
    client = a.client()
    run = client.start(missing).execution_id
    outcome = client.result(run, timeout=30)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error_type == "DriveFailedError"
    assert "elsewhere-kid@v7 is not cataloged" in outcome.message
    assert history_types(client, run).count("drive.failed") == 2
    assert client.list("elsewhere-kid").items == []


def test_a_version_cataloged_after_a_failed_drive_is_started_by_the_next_one(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A rolling deploy: the parent's workers are new first; the child's service catalogs
    the version a moment later; the parent, retried after its backoff, starts it."""
    a = _two(make_runtime)
    client = a.client()
    run = client.start(later).execution_id
    wait_until(lambda: "drive.failed" in history_types(client, run), 30, "a failed drive")
    d = make_runtime()
    d.register(kid_v9)
    d.start_worker(poll_interval=0.05)
    assert client.result(run, timeout=60).unwrap() == ["slept", "v9:l"]
    (started,) = [r.event for r in client.history(run) if r.event["type"] == "child.started"]
    assert started["version"] == 9


def test_a_child_result_read_as_json_stays_json_when_a_process_serving_the_child_resumes(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Started where its workflow was not served, a child's result is JSON to its parent on
    every replay, also one by a process that serves it (which would decode it into its
    output model: the replay would see another value than the drive that went on from
    it)."""
    a = _two(make_runtime)
    client = a.client()
    run = client.start(resumed).execution_id
    wait_until(lambda: "sleep.started" in history_types(client, run), 30, "the sleep")
    a.close()
    c = make_runtime()
    c.register(resumed, kid_v3)
    c.start_worker(poll_interval=0.05)
    assert c.client().result(run, timeout=30).unwrap() == "dict"
    (started,) = [r.event for r in c.client().history(run) if r.event["type"] == "child.started"]
    assert started["plainResult"] is True


@pytest.mark.parametrize("pin", [1, 2], ids=["registered-here", "cataloged"])
def test_a_caught_refusal_of_a_child_start_moves_no_later_call_on_replay(
    make_runtime: Callable[..., wp.Runtime], pin: int
) -> None:
    """A start refused (here its input) records nothing; the calls after it replay where
    they ran. Before, the refused call had taken a place: every replay after the sleep
    failed with a NonDeterminismError."""
    a = _two(make_runtime, kid_v1)
    client = a.client()
    run = client.start(caught, pin).execution_id
    assert client.result(run, timeout=30).unwrap() == "after+slept"


def test_a_child_from_the_catalog_needs_no_second_connection_of_its_drive(
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
    db_url: str,
) -> None:
    """The catalog is read on the drive's own connection: on the smallest pool a worker
    takes, parents starting such children all at once wait for no connection (before,
    each drive held one and waited for a second: the pool's timeout, a failed drive)."""
    b = make_runtime()
    b.register(kid_v1, kid_v2, kid_v3)
    b.start_worker(concurrency=4, poll_interval=0.05)
    with wp.Runtime(make_engine(db_url, pool_size=2, max_overflow=0, pool_timeout=3)) as a:
        a.register(parent)
        a.start_worker(concurrency=2, poll_interval=0.05)
        client = a.client()
        runs = [client.start(parent, 2).execution_id for _ in range(8)]
        for run in runs:
            assert client.result(run, timeout=60).unwrap()[0] == 2
        assert [client.describe(r).drive_failures for r in runs] == [0] * 8


@wp.workflow(name="elsewhere-kid", version=1)
def kid_v1_edited(ctx: wp.Context, order: Order) -> str:
    return f"edited:{order.sku}"


#: The child definition the parent below starts: a release's own, switched by the test.
RELEASE: dict[str, wp.Workflow[Any, Any]] = {}


@wp.workflow(name="elsewhere-edited-parent", version=1)
def edited_parent(ctx: wp.Context) -> str:
    try:
        return str(ctx.run_child(RELEASE["kid"], {"sku": "e", "qty": 1}))
    except wp.WorkflowVersionConflictError:
        return "caught"


def test_a_child_whose_version_the_catalog_holds_another_body_of_is_a_failed_drive(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A release that edited a child without a new version meets the catalog's refusal only
    in its own processes: raised in the body, a parent that caught it went another way
    than a replay by the release the catalog holds (and, uncaught, the run failed for
    good). It is a failed drive instead; a process of the other release drives the run."""
    a = _two(make_runtime, max_drive_failures=10)  # B catalogs elsewhere-kid v1 as kid_v1
    RELEASE["kid"] = kid_v1_edited
    a.register(edited_parent)
    client = a.client()
    run = client.start(edited_parent).execution_id
    wait_until(lambda: "drive.failed" in history_types(client, run), 30, "a failed drive")
    assert client.status(run) == "running"
    assert "child.started" not in history_types(client, run)
    (failed,) = [r.event for r in client.history(run) if r.event["type"] == "drive.failed"][:1]
    assert "WorkflowVersionConflictError" in str(failed)
    a.close()

    RELEASE["kid"] = kid_v1
    c = make_runtime()
    c.register(edited_parent, kid_v1)
    c.start_worker(poll_interval=0.05)
    assert c.client().result(run, timeout=30).unwrap() == "v1:ex1"


@wp.workflow(name="elsewhere-uncataloged-kid", version=1)
def uncataloged_kid(ctx: wp.Context, n: int) -> int:
    return n * 2


@wp.workflow(name="elsewhere-catalog-fails", version=1)
def catalog_fails(ctx: wp.Context) -> str:
    try:
        return f"child={ctx.run_child(uncataloged_kid, 4)}"
    except Exception as exc:
        return f"caught {type(exc).__name__}"


def test_a_database_error_cataloging_a_child_is_a_failed_drive_not_raised_in_the_body(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A child definition registered nowhere yet is cataloged as the parent starts it; that
    write failing is this drive's misfortune, which a replay would not meet: raised in the
    body, a parent that caught it went another way for good."""
    rt = make_runtime()
    rt.register(catalog_fails)
    refused: list[str] = []

    def refuse_once(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if re.search(r"INSERT\b.*\bwf_workflows\b", statement, re.I | re.S) and not refused:
            refused.append(statement)
            raise RuntimeError("the catalog write failed")

    event.listen(rt.database.base_engine, "before_cursor_execute", refuse_once)
    rt.start_worker(poll_interval=0.05)
    client = rt.client()
    run = client.start(catalog_fails).execution_id
    assert client.result(run, timeout=30).unwrap() == "child=8"
    assert refused
    assert history_types(client, run).count("drive.failed") == 1


def test_a_child_named_by_its_definition_with_a_version_served_elsewhere_starts_from_the_catalog(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``start_child(kid_v1, ..., version=2)`` in a process that has only v1 raised
    ``MissingWorkflowVersionError`` in the body, where the name (``"elsewhere-kid"``)
    started v2 from the catalog: which process drove the parent decided the body's path,
    and a replay by a process that has v2 diverged from it."""
    a = _two(make_runtime, kid_v1)
    client = a.client()
    run = client.start(by_object, 2).execution_id
    assert client.result(run, timeout=30).unwrap() == [2, {"v": 2, "sku": "o", "qty": 3}]
    (report,) = check_replay(a, [run])
    assert report.divergence is None
