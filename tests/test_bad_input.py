"""Bad input, at every entry point and on every backend: one clear typed error, nothing
half-written, no raw driver exception, no silent truncation, no endless retry.

Errors raised before a run exists (``start``, ``signal``, the client's arguments, definitions)
must leave every table as it was. Errors raised inside a running workflow must fail the run
once, with the typed error recorded, never as a drive failure that is retried.

The tests of this module share one runtime per backend (the ``runtime``, ``client`` and
``tables`` fixtures below), on a database of its own: "nothing written" is checked by
comparing table counts before and after, never by absolute counts.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import pickle
import subprocess
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field, field_validator

import wf_persist as wp
from wf_persist import cli, migrate
from wf_persist.models import executions_table, history_table, workflows_table

from .conftest import create_database, drop_database, server_url
from .helpers import wait_status

ROOT = Path(__file__).resolve().parent.parent

# -- workflows ----------------------------------------------------------------------------

#: Values a test hands to a workflow by key: a bad value cannot travel as the run's input
#: (``start`` refuses it), so the body looks it up in this process.
BAD: dict[str, Any] = {}
CALLS: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    BAD.clear()
    CALLS.clear()
    yield
    BAD.clear()


class Reading(BaseModel):
    value: float


class Count(BaseModel):
    n: int


class Unlucky(BaseModel):
    """A model whose validator raises what pydantic passes on as it is (not a ValueError)."""

    n: int

    @field_validator("n")
    @classmethod
    def _not_13(cls, n: int) -> int:
        if n == 13:
            raise KeyError("unlucky")
        return n


@dataclass
class Point:
    x: float
    y: float


@wp.step
def keep(value: Any) -> Any:
    CALLS["keep"] += 1
    return value


@wp.step(retry=wp.Retry(attempts=3, base=0.01))  # a result refused is not retried
def produce(key: str) -> Any:
    CALLS["produce"] += 1
    return BAD[key]


@wp.step
def needs_one(a: int) -> int:
    return a


@wp.step(name="keep")
def other_keep(value: Any) -> Any:
    CALLS["other_keep"] += 1
    return value


@wp.step
def inner(x: int) -> int:
    CALLS["inner"] += 1
    return x + 1


@wp.step
def outer(x: int) -> int:
    return inner(x) * 10  # a step calling a step directly: plain code, no workflow involved


def plain(x: int) -> int:
    CALLS["plain"] += 1
    return x


@wp.workflow(name="bad-any", version=1)
def any_wf(ctx: wp.Context, value: Any) -> Any:
    return value


class Mute(Exception):
    """An error whose text cannot be had."""

    def __str__(self) -> str:
        raise RuntimeError("no text")


@wp.step
def fail_with(kind: str) -> None:
    raise Mute() if kind == "mute" else ValueError(10**5000)


@wp.workflow(name="bad-error-text", version=1)
def error_text_wf(ctx: wp.Context, kind: str) -> str:
    try:
        ctx.run(fail_with, kind)
    except wp.StepExecutionError as exc:
        return str(exc.cause["message"])
    return "not failed"


@wp.workflow(name="bad-reading", version=1)
def reading_wf(ctx: wp.Context, reading: Reading) -> float:
    return reading.value


@wp.workflow(name="bad-step-arg", version=1)
def step_arg_wf(ctx: wp.Context, key: str) -> Any:
    return ctx.run(keep, BAD[key])


@wp.workflow(name="bad-step-result", version=1)
def step_result_wf(ctx: wp.Context, key: str) -> Any:
    return ctx.run(produce, key)


@wp.workflow(name="bad-output", version=1)
def output_wf(ctx: wp.Context, key: str) -> Any:
    return BAD[key]


@wp.workflow(name="bad-code-result", version=1)
def code_wf(ctx: wp.Context, key: str) -> Any:
    return ctx.code("make", lambda: BAD[key])


#: Payload types a signal wait may declare, by name (the run's input names one).
SIGNAL_TYPES: dict[str, Any] = {
    "any": Any,
    "Reading": Reading,
    "Count": Count,
    "Point": Point,
    "bytes": bytes,
    "Unlucky": Unlucky,
    "object": object,
}


@wp.workflow(name="bad-signal", version=1)
def signal_wf(ctx: wp.Context, kind: str) -> Any:
    got = ctx.wait_for_signal("go", SIGNAL_TYPES[kind])
    assert isinstance(got, wp.Received)
    return {"got": str(got.value)}


@wp.workflow(name="bad-round-trip", version=1)
def round_trip_wf(ctx: wp.Context, value: int) -> dict[str, int]:
    step = ctx.run(keep, value)
    code = ctx.code("same", lambda: value, output=int)
    got = ctx.wait_for_signal("value", int)
    assert isinstance(got, wp.Received)
    return {"input": value, "step": step, "code": code, "signal": got.value}


@wp.workflow(name="bad-bytes", version=1)
def bytes_wf(ctx: wp.Context, data: bytes) -> dict[str, Any]:
    untyped = ctx.run(keep, data)
    return {"typed": data.decode(), "untyped": untyped, "kind": type(untyped).__name__}


@wp.workflow(name="bad-call-name", version=1)
def call_name_wf(ctx: wp.Context, spec: dict[str, str]) -> None:
    name = BAD[spec["key"]]
    kind = spec["kind"]
    if kind == "signal":
        ctx.wait_for_signal(name)
    elif kind == "sleep":
        ctx.sleep(0, name=name)
    elif kind == "code":
        ctx.code(name, lambda: 1)
    elif kind == "all":
        ctx.all([wp.call(keep, 1)], name=name)
    CALLS["after"] += 1


@wp.workflow(name="bad-duration", version=1)
def duration_wf(ctx: wp.Context, spec: dict[str, str]) -> None:
    value = BAD[spec["key"]]
    if spec["kind"] == "sleep":
        ctx.sleep(value)
    else:
        ctx.wait_for_signal("go", timeout=value)
    CALLS["after"] += 1


@wp.workflow(name="bad-misuse", version=1)
def misuse_wf(ctx: wp.Context, how: str) -> str:
    if how == "plain":
        ctx.run(plain, 1)  # type: ignore[arg-type]
    elif how == "caught-plain":
        try:
            ctx.run(plain, 1)  # type: ignore[arg-type]
        except wp.WorkflowDefinitionError as exc:
            return f"caught {type(exc).__name__}: {exc}"
    elif how == "arity":
        ctx.run(needs_one, 1, 2)
    elif how == "unknown-keyword":
        ctx.run(needs_one, b=1)
    elif how == "all-not-a-call":
        ctx.all([keep])  # type: ignore[list-item]
    elif how == "all-plain":
        ctx.all([wp.call(plain, 1)])  # type: ignore[arg-type]
    elif how == "all-none":
        ctx.all(None)  # type: ignore[arg-type]
    elif how == "direct":
        keep(1)
    elif how == "two-steps-one-name":
        ctx.run(keep, 1)
        ctx.run(other_keep, 2)
    elif how == "same-step-twice":
        return f"{ctx.run(keep, 1)} {ctx.run(keep, 2)} {ctx.run(outer, 1)}"
    elif how == "fail-not-an-exception":
        ctx.fail("out of stock")  # type: ignore[arg-type]
    elif how == "fail-a-class":
        ctx.fail(LookupError)
    CALLS["after"] += 1
    return "done"


@wp.workflow(name="bad-misuse-async", version=1)
async def misuse_async_wf(ctx: wp.AsyncContext, how: str) -> str:
    ctx.fail(how)  # type: ignore[arg-type]


@wp.workflow(name="bad-size", version=1)
def size_wf(ctx: wp.Context, spec: dict[str, Any]) -> Any:
    big = "x" * int(spec["size"])
    where = spec["where"]
    if where == "step-result":
        return len(ctx.run(keep_big, spec["size"]))
    if where == "step-arg":
        return ctx.run(keep, big)
    if where == "step-echo":
        return len(ctx.run(keep, big))
    if where == "code":
        return ctx.code("big", lambda: big)
    if where == "output-list":
        return [big]
    return big  # the workflow's output


@wp.step
def keep_big(size: int) -> str:
    CALLS["keep_big"] += 1
    return "x" * size


@wp.workflow(name="bad-never-registered", version=1)
def never_registered_wf(ctx: wp.Context, value: Any) -> Any:
    return value


class Measured(Exception):
    """An error whose argument and field JSON cannot hold."""

    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.value = value


@wp.step
def measure() -> None:
    raise Measured(float("nan"))


@wp.workflow(name="bad-error-fields", version=1)
def error_fields_wf(ctx: wp.Context) -> None:
    ctx.run(measure)


class Opaque:
    """A class pydantic cannot validate."""


@wp.workflow(name="bad-payload-type", version=1)
def payload_type_wf(ctx: wp.Context, kind: str) -> None:
    if kind == "signal":
        ctx.wait_for_signal("go", Opaque)
    else:
        ctx.code("make", Opaque, output=Opaque)
    CALLS["after"] += 1


LONG = "n" * 200


@wp.step(name=LONG)
def long_named_step(x: int) -> int:
    return x * 2


@wp.workflow(name=LONG, version=1)
def long_named_wf(ctx: wp.Context, x: int) -> int:
    ctx.sleep(0, name=LONG)
    code = ctx.code(LONG, lambda: x, output=int)
    got = ctx.wait_for_signal(LONG, int)
    assert isinstance(got, wp.Received)
    (doubled,) = ctx.all([wp.call(long_named_step, code)], name=LONG)
    return int(doubled) + got.value


# -- helpers ------------------------------------------------------------------------------


class Tables:
    """Reads wf_persist's tables directly (not through the library under test)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {
                t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in (workflows_table, executions_table, history_table)
            }

    def run(self, execution_id: str) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(
                sa.select(executions_table).where(executions_table.c.id == execution_id)
            ).one()

    def scalar(self, sql: str) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()


