"""The thin client: operates runs with the database alone, validates starts against the
catalog's JSON Schemas, and never executes a step."""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

import wf_persist as wp
from wf_persist.models import executions_table, workflows_table

from .fixtures import workflows as w
from .helpers import Processes


@pytest.fixture
def thin(db_url: str) -> Iterator[wp.Client]:
    with wp.Client(db_url, poll_interval=0.05) as client:
        yield client


def _runs(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.count()).select_from(executions_table)).scalar_one()
        )


def test_a_start_by_name_is_validated_against_the_cataloged_schema(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    runtime.register(w.order_wf)
    refused: list[tuple[Any, str]] = [
        ({"order_id": "", "amount": 5}, "order_id: '' should be non-empty"),
        ({"order_id": "a", "amount": "5"}, "amount: '5' is not of type 'integer'"),  # strict
        ({"order_id": "a", "amount": 0}, "amount: 0 is less than or equal to"),
        ({"order_id": "a"}, "'amount' is a required property"),
        (None, "None is not of type 'object'"),
    ]
    for payload, message in refused:
        with pytest.raises(wp.InvalidPayloadError) as info:
            thin.start("order", payload)
        assert info.value.what == "input of workflow order"
        assert message in str(info.value), str(info.value)
    assert _runs(thin.engine) == 0
    handle = thin.start("order", {"order_id": "a", "amount": 5}, actor="ops")
    assert (handle.workflow_name, handle.version, handle.created) == ("order", 1, True)
    assert thin.describe(handle.execution_id).actor == "ops"
    # An idempotency key works as for the embedded client.
    first = thin.start("order", {"order_id": "b", "amount": 1}, idempotency_key="k")
    again = thin.start("order", {"order_id": "b", "amount": 1}, idempotency_key="k")
    assert again == first and not again.created


def test_unknown_names_and_versions_name_the_catalog(runtime: wp.Runtime, thin: wp.Client) -> None:
    runtime.register(w.versioned_v1, w.versioned_v2)
    assert thin.start("versioned", "x").version == 2  # the highest cataloged
    assert thin.start("versioned", "x", version=1).version == 1
    with pytest.raises(wp.MissingWorkflowVersionError) as missing:
        thin.start("versioned", "x", version=3)
    assert (missing.value.workflow_name, missing.value.version) == ("versioned", 3)
    assert "not cataloged in this database" in str(missing.value)
    with pytest.raises(wp.UnknownWorkflowError) as unknown:
        thin.start("nobody-registered-this", 1)
    assert unknown.value.workflow_name == "nobody-registered-this"
    assert "is not cataloged in this database" in str(unknown.value)


@pytest.mark.parametrize(
    "payload",
    [math.nan, math.inf, 2**64, {"a": object()}, b"\xff", "nul\x00", [[[[]]]] * 1 + [0]],
    ids=["nan", "inf", "2**64", "object", "bytes", "nul", "mixed"],
)
def test_unstorable_input_is_refused_before_anything_is_written(
    runtime: wp.Runtime, thin: wp.Client, payload: Any
) -> None:
    runtime.register(w.bad_result_wf)  # an input that must be null: the schema refuses too
    with pytest.raises((wp.NotSerializableError, wp.InvalidPayloadError)):
        thin.start("bad-result", payload)
    assert _runs(thin.engine) == 0


def test_values_too_deep_for_any_backend_are_refused(runtime: wp.Runtime, thin: wp.Client) -> None:
    runtime.register(w.determinism_wf, w.echo_wf)
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(wp.NotSerializableError, match="nested more than 29 levels"):
        thin.start("echo", deep)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(wp.NotSerializableError):
        thin.start("echo", cyclic)
    assert _runs(thin.engine) == 0


def _deep_tuple() -> Any:
    deep: Any = 1
    for _ in range(40):
        deep = (deep,)
    return deep


@pytest.mark.parametrize(
    "payload",
    [("nul\x00",), (2**64,), {"k": ("\ud800",)}, _deep_tuple()],
    ids=["nul", "bigint", "surrogate", "deep"],
)
def test_unstorable_values_inside_tuples_are_refused_too(
    runtime: wp.Runtime, thin: wp.Client, payload: Any
) -> None:
    """A tuple becomes a JSON list: what it holds is checked like a list's items (with no
    cataloged schema to refuse the shape, a NUL reached PostgreSQL as a raw DataError)."""
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(input_schema=None))
    with pytest.raises(wp.NotSerializableError):
        thin.start("echo", payload)
    assert _runs(thin.engine) == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.start("", 1), "expected a workflow or its name"),
        (lambda c: c.start(42, 1), "expected a workflow or its name"),
        (lambda c: c.start("echo", 1, version=0), "version must be a positive integer"),
        (lambda c: c.start("echo", 1, version=True), "version must be a positive integer"),
        (lambda c: c.start("echo", 1, version=2**40), "version must be a positive integer"),
        (lambda c: c.start("echo", 1, actor=""), "actor must be a non-empty string"),
        (lambda c: c.result("x" * 37), "an execution id is a string"),
        (lambda c: c.workflows(""), "expected a workflow or its name"),
    ],
)
def test_bad_arguments_are_typed_errors(
    runtime: wp.Runtime, thin: wp.Client, call: Callable[[wp.Client], object], message: str
) -> None:
    runtime.register(w.echo_wf)
    with pytest.raises(wp.InvalidArgumentError, match=message):
        call(thin)
    assert _runs(thin.engine) == 0


