"""A run's history read short must never be replayed: the steps missing from it would run
again. A host session's ``sql_select_limit`` (MySQL/MariaDB) cut every read silently; it is
refused when an engine opens, and a claim whose history is not every event up to its run's
next sequence fails its drive instead of replaying it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

import wf_persist as wp

from .fixtures import workflows as w
from .helpers import wait_until


@wp.workflow(name="short-read-steps", version=1)
def steps_then_wait(ctx: wp.Context) -> int:
    total = sum(int(ctx.run(w.echo, i)) for i in range(4))
    ctx.wait_for_signal("go", dict[str, Any])
    return total


@pytest.mark.needs("sql_mode")
@pytest.mark.parametrize(
    ("setting", "says"),
    [("sql_select_limit=5", "sql_select_limit"), ("max_join_size=10", "max_join_size")],
)
def test_session_limits_on_reads_are_refused_when_an_engine_opens(
    setting: str, says: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``sql_select_limit`` cut reads short silently; ``max_join_size`` refused a worker's
    claims and a page of runs once there were more rows than it allows (a raw 1104)."""
    limited = make_engine(db_url, connect_args={"init_command": f"SET SESSION {setting}"})
    for opening in (wp.Runtime, wp.Client):
        with pytest.raises(wp.UnsupportedDatabaseError, match=says):
            opening(limited)


@pytest.mark.needs("sql_mode")
def test_an_upgrade_through_a_session_with_max_join_size_completes_and_puts_it_back(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The upgrade reads information_schema, which max_join_size refused (a raw 1104 half-way
    through wf_0010); the session's setting is put back after."""
    from wf_persist import migrate

    setting = "SET SESSION sql_safe_updates=1, max_join_size=10"
    engine = make_engine(blank_db_url, connect_args={"init_command": setting}, pool_size=1)
    migrate.upgrade(engine)
    assert migrate.current(engine) == migrate.heads()[0]
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT @@sql_big_selects").scalar() == 0


def test_a_history_read_short_fails_the_drive_and_runs_no_recorded_step_again(
    db_url: str, runtime: wp.Runtime
) -> None:
    runtime.register(steps_then_wait)
    client = runtime.client()
    run = client.start(steps_then_wait).execution_id
    assert runtime.drive(run)
    assert [p.name for p in client.pending_signals(run)] == ["go"]
    ran = w.CALLS["echo"]
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:  # one recorded step's completion goes missing
            gone = conn.execute(
                text(
                    "DELETE FROM wf_history WHERE execution_id = :r AND type = 'step.completed'"
                    " AND sequence = (SELECT MIN(sequence) FROM (SELECT sequence FROM"
                    " wf_history WHERE execution_id = :r AND type = 'step.completed') AS s)"
                ),
                {"r": run},
            ).rowcount
        assert gone == 1
        client.signal(run, "go", {})
    finally:
        engine.dispose()
    # Driven here: a claim that reads the history itself is refused (one typed error,
    # nothing claimed); one that leaves it to the drive fails the drive.
    try:
        runtime.drive(run)
    except wp.UnsupportedDatabaseError as exc:
        assert "reading its history gave" in str(exc)
    assert w.CALLS["echo"] == ran, "a recorded step ran again"
    # By a worker: each drive fails, counted; the run never completes.
    runtime.start_worker(poll_interval=0.05)

    def failures() -> list[dict[str, Any]]:
        return [r.event for r in client.history(run) if r.event["type"] == "drive.failed"]

    wait_until(failures, 20, "a failed drive")
    assert "reading its history gave" in str(failures()[-1])
    assert w.CALLS["echo"] == ran, "a recorded step ran again"
    assert client.status(run) != "completed"


@wp.workflow(name="short-read-race", version=1)
def step_wait_step_wait(ctx: wp.Context) -> str:
    ctx.run(w.echo, 1)
    ctx.wait_for_signal("go", int)
    ctx.run(w.echo, 2)
    got = ctx.wait_for_signal("later", int)
    assert isinstance(got, wp.Received)
    return f"later {got.value}"


def test_events_appended_between_a_batch_claim_and_its_read_are_no_short_read(
    runtime: wp.Runtime,
) -> None:
    """A worker's batch claim reads the history later, in a transaction of its own: a
    signal buffered in between makes the read longer than the claim's sequence, which is
    no short read (the first check failed such drives: a child's end or a cancellation
    meeting a busy worker did it)."""
    runtime.register(step_wait_step_wait)
    client = runtime.client()
    run = client.start(step_wait_step_wait).execution_id
    assert runtime.drive(run)
    client.signal(run, "go", 1)
    (claim,) = runtime.claim_due(1)
    assert client.signal(run, "later", 5, buffer=True) == "buffered"
    runtime.drive_claim(claim)
    assert client.result(run, timeout=20).unwrap() == "later 5"
    assert [r for r in client.history(run) if r.event["type"] == "drive.failed"] == []


@pytest.mark.needs("libpq")
def test_a_history_too_big_to_gather_in_one_value_is_read_row_by_row(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's claim gathers a run's history into one value, which cannot pass 1 GB
    (program_limit_exceeded at every try: the caller's ``result()`` raised the driver's
    error for good). Such a claim is made again with the history read row by row; here
    the server refuses the gathered claim for a value of 1 GiB of its own making."""
    from sqlalchemy import func

    from wf_persist.backends import pg_sql, postgresql

    rt = make_runtime()
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 3).execution_id
    gathered = pg_sql.claim_statement
    refused: list[bool] = []

    def too_big(*args: Any) -> Any:
        refused.append(True)
        return gathered(*args).add_columns(func.repeat(" ", 1 << 30))

    monkeypatch.setattr(postgresql, "claim_statement", too_big)
    assert client.result(run, timeout=30).unwrap() == [1, 2, 3]
    assert refused