@pytest.fixture(scope="module")
def shared_url(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database for this module alone (other modules empty theirs per test)."""
    if backend == "sqlite":
        path = tmp_path_factory.mktemp("bad_input") / "wf.sqlite3"
        url = f"sqlite:///{path}"
        migrate.upgrade(url)
        yield url
        return
    name = create_database(backend)
    url = server_url(backend, name)
    migrate.upgrade(url)
    yield url
    drop_database(backend, name)


@pytest.fixture(scope="module")
def runtime(shared_url: str) -> Iterator[wp.Runtime]:
    with wp.Runtime(shared_url) as shared:
        yield shared


@pytest.fixture
def client(runtime: wp.Runtime) -> wp.WorkflowClient:
    return runtime.client()


@pytest.fixture(scope="module")
def tables(shared_url: str) -> Iterator[Tables]:
    found = Tables(shared_url)
    yield found
    found.engine.dispose()


def types_of(client: wp.WorkflowClient, execution_id: str) -> list[str]:
    return [r.event["type"] for r in client.history(execution_id)]


def failed_once(client: wp.WorkflowClient, tables: Tables, execution_id: str) -> wp.Failed:
    """The run failed on its first drive, its error recorded, with no drive failure."""
    outcome = client.result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed), outcome
    kinds = types_of(client, execution_id)
    assert kinds.count("workflow.failed") == 1 and kinds.count("workflow.started") == 1
    assert "drive.failed" not in kinds
    row = tables.run(execution_id)
    assert row.status == "failed" and row.drive_failures == 0
    assert row.error == outcome.error
    return outcome


def suspended(client: wp.WorkflowClient, execution_id: str) -> None:
    """Drive a new run until it parks."""
    assert client.runtime.drive(execution_id)
    assert client.status(execution_id) == "suspended"


# -- 1. in-memory SQLite URLs -------------------------------------------------------------


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_sqlite_urls_work_end_to_end(url: str) -> None:
    first = wp.Runtime(url)
    second = wp.Runtime(url)
    paths = [Path(rt.engine.url.database or "") for rt in (first, second)]
    try:
        assert all(p.is_file() for p in paths) and paths[0] != paths[1]
        client = first.client()
        BAD["k"] = 7
        handle = client.start(step_arg_wf, "k")
        assert client.result(handle.execution_id, timeout=10).unwrap() == 7
        assert types_of(client, handle.execution_id)[-1] == "workflow.completed"
        first.start_worker(concurrency=2, poll_interval=0.02)
        by_worker = client.start(any_wf, {"a": 1})
        wait_status(client, by_worker.execution_id, "completed", timeout=10)
        assert client.result(by_worker.execution_id).unwrap() == {"a": 1}
        # The second runtime has a database of its own.
        other = second.client()
        assert other.list(step_arg_wf).items == [] and other.list(any_wf).items == []
        with pytest.raises(wp.UnknownExecutionError):
            other.status(handle.execution_id)
    finally:
        first.close()
        second.close()
    for path in paths:
        assert not path.exists() and not path.parent.exists(), "the private file is removed"


# -- 2. unsupported databases -------------------------------------------------------------

#: URLs of a supported database that no engine can be made for: an unknown driver (SQLAlchemy's
#: NoSuchModuleError), a MySQL charset PyMySQL does not know (an AttributeError at connect)
#: or one narrower than utf8mb4. Each printed a whole traceback from every command.
UNUSABLE = [
    ("postgresql+nodriver://user:pw@127.0.0.1/db", "no SQLAlchemy driver"),
    ("mysql+pymysql://root@127.0.0.1:3306/test?charset=bogus", "utf8mb4"),
    ("mysql+pymysql://root@127.0.0.1:3306/test?charset=latin1", "utf8mb4"),
]


@pytest.mark.parametrize(("url", "said"), UNUSABLE)
@pytest.mark.parametrize("command", [["runs", "list"], ["workflows"], ["db", "upgrade"]])
def test_cli_refuses_an_unusable_url_in_one_line(
    url: str,
    said: str,
    command: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr(sys, "argv", ["wf-persist", *command, "--url", url])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert "pw" not in lines[0]
    for open_it in (wp.Runtime, wp.Client, wp.create_engine):
        with pytest.raises(wp.UnsupportedDatabaseError, match=said):
            open_it(url)


UNSUPPORTED = ["oracle://x", "foo://", "not a url", "mssql+pyodbc://user@host/db?driver=x"]


@pytest.mark.parametrize("url", UNSUPPORTED)
def test_unsupported_urls_are_refused_everywhere(url: str) -> None:
    for open_it in (wp.Runtime, wp.create_engine, migrate.upgrade):
        with pytest.raises(wp.UnsupportedDatabaseError) as info:
            open_it(url)
        assert "not supported" in str(info.value) or "not a database URL" in str(info.value)


@pytest.mark.parametrize("url", UNSUPPORTED)
def test_cli_refuses_unsupported_urls_in_one_line(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal must not wrap the line
    monkeypatch.setattr(sys, "argv", ["wf-persist", "db", "upgrade", "--url", url])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "not supported" in lines[0] or "not a database URL" in lines[0]


def test_cli_process_refuses_an_unsupported_url_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "wf_persist.cli", "db", "upgrade", "--url", "oracle://x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "40"},
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: the oracle database is not supported (SQLite, PostgreSQL, MySQL/MariaDB are)"
    ]


def test_host_engine_of_an_unsupported_dialect_is_refused() -> None:
    class FakeDBAPI(types.ModuleType):
        paramstyle = "pyformat"
        apilevel = "2.0"
        threadsafety = 1

        class Error(Exception):
            pass

    engine = sa.create_engine("mssql+pymssql://user@host/db", module=FakeDBAPI("fake"))
    with pytest.raises(wp.UnsupportedDatabaseError, match="mssql database is not supported"):
        wp.Runtime(engine)


# -- 3-6. values a database cannot store exactly ------------------------------------------

NAN = "NaN or an infinity"
WIDE = "does not fit 64 bits"
NUL = "NUL character"
SURROGATE = "lone surrogate"
BYTES = "can't decode byte 0xff"
DEEP = "nested more than 29 levels"
LOST = "both written as the JSON key"


def nested(levels: int) -> Any:
    """``[[...[1]...]]``: ``levels`` lists, one inside the other."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


#: id -> (value, what the error says)
UNSTORABLE: dict[str, tuple[Any, str]] = {
    "nan": (float("nan"), NAN),
    "inf": (float("inf"), NAN),
    "-inf": (float("-inf"), NAN),
    "nan-nested": ({"a": [1.5, float("nan")]}, NAN),
    "nan-in-model": (Reading(value=float("nan")), NAN),
    "inf-in-dataclass": (Point(1.0, float("-inf")), NAN),
    "2**63": (2**63, WIDE),
    "-2**63-1": (-(2**63) - 1, WIDE),
    "2**70": (2**70, WIDE),
    "2**70-in-model": (Count(n=2**70), WIDE),
    # More digits than Python turns into text: the message must still be had.
    "10**5000": (10**5000, WIDE),
    "10**5000-in-list": ([1, 10**5000], WIDE),
    "invalid-utf8-bytes": (b"\xff", BYTES),
    "nul": ("a\x00b", NUL),
    "surrogate": ("x\ud800", SURROGATE),
    "nul-in-key": ({"a\x00": 1}, NUL),
    # MariaDB keeps JSON up to 31 levels; pydantic serializes up to 254
    "nested-30": (nested(30), DEEP),
    "nested-in-dict-30": ({"a": nested(29)}, DEEP),
    "nested-300": (nested(300), DEEP),
    # JSON keys are text: one of two keys written alike would be dropped, silently.
    "int-and-text-key": ({1: "a", "1": "b"}, LOST),
    "bool-and-text-key": ({"true": 2, True: 1}, LOST),
    "colliding-keys-nested": ([{"x": {2: 0, "2": 1}}], LOST),
}
unstorable = pytest.mark.parametrize("value,says", UNSTORABLE.values(), ids=list(UNSTORABLE))


@unstorable
def test_unstorable_workflow_input_is_refused_by_start(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    before = tables.counts()
    with pytest.raises(wp.NotSerializableError, match=says) as info:
        client.start(any_wf, value, idempotency_key="k", actor="ann")
    assert info.value.what == "input of workflow bad-any"
    assert tables.counts() == before, "no run, no history, no catalog row"


def test_values_nested_29_levels_deep_are_stored_everywhere(
    client: wp.WorkflowClient,
) -> None:
    BAD["k"] = nested(29)
    for wf in (step_arg_wf, step_result_wf, output_wf):
        handle = client.start(wf, "k")
        assert client.result(handle.execution_id, timeout=30).unwrap() == nested(29)
        assert "drive.failed" not in types_of(client, handle.execution_id)
    handle = client.start(any_wf, nested(29))
    assert client.result(handle.execution_id, timeout=30).unwrap() == nested(29)


def test_bad_input_to_an_unregistered_workflow_catalogs_nothing(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    before = tables.counts()
    for value in (float("nan"), 2**64, "a\x00b"):
        with pytest.raises(wp.NotSerializableError):
            client.start(never_registered_wf, value)
    assert tables.counts() == before, "not even a catalog row"
    client.start(never_registered_wf, 1)
    after = tables.counts()
    assert after["wf_workflows"] == before["wf_workflows"] + 1
    assert after["wf_executions"] == before["wf_executions"] + 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "-Infinity"])
def test_non_finite_float_in_a_typed_input_is_refused(
    client: wp.WorkflowClient, tables: Tables, value: Any
) -> None:
    before = tables.counts()
    with pytest.raises(wp.NotSerializableError, match=NAN):
        client.start(reading_wf, {"value": value})
    assert tables.counts() == before


@unstorable
def test_unstorable_step_argument_fails_the_run_at_the_call(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    BAD["k"] = value
    handle = client.start(step_arg_wf, "k")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "NotSerializableError" and says in outcome.message
    assert "argument 'value' of step keep" in outcome.message
    assert CALLS["keep"] == 0
    assert not any(t.startswith("step.") for t in types_of(client, handle.execution_id))


@unstorable
def test_unstorable_step_result_fails_the_step_once(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    BAD["k"] = value
    handle = client.start(step_result_wf, "k")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "StepExecutionError"
    assert outcome.error["cause"]["name"] == "NotSerializableError"
    assert says in outcome.error["cause"]["message"]
    assert CALLS["produce"] == 1, "ran once, not retried in a loop"
    step_events = [
        r.event for r in client.history(handle.execution_id) if r.event["type"].startswith("step.")
    ]
    assert [e["type"] for e in step_events] == ["step.started", "step.failed"]
    assert step_events[1]["final"] is True
    assert step_events[1]["error"]["name"] == "NotSerializableError"


@unstorable
def test_unstorable_workflow_output_fails_the_run(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    BAD["k"] = value
    handle = client.start(output_wf, "k")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "NotSerializableError" and says in outcome.message
    assert "output of workflow bad-output" in outcome.message
    assert tables.run(handle.execution_id).result is None


@unstorable
def test_unstorable_code_result_fails_the_code_block(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    BAD["k"] = value
    handle = client.start(code_wf, "k")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "CodeExecutionError"
    assert outcome.error["cause"]["name"] == "NotSerializableError"
    assert says in outcome.error["cause"]["message"]
    assert "code.failed" in types_of(client, handle.execution_id)


def _signal_kind(value: Any) -> str:
    name = type(value).__name__
    return name if name in SIGNAL_TYPES else "any"


@unstorable
def test_unstorable_signal_payload_is_refused_and_the_run_keeps_waiting(
    client: wp.WorkflowClient, tables: Tables, value: Any, says: str
) -> None:
    kind = _signal_kind(value)
    handle = client.start(signal_wf, kind)
    suspended(client, handle.execution_id)
    before = tables.counts()
    with pytest.raises(wp.SignalPayloadError, match=says) as info:
        client.signal(handle.execution_id, "go", value, actor="ann")
    assert info.value.signal_name == "go"
    assert tables.counts() == before, "nothing recorded"
    assert client.status(handle.execution_id) == "suspended"
    good = {"any": 1, "Reading": Reading(value=1.5), "Count": Count(n=2), "Point": Point(1, 2)}
    client.signal(handle.execution_id, "go", good.get(kind, b"ok"))
    assert isinstance(client.result(handle.execution_id, timeout=10), wp.Completed)


@pytest.mark.parametrize(
    "value", [{1, 2}, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), {"when": {3}}], ids=repr
)
def test_a_wait_typed_object_takes_what_a_buffered_signal_may_carry(
    client: wp.WorkflowClient, tables: Tables, value: Any
) -> None:
    """A wait typed ``object`` is an untyped one: a payload JSON cannot hold (a set, a
    datetime) was written by pydantic (a set as a list) and delivered to such a wait, while
    the same signal buffered before the wait was refused; both are refused now, nothing
    written, and plain JSON is taken either way."""
    waiting = client.start(signal_wf, "object")
    suspended(client, waiting.execution_id)
    early = client.start(signal_wf, "object")  # not driven yet: no wait recorded
    before = tables.counts()
    for execution_id, buffer in ((waiting.execution_id, False), (early.execution_id, True)):
        with pytest.raises(wp.SignalPayloadError) as info:
            client.signal(execution_id, "go", value, buffer=buffer)
        assert info.value.signal_name == "go"
    assert tables.counts() == before, "nothing recorded"
    assert client.signal(waiting.execution_id, "go", [1, 2]) == "delivered"
    assert client.signal(early.execution_id, "go", [1, 2], buffer=True) == "buffered"
    assert client.runtime.drive(early.execution_id)
    for handle in (waiting, early):
        assert client.result(handle.execution_id, timeout=10).unwrap() == {"got": "[1, 2]"}


@wp.workflow(name="bad-unlucky", version=1)
def unlucky_wf(ctx: wp.Context, unlucky: Unlucky) -> int:
    return unlucky.n


def test_a_validator_raising_any_exception_is_a_typed_payload_error(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    """A validator of the caller's own that raised KeyError (pydantic passes on what is
    not a ValueError or AssertionError) escaped start and signal raw; nothing is written
    either way, and the run keeps waiting for a good signal."""
    before = tables.counts()
    with pytest.raises(wp.InvalidPayloadError, match="validating it raised KeyError") as info:
        client.start(unlucky_wf, {"n": 13})
    assert isinstance(info.value.__cause__, KeyError)
    assert tables.counts() == before, "nothing written, not even a catalog row"
    handle = client.start(signal_wf, "Unlucky")
    suspended(client, handle.execution_id)
    before = tables.counts()
    for buffer in (False, True):
        with pytest.raises(wp.SignalPayloadError, match="validating it raised KeyError"):
            client.signal(handle.execution_id, "go", {"n": 13}, buffer=buffer)
    assert tables.counts() == before, "nothing recorded"
    client.signal(handle.execution_id, "go", {"n": 1})
    assert client.result(handle.execution_id, timeout=10).unwrap() == {"got": "n=1"}


@pytest.mark.parametrize("value", [2**63 - 1, -(2**63)], ids=["2**63-1", "-2**63"])
def test_64_bit_extremes_round_trip_exactly(
    client: wp.WorkflowClient, tables: Tables, value: int
) -> None:
    handle = client.start(round_trip_wf, value)
    suspended(client, handle.execution_id)
    client.signal(handle.execution_id, "value", value)
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Completed)
    expected = {"input": value, "step": value, "code": value, "signal": value}
    assert outcome.value == expected
    assert all(type(v) is int for v in outcome.value.values())
    events = {r.event["type"]: r.event for r in client.history(handle.execution_id)}
    recorded = [
        events["execution.started"]["payload"],
        events["step.completed"]["result"],
        events["code.completed"]["result"],
        events["signal.delivered"]["payload"],
        events["signal.received"]["payload"],
        *events["workflow.completed"]["result"].values(),
    ]
    assert recorded == [value] * 9 and all(type(v) is int for v in recorded)
    row = tables.run(handle.execution_id)
    assert row.input == value and type(row.input) is int
    assert row.result == expected


def test_valid_utf8_bytes_are_stored_as_their_text(client: wp.WorkflowClient) -> None:
    """Bytes are stored as their UTF-8 text (pydantic's JSON form): a ``bytes`` parameter
    gets bytes back, an untyped one gets the text."""
    handle = client.start(bytes_wf, "héllo".encode())
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Completed)
    assert outcome.value == {"typed": "héllo", "untyped": "héllo", "kind": "str"}
    assert client.history(handle.execution_id)[0].event["payload"] == "héllo"


def test_an_error_carrying_nan_is_recorded_without_it(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    handle = client.start(error_fields_wf)
    outcome = failed_once(client, tables, handle.execution_id)
    cause = outcome.error["cause"]
    assert cause["name"] == "Measured" and cause["args"] == ["nan"]
    assert "value" not in cause, "a field JSON cannot hold is left out"


def test_a_type_pydantic_cannot_validate_is_a_definition_error(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    def takes(ctx: wp.Context, x: Opaque) -> None:
        return None

    with pytest.raises(wp.WorkflowDefinitionError, match="cannot validate values of type"):
        wp.step(takes)
    with pytest.raises(wp.WorkflowDefinitionError, match="cannot validate values of type"):
        wp.workflow(name="x")(takes)
    for kind in ("signal", "code"):
        handle = client.start(payload_type_wf, kind)
        outcome = failed_once(client, tables, handle.execution_id)
        assert outcome.error_type == "WorkflowDefinitionError"
        assert "cannot validate values of type" in outcome.message
    assert CALLS["after"] == 0


# -- 6. text a database rejects, in names and keys ----------------------------------------

REJECTED_TEXT = pytest.mark.parametrize("text", ["a\x00b", "a\ud800b"], ids=["nul", "surrogate"])


@REJECTED_TEXT
def test_rejected_text_in_client_arguments(
    client: wp.WorkflowClient, tables: Tables, text: str
) -> None:
    handle = client.start(signal_wf, "any")
    suspended(client, handle.execution_id)
    before = tables.counts()
    calls: list[Callable[[], object]] = [
        lambda: client.start(any_wf, 1, actor=text),
        lambda: client.start(any_wf, 1, idempotency_key=text),
        lambda: client.signal(handle.execution_id, text, 1),
        lambda: client.signal(handle.execution_id, "go", 1, actor=text),
        lambda: client.cancel(handle.execution_id, actor=text),
        lambda: client.status(text),
        lambda: client.history(text),
        lambda: client.result(text),
        lambda: client.pending_signals(text),
        lambda: client.list(any_wf, actor=text),
        lambda: client.list(text),
    ]
    for call in calls:
        with pytest.raises(wp.InvalidArgumentError, match="NUL or invalid UTF-8"):
            call()
    assert tables.counts() == before
    assert client.status(handle.execution_id) == "suspended"


@REJECTED_TEXT
def test_rejected_text_in_definition_names(text: str) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="workflow name"):
        wp.workflow(name=text)
    with pytest.raises(wp.WorkflowDefinitionError, match="step name"):
        wp.step(name=text)(plain)


@REJECTED_TEXT
@pytest.mark.parametrize("kind", ["signal", "sleep", "code", "all"])
def test_rejected_text_in_call_names_fails_the_run(
    client: wp.WorkflowClient, tables: Tables, text: str, kind: str
) -> None:
    BAD["name"] = text
    handle = client.start(call_name_wf, {"key": "name", "kind": kind})
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "InvalidArgumentError"
    assert "NUL or invalid UTF-8" in outcome.message
    assert CALLS["after"] == 0 and CALLS["keep"] == 0
    assert types_of(client, handle.execution_id) == [
        "execution.started",
        "workflow.started",
        "workflow.failed",
    ]


# -- 7. execution ids ---------------------------------------------------------------------


def test_malformed_execution_ids_are_invalid_arguments(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    before = tables.counts()
    calls: list[Callable[[], object]] = [
        lambda: client.status(123),  # type: ignore[arg-type]
        lambda: client.describe(None),  # type: ignore[arg-type]
        lambda: client.history(b"x"),  # type: ignore[arg-type]
        lambda: client.cancel(123),  # type: ignore[arg-type]
        lambda: client.signal(123, "x", 1),  # type: ignore[arg-type]
        lambda: client.result(123),  # type: ignore[arg-type]
        lambda: client.pending_signals(object()),  # type: ignore[arg-type]
        lambda: client.status(""),
    ]
    long_id = "x" * 10_000
    for method in ("status", "describe", "history", "cancel", "result", "pending_signals"):
        calls.append(lambda m=method: getattr(client, m)(long_id))  # type: ignore[misc]
    calls.append(lambda: client.signal(long_id, "x", 1))
    for call in calls:
        with pytest.raises(wp.InvalidArgumentError, match="execution id"):
            call()
    assert tables.counts() == before


def test_unknown_well_formed_id_is_unknown_everywhere(client: wp.WorkflowClient) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    calls: list[Callable[[], object]] = [
        lambda: client.status(missing),
        lambda: client.describe(missing),
        lambda: client.history(missing),
        lambda: client.cancel(missing),
        lambda: client.signal(missing, "x", 1),
        lambda: client.result(missing),
        lambda: client.pending_signals(missing),
    ]
    for call in calls:
        with pytest.raises(wp.UnknownExecutionError, match=missing):
            call()


def test_another_spelling_of_an_id_is_unknown_everywhere(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    """An id in upper case names no run on any backend (MySQL/MariaDB's default collation,
    which ids keep, found the run by it, and a cancel recorded history under that
    spelling); nothing is written."""
    handle = client.start(signal_wf, "any")
    suspended(client, handle.execution_id)
    other = handle.execution_id.upper()
    before = tables.counts()
    thin = wp.Client(client.runtime.engine)
    calls: list[Callable[[], object]] = [
        lambda: client.status(other),
        lambda: client.describe(other),
        lambda: client.history(other),
        lambda: client.pending_signals(other),
        lambda: client.outcome(other),
        lambda: client.result(other, timeout=0),
        lambda: client.get_event(other, "progress", timeout=0),
        lambda: client.signal(other, "go", 1),
        lambda: client.signal(other, "go", 1, buffer=True),
        lambda: client.cancel(other),
        lambda: thin.status(other),
        lambda: thin.result(other, timeout=0),
        lambda: thin.cancel(other),
    ]
    for call in calls:
        with pytest.raises(wp.UnknownExecutionError):
            call()
    assert tables.counts() == before
    assert client.status(handle.execution_id) == "suspended"


# -- 8, 10, 12. misuse of ctx -------------------------------------------------------------

MISUSE = {
    "plain": ("WorkflowDefinitionError", "needs a step declared with @wp.step"),
    "arity": ("InvalidPayloadError", "arguments of step needs_one"),
    "unknown-keyword": ("InvalidPayloadError", "arguments of step needs_one"),
    "all-not-a-call": ("WorkflowDefinitionError", "wp.call(step, ...)"),
    "all-plain": ("WorkflowDefinitionError", "needs a step declared with @wp.step"),
    "all-none": ("WorkflowDefinitionError", "ctx.all takes"),
    "direct": ("WorkflowDefinitionError", "use ctx.run(keep, ...)"),
    "two-steps-one-name": ("WorkflowDefinitionError", "two different steps are named 'keep'"),
    # Python's own TypeError ("exceptions must derive from BaseException") failed the run.
    "fail-not-an-exception": ("WorkflowDefinitionError", "ctx.fail() takes an exception, got str"),
}


@pytest.mark.parametrize("how", list(MISUSE))
def test_misused_ctx_fails_the_run_with_a_typed_error(
    client: wp.WorkflowClient, tables: Tables, how: str
) -> None:
    error_type, says = MISUSE[how]
    handle = client.start(misuse_wf, how)
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == error_type and says in outcome.message
    assert outcome.error["module"] == "wf_persist.errors"
    assert CALLS["after"] == 0 and CALLS["plain"] == 0 and CALLS["other_keep"] == 0
    assert CALLS["keep"] == (1 if how == "two-steps-one-name" else 0)


def test_an_async_bodys_ctx_fail_of_a_non_exception_is_a_definition_error(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    handle = client.start(misuse_async_wf, "out of stock")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "WorkflowDefinitionError"
    assert outcome.message == "ctx.fail() takes an exception, got str 'out of stock'"


def test_ctx_fail_of_an_exception_class_fails_the_run_with_it(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    """As ``raise`` takes a class (made with no arguments): not a definition error."""
    handle = client.start(misuse_wf, "fail-a-class")
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "LookupError" and outcome.matches(LookupError)


def test_a_non_step_is_refused_at_the_call_site(client: wp.WorkflowClient) -> None:
    handle = client.start(misuse_wf, "caught-plain")
    message = client.result(handle.execution_id, timeout=10).unwrap()
    assert message.startswith("caught WorkflowDefinitionError: ctx.run needs a step")
    assert CALLS["plain"] == 0


def test_steps_reused_and_called_directly_outside_a_body_still_work(
    client: wp.WorkflowClient,
) -> None:
    assert keep(5) == 5 and outer(1) == 20  # unit tests of steps call them directly
    handle = client.start(misuse_wf, "same-step-twice")
    assert client.result(handle.execution_id, timeout=10).unwrap() == "1 2 20"
    assert CALLS["inner"] == 2


# -- 9, 11. definitions -------------------------------------------------------------------


def _generator_fn(ctx: wp.Context) -> Iterator[int]:
    yield 1


async def _async_generator_fn(ctx: wp.Context) -> Any:
    yield 1


@pytest.mark.parametrize("fn", [_generator_fn, _async_generator_fn])
def test_generator_functions_are_refused_at_decoration(
    fn: Callable[..., Any],
) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="workflow"):
        wp.workflow(name="x")(fn)
    with pytest.raises(wp.WorkflowDefinitionError, match="step"):
        wp.step(fn)
    with pytest.raises(wp.WorkflowDefinitionError, match="compensation"):
        wp.step(compensate=fn)(plain)


def test_a_step_as_a_compensation_is_refused_at_decoration() -> None:
    """A ``@wp.step`` given as ``compensate=`` was called as a plain function during the
    unwind: its limit (and retries, timeout) silently did not apply, and four unwinds ran
    a ``Limit(1)`` undo at once."""
    limited = wp.step(concurrency=wp.Limit(1), name="limited_undo")(plain)
    with pytest.raises(wp.WorkflowDefinitionError, match=r"limited_undo\.fn"):
        wp.step(compensate=limited, name="does")(plain)
    assert wp.step(compensate=limited.fn, name="does")(plain).compensate is plain


@pytest.mark.parametrize(
    "name,says",
    [
        ("", "non-empty string"),
        (123, "non-empty string"),
        (b"x", "non-empty string"),
        ("w" * 201, "201 characters; at most 200"),
    ],
    ids=["empty", "int", "bytes", "too-long"],
)
def test_bad_definition_names(name: Any, says: str) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match=says):
        wp.workflow(name=name)
    with pytest.raises(wp.WorkflowDefinitionError, match=says):
        wp.step(name=name)(plain)


@pytest.mark.parametrize("version", [0, -1, True, 2**40, 1.5, "1"])
def test_bad_workflow_versions(version: Any) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="version"):
        wp.workflow(name="x", version=version)


@pytest.mark.parametrize("kind", ["signal", "sleep", "code", "all"])
@pytest.mark.parametrize("name", ["c" * 201, 123, ""], ids=["too-long", "int", "empty"])
def test_bad_call_names_fail_the_run(
    client: wp.WorkflowClient, tables: Tables, kind: str, name: Any
) -> None:
    BAD["name"] = name
    handle = client.start(call_name_wf, {"key": "name", "kind": kind})
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "InvalidArgumentError"
    says = "201 characters; at most 200" if isinstance(name, str) and name else "non-empty string"
    assert says in outcome.message, outcome.message
    assert CALLS["after"] == 0


def test_200_character_names_work_end_to_end(client: wp.WorkflowClient, tables: Tables) -> None:
    handle = client.start(long_named_wf, 4)
    assert handle.workflow_name == LONG
    for _ in range(50):  # the sleep, then the signal wait
        if client.pending_signals(handle.execution_id):
            break
        with pytest.raises(wp.ResultTimeoutError):
            client.result(handle.execution_id, timeout=0.02)
    client.signal(handle.execution_id, LONG, 1)
    assert client.result(handle.execution_id, timeout=10).unwrap() == 9
    activities = {r.event.get("activityName") for r in client.history(handle.execution_id)}
    assert {f"{LONG}#1", f"{LONG}#2", f"{LONG}#3", f"{LONG}#4", f"{LONG}#5"} <= activities
    assert [i.execution_id for i in client.list(LONG).items] == [handle.execution_id]
    assert tables.run(handle.execution_id).workflow_name == LONG


# -- 13. values too large for the backend -------------------------------------------------


@pytest.fixture
def limit(runtime: wp.Runtime, backend: str, tables: Tables) -> Iterator[int]:
    """The largest value the backend takes: MariaDB's own (from max_allowed_packet), a
    lowered one elsewhere (their real limits are hundreds of megabytes)."""
    real = runtime.backend.max_value_bytes
    if backend == "mysql":
        packet = int(tables.scalar("SELECT @@max_allowed_packet"))
        assert packet // 4 < real < packet // 2
        yield real
        return
    runtime.backend.max_value_bytes = 10_000
    yield 10_000
    runtime.backend.max_value_bytes = real


def test_too_large_input_is_refused_by_start(
    client: wp.WorkflowClient, tables: Tables, limit: int
) -> None:
    before = tables.counts()
    with pytest.raises(wp.ValueTooLargeError) as info:
        client.start(any_wf, "x" * limit)
    assert info.value.limit == limit < info.value.size
    assert "input of workflow bad-any" in str(info.value)
    assert tables.counts() == before


@pytest.mark.parametrize("where", ["step-result", "step-arg", "code", "output"])
def test_too_large_values_inside_a_run_fail_it_once(
    client: wp.WorkflowClient, tables: Tables, limit: int, where: str
) -> None:
    handle = client.start(size_wf, {"size": limit, "where": where})
    outcome = failed_once(client, tables, handle.execution_id)
    cause = outcome.error.get("cause", outcome.error)
    expected = {
        "step-result": ("StepExecutionError", "result of step keep_big"),
        "step-arg": ("ValueTooLargeError", "arguments of step keep"),
        "code": ("CodeExecutionError", "result of code block big"),
        "output": ("ValueTooLargeError", "output of workflow bad-size"),
    }[where]
    assert outcome.error_type == expected[0]
    assert cause["name"] == "ValueTooLargeError" and expected[1] in cause["message"]
    assert cause["limit"] == limit
    kinds = types_of(client, handle.execution_id)
    if where == "step-result":
        assert CALLS["keep_big"] == 1, "ran once, not retried in a loop"
        assert kinds.count("step.started") == 1 and kinds.count("step.failed") == 1
    assert "step.completed" not in kinds and CALLS["keep"] == 0


#: How each kind of write holds the value ``"x" * n`` (what its size is measured on).
AT_THE_LIMIT: dict[str, Callable[[int], Any]] = {
    "step-echo": lambda n: {"value": "x" * n},  # a step's arguments, and its result
    "output-list": lambda n: ["x" * n],  # the run's output: an event and a column
}


@pytest.mark.parametrize("where", list(AT_THE_LIMIT))
def test_a_value_at_the_limit_is_stored_whole(
    runtime: wp.Runtime, client: wp.WorkflowClient, tables: Tables, limit: int, where: str
) -> None:
    wrap = AT_THE_LIMIT[where]
    base = runtime.backend.value_size(json.dumps(wrap(0)))
    size = limit - base  # the largest value the backend takes (as it measures what it sends)
    runtime.backend.check_size("v", wrap(size))
    with pytest.raises(wp.ValueTooLargeError):
        runtime.backend.check_size("v", wrap(size + 1))
    handle = client.start(size_wf, {"size": size, "where": where})
    outcome = client.result(handle.execution_id, timeout=60)
    assert isinstance(outcome, wp.Completed), outcome
    assert outcome.value == (["x" * size] if where == "output-list" else size)
    assert "drive.failed" not in types_of(client, handle.execution_id)
    assert tables.run(handle.execution_id).drive_failures == 0


def test_the_size_checked_is_the_size_sent(runtime: wp.Runtime) -> None:
    """Lists of small items take more room as sent (``[0, 0]``) than compact (``[0,0]``)."""
    backend = runtime.backend
    real, backend.max_value_bytes = backend.max_value_bytes, 10_000
    try:
        value = [0] * 5_000  # 10,001 bytes compact
        with pytest.raises(wp.ValueTooLargeError) as info:
            backend.check_size("v", value)
        assert info.value.size == backend.value_size(json.dumps(value)) > 14_000
    finally:
        backend.max_value_bytes = real


def test_too_large_signal_payload_is_refused(
    client: wp.WorkflowClient, tables: Tables, limit: int
) -> None:
    handle = client.start(signal_wf, "any")
    suspended(client, handle.execution_id)
    before = tables.counts()
    with pytest.raises(wp.ValueTooLargeError, match="payload of signal go"):
        client.signal(handle.execution_id, "go", "x" * limit)
    assert tables.counts() == before
    assert client.status(handle.execution_id) == "suspended"


# -- 14. durations and numeric options ----------------------------------------------------

BAD_DURATIONS = {
    "negative": -1,
    "nan": float("nan"),
    "inf": float("inf"),
    "text": "5",
    "bool": True,
    "negative-timedelta": dt.timedelta(seconds=-1),
    "huge": 1e300,
}


@pytest.mark.parametrize("value", BAD_DURATIONS.values(), ids=list(BAD_DURATIONS))
@pytest.mark.parametrize("kind", ["sleep", "timeout"])
def test_bad_durations_fail_the_run(
    client: wp.WorkflowClient, tables: Tables, kind: str, value: Any
) -> None:
    BAD["d"] = value
    handle = client.start(duration_wf, {"key": "d", "kind": kind})
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "InvalidArgumentError"
    assert ("sleep duration" if kind == "sleep" else "signal timeout") in outcome.message
    assert CALLS["after"] == 0
    assert types_of(client, handle.execution_id)[-2:] == ["workflow.started", "workflow.failed"]


BAD_POSITIVE = [0, -1, math.nan, math.inf, "3", True, None]


@pytest.mark.parametrize("option", ["lease_ttl", "poll_interval"])
@pytest.mark.parametrize("value", BAD_POSITIVE, ids=repr)
def test_bad_runtime_timings(shared_url: str, option: str, value: Any) -> None:
    with pytest.raises(wp.InvalidArgumentError, match=option):
        wp.Runtime(shared_url, **{option: value})


@pytest.mark.parametrize(
    "options",
    [
        {"max_drive_failures": 0},
        {"max_drive_failures": True},
        {"max_drive_failures": 2.5},
        {"record_start_after": -1},
        {"record_start_after": math.nan},
        {"record_start_after": "1"},
    ],
    ids=repr,
)
def test_bad_runtime_options(shared_url: str, options: dict[str, Any]) -> None:
    with pytest.raises(wp.InvalidArgumentError, match=next(iter(options))):
        wp.Runtime(shared_url, **options)


@pytest.mark.parametrize("concurrency", [0, -1, True, "4", 2.0])
def test_bad_worker_concurrency(runtime: wp.Runtime, concurrency: Any) -> None:
    with pytest.raises(wp.InvalidArgumentError, match="concurrency"):
        wp.Worker(runtime, concurrency=concurrency)
    with pytest.raises(wp.InvalidArgumentError, match="concurrency"):
        runtime.start_worker(concurrency=concurrency)


@pytest.mark.parametrize("poll_interval", [0, math.nan, "1"], ids=repr)
def test_bad_worker_poll_interval(runtime: wp.Runtime, poll_interval: Any) -> None:
    with pytest.raises(wp.InvalidArgumentError, match="poll_interval"):
        wp.Worker(runtime, poll_interval=poll_interval)


@pytest.mark.parametrize(
    "options",
    [
        {"limit": 0},
        {"limit": True},
        {"limit": -1},
        {"limit": "5"},
        {"status": "bogus"},
        {"created_after": dt.datetime(2024, 1, 1)},
        {"created_before": "2024-01-01"},
        # aware, but out of range once in UTC (what is stored and compared)
        {
            "created_after": dt.datetime(
                9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5))
            )
        },
        {"created_before": dt.datetime(1, 1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5)))},
        {"version": "1"},
        {"version": True},
        {"actor": ""},
    ],
    ids=repr,
)
def test_bad_list_arguments(client: wp.WorkflowClient, options: dict[str, Any]) -> None:
    with pytest.raises(wp.InvalidArgumentError):
        client.list(any_wf, **options)


def test_a_cursor_out_of_range_is_an_invalid_cursor(client: wp.WorkflowClient) -> None:
    import base64
    import json

    late = dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5)))
    for fields in ([late.isoformat(), "x"], ["2024-01-01T00:00:00+00:00", "a\x00b"]):
        cursor = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()
        with pytest.raises(wp.InvalidCursorError):
            client.list(any_wf, cursor=cursor)


