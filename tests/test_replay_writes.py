"""A replay writes nothing it recorded before: a finished ``ctx.all`` block's
``all.started`` and ``all.completed``/``all.failed``, and a seen cancellation's
``cancellation.received``, are not sent again (the store would drop each duplicate, but only
after a row-locked transaction). Counted at the database (:mod:`tests.dbcount`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

import wf_persist as wp
from wf_persist.replay import Journal

from .dbcount import Counts, counting
from .helpers import history_types, is_due, wait_until


@wp.step
def double(i: int) -> int:
    return 2 * i


@wp.workflow(name="blocks-then-nap", version=1)
def blocks_then_nap(ctx: wp.Context, blocks: int) -> int:
    total = 0
    for b in range(blocks):
        total += sum(ctx.all([wp.call(double, b), wp.call(double, b + 1)]))
    ctx.sleep(0.05)
    return total


def test_a_replay_does_not_record_finished_blocks_again(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Two runs that differ only in their number of finished blocks (1 and 4) resume after
    their sleep at the same cost: the blocks replay from the history alone."""
    rt = make_runtime(lease_ttl=300)  # no lease renewal inside the measurement
    rt.register(blocks_then_nap)
    client = rt.client()

    def resume_cost(blocks: int, name: str) -> Counts:
        execution_id = client.start(blocks_then_nap, blocks).execution_id
        assert rt.drive(execution_id)
        assert client.status(execution_id) == "suspended"
        wait_until(lambda: is_due(rt, execution_id), what="the timer")
        with counting(rt.backend.base_engine, tmp_path / name) as counter:
            assert rt.drive(execution_id)
            counts = counter.counts()
        assert client.result(execution_id).unwrap() == sum(4 * b + 2 for b in range(blocks))
        types = history_types(client, execution_id)
        assert types.count("all.started") == types.count("all.completed") == blocks
        return counts

    resume_cost(1, "warm")  # prepared statements, the catalog
    one, four = resume_cost(1, "one"), resume_cost(4, "four")
    assert (four - one).transactions == 0, (one, four)
    assert (four - one).statements == 0, (one, four)


#: The threads that validated a ``Noted`` value: a recorded result is validated again where
#: its replay reads it.
VALIDATED_ON: list[str] = []


class Noted(BaseModel):
    value: int

    @field_validator("value")
    @classmethod
    def _note_thread(cls, value: int) -> int:
        VALIDATED_ON.append(threading.current_thread().name)
        return value


class Refused(Exception):
    """A branch's terminal error (not retried)."""


@wp.step(errors=(Refused,))
def noted(i: int) -> Noted:
    if i < 0:
        raise Refused(f"no {i}")
    return Noted(value=i)


@wp.workflow(name="noted-blocks-then-nap", version=1)
def noted_blocks_then_nap(ctx: wp.Context) -> list[int]:
    first = ctx.all([wp.call(noted, 1), wp.call(noted, 2), wp.call(noted, 3)])
    with contextlib.suppress(Refused):
        ctx.all([wp.call(noted, 4), wp.call(noted, -1)], name="refused")
    ctx.sleep(0.05)
    return [n.value for n in first]


