"""Review of the web view and of OpenTelemetry: regression tests (real databases, real HTTP).

- The web view over a named PostgreSQL schema: a run's page and API read the SQL views in
  the default schema instead (500, raw ``UndefinedTable``).
- A run's page for a run of thousands of steps: its step attempts came from the
  ``wf_step_attempts`` view, a join quadratic in the run's history (8-27 s for 5,000 steps
  depending on the backend), polled again every 1.5 s by an open page.
- A hostile or malformed ``trace`` in ``execution.started`` (anyone may write that event:
  docs/sql.md) made every drive of the run fail, then failed the run.
- ``wf-persist web`` on 127.0.0.1 answered any ``Host``: a page of another site whose
  name rebinds to 127.0.0.1 (DNS rebinding) read every run's input, result and error.
- A tracer that raises (a span processor's ``on_start``/``on_end``) failed the run with
  the tracer's error after the step ran (its result lost), failed drives, and made
  ``start()`` raise for a run it had created.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import Engine, update

import wf_persist as wp
from wf_persist import migrate, telemetry
from wf_persist.models import history_table
from wf_persist.web import create_app

from .fixtures import workflows as w
from .helpers import Processes, wait_until
from .webserver import serving

CALLS: Counter[str] = Counter()


@wp.step()
def counted(n: int) -> int:
    CALLS["counted"] += 1
    return n + 1


@wp.workflow(name="review-once", version=1)
def once_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(counted, n)


@wp.step()
def tick(i: int) -> int:
    return i


@wp.workflow(name="review-long", version=1)
def long_wf(ctx: wp.Context, n: int) -> int:
    for i in range(n):
        ctx.run(tick, i)
    return n


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    CALLS.clear()
    yield
    telemetry.instrument()


# the web view ---------------------------------------------------------------------------


@pytest.mark.needs("schemas")
def test_the_web_view_reads_a_named_schemas_views(blank_db_url: str) -> None:
    migrate.upgrade(blank_db_url, schema="wf")
    with wp.Runtime(blank_db_url, schema="wf") as rt:
        rt.register(*w.ALL)
        run = rt.client().start(w.approval_wf, 30.0).execution_id
        with pytest.raises(wp.ResultTimeoutError):
            rt.client().result(run, timeout=1.5)  # driven here up to its signal wait
        done = rt.client().start(w.echo_wf, 3).execution_id
        assert rt.client().result(done, timeout=30).unwrap() == [1, 2, 3]
        with (
            wp.Client(blank_db_url, schema="wf") as client,
            serving(create_app(client=client)) as base,
            httpx.Client(base_url=base, timeout=30) as http,
        ):
            found = http.get(f"/api/runs/{run}")
            assert found.status_code == 200, found.text
            assert found.json()["wait"]["kind"] == "signal"
            steps = [t for t in found.json()["timeline"] if t["kind"] == "step"]
            assert [(t["label"], t["outcome"]) for t in steps] == [
                ("reserve_budget#1 attempt 1", "completed")
            ]
            echoed = http.get(f"/api/runs/{done}").json()["timeline"]
            assert [t["outcome"] for t in echoed if t["kind"] == "step"] == ["completed"] * 3
            assert http.get(f"/runs/{run}").status_code == 200


def test_a_run_of_thousands_of_steps_shows_at_once(runtime: wp.Runtime, db_url: str) -> None:
    runtime.register(long_wf)
    steps = 4000
    run = runtime.client().start(long_wf, steps).execution_id
    assert runtime.client().result(run, timeout=300).unwrap() == steps
    with (
        wp.Client(db_url) as client,
        serving(create_app(client=client)) as base,
        httpx.Client(base_url=base, timeout=300) as http,
    ):
        began = time.monotonic()
        found = http.get(f"/api/runs/{run}")
        took = time.monotonic() - began
        assert found.status_code == 200
        attempts = [t for t in found.json()["timeline"] if t["kind"] == "step"]
        assert len(attempts) == steps
        assert {t["outcome"] for t in attempts} == {"completed"}
        assert all(t["durationMs"] is not None and t["durationMs"] >= 0 for t in attempts)
        assert took < 4.0, f"a run of {steps} steps took {took:.1f} s to show"


def test_abandoned_and_retried_attempts_are_still_told_apart(
    runtime: wp.Runtime, db_url: str
) -> None:
    """The attempts paired from the history: a retried step's failed and completed
    attempts, as the view paired them."""
    from .fixtures import traced as tf

    tf.FLAKY["failures"] = 1
    runtime.register(*tf.ALL)
    runtime.start_worker(concurrency=2)
    run = runtime.client().start(tf.traced_parent, 1).execution_id
    assert runtime.client().result(run, timeout=30).unwrap() == 11
    with wp.Client(db_url) as client:
        from wf_persist.web import data

        steps = [t for t in data.run(client, run)["timeline"] if t["kind"] == "step"]
    assert [(t["label"], t["outcome"]) for t in steps] == [
        ("flaky#1 attempt 1", "failed"),
        ("flaky#1 attempt 2", "completed"),
    ]


@pytest.mark.parametrize("listen", ["127.0.0.1", "::1", "127.0.0.2"])
def test_the_cli_on_this_machine_answers_only_this_machines_names(
    runtime: wp.Runtime, db_url: str, procs: Processes, listen: str
) -> None:
    """On any loopback address (``--host ::1`` answered every ``Host``)."""
    from .webserver import _free_port

    runtime.register(*w.ALL)
    run = runtime.client().start(w.echo_wf, 3, actor="secret-owner").execution_id
    runtime.client().result(run, timeout=30)
    port = _free_port()
    served = procs.python(
        "-m",
        "wf_persist.cli",
        "web",
        "--url",
        db_url,
        "--host",
        listen,
        "--port",
        str(port),
        name="web",
    )
    literal = f"[{listen}]" if ":" in listen else listen
    base = f"http://{literal}:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/api/runs", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, what="wf-persist web", timeout=30)
    names = (f"{literal}:{port}", literal, f"127.0.0.1:{port}", f"LocalHost:{port}", "[::1]")
    for host in names:
        assert httpx.get(base + "/api/runs", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", "[::1", "[::2]:80", f"{literal}.evil"):
        rebound = httpx.get(base + f"/api/runs/{run}", headers={"Host": host})
        assert rebound.status_code == 400, host
        assert "secret-owner" not in rebound.text
    served.stop()


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:4787", "127.0.0.1"),
        ("LOCALHOST", "localhost"),
        ("[::1]:4787", "::1"),
        ("[::1]", "::1"),
        ("[::1", ""),
        ("::1", "::1"),  # no brackets: no port either
        ("evil.example:80", "evil.example"),
        ("", ""),
        ("[::1].evil", ""),
        ("a b:80", ""),
        ("host:80:90", ""),
    ],
)
def test_a_host_header_names_its_host_without_port_brackets_or_case(header: str, name: str) -> None:
    from wf_persist.web.app import host_name

    assert host_name(header) == name


# OpenTelemetry ----------------------------------------------------------------------------


class Recorded:
    def __init__(self, *processors: SpanProcessor) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        for p in processors:
            self.provider.add_span_processor(p)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        telemetry.instrument(tracer_provider=self.provider)

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


def _set_trace(engine: Engine, execution_id: str, trace: Any, client: wp.Client) -> None:
    event = dict(client.history(execution_id)[0].event)
    event["trace"] = trace
    with engine.begin() as conn:
        conn.execute(
            update(history_table)
            .where(history_table.c.execution_id == execution_id, history_table.c.sequence == 1)
            .values(event=event)
        )


VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    "trace",
    [
        {"traceparent": 123},
        {"traceparent": VALID, "tracestate": 5},
        {"traceparent": VALID, "tracestate": ["a=1", 2]},
        {"traceparent": [7]},
        {"traceparent": "x" * 100_000},
    ],
    ids=["int", "int-state", "list-state", "list-int", "huge"],
)
def test_a_malformed_stored_trace_never_fails_a_drive(
    make_runtime: Any, db_url: str, trace: Any
) -> None:
    recorded = Recorded()
    starter = make_runtime()
    starter.register(once_wf)
    client = starter.client()
    run = client.start(once_wf, 1).execution_id
    _set_trace(starter.engine, run, trace, client)
    driver = make_runtime()  # not where it was started: it reads the stored trace
    driver.register(once_wf)
    driver.drive(run)
    info = client.describe(run)
    assert (info.status, info.drive_failures) == ("completed", 0), info.error
    assert client.result(run, timeout=5).unwrap() == 2
    (drive,) = recorded.spans("wf.drive")
    assert (drive.attributes or {})["wf.drive.outcome"] == "completed"


def test_a_valid_stored_trace_is_still_continued(make_runtime: Any) -> None:
    recorded = Recorded()
    starter = make_runtime()
    starter.register(once_wf)
    client = starter.client()
    run = client.start(once_wf, 1).execution_id
    _set_trace(starter.engine, run, {"traceparent": VALID, "extra": 5}, client)
    driver = make_runtime()
    driver.register(once_wf)
    driver.drive(run)
    (drive,) = recorded.spans("wf.drive")
    assert format(drive.context.trace_id, "032x") == VALID.split("-")[1]
    assert drive.parent is not None and format(drive.parent.span_id, "016x") == VALID.split("-")[2]


class Raising(SpanProcessor):
    """A span processor that raises when a span of one name starts or ends."""

    def __init__(self, name: str, when: str) -> None:
        self.name, self.when = name, when

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        if self.when == "start" and span.name == self.name:
            raise RuntimeError("processor on_start")

    def on_end(self, span: ReadableSpan) -> None:
        if self.when == "end" and span.name == self.name:
            raise RuntimeError("processor on_end")


@pytest.mark.parametrize("when", ["start", "end"])
@pytest.mark.parametrize("name", ["wf.step", "wf.drive", "wf.start"])
def test_a_tracer_that_raises_changes_nothing_of_a_run(
    runtime: wp.Runtime, name: str, when: str
) -> None:
    Recorded(Raising(name, when))
    runtime.register(once_wf)
    client = runtime.client()
    run = client.start(once_wf, 1).execution_id  # a start that is made is not reported failed
    runtime.drive(run)
    info = client.describe(run)
    assert (info.status, info.drive_failures) == ("completed", 0), info.error
    assert client.result(run, timeout=5).unwrap() == 2
    assert CALLS["counted"] == 1
    assert [r.event["type"] for r in client.history(run)] == [
        "execution.started",
        "workflow.started",
        "step.started",
        "step.completed",
        "workflow.completed",
    ]


def test_a_signal_delivered_is_not_reported_failed_by_a_raising_tracer(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*w.ALL)
    client = runtime.client()
    run = client.start(w.approval_wf, 30.0).execution_id
    with pytest.raises(wp.ResultTimeoutError):
        client.result(run, timeout=1.5)
    Recorded(Raising("wf.signal", "end"))
    assert client.signal(run, "approval", {"approved": True}) == "delivered"
    assert client.result(run, timeout=30).unwrap() == "approved"


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.1", True),  # 127.0.0.1 spelt short: answered every Host
        ("2130706433", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("name.invalid", False),
    ],
)
def test_the_cli_knows_a_loopback_address_however_it_is_spelt(host: str, local: bool) -> None:
    """From the lookup the listener makes (a second lookup failing once left the check
    off); a name that does not resolve is refused."""
    from wf_persist.cli.web import _check_listen

    from .webserver import _free_port

    if host == "name.invalid":
        with pytest.raises(wp.InvalidArgumentError, match="cannot listen"):
            _check_listen(host, _free_port())
        return
    assert _check_listen(host, _free_port()) is local