@pytest.mark.parametrize("timeout", ["1", math.nan, True], ids=repr)
def test_bad_result_timeout(client: wp.WorkflowClient, timeout: Any) -> None:
    done = client.start(any_wf, 1)
    with pytest.raises(wp.InvalidArgumentError, match="timeout"):
        client.result(done.execution_id, timeout=timeout)


@pytest.mark.parametrize("workflow", [123, "", "w" * 201], ids=repr)
def test_bad_list_workflow(client: wp.WorkflowClient, workflow: Any) -> None:
    with pytest.raises(wp.InvalidArgumentError, match="workflow"):
        client.list(workflow)


@pytest.mark.parametrize(
    "options",
    [
        {"older_than": dt.timedelta(0), "batch_size": 0},
        {"older_than": dt.timedelta(0), "batch_size": True},
        {"older_than": "x"},
        {"older_than": dt.datetime(2024, 1, 1)},
        {"older_than": dt.timedelta(0), "statuses": ("running",)},
        {"older_than": dt.timedelta(0), "statuses": ()},
        {"older_than": dt.timedelta(0), "statuses": "completed"},
        {"older_than": dt.timedelta(0), "statuses": None},
        {"older_than": dt.timedelta(0), "statuses": [["completed"]]},
        {"older_than": dt.timedelta.max},
        {"older_than": dt.timedelta(days=-1)},  # an age in the future: every finished run
        {"older_than": -dt.timedelta.resolution},
        {"older_than": dt.datetime.now(dt.UTC) + dt.timedelta(days=365)},
        {"older_than": dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5)))},
    ],
    ids=repr,
)
def test_bad_purge_arguments(
    client: wp.WorkflowClient, tables: Tables, options: dict[str, Any]
) -> None:
    done = client.start(any_wf, 1)
    client.result(done.execution_id)
    before = tables.counts()
    with pytest.raises(wp.InvalidArgumentError):
        client.purge(**options)
    assert tables.counts() == before


