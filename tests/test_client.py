"""Client API: idempotent starts, status, keyset listing, history, and its typed errors."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import pytest
from sqlalchemy import Table, create_engine, delete, event, func, select

import wf_persist as wp
from wf_persist.models import executions_table, history_table

from .fixtures import workflows as w
from .fixtures.proc import ready_files
from .helpers import Processes, wait_until


def _count(url: str, table: Table, **where: object) -> int:
    query = select(func.count()).select_from(table)
    for col, value in where.items():
        query = query.where(table.c[col] == value)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def test_unknown_execution_id_everywhere(client: wp.WorkflowClient) -> None:
    for call in (client.status, client.describe, client.history, client.result):
        with pytest.raises(wp.UnknownExecutionError) as info:
            call("no-such-id")
        assert info.value.execution_id == "no-such-id"
        assert "Unknown workflow execution: no-such-id" in str(info.value)


def test_idempotency_key_returns_the_same_handle_and_records_nothing(
    runtime: wp.Runtime, db_url: str
) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    a = client.start(w.echo_wf, 3, idempotency_key="k-1", actor="ann")
    b = client.start(w.echo_wf, 4, idempotency_key="k-1", actor="bob")
    c = client.start(w.echo_wf, 3)
    d = client.start(w.echo_wf, 3)
    assert a == b and b.created is False and a.created is True
    assert len({a.execution_id, c.execution_id, d.execution_id}) == 3
    assert _count(db_url, executions_table) == 3
    assert _count(db_url, history_table, execution_id=a.execution_id) == 1
    assert client.describe(a.execution_id).actor == "ann"
    with pytest.raises(wp.InvalidArgumentError):
        client.start(w.echo_wf, 3, idempotency_key="")
    with pytest.raises(wp.InvalidArgumentError):
        client.start(w.echo_wf, 3, actor="x" * 256)


@pytest.mark.needs("libpq")  # the keyed insert leaves the run it met unlocked: deletable
def test_a_start_whose_keyed_run_was_purged_meanwhile_starts_a_new_one(
    runtime: wp.Runtime, db_url: str
) -> None:
    """The insert met the finished run holding the key, which a purge deleted before the
    start looked it up: the start, in a transaction of its own, tries again and creates
    the run, instead of raising IdempotencyConflictError."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    first = client.start(w.echo_wf, 3, idempotency_key="k")
    client.result(first.execution_id, timeout=30).unwrap()
    purger = create_engine(db_url)
    purged: list[str] = []

    def purge_first(_c: object, _cur: object, statement: str, *_: object) -> None:
        if (
            not purged
            and statement.lstrip().upper().startswith("SELECT")
            and ("idempotency_key =" in statement)
        ):
            purged.append(statement)
            with purger.begin() as conn:
                conn.execute(
                    delete(executions_table).where(executions_table.c.id == first.execution_id)
                )

    engine = runtime.backend.base_engine
    event.listen(engine, "before_cursor_execute", purge_first)
    try:
        again = client.start(w.echo_wf, 4, idempotency_key="k")
    finally:
        event.remove(engine, "before_cursor_execute", purge_first)
        purger.dispose()
    assert purged, "the start never looked the key's run up"
    assert again.created and again.execution_id != first.execution_id
    assert client.result(again.execution_id, timeout=30).unwrap() == [1, 2, 3, 4]


def test_idempotent_start_from_20_threads_creates_one_run(runtime: wp.Runtime, db_url: str) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    barrier = threading.Barrier(20)
    ids: list[str] = []
    errors: list[BaseException] = []

    def go() -> None:
        try:
            barrier.wait()
            ids.append(client.start(w.echo_wf, 3, idempotency_key="same").execution_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ids) == 20 and len(set(ids)) == 1
    assert _count(db_url, executions_table) == 1
    assert _count(db_url, history_table) == 1


