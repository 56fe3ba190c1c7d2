"""A run's count of failed drives is reset only by progress or a clean end of a drive.

``drive_failures`` counts the drives in a row that stopped on an error: after
``max_drive_failures`` the run fails, so a write the database refuses every time cannot
make a step, a ``ctx.all`` branch or a compensation run again at every drive, for ever.
A replay writes things that are no progress at every drive (a long attempt's
``step.started``, keyed events it records again and the store drops as duplicates): none
of them resets the count. A drive that parks the run ended without error: that does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import wf_persist as wp
from wf_persist.backends.clock import db_now
from wf_persist.models import executions_table as ex
from wf_persist.store import history

from .helpers import history_types
from .test_mutation_killers import _row
from .test_mutation_killers_driver import refuse  # noqa: F401  (a fixture)

RUNS: list[str] = []


def _due_now(runtime: wp.Runtime, execution_id: str) -> None:
    with runtime.transaction() as conn:  # due again now, not after the backoff
        conn.execute(ex.update().where(ex.c.id == execution_id).values(wake_at=db_now()))


def _drive_until_failed(runtime: wp.Runtime, execution_id: str, drives: int) -> list[int]:
    counts: list[int] = []
    for _ in range(drives):
        if _row(runtime, execution_id)["status"] == "failed":
            break
        _due_now(runtime, execution_id)
        runtime.drive(execution_id)
        count = _row(runtime, execution_id)["drive_failures"]
        assert isinstance(count, int)
        counts.append(count)
    return counts


# a ctx.all branch whose completion the database refuses ------------------------------------


@wp.step
def branch_refused(n: int) -> int:
    RUNS.append("branch")
    return n


@wp.workflow(name="drive-failures-all-refused", version=1)
def all_refused_wf(ctx: wp.Context, n: int) -> list[int]:
    return ctx.all([wp.call(branch_refused, n)])


def test_all_branch_whose_completion_is_refused_ends_the_run(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """``ctx.all`` records ``all.started`` (keyed) at every replay, dropped as a duplicate:
    no progress. The branch whose completion is refused runs once a drive, three times."""
    refuse("NEW.type = 'step.completed'")
    runtime = make_runtime(max_drive_failures=3)
    runtime.register(all_refused_wf)
    RUNS.clear()
    execution_id = runtime.client().start(all_refused_wf, 1).execution_id
    counts = _drive_until_failed(runtime, execution_id, 8)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed", f"drive_failures after each drive: {counts}"
    assert counts == [1, 2, 3] and len(RUNS) == 3


# an earlier ctx.all, recorded again at every replay -------------------------------------


@wp.step
def quick_branch(n: int) -> int:
    return n


@wp.step
def slow_refused(n: int) -> int:
    RUNS.append("slow")
    return n


@wp.workflow(name="drive-failures-all-then-refused", version=1)
def all_then_refused_wf(ctx: wp.Context, n: int) -> int:
    ctx.all([wp.call(quick_branch, n)])
    return ctx.run(slow_refused, n)


def test_earlier_ctx_all_keeps_resetting_the_count(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """A step whose start is recorded on its own (``record_start_after=0``) and whose
    completion is refused, after a ``ctx.all`` that ended long ago (its ``all.started``
    and ``all.finished`` are recorded again, as nothing, at every replay)."""
    refuse("NEW.type = 'step.completed' AND NEW.activity_name LIKE 'slow_refused%'")
    runtime = make_runtime(record_start_after=0, max_drive_failures=3)
    runtime.register(all_then_refused_wf)
    RUNS.clear()
    execution_id = runtime.client().start(all_then_refused_wf, 1).execution_id
    counts = _drive_until_failed(runtime, execution_id, 8)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed", f"drive_failures after each drive: {counts}"
    assert counts == [1, 2, 3] and len(RUNS) == 3


# a cancelled run: cancellation.received recorded again at every replay ------------------

UNDONE: list[int] = []


def _undo(result: int, n: int) -> None:
    UNDONE.append(n)


@wp.step(compensate=_undo)
def booked(n: int) -> int:
    return n


@wp.workflow(name="drive-failures-cancel-refused", version=1)
def cancel_refused_wf(ctx: wp.Context, n: int) -> int:
    ctx.run(booked, n)
    ctx.wait_for_signal("never")
    return n


def test_cancelled_run_whose_compensation_record_is_refused_ends(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """A cancelled run records ``cancellation.received`` (keyed) again at every replay: a
    compensation whose record the database refuses runs once a drive, at most three
    times, and the run fails."""
    runtime = make_runtime(max_drive_failures=3)
    runtime.register(cancel_refused_wf)
    client = runtime.client()
    UNDONE.clear()
    execution_id = client.start(cancel_refused_wf, 5).execution_id
    runtime.drive(execution_id)
    assert _row(runtime, execution_id)["status"] == "suspended"
    refuse("NEW.type = 'compensation.started'")
    client.cancel(execution_id)
    counts = _drive_until_failed(runtime, execution_id, 8)
    row = _row(runtime, execution_id)
    assert row["status"] == "failed", f"drive_failures after each drive: {counts}"
    assert counts == [1, 2, 3] and UNDONE == [5, 5, 5]


# a drive that parks again, adding nothing ------------------------------------------------


@wp.workflow(name="drive-failures-sleeper", version=1)
def sleeper_wf(ctx: wp.Context) -> str:
    ctx.sleep(3600)
    return "slept"


def test_a_clean_drive_that_reparks_resets_the_count(runtime: wp.Runtime) -> None:
    """A sleeping run woken early parks again with nothing new: its drive ended without
    error, so the failed drives before it are no longer "in a row"."""
    runtime.register(sleeper_wf)
    execution_id = runtime.client().start(sleeper_wf).execution_id
    runtime.drive(execution_id)  # parks: sleep.started
    with runtime.transaction() as conn:  # as after 9 failed drives, woken early
        conn.execute(
            ex.update().where(ex.c.id == execution_id).values(drive_failures=9, wake_at=db_now())
        )
    runtime.drive(execution_id)  # replays, parks again until the sleep ends: no error
    row = _row(runtime, execution_id)
    assert row["status"] == "suspended"
    assert row["drive_failures"] == 0, "a drive that ended without error left the count at 9"


# a failed drive whose own record the database refuses ------------------------------------


@wp.step
def last_step(n: int) -> int:
    RUNS.append("last")
    return n


@wp.workflow(name="drive-failures-child", version=1)
def child_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run(last_step, n)


@wp.workflow(name="drive-failures-parent", version=1)
def parent_wf(ctx: wp.Context, n: int) -> int:
    return ctx.run_child(child_wf, n)


def test_a_failed_drive_whose_record_is_refused_is_counted_on_the_run(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """The step's completion and the ``drive.failed`` event are both refused: the failed
    drive is counted on the run's row alone, so the step runs three times, not once per
    lease for ever, and the run fails (its outcome read from the row)."""
    refuse("NEW.type IN ('step.completed', 'drive.failed')")
    runtime = make_runtime(max_drive_failures=3)
    runtime.register(child_wf)
    RUNS.clear()
    execution_id = runtime.client().start(child_wf, 4).execution_id
    counts = _drive_until_failed(runtime, execution_id, 8)
    assert _row(runtime, execution_id)["status"] == "failed", f"counts: {counts}"
    assert counts == [1, 2, 3] and RUNS == ["last"] * 3
    outcome = runtime.client().result(execution_id, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)


def test_a_child_whose_parent_cannot_be_told_still_ends(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """The child's outcome goes into its parent's history in the same transaction; the
    parent's ``child.finished`` is refused, so every finish of the child fails, and so
    does the record of its last failed drive (a terminal child tells its parent): the
    child is failed on its row alone after three drives, its step run three times."""
    runtime = make_runtime(max_drive_failures=3)
    runtime.register(parent_wf, child_wf)
    RUNS.clear()
    parent = runtime.client().start(parent_wf, 4).execution_id
    runtime.drive(parent)  # starts the child, parks
    [child] = [
        r.event["childExecutionId"]
        for r in runtime.client().history(parent)
        if r.event["type"] == "child.started"
    ]
    refuse("NEW.type = 'child.finished'")
    counts = _drive_until_failed(runtime, child, 8)
    assert _row(runtime, child)["status"] == "failed", f"counts: {counts}"
    assert RUNS == ["last"] * 3


def _child_of(runtime: wp.Runtime, parent: str) -> str:
    [child] = [
        r.event["childExecutionId"]
        for r in runtime.client().history(parent)
        if r.event["type"] == "child.started"
    ]
    return str(child)


def test_a_child_failed_on_its_row_still_tells_its_parent(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
) -> None:
    """Only the child's own history refuses (its step's completion, its ``drive.failed``):
    failed on its row at the limit, it still tells its parent, which fails in turn."""
    runtime = make_runtime(max_drive_failures=2)
    runtime.register(parent_wf, child_wf)
    RUNS.clear()
    parent = runtime.client().start(parent_wf, 4).execution_id
    runtime.drive(parent)
    child = _child_of(runtime, parent)
    refuse(f"NEW.type IN ('step.completed', 'drive.failed') AND NEW.execution_id = '{child}'")
    _drive_until_failed(runtime, child, 6)
    assert _row(runtime, child)["status"] == "failed" and RUNS == ["last"] * 2
    assert "child.finished" in history_types(runtime.client(), parent)
    _due_now(runtime, parent)  # woken by the news already; now, whoever drives it
    runtime.drive(parent)
    outcome = runtime.client().result(parent, timeout=5)
    assert isinstance(outcome, wp.Failed)


def test_a_passing_error_at_the_limit_is_tried_again_with_the_history(
    make_runtime: Callable[..., wp.Runtime],
    refuse: Callable[[str], None],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record of the last failed drive meets an error once (a dropped connection, a
    deadlock): it is tried again, whole (``drive.failed``, ``workflow.failed``, the parent
    told), not reduced to the run's row at once."""
    runtime = make_runtime(max_drive_failures=1)
    runtime.register(parent_wf, child_wf)
    parent = runtime.client().start(parent_wf, 4).execution_id
    runtime.drive(parent)
    child = _child_of(runtime, parent)
    refuse(f"NEW.type = 'step.completed' AND NEW.execution_id = '{child}'")
    real = history.append
    tripped: list[bool] = []

    def once(conn: Any, backend: Any, eid: str, evs: Any, **kw: Any) -> Any:
        if not tripped and any(e.type == "drive.failed" for e in evs):
            tripped.append(True)
            raise ConnectionError("server closed the connection unexpectedly")
        return real(conn, backend, eid, evs, **kw)

    monkeypatch.setattr(history, "append", once)
    _due_now(runtime, child)
    runtime.drive(child)
    assert tripped
    types = history_types(runtime.client(), child)
    assert types[-2:] == ["drive.failed", "workflow.failed"]
    assert "child.finished" in history_types(runtime.client(), parent)