# -- 15. bindings, registration and starts ------------------------------------------------


def test_a_database_that_cannot_be_connected_to_is_one_typed_error(
    backend: str, db_url: str, tmp_path: Path
) -> None:
    """A URL naming a database, role or file the server does not have (or a server that is
    not there) raised SQLAlchemy's OperationalError from the driver. Now one typed error
    that names the database (password hidden) and is still an OperationalError (code that
    retries on that while a database comes up keeps working); nothing is created."""
    from .conftest import CAPABILITIES

    url = sa.make_url(db_url)
    if "embedded" in CAPABILITIES[backend]:
        missing = [url.set(database=str(tmp_path / "no" / "such" / "dir.sqlite3"))]
    else:
        missing = [
            url.set(database="wf_no_such_database", password="sekrit-pw"),
            url.set(database="wf_no_such_database", query={"password": "sekrit-pw"}),
            url.set(port=1),  # nothing listens there
        ]
    for bad in missing:
        text = bad.render_as_string(hide_password=False)
        for opening in (wp.Runtime, wp.Client, migrate.upgrade):
            with pytest.raises(wp.DatabaseConnectError) as caught:
                opening(text)
            assert isinstance(caught.value, sa.exc.OperationalError)
            assert str(caught.value).startswith("cannot connect to the database at ")
            assert "sekrit-pw" not in str(caught.value)
            copied = pickle.loads(pickle.dumps(caught.value))
            assert str(copied) == str(caught.value)
            assert type(copied.orig) is type(caught.value.orig)
    assert not (tmp_path / "no").exists()