def test_idempotent_start_from_two_processes_creates_one_run(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    runtime.register(w.echo_wf)
    go = tmp_path / "go"
    starters = [procs.proc(db_url, "start-idem", "proc-key", "5", str(go)) for _ in range(2)]
    wait_until(lambda: len(ready_files(go)) == 2, 60, "both processes ready")
    go.touch()
    outputs = [json.loads(procs.finish(p).stdout) for p in starters]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 1
    assert _count(db_url, executions_table) == 1


def test_list_is_keyset_paginated_with_opaque_cursors(runtime: wp.Runtime) -> None:
    runtime.register(w.echo_wf, w.order_wf)
    client = runtime.client()
    started = [client.start(w.echo_wf, 3).execution_id for _ in range(7)]
    client.start(w.order_wf, {"order_id": "x", "amount": 1})
    for execution_id in started[:3]:
        client.result(execution_id)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = client.list(w.echo_wf, limit=3, cursor=cursor)
        seen += [i.execution_id for i in page.items]
        pages += 1
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == started and pages == 3
    assert [i.execution_id for i in client.list("echo").items] == started
    done = client.list("echo", status="completed", limit=2)
    assert [i.execution_id for i in done.items] == started[:2]
    rest = client.list("echo", status="completed", limit=2, cursor=done.next_cursor)
    assert [i.execution_id for i in rest.items] == started[2:3] and rest.next_cursor is None
    assert [i.execution_id for i in client.list("echo", status="running").items] == started[3:]
    assert client.list("nobody").items == []


@pytest.mark.parametrize("cursor", ["not-a-cursor", "", "e30", "WyJ4IiwgMV0", "!!!"])
def test_malformed_cursor_raises(client: wp.WorkflowClient, cursor: str) -> None:
    with pytest.raises(wp.InvalidCursorError):
        client.list("echo", cursor=cursor)


@pytest.mark.parametrize("limit", [0, -1, True])
def test_non_positive_limit_raises(client: wp.WorkflowClient, limit: int) -> None:
    with pytest.raises(wp.InvalidArgumentError):
        client.list("echo", limit=limit)


def test_unknown_status_filter_raises(client: wp.WorkflowClient) -> None:
    with pytest.raises(wp.InvalidArgumentError):
        client.list("echo", status="done")


def test_history_records_have_sequence_time_and_event(runtime: wp.Runtime) -> None:
    runtime.register(w.echo_wf)
    client = runtime.client()
    handle = client.start(w.echo_wf, 2)
    client.result(handle.execution_id)
    records = client.history(handle.execution_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert all(r.created_at.tzinfo is not None for r in records)
    times = [r.created_at for r in records]
    assert times == sorted(times)
    assert records[-1].event == {
        "type": "workflow.completed",
        "executionId": handle.execution_id,
        "workflowName": "echo",
        "result": [1, 2],
    }


def test_result_times_out_while_another_runtime_holds_the_lease(make_runtime: object) -> None:
    holder = make_runtime(lease_ttl=60)  # type: ignore[operator]
    holder.register(w.echo_wf)
    handle = holder.client().start(w.echo_wf, 3)
    with holder.transaction() as conn:
        assert holder.backend.claim(conn, handle.execution_id, holder.owner, 60)
    waiter = make_runtime()  # type: ignore[operator]
    waiter.register(w.echo_wf)
    with pytest.raises(wp.ResultTimeoutError):
        waiter.client().result(handle.execution_id, timeout=0.3)
    assert waiter.client().status(handle.execution_id) == "running"


def test_a_result_timeout_names_the_timeout_asked_for(runtime: wp.Runtime) -> None:
    """The embedded client drives the run first (up to its signal wait), then waits out
    the rest: the error says the caller's timeout, not what was left of it."""
    runtime.register(w.approval_wf)
    client = runtime.client()
    run = client.start(w.approval_wf, None).execution_id
    with pytest.raises(wp.ResultTimeoutError) as late:
        client.result(run, timeout=0.5)
    assert late.value.timeout == 0.5 and "within 0.5s" in str(late.value)
    assert client.status(run) == "suspended"  # it was driven here, up to the wait


def test_signal_and_cancel_need_no_workflow_code_in_this_process(make_runtime: object) -> None:
    """A process that registered nothing (a web handler, an operations script) signals and
    cancels runs that a runtime with the code drives: the signal is validated against the
    schema its wait recorded, and the cancellation is unwound by whoever drives the run."""
    full = make_runtime()  # type: ignore[operator]
    full.register(w.approval_wf)
    waiting = full.client().start(w.approval_wf, None)
    doomed = full.client().start(w.approval_wf, None)

    def at_the_wait(execution_id: str) -> bool:  # past its short sleep, to the signal wait
        full.drive(execution_id)
        return bool(full.client().pending_signals(execution_id))

    for execution_id in (waiting.execution_id, doomed.execution_id):
        wait_until(functools.partial(at_the_wait, execution_id), what="the signal wait")

    thin = make_runtime().client()  # type: ignore[operator]
    with pytest.raises(wp.SignalPayloadError):
        thin.signal(waiting.execution_id, "approval", {"approved": "perhaps"})
    thin.signal(waiting.execution_id, "approval", {"approved": True}, actor="ops")
    thin.cancel(doomed.execution_id, actor="ops")
    assert thin.status(doomed.execution_id) == "compensating"

    assert full.client().result(waiting.execution_id, timeout=30).unwrap() == "approved"
    cancelled = full.client().result(doomed.execution_id, timeout=30)
    assert isinstance(cancelled, wp.Failed) and cancelled.error_type == "Cancelled"