def test_client_construction_checks_its_arguments(db_url: str) -> None:
    with pytest.raises(wp.InvalidArgumentError, match="bind must be a URL or an Engine"):
        wp.Client(42)  # type: ignore[arg-type]
    with pytest.raises(wp.InvalidArgumentError, match="poll_interval must be a positive"):
        wp.Client(db_url, poll_interval=0)
    with pytest.raises(wp.UnsupportedDatabaseError):
        wp.Client("oracle://nobody@nowhere/db")


def test_result_waits_and_never_drives(runtime: wp.Runtime, thin: wp.Client) -> None:
    runtime.register(w.echo_wf, w.explode_wf)
    handle = thin.start("echo", 3)
    with pytest.raises(wp.ResultTimeoutError):
        thin.result(handle.execution_id, timeout=0.3)
    # Nothing ran: the run is due and untouched, only its start is recorded.
    assert [r.event["type"] for r in thin.history(handle.execution_id)] == ["execution.started"]
    assert thin.status(handle.execution_id) == "running"
    assert runtime.drive(handle.execution_id)
    outcome = thin.result(handle.execution_id, timeout=5)
    assert isinstance(outcome, wp.Completed) and outcome.value == [1, 2, 3]  # the stored JSON
    failing = thin.start("explode", "boom")
    runtime.start_worker()
    failed = thin.result(failing.execution_id, timeout=20)
    assert isinstance(failed, wp.Failed) and "boom" in failed.message


def test_the_catalog_lists_versions_with_their_schemas(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    runtime.register(w.versioned_v1, w.versioned_v2, w.echo_wf)
    entries = thin.workflows()
    assert [(e.name, e.version) for e in entries] == [
        ("echo", 1),
        ("versioned", 1),
        ("versioned", 2),
    ]
    echo = entries[0]
    assert echo.source_hash == w.echo_wf.source_hash
    assert echo.input_schema == {"type": "integer"}
    assert echo.output_schema == {"items": {"type": "integer"}, "type": "array"}
    assert echo.registered_at.tzinfo is not None
    assert [e.version for e in thin.workflows("versioned")] == [1, 2]
    assert thin.workflows("nothing-here") == []
    assert runtime.client().workflows() == entries


def test_a_version_cataloged_without_schemas_gets_them_from_its_next_registration(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(input_schema=None, output_schema=None))
    assert thin.workflows()[0].input_schema is None
    # Without a schema any JSON input is accepted (the worker validates it when it runs).
    loose = thin.start("echo", "not a number")
    assert thin.status(loose.execution_id) == "running"
    other = wp.Runtime(runtime.engine)  # e.g. a worker of the new release starting
    try:
        other.register(w.echo_wf)
    finally:
        other.close()
    assert thin.workflows()[0].input_schema == {"type": "integer"}
    with pytest.raises(wp.InvalidPayloadError):
        thin.start("echo", "not a number")


def test_a_schema_that_is_not_json_schema_checks_nothing(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(input_schema={"type": "no-such-type"}))
    assert thin.status(thin.start("echo", 2).execution_id) == "running"


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
    ids=["self", "cycle"],
)
def test_a_schema_whose_references_never_end_checks_nothing(
    runtime: wp.Runtime, thin: wp.Client, schema: dict[str, Any]
) -> None:
    """A schema that references itself forever is no JSON Schema to check by (not a raw
    RecursionError from the thin client)."""
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(input_schema=schema))
    assert thin.status(thin.start("echo", 2).execution_id) == "running"