@pytest.mark.needs("sql_mode")
def test_a_mysql_url_that_names_no_database_is_refused(db_url: str) -> None:
    """``mysql+pymysql://user@host/``: every name of ours named no table, and SQLAlchemy's
    reflection failed on a bare AssertionError."""
    url = sa.make_url(db_url).set(database="").render_as_string(hide_password=False)
    for opening in (wp.Runtime, wp.Client, migrate.upgrade, migrate.current):
        with pytest.raises(wp.UnsupportedDatabaseError, match="use no database"):
            opening(url)


@pytest.mark.parametrize("bind", [123, object(), b"sqlite://", 1.5], ids=repr)
def test_bad_bind_is_an_invalid_argument(bind: Any) -> None:
    with pytest.raises(wp.InvalidArgumentError, match="bind must be a URL or an Engine"):
        wp.Runtime(bind)


def test_bad_register_and_start_arguments(
    runtime: wp.Runtime, client: wp.WorkflowClient, tables: Tables
) -> None:
    before = tables.counts()
    not_workflows: list[Any] = ["not a workflow", plain, keep, None, 123]
    for bad in not_workflows:
        with pytest.raises(wp.InvalidArgumentError, match="register takes"):
            runtime.register(bad)
    for bad in not_workflows[1:]:  # a string is a name
        with pytest.raises(wp.InvalidArgumentError, match="expected a workflow"):
            client.start(bad)
    with pytest.raises(wp.InvalidArgumentError, match="register takes"):
        runtime.register(never_registered_wf, "not a workflow")  # type: ignore[arg-type]
    with pytest.raises(wp.UnknownWorkflowError, match="unknown-name"):
        client.start("unknown-name")
    bad_versions: list[Any] = ["1", True, 0, -1]
    for version in bad_versions:
        with pytest.raises(wp.InvalidArgumentError, match="version"):
            client.start(any_wf, 1, version=version)
    assert tables.counts() == before, "nothing registered, nothing started"


