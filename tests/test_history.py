"""History appends: dedupe keys, sequence allocation under concurrency, atomic status."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select, update

import wf_persist as wp
from wf_persist.events import NewEvent
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist
from wf_persist.store import history

from .fixtures import workflows as w
from .fixtures.proc import ready_files
from .helpers import Processes, wait_until


def _started(runtime: wp.Runtime) -> str:
    runtime.register(w.echo_wf)
    return runtime.client().start(w.echo_wf, 3).execution_id


def test_duplicate_dedupe_key_is_dropped_and_changes_no_status(runtime: wp.Runtime) -> None:
    execution_id = _started(runtime)
    now = runtime.clock()
    waiting = {"type": "signal.waiting", "executionId": execution_id, "activityName": "approval#1"}
    with runtime.transaction() as conn:
        first = history.append(
            conn,
            runtime.backend,
            execution_id,
            [NewEvent(waiting, now, "signal.waiting:approval#1")],
            now=now,
        )
    assert first.sequences == [2] and first.transitioned and first.status == "suspended"
    with runtime.transaction() as conn:
        conn.execute(update(ex).where(ex.c.id == execution_id).values(status="running"))
    with runtime.transaction() as conn:
        again = history.append(
            conn,
            runtime.backend,
            execution_id,
            [
                NewEvent(waiting, now, "signal.waiting:approval#1"),
                NewEvent({"type": "note", "executionId": execution_id}, now),
            ],
            now=now,
        )
    assert again.sequences == [3], "the duplicate takes no sequence number"
    assert again.transitioned is False
    client = runtime.client()
    assert client.status(execution_id) == "running", "a dropped duplicate changes no status"
    types = [r.event["type"] for r in client.history(execution_id)]
    assert types == ["execution.started", "signal.waiting", "note"]
    assert [r.sequence for r in client.history(execution_id)] == [1, 2, 3]


def test_status_change_rolls_back_with_its_event(runtime: wp.Runtime) -> None:
    execution_id = _started(runtime)
    now = runtime.clock()
    ev = {"type": "sleep.started", "executionId": execution_id, "activityName": "nap#1"}
    with pytest.raises(RuntimeError), runtime.transaction() as conn:
        history.append(
            conn, runtime.backend, execution_id, [NewEvent(ev, now, "sleep.started:nap#1")], now=now
        )
        raise RuntimeError("host aborts")
    client = runtime.client()
    assert client.status(execution_id) == "running"
    assert len(client.history(execution_id)) == 1


def test_terminal_status_is_final(runtime: wp.Runtime) -> None:
    execution_id = _started(runtime)
    client = runtime.client()
    client.result(execution_id)
    now = runtime.clock()
    with runtime.transaction() as conn:
        res = history.append(
            conn,
            runtime.backend,
            execution_id,
            [NewEvent({"type": "sleep.completed", "executionId": execution_id}, now)],
            now=now,
        )
    assert res.transitioned is False
    assert client.status(execution_id) == "completed"


def test_fenced_writes_require_the_current_claim_epoch(runtime: wp.Runtime) -> None:
    execution_id = _started(runtime)
    now = runtime.clock()
    backend = runtime.backend
    ev = NewEvent(
        {"type": "step.completed", "executionId": execution_id, "activityName": "x#1"}, now
    )
    with pytest.raises(wp.LeaseLostError), runtime.transaction() as conn:
        backend.fenced(conn, execution_id, 7, [ev], now=now)
    with runtime.transaction() as conn:
        claim = backend.claim(conn, execution_id, runtime.owner, 30)
    assert claim is not None and claim.epoch == 1
    with runtime.transaction() as conn:
        assert backend.fenced(conn, execution_id, claim.epoch, [ev, ev], now=now).sequences == [
            2,
            3,
        ]
    with runtime.transaction() as conn:  # a claim never wins over a live lease
        assert backend.claim(conn, execution_id, "another", 30) is None
    with runtime.transaction() as conn:  # released: claimable again, with a new epoch
        assert backend.release(conn, {execution_id: claim.epoch}) == 1
    with runtime.transaction() as conn:
        again = backend.claim(conn, execution_id, "another", 30)
    assert again is not None and again.epoch == 2
    with pytest.raises(wp.LeaseLostError), runtime.transaction() as conn:  # the old token
        backend.fenced(conn, execution_id, claim.epoch, [ev], now=now)
    with pytest.raises(wp.LeaseLostError), runtime.transaction() as conn:
        history.append(conn, backend, execution_id, [ev], now=now, epoch=claim.epoch)
    with pytest.raises(wp.UnknownExecutionError), runtime.transaction() as conn:
        history.append(conn, backend, "missing", [ev], now=now)


def test_two_processes_appending_to_one_execution_never_collide(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    execution_id = _started(runtime)
    go = tmp_path / "go"
    appenders = [procs.proc(db_url, "append", execution_id, "100", str(go)) for _ in range(2)]
    wait_until(lambda: len(ready_files(go)) == 2, 60, "both processes ready")
    go.touch()
    for p in appenders:
        procs.finish(p)
    with runtime.transaction() as conn:
        seqs = (
            conn.execute(
                select(hist.c.sequence)
                .where(hist.c.execution_id == execution_id)
                .order_by(hist.c.sequence)
            )
            .scalars()
            .all()
        )
        next_seq = conn.execute(select(ex.c.next_seq).where(ex.c.id == execution_id)).scalar_one()
    assert seqs == list(range(1, 202))
    assert next_seq == 202
    writers = {r.event.get("pid") for r in runtime.client().history(execution_id)[1:]}
    assert len(writers) == 2