def test_a_pattern_is_matched_in_linear_time(runtime: wp.Runtime, thin: wp.Client) -> None:
    """pydantic matches ``pattern`` with a linear-time engine; so must the thin client, or a
    hostile payload hangs it (Python's ``re`` takes exponential time on ``^(a+)+$``)."""
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(
            sa.update(workflows_table).values(input_schema={"type": "string", "pattern": "^(a+)+$"})
        )
    started = time.monotonic()
    with pytest.raises(wp.InvalidPayloadError, match="does not match"):
        thin.start("echo", "a" * 26 + "!")
    assert time.monotonic() - started < 2
    assert _runs(thin.engine) == 0
    assert thin.status(thin.start("echo", "aaa").execution_id) == "running"


@pytest.mark.parametrize(
    ("schema", "accepted"),
    [(True, True), (False, False), (["x"], True), ("abc", True), (5, True)],
    ids=["true", "false", "list", "string", "number"],
)
def test_a_cataloged_schema_that_is_no_object_is_judged_not_crashed_on(
    runtime: wp.Runtime, thin: wp.Client, schema: Any, accepted: bool
) -> None:
    """``true`` and ``false`` are JSON Schemas (accept all, refuse all); any other
    non-object checks nothing, as a schema that is not JSON Schema does."""
    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(input_schema=schema))
    if accepted:
        assert thin.status(thin.start("echo", 2).execution_id) == "running"
    else:
        with pytest.raises(wp.InvalidPayloadError):
            thin.start("echo", 2)
        assert _runs(thin.engine) == 0


def test_a_client_on_a_host_engine_leaves_the_engine_open(
    db_url: str, make_engine: Callable[..., Engine], runtime: wp.Runtime
) -> None:
    runtime.register(w.echo_wf)
    engine = make_engine(db_url)
    with wp.Client(engine) as thin:
        handle = thin.start("echo", 2)
    with engine.connect() as conn:  # still usable
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    assert runtime.client().result(handle.execution_id, timeout=10).unwrap() == [1, 2]