@pytest.mark.parametrize(
    ("module", "url", "extra"),
    [
        ("psycopg", "postgresql://nobody@127.0.0.1:1/none", "postgresql"),
        ("pymysql", "mysql://nobody@127.0.0.1:1/none", "mysql"),
    ],
)
def test_a_missing_driver_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, url: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    for open_it in (wp.Runtime, wp.Client):
        with pytest.raises(wp.UnsupportedDatabaseError) as info:
            open_it(url)
        assert f"pip install 'wf-persist[{extra}]'" in str(info.value)


@pytest.mark.parametrize(
    ("kind", "says"),
    [("mute", "<a Mute that cannot be shown as text>"), ("huge", "<a ValueError that cannot")],
)
def test_a_step_error_without_text_is_recorded_and_caught_as_the_steps_failure(
    client: wp.WorkflowClient, kind: str, says: str
) -> None:
    """Recording the failure once raised again (the error's own ``__str__``, an integer
    Python will not print), failing the run with that error instead of the step's."""
    outcome = client.execute(error_text_wf, kind, timeout=30)
    assert isinstance(outcome, wp.Completed), outcome
    assert says in outcome.value
    failed = [r.event for r in client.history(outcome.execution_id)]
    assert [e["type"] for e in failed].count("step.failed") == 1


