"""The source-hash version catalog: first registration wins, runs stay pinned."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, select

import wf_persist as wp
from wf_persist.models import workflows_table
from wf_persist.sources import normalized_source, source_hash

from .fixtures import workflows as w
from .helpers import Processes


def _v1_plain(ctx: wp.Context, x: int) -> int:
    return x + 1


def _v1_reformatted(ctx: wp.Context, x: int) -> int:  # a comment
    """A docstring does not count either."""
    # neither does this comment

    return x + 1


def _v1_changed(ctx: wp.Context, x: int) -> int:
    return x + 2


def test_source_hash_ignores_comments_and_formatting_only() -> None:
    assert normalized_source(_v1_plain).replace("_v1_plain", "f") == normalized_source(
        _v1_reformatted
    ).replace("_v1_reformatted", "f")
    base = source_hash("wf", 1, _v1_plain)
    assert len(base) == 64 and base == source_hash("wf", 1, _v1_plain)
    assert source_hash("wf", 1, _v1_changed) != base
    assert source_hash("wf", 2, _v1_plain) != base
    assert source_hash("other", 1, _v1_plain) != base


def test_a_version_of_an_int_subclass_is_a_plain_int() -> None:
    """Its own __str__ entered the source hash (a conflict with ``version=1`` for the same
    code) and its __hash__ ran when registering."""

    class One(int):
        def __str__(self) -> str:
            return "one"

        def __hash__(self) -> int:
            raise RuntimeError("hash")

    def body(ctx: wp.Context) -> None:
        return None

    odd = wp.workflow(name="odd", version=One(1))(body)
    plain = wp.workflow(name="odd", version=1)(body)
    assert type(odd.version) is int and odd.source_hash == plain.source_hash


def test_invalid_definitions_are_rejected() -> None:
    with pytest.raises(wp.WorkflowDefinitionError):
        wp.workflow(name="x", version=0)
    with pytest.raises(wp.WorkflowDefinitionError):
        wp.workflow(name="x", version=True)
    with pytest.raises(wp.WorkflowDefinitionError):

        @wp.workflow(name="x")
        def too_many(ctx: wp.Context, a: int, b: int) -> None: ...


def test_register_is_idempotent_and_catalogs_the_hash(
    runtime: wp.Runtime, db_engine: Engine
) -> None:
    runtime.register(w.versioned_v1, w.versioned_v2)
    runtime.register(w.versioned_v1)
    with db_engine.connect() as conn:
        rows = conn.execute(select(workflows_table).order_by(workflows_table.c.version)).all()
    assert [(r.name, r.version, r.source_hash) for r in rows] == [
        ("versioned", 1, w.versioned_v1.source_hash),
        ("versioned", 2, w.versioned_v2.source_hash),
    ]


def test_conflicting_registration_raises_in_this_and_other_runtimes(
    make_runtime: object, db_url: str, db_engine: Engine, procs: Processes
) -> None:
    first = make_runtime()  # type: ignore[operator]
    first.register(w.versioned_v1)

    @wp.workflow(name="versioned", version=1)
    def changed(ctx: wp.Context, name: str) -> str:
        return f"changed-{name}"

    with pytest.raises(wp.WorkflowVersionConflictError) as info:
        first.register(changed)
    assert "register a new version instead" in str(info.value)
    assert info.value.workflow_name == "versioned" and info.value.version == 1

    second = make_runtime()  # type: ignore[operator]
    with pytest.raises(wp.WorkflowVersionConflictError):
        second.register(changed)
    with pytest.raises(wp.WorkflowVersionConflictError):
        second.client().start(changed, "x")
    # All or nothing: a batch with one conflict registers none of it.
    with pytest.raises(wp.WorkflowVersionConflictError):
        second.register(w.versioned_v2, changed)
    with db_engine.connect() as conn:
        versions = conn.execute(select(workflows_table.c.version)).scalars().all()
    assert versions == [1]

    assert procs.run_proc(db_url, "register-conflict") == "WorkflowVersionConflictError"


def test_start_uses_highest_version_unless_pinned(runtime: wp.Runtime) -> None:
    runtime.register(w.versioned_v1)
    client = runtime.client()
    old = client.start("versioned", "a")
    assert old.version == 1
    runtime.register(w.versioned_v2)
    newer = client.start(w.versioned_v1, "b")  # the definition names the workflow, not the version
    pinned = client.start(w.versioned_v1, "c", version=1)
    assert (newer.version, pinned.version) == (2, 1)
    assert client.result(old.execution_id).unwrap() == "v1-a"
    assert client.result(newer.execution_id).unwrap() == "v2-b"
    assert client.result(pinned.execution_id).unwrap() == "v1-c"
    assert [i.execution_id for i in client.list("versioned", version=1).items] == [
        old.execution_id,
        pinned.execution_id,
    ]
    assert [i.execution_id for i in client.list("versioned", version=2).items] == [
        newer.execution_id
    ]
    with pytest.raises(wp.MissingWorkflowVersionError):
        client.start("versioned", "d", version=3)
    with pytest.raises(wp.UnknownWorkflowError):
        client.start("never-registered", "x")


def test_runtime_without_the_pinned_version(make_runtime: object) -> None:
    full = make_runtime()  # type: ignore[operator]
    full.register(w.versioned_v1, w.versioned_v2)
    handle = full.client().start("versioned", "z", version=1)

    partial = make_runtime()  # type: ignore[operator]
    partial.register(w.versioned_v2)
    client = partial.client()
    with pytest.raises(wp.MissingWorkflowVersionError) as info:
        client.result(handle.execution_id, timeout=1)
    assert (info.value.workflow_name, info.value.version) == ("versioned", 1)
    assert "versioned@v1 is not registered in this runtime" in str(info.value)
    # Reading still works, and the run was not touched.
    assert client.status(handle.execution_id) == "running"
    assert [r.event["type"] for r in client.history(handle.execution_id)] == ["execution.started"]
    assert [i.execution_id for i in client.list("versioned").items] == [handle.execution_id]
    assert full.client().result(handle.execution_id).unwrap() == "v1-z"