OPS_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import wf_persist as wp

    client = wp.Client(poll_interval=0.02)
    deadline = time.monotonic() + 60
    while not client.workflows("approval"):  # the worker catalogs it when it starts
        assert time.monotonic() < deadline, "no worker cataloged 'approval'"
        time.sleep(0.05)

    def parked(execution_id):
        while not client.pending_signals(execution_id):
            assert time.monotonic() < deadline, "the run never waited"
            time.sleep(0.02)

    approved = client.start("approval", None)
    parked(approved.execution_id)
    client.signal(approved.execution_id, "approval", {"approved": True}, actor="ops")
    cancelled = client.start("approval", None)
    parked(cancelled.execution_id)
    client.cancel(cancelled.execution_id, compensate=False)
    outcomes = [client.result(h.execution_id, timeout=60) for h in (approved, cancelled)]
    mine = sorted(m for m in sys.modules if m.split(".")[0] == "tests")
    print(json.dumps({
        "outcomes": [[o.status, getattr(o, "value", None), getattr(o, "error_type", None)]
                     for o in outcomes],
        "imported": mine,
    }))
    client.close()
    """
)


def test_an_operations_script_with_only_wf_persist_operates_runs_of_a_worker(
    db_url: str, procs: Processes, tmp_path: Path
) -> None:
    """start by name, signal, cancel and result from a process that has no workflow code,
    against runs a ``wf-persist worker`` process drives."""
    procs.worker(db_url)
    script = tmp_path / "ops.py"
    script.write_text(OPS_SCRIPT)
    finished = procs.run(
        [sys.executable, str(script)],
        env={"WF_PERSIST_DATABASE_URL": db_url},
        name="ops script",
    )
    report = json.loads(finished.stdout)
    assert report["imported"] == []
    assert report["outcomes"] == [["completed", "approved", None], ["failed", None, "Cancelled"]]


def test_runs_of_every_workflow_are_listed_in_pages(runtime: wp.Runtime, thin: wp.Client) -> None:
    runtime.register(w.echo_wf, w.versioned_v1)
    started = [
        thin.start("echo" if i % 2 else "versioned", 2 if i % 2 else "x").execution_id
        for i in range(5)
    ]
    seen: list[str] = []
    cursor = None
    while True:
        page = thin.list(limit=2, cursor=cursor)
        seen += [i.execution_id for i in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == sorted(started) and len(seen) == 5
    items = thin.list().items
    assert [(i.created_at, i.execution_id) for i in items] == sorted(
        (i.created_at, i.execution_id) for i in items
    )
    assert {i.workflow_name for i in thin.list(status="running").items} == {"echo", "versioned"}
    info = thin.describe(started[1])
    assert (info.input, info.result, info.error, info.drive_failures) == (2, None, None, 0)
    with pytest.raises(wp.InvalidArgumentError, match="version filters the runs of one workflow"):
        thin.list(version=1)


def test_filling_missing_schemas_never_erases_a_recorded_one(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    """A process that could make only the output schema fills that one in and leaves the
    input schema another process recorded."""
    from wf_persist.store import catalog

    runtime.register(w.echo_wf)
    with thin.engine.begin() as conn:
        conn.execute(sa.update(workflows_table).values(output_schema=None))
    with runtime.backend.begin() as conn:
        found = catalog.catalog_version(
            conn,
            runtime.backend,
            "echo",
            1,
            w.echo_wf.source_hash,
            runtime.clock(),
            (None, {"type": "array"}),
        )
    assert found == w.echo_wf.source_hash
    [entry] = thin.workflows()
    assert (entry.input_schema, entry.output_schema) == ({"type": "integer"}, {"type": "array"})


def test_a_look_at_a_run_reads_what_a_transaction_reads(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    """A client's look at a run (``result``, ``describe``) takes the backend's quickest read
    (on PostgreSQL straight through the driver): the same row, value for value and type for
    type, as SQLAlchemy's execution in a transaction gives, for every state of a run."""
    from wf_persist.store import executions

    runtime.register(w.echo_wf, w.explode_wf)
    due = thin.start("echo", 2, idempotency_key="k\u00e9y")
    done = runtime.client().start(w.echo_wf, 3)
    failed = runtime.client().start(w.explode_wf, "bo\u2603m")
    assert runtime.drive(done.execution_id) and runtime.drive(failed.execution_id)
    backend = thin.backend
    for handle in (due, done, failed):
        looked = executions.look(backend, handle.execution_id)
        with backend.read() as conn:
            read = executions.get(conn, handle.execution_id)
        assert looked is not None and read is not None
        assert looked._asdict() == read._asdict()
        assert [type(v) for v in looked] == [type(v) for v in read]
        assert looked.created_at.tzinfo is dt.UTC
    first = executions.look(backend, due.execution_id)
    assert first is not None and first.due and first.status == "running"
    assert executions.look(backend, "00000000-0000-0000-0000-000000000000") is None
    info = thin.describe(failed.execution_id)
    assert info.status == "failed" and "bo\u2603m" in json.dumps(info.error, ensure_ascii=False)
    assert thin.describe(due.execution_id).idempotency_key == "k\u00e9y"
    assert thin.result(done.execution_id, timeout=5).unwrap() == [1, 2, 3]
    with pytest.raises(wp.UnknownExecutionError):
        thin.describe("00000000-0000-0000-0000-000000000000")


class _Level(enum.IntEnum):
    HIGH = 2


@pytest.mark.timeout(60)
def test_an_int_enum_payload_is_stored_as_its_number_not_checked_forever(
    runtime: wp.Runtime, thin: wp.Client
) -> None:
    """An ``int`` subclass was checked against the 64-bit range by ``in range(...)``, which
    for anything but an exact ``int`` walks the whole range: the start never returned."""
    runtime.register(w.echo_wf)
    handle = thin.start("echo", _Level.HIGH)
    with thin.engine.connect() as conn:
        stored = conn.execute(
            sa.select(executions_table.c.input).where(executions_table.c.id == handle.execution_id)
        ).scalar_one()
    assert stored == 2
    with pytest.raises(wp.NotSerializableError, match="64 bits"):
        thin.start("echo", _Big.HUGE)


class _Big(enum.IntEnum):
    HUGE = 2**64