@pytest.mark.parametrize(
    ("call", "value", "says"),
    [
        ("version", 10**5000, "16610 bits"),
        ("timeout", 10**5000, "16610 bits"),
        ("lease_ttl", 10**5000, "16610 bits"),
        ("lease_ttl", 1e15, "at most 3153600000 seconds"),  # no timedelta holds it
        ("poll_interval", 3.1e10, "at most 3153600000 seconds"),  # beyond Python's waits
        ("client_poll_interval", 3.1e10, "at most 3153600000 seconds"),
        ("concurrency", 10**5000, "16610 bits"),
        ("concurrency", 10**6, "at most 100000"),
    ],
    ids=lambda v: (
        v
        if isinstance(v, str)
        else f"{type(v).__name__}-{v.bit_length() if isinstance(v, int) else v}"
    ),
)
def test_an_out_of_range_setting_is_a_typed_argument_error(
    runtime: wp.Runtime, client: wp.WorkflowClient, call: str, value: Any, says: str
) -> None:
    """Before, such values raised Python's own ValueError or OverflowError, or were taken:
    a poll interval beyond what a thread may wait killed the worker's loop, leaving runs
    unclaimed."""
    with pytest.raises(wp.InvalidArgumentError, match=says):
        if call == "version":
            client.start("bad-any", 1, version=value)
        elif call == "timeout":
            client.result("no-such-run", timeout=value)
        elif call == "client_poll_interval":
            wp.Client(runtime.engine, poll_interval=value)
        elif call == "concurrency":
            runtime.start_worker(concurrency=value)
        else:
            wp.Runtime(runtime.engine, **{call: value})


class _Short(str):
    """A string that says it is short."""

    def __len__(self) -> int:
        return 5