def test_a_replay_reads_a_finished_block_without_threads(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A block whose branches are all recorded (one that completed, one that failed) is read
    back in the thread that replays the body: the recorded results are validated there, in
    order, and no branch thread starts; the first drive ran its branches on threads."""
    rt = make_runtime(lease_ttl=300)
    rt.register(noted_blocks_then_nap)
    client = rt.client()
    execution_id = client.start(noted_blocks_then_nap).execution_id
    VALIDATED_ON.clear()
    assert rt.drive(execution_id)
    assert client.status(execution_id) == "suspended"
    assert VALIDATED_ON and all(n.startswith("wf-persist-all") for n in VALIDATED_ON)
    wait_until(lambda: is_due(rt, execution_id), what="the timer")
    VALIDATED_ON.clear()
    before = {t.name for t in threading.enumerate()}
    assert rt.drive(execution_id)
    assert client.result(execution_id).unwrap() == [1, 2, 3]
    here = threading.current_thread().name
    # 1, 2, 3, then 4 of the failed block
    assert len(VALIDATED_ON) == VALIDATED_ON.count(here) == 4, VALIDATED_ON
    assert not any(
        t.name.startswith("wf-persist-all") for t in threading.enumerate() if t.name not in before
    )
    types = history_types(client, execution_id)
    assert types.count("all.completed") == types.count("all.failed") == 1, types
    assert types.count("step.completed") == 4, types


class Interrupted(BaseException):
    """Not an error of the compensation: an interrupt (as a shutdown's) that ends the drive
    and gives the run back, due again at once."""


def undo(_result: str, marker: str, reason: dict[str, Any]) -> None:
    """Interrupted the first time it runs for a marker (its file does not exist yet)."""
    path = Path(marker)
    if marker.endswith("interrupt") and not path.exists():
        path.write_text("ran")
        raise Interrupted


@wp.step(compensate=undo)
def reserve(marker: str) -> str:
    return marker


@wp.workflow(name="reserve-then-wait", version=1)
def reserve_then_wait(ctx: wp.Context, marker: str) -> str:
    ctx.run(reserve, marker)
    ctx.wait_for_signal("go")
    return "done"


def test_a_replay_does_not_record_a_seen_cancellation_again(
    make_runtime: Callable[..., wp.Runtime], tmp_path: Path
) -> None:
    """Run A's compensation is interrupted after its drive recorded the cancellation, so
    its next drive replays it; run B's first drive after the cancel does the same work and
    records the cancellation: one transaction more than A's replay, no other difference."""
    rt = make_runtime(lease_ttl=300)
    rt.register(reserve_then_wait)
    client = rt.client()

    def parked(marker: str) -> str:
        execution_id = client.start(reserve_then_wait, str(tmp_path / marker)).execution_id
        assert rt.drive(execution_id)
        assert client.status(execution_id) == "suspended"
        client.cancel(execution_id, compensate=True, actor="ops")
        return execution_id

    def cost(execution_id: str, name: str) -> Counts:
        with counting(rt.backend.base_engine, tmp_path / name) as counter:
            assert rt.drive(execution_id)
            counts = counter.counts()
        outcome = client.result(execution_id)
        assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled", outcome
        types = history_types(client, execution_id)
        assert types.count("cancellation.received") == 1, types
        assert types.count("compensation.completed") == 1, types
        return counts

    cost(parked("warm"), "warm")  # prepared statements, the catalog
    replayed = parked("a-interrupt")
    with pytest.raises(Interrupted):
        rt.drive(replayed)
    assert "cancellation.received" in history_types(client, replayed)
    a = cost(replayed, "a")
    b = cost(parked("b"), "b")
    assert (b - a).transactions == 1, (a, b)
    assert (b - a).rollbacks == 0, (a, b)


def test_journal_notes_what_a_replay_need_not_record() -> None:
    """The journal says which block finished and that the cancellation was seen."""
    journal = Journal.from_events(
        [
            {"type": "all.started", "activityName": "all#1", "branchActivities": ["a#1"]},
            {"type": "step.completed", "activityName": "a#1", "result": 1},
            {"type": "all.completed", "activityName": "all#1"},
            {"type": "all.started", "activityName": "all#3", "branchActivities": ["b#1"]},
            {"type": "step.failed", "activityName": "b#1", "final": True},
            {"type": "all.failed", "activityName": "all#3"},
            {"type": "all.started", "activityName": "all#2", "branchActivities": ["a#2"]},
            {"type": "execution.cancelled", "compensate": True, "actor": "ops"},
            {"type": "cancellation.received", "compensate": True},
        ]
    )
    assert journal.blocks_done == {"all#1", "all#3"}
    assert set(journal.branches) == {"all#1", "all#2", "all#3"}
    assert journal.cancel_seen is True
    assert Journal.from_events([{"type": "execution.cancelled"}]).cancel_seen is False