def test_a_string_that_misstates_its_length_is_measured_as_a_string(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    before = tables.counts()
    with pytest.raises(wp.InvalidArgumentError, match="at most"):
        client.start(any_wf, 1, idempotency_key=_Short("k" * 5000))
    with pytest.raises(wp.InvalidArgumentError, match="execution id"):
        client.status(_Short("a" * 5000))
    with pytest.raises((wp.InvalidArgumentError, wp.UnknownWorkflowError)):
        client.start(_Short("w" * 5000), 1)
    assert tables.counts() == before


# -- subclasses whose own methods raise ---------------------------------------------------


class RaisingText(str):
    """A ``str`` whose length, hash and equality raise: only its text may be used."""

    def __len__(self) -> int:
        raise RuntimeError("len")

    def __hash__(self) -> int:
        raise RuntimeError("hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")


class RaisingInt(int):
    def __lt__(self, other: object) -> bool:
        raise RuntimeError("lt")

    def __le__(self, other: object) -> bool:
        raise RuntimeError("le")

    def __ge__(self, other: object) -> bool:
        raise RuntimeError("ge")

    def __gt__(self, other: object) -> bool:
        raise RuntimeError("gt")


class RaisingFloat(float):
    def __ge__(self, other: object) -> bool:
        raise RuntimeError("ge")

    def __gt__(self, other: object) -> bool:
        raise RuntimeError("gt")


class RaisingDelta(dt.timedelta):
    def total_seconds(self) -> float:
        raise RuntimeError("total_seconds")


@wp.workflow(name="bad-subclassed-calls", version=1)
def subclassed_calls_wf(ctx: wp.Context) -> list[int]:
    ctx.sleep(RaisingFloat(0.01), name=RaisingText("nap"))
    ctx.sleep(RaisingDelta(seconds=0.01))
    got = ctx.all([wp.call(keep, 1), wp.call(keep, 2)], concurrency=RaisingInt(2))
    ctx.set_event(RaisingText("progress"), 1)
    ctx.code(RaisingText("once"), lambda: 1)
    return [int(v) for v in got]


def test_subclassed_arguments_are_used_as_the_plain_values_they_hold(
    runtime: wp.Runtime, client: wp.WorkflowClient, tables: Tables
) -> None:
    """A str, int, float or timedelta subclass whose own comparisons, hash or conversions
    raise: every entry point reads the plain value it holds (those raised out of start,
    list, signal and result, and failed the run inside a body); a name too long for any
    wait is refused as such, also for a buffered signal."""
    runtime.register(subclassed_calls_wf)  # started by its name below
    handle = client.start(
        RaisingText("bad-subclassed-calls"),
        version=RaisingInt(1),
        idempotency_key=RaisingText("subclassed"),
        actor=RaisingText("ops"),
        timeout=RaisingFloat(60),
    )
    assert client.result(handle.execution_id, timeout=RaisingFloat(30)).unwrap() == [1, 2]
    assert client.get_event(handle.execution_id, RaisingText("progress")) == 1
    page = client.list(
        RaisingText("bad-subclassed-calls"), version=RaisingInt(1), status=RaisingText("completed")
    )
    assert [i.execution_id for i in page.items] == [handle.execution_id]
    assert client.start(any_wf, 1, timeout=RaisingDelta(seconds=60)).created
    waiting = client.start(signal_wf, "any")
    suspended(client, waiting.execution_id)
    assert client.signal(waiting.execution_id, RaisingText("go"), 5) == "delivered"
    before = tables.counts()
    for name in ("g" * 201, "😀" * 255):
        with pytest.raises(wp.InvalidArgumentError, match="at most 200 characters"):
            client.signal(waiting.execution_id, name, 1, buffer=True)
        with pytest.raises(wp.InvalidArgumentError, match="at most 200 characters"):
            client.get_event(waiting.execution_id, name, timeout=0)
    assert tables.counts() == before


class ClaimsToBeText:
    """Not a ``str``, though ``isinstance(x, str)`` says so (its ``__class__`` lies)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return str


def test_an_object_claiming_to_be_a_str_is_refused_as_one_typed_error(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    """``isinstance`` believed it, then ``str``'s own methods refused it: a raw TypeError."""
    run = client.start(signal_wf, "any").execution_id
    suspended(client, run)
    fake: Any = ClaimsToBeText()
    before = tables.counts()
    calls: list[Callable[[], object]] = [
        lambda: client.status(fake),
        lambda: client.start(fake),
        lambda: client.start(any_wf, 1, idempotency_key=fake),
        lambda: client.signal(run, fake, 1),
        lambda: client.cancel(run, actor=fake),
        lambda: client.get_event(run, fake, timeout=0),
        lambda: client.list(any_wf, actor=fake),
    ]
    for call in calls:
        with pytest.raises(wp.InvalidArgumentError):
            call()
    assert tables.counts() == before


@wp.workflow(name="limited_text", version=1)
def limited_text_wf(ctx: wp.Context, text: str) -> str:
    return text


def test_a_host_sqlite_engine_with_a_lower_length_limit_is_measured_by_it(
    tmp_path: Path, make_engine: Callable[..., sa.Engine]
) -> None:
    """A host's connections may lower SQLITE_LIMIT_LENGTH: the limit was read from a
    throwaway connection of SQLite's defaults, and a value past the engine's own limit
    raised the driver's raw DataError."""
    import sqlite3

    engine = make_engine(f"sqlite:///{tmp_path / 'limited.sqlite3'}")

    @sa.event.listens_for(engine, "connect")
    def _limit(raw: Any, _record: Any) -> None:
        raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100_000)

    migrate.upgrade(engine)
    with wp.Runtime(engine) as rt:
        rt.register(limited_text_wf)
        assert rt.backend.max_value_bytes < 100_000
        with pytest.raises(wp.ValueTooLargeError):
            rt.client().start(limited_text_wf, "a" * 200_000)
        assert rt.client().list("limited_text").items == []
        small = rt.client().start(limited_text_wf, "a" * 1_000).execution_id
        assert rt.client().result(small, timeout=30).unwrap() == "a" * 1_000


def test_an_input_and_a_result_each_at_sqlites_value_limit_fit_the_runs_row(
    tmp_path: Path, make_engine: Callable[..., sa.Engine]
) -> None:
    """SQLite's length limit bounds a whole row, and a run's row holds its input and its
    result: each within the limit (the limit less a margin, before), they did not fit
    together, and every drive failed with the driver's "string or blob too big" until the
    run failed with DriveFailedError."""
    import sqlite3

    engine = make_engine(f"sqlite:///{tmp_path / 'row.sqlite3'}")

    @sa.event.listens_for(engine, "connect")
    def _limit(raw: Any, _record: Any) -> None:
        raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)

    migrate.upgrade(engine)
    with wp.Runtime(engine, max_drive_failures=1) as rt:
        rt.register(limited_text_wf)
        text = "x" * (rt.backend.max_value_bytes - 2)  # its JSON: exactly the limit
        assert rt.client().execute(limited_text_wf, text).unwrap() == text
        with pytest.raises(wp.ValueTooLargeError):
            rt.client().start(limited_text_wf, text + "x")


@pytest.mark.needs("schemas")  # PostgreSQL
def test_a_value_past_what_postgresqls_jsonb_parser_takes_is_refused_typed(
    runtime: wp.Runtime,
) -> None:
    """An array of small numbers of 69 MB of JSON (within the 256 MiB the limit was) failed
    the start with PostgreSQL's raw "invalid memory alloc request size": such a document
    takes 32 bytes an element to parse. The limit is 16 MiB now; the refusal is typed, and
    nothing is written."""
    runtime.register(limited_text_wf)
    with pytest.raises(wp.ValueTooLargeError) as info:
        runtime.client().start(limited_text_wf, "1," * (9 * 1024 * 1024))
    assert info.value.limit == 16 * 1024 * 1024 - 64 * 1024
    assert runtime.client().list("limited_text").items == []


class Aliased(BaseModel):
    user_id: int = Field(alias="userId")


@wp.step(retry=wp.Retry(attempts=3, base=0.01))
def aliased() -> Aliased:
    CALLS["aliased"] += 1
    return Aliased(userId=1)


@wp.workflow(name="aliased-result", version=1)
def aliased_wf(ctx: wp.Context) -> int:
    return ctx.run(aliased).user_id


def test_a_step_result_that_does_not_read_its_own_json_back_fails_the_step_once(
    client: wp.WorkflowClient, tables: Tables
) -> None:
    """A model with an alias and no populate_by_name is written by field name and reads
    only its alias: the read-back raised pydantic's raw error, and the step was retried,
    its effects repeated for a value that could never be kept."""
    CALLS["aliased"] = 0
    handle = client.start(aliased_wf)
    outcome = failed_once(client, tables, handle.execution_id)
    assert outcome.error_type == "StepExecutionError"
    assert outcome.error["cause"]["name"] == "NotSerializableError"
    assert "populate_by_name" in outcome.error["cause"]["message"]
    assert CALLS["aliased"] == 1
