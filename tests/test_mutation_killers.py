"""Tests that kill mutants of the core modules the rest of the suite let survive.

Each pins documented behaviour (README, docstrings, docs/sql.md) that a mutation run
(``make mutation``, docs/mutation.md) showed no other test asserted; each docstring names
the mutants it kills.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import StringConstraints
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool

import wf_persist as wp
from wf_persist import migrate
from wf_persist.backends.sqlite import SQLiteBackend
from wf_persist.context import MAX_DURATION_SECONDS
from wf_persist.errors import StaleHistoryError
from wf_persist.events import NewEvent
from wf_persist.leases import Outage
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist
from wf_persist.store import executions, history, signals
from wf_persist.worker import Worker

from .fixtures import saga as s
from .fixtures import workflows as w
from .helpers import history_types, wait_status, wait_until
from .test_limits_secrets import holder_and_queued

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
TOKYO = dt.timezone(dt.timedelta(hours=9))


def _started(runtime: wp.Runtime) -> str:
    runtime.register(w.echo_wf)
    return runtime.client().start(w.echo_wf, 2).execution_id


def _row(runtime: wp.Runtime, execution_id: str) -> dict[str, object]:
    with runtime.transaction() as conn:
        return dict(conn.execute(select(ex).where(ex.c.id == execution_id)).mappings().one())


def _seconds(later: object, earlier: object) -> float:
    assert isinstance(later, dt.datetime) and isinstance(earlier, dt.datetime)
    return (later - earlier).total_seconds()


# leases: Backend.renew ----------------------------------------------------------------


def test_renew_extends_only_leases_held_at_their_epoch(runtime: wp.Runtime) -> None:
    """``renew`` extends the lease (and the takeover time, ``wake_at``) of each run still
    held at the given epoch, by the TTL on the database's clock, and returns those ids; a
    run held at another epoch, or not named, is left alone. Kills the ``Backend.renew``
    mutants that drop or null a column, lose the WHERE or the TTL parameter."""
    held = _started(runtime)
    other = _started(runtime)
    backend = runtime.backend
    with runtime.transaction() as conn:
        claim = backend.claim(conn, held, runtime.owner, 5)
        other_claim = backend.claim(conn, other, runtime.owner, 5)
    assert claim is not None and other_claim is not None
    before, other_before = _row(runtime, held), _row(runtime, other)
    with runtime.transaction() as conn:
        assert backend.renew(conn, {}, 3600) == set()
        assert backend.renew(conn, {held: claim.epoch}, 3600) == {held}
    after = _row(runtime, held)
    assert _seconds(after["lease_expires_at"], before["lease_expires_at"]) > 3000
    assert _seconds(after["wake_at"], before["wake_at"]) > 3000
    assert _row(runtime, other) == other_before, "a lease not named is not renewed"
    with runtime.transaction() as conn:  # a stale epoch renews nothing
        assert backend.renew(conn, {held: claim.epoch + 1}, 7200) == set()
    assert _row(runtime, held) == after


def test_release_clears_the_lease_and_makes_the_run_due_after_the_delay(
    runtime: wp.Runtime,
) -> None:
    """``release`` gives up leases held at their epoch: the run has no lease owner or expiry
    any more (docs/sql.md: they are set "while one does" drive it) and is due again after
    ``delay`` seconds, so another runtime claims it then; it returns how many it released,
    0 for none. Kills the ``Backend.release`` mutants that keep a lease column or miscount."""
    execution_id = _started(runtime)
    backend = runtime.backend
    with runtime.transaction() as conn:
        claim = backend.claim(conn, execution_id, runtime.owner, 3600)
        assert backend.release(conn, {}) == 0
    assert claim is not None
    with runtime.transaction() as conn:
        assert backend.release(conn, {execution_id: claim.epoch + 1}) == 0
        assert backend.release(conn, {execution_id: claim.epoch}, 3600) == 1
    row = _row(runtime, execution_id)
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    with runtime.transaction() as conn:  # due again only in an hour
        assert backend.claim(conn, execution_id, "another", 30) is None
    other = _started(runtime)
    with runtime.transaction() as conn:
        held = backend.claim(conn, other, runtime.owner, 3600)
    assert held is not None
    with runtime.transaction() as conn:
        assert backend.release(conn, {other: held.epoch}) == 1
    with runtime.transaction() as conn:  # released without a delay: claimable at once
        taken = backend.claim(conn, other, "another", 30)
    assert taken is not None and taken.epoch > held.epoch


# listing: keyset pagination and filters -------------------------------------------------


def _create(runtime: wp.Runtime, execution_id: str, at: dt.datetime, actor: str | None) -> None:
    runtime.register(w.echo_wf)
    started = NewEvent({"type": "execution.started", "executionId": execution_id}, at)
    with runtime.transaction() as conn:
        executions.create(
            conn,
            runtime.backend,
            execution_id=execution_id,
            workflow_name=w.echo_wf.name,
            workflow_version=1,
            payload=None,
            idempotency_key=None,
            actor=actor,
            started=started,
            now=at,
        )


def test_pages_walk_runs_created_at_the_same_instant_exactly_once(runtime: wp.Runtime) -> None:
    """``list`` is keyset-paginated on ``(created_at, id)``: runs created at one instant
    are ordered by id and each page starts after the last row of the previous one, so a
    run is neither skipped nor repeated, also when an older run has a larger id. Kills the
    ``keyset_after`` mutants that drop either half of the tie-break and the ``list_page``
    mutants that drop ``id`` from the ORDER BY."""
    early = "ffffffff-0000-4000-8000-" + "0" * 12
    ties = [f"{i:08x}-0000-4000-8000-" + "0" * 12 for i in (3, 1, 2)]
    _create(runtime, early, T0, None)
    for execution_id in ties:
        _create(runtime, execution_id, T0 + dt.timedelta(seconds=1), None)
    client = runtime.client()
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        page = client.list(w.echo_wf, limit=1, cursor=cursor)
        seen += [i.execution_id for i in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [early, *sorted(ties)]
    assert [i.execution_id for i in client.list(w.echo_wf).items] == [early, *sorted(ties)]


def test_list_time_range_is_half_open_and_actor_filters(runtime: wp.Runtime) -> None:
    """Creation time is filtered as ``[created_after, created_before)`` and ``actor``
    selects that actor's runs only. Kills the ``list_page`` mutants that drop a bound,
    make either bound inclusive/exclusive the other way, or invert the actor filter."""
    ids = [str(uuid.UUID(int=i + 1)) for i in range(4)]
    for i, (execution_id, actor) in enumerate(zip(ids, ["ann", "bob", "ann", "cy"], strict=True)):
        _create(runtime, execution_id, T0 + dt.timedelta(hours=i), actor)
    client = runtime.client()

    def listed(**kwargs: object) -> list[str]:
        return [i.execution_id for i in client.list(w.echo_wf, **kwargs).items]  # type: ignore[arg-type]

    one, three = T0 + dt.timedelta(hours=1), T0 + dt.timedelta(hours=3)
    assert listed(created_after=one, created_before=three) == ids[1:3]
    assert listed(created_after=one) == ids[1:]
    assert listed(created_before=three) == ids[:3]
    assert listed(actor="ann") == [ids[0], ids[2]]
    assert listed(actor="cy", created_after=one) == [ids[3]]
    assert listed(limit=2) == ids[:2]


# purge ----------------------------------------------------------------------------------


def test_purge_batch_deletes_the_oldest_finished_runs_of_the_wanted_statuses(
    runtime: wp.Runtime,
) -> None:
    """``purge_batch`` deletes up to ``limit`` runs of the wanted terminal statuses that
    finished strictly before the cutoff, oldest first, with their history; other statuses,
    later runs and every other run's history stay, and non-terminal statuses match
    nothing. Kills the ``purge_batch`` mutants that drop or loosen a filter, the ordering,
    the history filter or the early return."""
    runtime.register(*w.ALL)
    client = runtime.client()
    done = [client.start(w.echo_wf, 2).execution_id for _ in range(3)]
    for execution_id in done:
        client.result(execution_id)
    failed = client.start(w.explode_wf, "x").execution_id
    client.result(failed)
    running = client.start(w.echo_wf, 2).execution_id
    # finished at T0+3min, +2min, +1min (completed: the oldest was started last) and T0
    finished_at = dict(zip([*done, failed], (3, 2, 1, 0), strict=True))
    with runtime.transaction() as conn:
        for execution_id, minutes in finished_at.items():
            at = T0 + dt.timedelta(minutes=minutes)
            conn.execute(ex.update().where(ex.c.id == execution_id).values(finished_at=at))
    cutoff = T0 + dt.timedelta(minutes=3)  # the run finished exactly then is not older
    with runtime.transaction() as conn:
        assert (
            executions.purge_batch(conn, finished_before=cutoff, statuses=["running"], limit=9) == 0
        )
        assert (
            executions.purge_batch(conn, finished_before=cutoff, statuses=["completed"], limit=1)
            == 1
        )
    gone = done[2]  # completed at T0+1min: the oldest completed run
    with pytest.raises(wp.UnknownExecutionError):
        client.status(gone)
    with runtime.transaction() as conn:
        assert (
            executions.purge_batch(conn, finished_before=cutoff, statuses=["completed"], limit=9)
            == 1
        )
    assert client.status(done[0]) == "completed", "finished at the cutoff: kept"
    assert client.status(failed) == "failed", "a status not asked for: kept"
    assert client.status(running) == "running"
    with runtime.transaction() as conn:
        left = {r[0] for r in conn.execute(select(hist.c.execution_id).distinct())}
    assert left == {done[0], failed, running}


def test_purge_batch_deletes_history_whatever_the_foreign_key_setting(
    runtime: wp.Runtime, db_engine: Engine
) -> None:
    """History is deleted explicitly, not by the foreign key's cascade, "so it works
    whatever the connection's foreign-key setting": on a host's plain SQLite engine
    (foreign keys off) a purge leaves no orphaned history. Kills the ``purge_batch`` mutant
    that deletes no history itself."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    done = [client.start(w.echo_wf, 2).execution_id for _ in range(2)]
    for execution_id in done:
        client.result(execution_id, timeout=30)
    later = runtime.clock() + dt.timedelta(hours=1)
    with db_engine.begin() as conn:
        purged = executions.purge_batch(
            conn, finished_before=later, statuses=["completed"], limit=10
        )
    assert purged == 2
    with db_engine.connect() as conn:
        left = conn.execute(select(hist.c.execution_id).where(hist.c.execution_id.in_(done)))
        assert left.all() == []


# SQLite: read-only commands never create a database ------------------------------------


def test_schema_state_of_sqlite_urls_never_creates_a_file(tmp_path: Path) -> None:
    """``migrate.state`` never creates anything: a missing SQLite file reads as
    ``missing`` and is not created, also when named by a URI filename (``file:PATH``, which
    SQLite would create too), while in-memory databases (``sqlite://``, ``:memory:``,
    ``mode=memory``) are read as they are. Kills every ``SQLiteBackend.database_missing``
    mutant."""
    missing = tmp_path / "missing.sqlite3"
    state = migrate.state(f"sqlite:///{missing}")
    assert state.missing and state.revision is None and not missing.exists()
    for url in ("sqlite://", "sqlite:///:memory:"):
        memory = migrate.state(url)
        assert not memory.missing and memory.revision is None, url
    assert SQLiteBackend.database_missing(make_url(f"sqlite:///{missing}"))
    assert not SQLiteBackend.database_missing(make_url("sqlite://"))
    assert not SQLiteBackend.database_missing(make_url("sqlite:///:memory:"))
    assert SQLiteBackend.database_missing(make_url(f"sqlite:///file:{missing}?uri=true"))
    in_memory = f"sqlite:///file:{missing}?uri=true&mode=memory"
    assert not SQLiteBackend.database_missing(make_url(in_memory))
    made = tmp_path / "made.sqlite3"
    migrate.upgrade(f"sqlite:///{made}")
    assert not SQLiteBackend.database_missing(make_url(f"sqlite:///{made}"))
    uri = migrate.state(f"sqlite:///file:{made}?mode=ro&uri=true")
    assert not uri.missing and uri.revision == migrate.current(f"sqlite:///{made}") is not None


def test_an_existing_database_is_never_missing(db_url: str) -> None:
    """Every backend reads an existing, migrated database's revision (none is taken for a
    missing SQLite file)."""
    state = migrate.state(db_url)
    assert not state.missing and state.revision is not None


# fenced writes (the generic UPDATE ... RETURNING path) -----------------------------------


def test_fenced_write_sets_columns_under_its_status_guard(runtime: wp.Runtime) -> None:
    """``Backend.fenced`` appends the events and updates the run only at the current epoch
    and, with a guard, only from a guarded status; it returns the new sequences and the
    run's status after the write (on every backend), and a refused write raises
    ``LeaseLostError`` naming the run and changes nothing. Kills the ``fenced`` and
    ``_params`` mutants that drop the values, the guard, the returned status or the run id
    of the error."""
    execution_id = _started(runtime)
    backend = runtime.backend
    now = runtime.clock()
    with runtime.transaction() as conn:
        claim = backend.claim(conn, execution_id, runtime.owner, 30)
    assert claim is not None

    def event(name: str) -> NewEvent:
        doc = {"type": "step.completed", "executionId": execution_id, "activityName": name}
        return NewEvent(doc, now)

    with runtime.transaction() as conn:
        done = backend.fenced(conn, execution_id, claim.epoch, [event("a#1")], now=now)
    assert (done.sequences, done.status) == ([2], "running")
    with runtime.transaction() as conn:
        done = backend.fenced(
            conn, execution_id, claim.epoch, [], now=now, values={"status": "suspended"}
        )
    assert (done.sequences, done.status) == ([], "suspended"), "the status after the write"
    assert _row(runtime, execution_id)["status"] == "suspended"
    with pytest.raises(wp.LeaseLostError) as lost, runtime.transaction() as conn:
        backend.fenced(
            conn,
            execution_id,
            claim.epoch,
            [event("b#1")],
            now=now,
            values={"status": "completed"},
            guard=("running",),
        )
    assert lost.value.execution_id == execution_id
    assert _row(runtime, execution_id)["status"] == "suspended"
    with runtime.transaction() as conn:
        done = backend.fenced(
            conn,
            execution_id,
            claim.epoch,
            [event("b#1"), event("c#1")],
            now=now,
            values={"status": "completed"},
            guard=("running", "suspended"),
        )
    assert done.sequences == [3, 4]
    assert _row(runtime, execution_id)["status"] == "completed"
    types = [e["type"] for e in (r.event for r in runtime.client().history(execution_id))]
    assert types == ["execution.started", "step.completed", "step.completed", "step.completed"]


# compensations ---------------------------------------------------------------------------

UNDONE: list[tuple[int, int]] = []


@wp.step(compensate=max)
def reserve(amount: int) -> int:
    return amount + 1


@wp.workflow(name="mutation-compensate-builtin", version=1)
def compensate_builtin_wf(ctx: wp.Context, amount: int) -> int:
    ctx.run(reserve, amount)
    ctx.fail(ValueError("undo"))
    return 0


def test_a_compensation_without_an_inspectable_signature_runs_without_reason(
    runtime: wp.Runtime,
) -> None:
    """A compensation is called as ``compensate(result, *args)`` plus ``reason=`` only when
    it accepts one; a callable whose signature cannot be read (a builtin such as ``max``)
    is called without it and completes. Kills ``_call_compensation``'s mutant that breaks
    the no-signature fallback."""
    runtime.register(compensate_builtin_wf)
    client = runtime.client()
    execution_id = client.start(compensate_builtin_wf, 4).execution_id
    assert isinstance(client.result(execution_id, timeout=30), wp.Failed)
    types = [r.event["type"] for r in client.history(execution_id)]
    assert "compensation.completed" in types and "compensation.failed" not in types


# replay from fresh history ---------------------------------------------------------------

CANCELLER: dict[str, wp.WorkflowClient] = {}


@wp.step
def cancel_own_run(execution_id: str) -> str:
    CANCELLER["client"].cancel(execution_id, actor="itself")
    return execution_id


@wp.workflow(name="mutation-cancel-then-sleep", version=1)
def cancel_then_sleep_wf(ctx: wp.Context) -> str:
    ctx.run(cancel_own_run, ctx.execution_id)
    ctx.sleep(3600)
    return "slept"


def test_a_cancellation_seen_mid_drive_replays_from_fresh_history(runtime: wp.Runtime) -> None:
    """A client event after the history a drive read (here a cancellation recorded while a
    step ran) makes the next call replay the body from fresh history in the same drive:
    the run unwinds and fails as cancelled, with no failed drive counted, and records the
    request it saw (``cancellation.received``: run, ``compensate``, actor). Kills the
    ``load_journal`` mutants (each turns the reload into a failed drive) and the
    ``Context._before_new_call`` mutants that drop a field of that event."""
    runtime.register(cancel_then_sleep_wf)
    client = runtime.client()
    CANCELLER["client"] = client
    execution_id = client.start(cancel_then_sleep_wf).execution_id
    outcome = client.result(execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"
    events = [r.event for r in client.history(execution_id)]
    types = [e["type"] for e in events]
    assert "drive.failed" not in types and "sleep.started" not in types
    assert _row(runtime, execution_id)["drive_failures"] == 0
    received = next(e for e in events if e["type"] == "cancellation.received")
    assert (received["executionId"], received["compensate"], received["actor"]) == (
        execution_id,
        True,
        "itself",
    ), "the driver's record of the request it saw"


# cancellation fences the run -------------------------------------------------------------


def test_a_cancelled_runs_epoch_moves_past_every_claim(runtime: wp.Runtime) -> None:
    """Cancelling without compensation bumps the fencing token, so no driver that ever
    held the run (any earlier epoch) can write to it again. Kills the ``cancel`` mutant
    that moves the epoch backwards (onto an older claim's token)."""
    execution_id = _started(runtime)
    backend = runtime.backend
    with runtime.transaction() as conn:
        first = backend.claim(conn, execution_id, "first", 30)
    assert first is not None
    with runtime.transaction() as conn:
        backend.release(conn, {execution_id: first.epoch})
    with runtime.transaction() as conn:
        second = backend.claim(conn, execution_id, "second", 30)
    assert second is not None and second.epoch > first.epoch
    runtime.client().cancel(execution_id, compensate=False)
    assert _row(runtime, execution_id)["claim_epoch"] > second.epoch  # type: ignore[operator]
    now = runtime.clock()
    ev = NewEvent(
        {"type": "step.completed", "executionId": execution_id, "activityName": "x#1"}, now
    )
    for epoch in (first.epoch, second.epoch):
        with pytest.raises(wp.LeaseLostError), runtime.transaction() as conn:
            backend.fenced(conn, execution_id, epoch, [ev], now=now)


def test_cancelling_an_unknown_run_raises_naming_it(runtime: wp.Runtime) -> None:
    """Cancelling an id no run has raises ``UnknownExecutionError`` carrying that id, from
    the client and from the store function a host calls in its own transaction. Kills the
    ``store.executions.cancel`` mutant that raises it without the id."""
    missing = str(uuid.uuid4())
    with pytest.raises(wp.UnknownExecutionError) as raised:
        runtime.client().cancel(missing)
    assert raised.value.execution_id == missing
    now = runtime.clock()
    cancelled = NewEvent({"type": "execution.cancelled", "executionId": missing}, now)
    with pytest.raises(wp.UnknownExecutionError) as raised, runtime.transaction() as conn:
        executions.cancel(
            conn, runtime.backend, missing, cancelled=cancelled, compensate=True, error={}, now=now
        )
    assert raised.value.execution_id == missing


# concurrency slots -----------------------------------------------------------------------


@pytest.mark.usefixtures("saga_reset")
def test_a_run_queued_behind_a_limit_waits_without_replaying_or_failing(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A run waiting for a step's slot checks now and then that it is still its own and
    not cancelled, and otherwise just waits: once the slot frees, its one attempt runs,
    with no failed drive and no replay (one ``step.started``). Kills the ``check_run``
    mutants that break the check's query or replay on every check."""
    runtime = make_runtime(record_start_after=0)
    client = runtime.client()
    holder, queued = holder_and_queued(runtime)
    time.sleep(0.8)  # several of the checks made every 0.2 s while it queues
    s.GATE.set()
    assert client.result(holder.execution_id, timeout=10).unwrap() == "holder"
    assert client.result(queued.execution_id, timeout=10).unwrap() == "queued"
    types = history_types(client, queued.execution_id)
    assert types.count("step.started") == 1 and "drive.failed" not in types
    assert _row(runtime, queued.execution_id)["drive_failures"] == 0


@pytest.mark.usefixtures("saga_reset")
def test_a_run_cancelled_while_it_queues_stops_waiting_at_once(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A run cancelled without compensation while it waits for a slot stops waiting at its
    next check (every 0.2 s), not when its lease renewal next fails (a quarter of a long
    TTL later). Kills the ``check_run`` mutant that only notices a vanished run."""
    runtime = make_runtime(record_start_after=0, lease_ttl=60)
    client = runtime.client()
    holder, queued = holder_and_queued(runtime)
    client.cancel(queued.execution_id, compensate=False)
    wait_until(lambda: queued.execution_id not in runtime._driving, 3, "the queued drive ends")
    s.GATE.set()
    assert client.result(holder.execution_id, timeout=10).unwrap() == "holder"
    assert s.CALLS["exclusive:queued"] == 0


# workers ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("saga_reset")
def test_worker_stop_waits_for_runs_in_flight_and_is_safe_before_start(
    runtime: wp.Runtime,
) -> None:
    """``Worker.stop`` on a worker never started returns at once; on a started one it waits
    (up to ``timeout``) for its loop, which waits for the runs in flight; the loop is a
    daemon thread, so a process that never stops it can still exit. Kills the
    ``Worker.stop`` mutants of its join condition and ``Worker.start``'s daemon mutant."""
    Worker(runtime, concurrency=1).stop()
    runtime.register(*s.ALL)
    worker = Worker(runtime, concurrency=1, poll_interval=0.05).start()
    runtime.client().start(s.exclusive_wf, "holder")
    wait_until(lambda: s.CALLS["exclusive:holder"] > 0, what="the run in flight")
    threading.Timer(0.5, s.GATE.set).start()
    assert worker._thread is not None and worker._thread.daemon  # never keeps a process alive
    worker.stop(timeout=10)
    assert s.GATE.is_set()
    assert worker._thread is not None and not worker._thread.is_alive()


@pytest.mark.usefixtures("saga_reset")
def test_a_worker_claims_no_more_runs_than_it_drives_at_once(runtime: wp.Runtime) -> None:
    """``concurrency`` is how many runs a worker drives at once, and it claims no more
    than that: due runs it could not start stay unleased, for other workers. Here two are
    in flight (one in the step, one queued for its slot) and two more stay unclaimed.
    Kills the ``Worker.run`` mutants that count runs in flight wrong."""
    runtime.register(*s.ALL)
    client = runtime.client()
    holder = client.start(s.exclusive_wf, "holder").execution_id
    runtime.start_worker(concurrency=2, poll_interval=0.02)
    wait_until(lambda: s.CALLS["exclusive:holder"] > 0, what="the run in flight")
    queued = client.start(s.exclusive_wf, "b").execution_id
    wait_until(lambda: "step.started" in history_types(client, queued), 10, "b's attempt")
    others = [client.start(s.exclusive_wf, label).execution_id for label in ("c", "d")]
    time.sleep(0.5)  # many polls of the worker's loop
    with runtime.transaction() as conn:
        leased = conn.execute(select(ex.c.id).where(ex.c.lease_owner.is_not(None))).all()
    assert sorted(r[0] for r in leased) == sorted([holder, queued])
    s.GATE.set()
    for execution_id in [holder, queued, *others]:
        assert isinstance(client.result(execution_id, timeout=10), wp.Completed)


def test_worker_arguments_are_checked_and_default_to_four_runs(runtime: wp.Runtime) -> None:
    """A worker drives 4 runs at once unless told otherwise and polls at the runtime's
    interval; ``concurrency`` must be a positive integer (not a bool, not a float). Kills
    the ``Worker.__init__`` mutants of the default and of the type check, and the
    ``Runtime.start_worker`` mutants of its default and its poll interval (README:
    ``runtime.start_worker(concurrency=4)``)."""
    worker = Worker(runtime)
    assert worker.concurrency == 4 and worker.poll_interval == runtime.poll_interval
    for bad in (True, 2.0, 0, -1):
        with pytest.raises(wp.InvalidArgumentError, match="concurrency"):
            Worker(runtime, concurrency=bad)  # type: ignore[arg-type]
    for interval in (True, "1", 0, -0.5, float("inf")):
        with pytest.raises(wp.InvalidArgumentError, match="poll_interval"):
            Worker(runtime, poll_interval=interval)  # type: ignore[arg-type]
    assert Worker(runtime, poll_interval=2).poll_interval == 2.0
    started = runtime.start_worker(poll_interval=0.4)
    assert started.concurrency == 4 and started.poll_interval == 0.4


@wp.workflow(name="mutation-short-sleep", version=1)
def short_sleep_wf(ctx: wp.Context) -> str:
    ctx.sleep(0.2)
    return "woke"


def test_a_worker_wakes_for_a_known_timer_before_its_poll_interval(runtime: wp.Runtime) -> None:
    """ "Timers known to this worker fire on time; others within one interval": with a
    5 s poll interval, a run sleeping 0.2 s is finished well before the first poll.
    Kills the ``Worker._idle_wait`` mutant that ignores the next wake time."""
    runtime.register(short_sleep_wf)
    runtime.start_worker(concurrency=2, poll_interval=5)
    client = runtime.client()
    started = time.monotonic()
    execution_id = client.start(short_sleep_wf).execution_id
    wait_status(client, execution_id, "completed", 4)  # polls status, never drives the run
    assert time.monotonic() - started < 4


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    """Saying once (not every poll) that something fails: the first failure of an outage
    is logged and later ones are not, its end is logged once, the backoff doubles from
    ``base`` up to ``cap``, and a new outage starts over. Kills the
    ``Outage.succeeded`` mutants."""
    logger = logging.getLogger("wf_persist.test_outage")
    outage = Outage(logger, "polling", 0.5, cap=1.5)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        waits = [outage.failed(RuntimeError("down")) for _ in range(3)]
        outage.succeeded()
        outage.succeeded()
        again = outage.failed(RuntimeError("down again"))
    assert waits == [0.5, 1.0, 1.5] and again == 0.5
    levels = [r.levelname for r in caplog.records]
    assert levels == ["ERROR", "WARNING", "ERROR"], caplog.text


# signals -----------------------------------------------------------------------------------


@wp.workflow(name="mutation-two-signals", version=1)
def two_signals_wf(ctx: wp.Context) -> str:
    ctx.wait_for_signal("a#b", int)
    ctx.wait_for_signal("other", int)
    return "done"


def test_signal_errors_name_the_run_and_a_received_wait_counts_as_delivered(
    runtime: wp.Runtime,
) -> None:
    """A signal to a wait that already got its signal (delivered, or received by the run)
    raises ``SignalAlreadyDeliveredError``; to a name the run never waited on, or to a run
    that is not signalable, ``SignalNotWaitingError``; both carry the run's id and the
    signal's name, also when the name itself contains ``#``. Kills the
    ``store.signals.deliver`` mutants of those branches and error arguments."""
    runtime.register(two_signals_wf)
    client = runtime.client()
    execution_id = client.start(two_signals_wf).execution_id
    runtime.start_worker(concurrency=2, poll_interval=0.02)
    wait_until(lambda: client.pending_signals(execution_id), 10, "the first wait")
    client.signal(execution_id, "a#b", 1)
    with pytest.raises(wp.SignalAlreadyDeliveredError) as delivered:
        client.signal(execution_id, "a#b", 2)
    assert (delivered.value.execution_id, delivered.value.signal_name) == (execution_id, "a#b")
    wait_until(
        lambda: [p.name for p in client.pending_signals(execution_id)] == ["other"],
        10,
        "the second wait",
    )
    assert "signal.received" in history_types(client, execution_id)
    with pytest.raises(wp.SignalAlreadyDeliveredError) as received:
        client.signal(execution_id, "a#b", 3)
    assert (received.value.execution_id, received.value.signal_name) == (execution_id, "a#b")
    with pytest.raises(wp.SignalNotWaitingError) as never:
        client.signal(execution_id, "never", 1)
    assert (never.value.execution_id, never.value.signal_name) == (execution_id, "never")
    client.signal(execution_id, "other", 4)
    wait_status(client, execution_id, "completed", 10)
    with pytest.raises(wp.SignalNotWaitingError) as finished:
        client.signal(execution_id, "other", 5)
    assert (finished.value.execution_id, finished.value.signal_name) == (execution_id, "other")
    missing = str(uuid.uuid4())
    with pytest.raises(wp.UnknownExecutionError) as unknown, runtime.transaction() as conn:
        signals.deliver(
            conn, runtime.backend, missing, "x", lambda wait: None, None, runtime.clock()
        )
    assert unknown.value.execution_id == missing


# retries across replays --------------------------------------------------------------------

ATTEMPTS: list[int] = []


@wp.step(retry=wp.Retry(attempts=3, backoff="exponential", base=1.05, factor=1))
def always_fails() -> str:
    ATTEMPTS.append(1)
    raise RuntimeError("still down")


@wp.workflow(name="mutation-parked-retries", version=1)
def parked_retries_wf(ctx: wp.Context) -> str:
    return ctx.run(always_fails)


def test_parked_retries_keep_counting_attempts_across_replays(runtime: wp.Runtime) -> None:
    """Each retry delay here is longer than the inline limit, so the run parks between
    attempts and every attempt after the first starts from a replayed history: it must
    still be attempt n+1 of ``attempts`` (each ``step.failed`` records its number, the
    last one ``final``), and the step runs exactly ``attempts`` times. Kills the
    ``Journal._step_event`` mutants that lose the attempt number or miscount failures."""
    ATTEMPTS.clear()
    runtime.register(parked_retries_wf)
    client = runtime.client()
    execution_id = client.start(parked_retries_wf).execution_id
    outcome = client.result(execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    failed = [r.event for r in client.history(execution_id) if r.event["type"] == "step.failed"]
    assert [(e["attempt"], e["final"]) for e in failed] == [(1, False), (2, False), (3, True)]
    assert len(ATTEMPTS) == 3


# recorded step failures raised again on replay -----------------------------------------


class Declined(Exception):
    """A terminal error importable by its module path: replay rebuilds this very class."""

    def __init__(self, code: int) -> None:
        super().__init__(f"declined {code}")
        self.code = code


def _local_error() -> type[Exception]:
    class Refused(Exception):  # not importable by name: replay finds it among step.errors
        def __init__(self, reason: str) -> None:
            super().__init__(reason)
            self.reason = reason

    return Refused


#: Bound under another name: ``module:Refused`` does not resolve, so replay takes the
#: class from the step's ``errors``.
_REFUSED = _local_error()
#: A subclass raised where its base is declared: replay rebuilds the declared base.
_HARD_REFUSAL = type("HardRefusal", (_REFUSED,), {})


@wp.step(errors=(Declined,))
def mutation_decline(code: int) -> str:
    raise Declined(code)


@wp.step(errors=(_REFUSED,))
def mutation_refuse(reason: str) -> str:
    raise _REFUSED(reason)


@wp.step(errors=(_REFUSED,))
def mutation_refuse_hard(reason: str) -> str:
    raise _HARD_REFUSAL(reason)


@wp.step(retry=wp.Retry(attempts=1))
def mutation_flaky() -> str:
    raise RuntimeError("flaky")


@wp.workflow(name="mutation-replayed-failures", version=1)
def replayed_failures_wf(ctx: wp.Context) -> list[str]:
    """Catches three recorded step failures, then sleeps: the result comes from the replay
    after the sleep, so each failure is the one rebuilt from history."""
    seen = []
    try:
        ctx.run(mutation_decline, 7)
    except Declined as exc:
        seen.append(f"{type(exc).__name__}:{exc.code}")
    try:
        ctx.run(mutation_refuse, "no stock")
    except _REFUSED as exc:
        seen.append(f"{type(exc).__name__}:{exc.reason}")  # type: ignore[attr-defined]
    try:
        ctx.run(mutation_refuse_hard, "never")
    except _REFUSED as exc:
        seen.append(f"{type(exc).__name__}:{exc.reason}")  # type: ignore[attr-defined]
    try:
        ctx.run(mutation_flaky)
    except wp.StepExecutionError as exc:
        seen.append(f"{type(exc).__name__}:{exc.step_name}")
    ctx.sleep(0.05)
    return seen


def test_recorded_step_failures_are_raised_again_as_recorded_on_replay(
    runtime: wp.Runtime,
) -> None:
    """README: a terminal error is "raised in the workflow as itself (rebuilt with its
    fields on replay)", whether or not its class can be imported by name; exhausted retries
    raise ``StepExecutionError`` naming the step. Kills the ``_recorded_step_error``
    mutants."""
    runtime.register(replayed_failures_wf)
    client = runtime.client()
    handle = client.start(replayed_failures_wf, None)
    outcome = client.result(handle.execution_id, timeout=30)
    assert outcome.unwrap() == [
        "Declined:7",
        "Refused:no stock",
        "Refused:never",
        "StepExecutionError:mutation_flaky",
    ]
    assert history_types(client, handle.execution_id).count("step.failed") == 4


# code blocks --------------------------------------------------------------------------


@wp.workflow(name="mutation-code-blocks", version=1)
def code_blocks_wf(ctx: wp.Context) -> list[str]:
    """Two code blocks, one failing and caught, then a sleep: the result comes from the
    replay after it, so both outcomes are the recorded ones."""
    seen = [str(ctx.code("pick", lambda: 41 + 1, output=int, reason="the answer"))]
    try:
        ctx.code("boom", lambda: 1 // 0, output=int, reason="divide")
    except wp.CodeExecutionError as exc:
        seen.append(f"{exc.code_name}:{exc.cause['name']}")
    ctx.sleep(0.05)
    return seen


@wp.workflow(name="mutation-code-misuse", version=1)
def code_misuse_wf(ctx: wp.Context, what: str) -> str:
    if what == "name":
        ctx.code("", lambda: 1)
    return str(ctx.code("nan", lambda: float("nan"), output=float))


def test_code_blocks_record_their_reason_and_outcome_and_replay_them(
    runtime: wp.Runtime,
) -> None:
    """README: ``ctx.code(name, fn, output=...)`` runs once and records its value; an
    exception fails as ``CodeExecutionError`` (naming the block, carrying the cause) and a
    replay raises it again. Kills the ``Context.code`` mutants that drop the name, the
    reason, the outcome flag or the cause."""
    runtime.register(code_blocks_wf)
    client = runtime.client()
    handle = client.start(code_blocks_wf, None)
    assert client.result(handle.execution_id, timeout=30).unwrap() == [
        "42",
        "boom:ZeroDivisionError",
    ]
    events = [r.event for r in client.history(handle.execution_id)]
    code = [e for e in events if e["type"].startswith("code.")]
    assert [(e["type"], e["name"], e["activityName"], e["invocation"]) for e in code] == [
        ("code.started", "pick", "pick#1", 1),
        ("code.completed", "pick", "pick#1", 1),
        ("code.started", "boom", "boom#1", 1),
        ("code.failed", "boom", "boom#1", 1),
    ]
    assert [e["reason"] for e in code] == ["the answer"] * 2 + ["divide"] * 2
    assert code[1]["result"] == 42
    assert code[3]["error"]["name"] == "ZeroDivisionError"


def test_code_block_misuse_names_the_code_block(runtime: wp.Runtime) -> None:
    """A bad code block name and an unstorable result are refused with errors that say it
    was a code block and which one."""
    runtime.register(code_misuse_wf)
    client = runtime.client()
    bad_name = client.result(client.start(code_misuse_wf, "name").execution_id, timeout=30)
    assert isinstance(bad_name, wp.Failed)
    assert "code block name must be a non-empty string" in bad_name.message
    nan = client.result(client.start(code_misuse_wf, "nan").execution_id, timeout=30)
    assert isinstance(nan, wp.Failed) and nan.error_type == "CodeExecutionError"
    assert "result of code block nan" in nan.message


# ctx.all ------------------------------------------------------------------------------

_FLAKY_ONCE: dict[str, int] = {}


@wp.step
def mutation_double(n: int) -> int:
    return 2 * n


@wp.step(retry=wp.Retry(attempts=2, backoff="exponential", base=1.2, factor=1))
def mutation_fails_once(key: str) -> str:
    _FLAKY_ONCE[key] = _FLAKY_ONCE.get(key, 0) + 1
    if _FLAKY_ONCE[key] == 1:
        raise RuntimeError("first attempt fails")
    return key


def _not_a_step(n: int) -> int:
    return n


@wp.workflow(name="mutation-all-misuse", version=1)
def all_misuse_wf(ctx: wp.Context, what: str) -> list[int]:
    calls = [wp.call(mutation_double, 1), wp.call(mutation_double, 2)]
    if what == "concurrency-0":
        return ctx.all(calls, concurrency=0)
    if what == "concurrency-text":
        return ctx.all(calls, concurrency="2")  # type: ignore[arg-type]
    if what == "name":
        return ctx.all(calls, name="")
    if what == "not-a-list":
        return ctx.all(wp.call(mutation_double, 1))  # type: ignore[arg-type]
    if what == "not-a-call":
        return ctx.all([mutation_double])  # type: ignore[list-item]
    if what == "plain-function":
        return ctx.all([wp.call(_not_a_step, 1)])  # type: ignore[arg-type]
    return ctx.all(calls, concurrency=1)


@wp.workflow(name="mutation-all-retry", version=1)
def all_retry_wf(ctx: wp.Context, key: str) -> list[str]:
    return ctx.all([wp.call(mutation_fails_once, key), wp.call(mutation_fails_once, key + "!")])


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("concurrency-0", "concurrency must be a positive integer, got 0"),
        ("concurrency-text", "concurrency must be a positive integer, got '2'"),
        ("name", "ctx.all name"),
        ("not-a-list", "ctx.all takes a list of wp.call(step, ...) items"),
        ("not-a-call", "ctx.all takes wp.call(step, ...) items"),
        ("plain-function", "ctx.all needs a step declared with @wp.step"),
    ],
)
def test_ctx_all_misuse_is_refused_saying_what_is_wrong(
    runtime: wp.Runtime, what: str, says: str
) -> None:
    runtime.register(all_misuse_wf)
    client = runtime.client()
    outcome = client.result(client.start(all_misuse_wf, what).execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and says in outcome.message


def test_ctx_all_records_its_branches_and_runs_one_at_a_time_with_concurrency_1(
    runtime: wp.Runtime,
) -> None:
    runtime.register(all_misuse_wf)
    client = runtime.client()
    handle = client.start(all_misuse_wf, "ok")
    assert client.result(handle.execution_id, timeout=30).unwrap() == [2, 4]
    events = [r.event for r in client.history(handle.execution_id)]
    started = next(e for e in events if e["type"] == "all.started")
    done = next(e for e in events if e["type"] == "all.completed")
    assert (started["branches"], done["branches"]) == (2, 2)
    steps = [e for e in events if e["type"] == "step.completed"]
    assert [(e["activityName"], e["invocation"]) for e in steps] == [
        ("mutation_double#1", 1),
        ("mutation_double#2", 2),
    ]


def test_a_branch_waits_out_a_long_retry_backoff_in_its_thread(runtime: wp.Runtime) -> None:
    """Inside ``ctx.all`` a retry backoff is always waited in the branch's thread (the run
    cannot park with other branches in flight), even one longer than a parked retry's."""
    runtime.register(all_retry_wf)
    client = runtime.client()
    key = uuid.uuid4().hex
    handle = client.start(all_retry_wf, key)
    assert client.result(handle.execution_id, timeout=30).unwrap() == [key, key + "!"]
    assert history_types(client, handle.execution_id).count("step.failed") == 2


# claims and pools ---------------------------------------------------------------------


def test_claimed_runs_are_held_from_before_the_claim_and_never_twice(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``Runtime.claim_due`` hands each claimed run to the lease keeper at its epoch, with
    the lease counted from before the claim; it never claims a run this process is still
    driving (even one whose lease looks expired), and a closing runtime claims nothing."""
    rt = make_runtime(lease_ttl=30)
    rt.register(w.three_steps_wf)
    first = rt.client().start(w.three_steps_wf, {"marks": "/dev/null", "hang_file": ""})
    before = time.monotonic()
    claims = rt.claim_due(10)
    after = time.monotonic()
    assert [c.execution_id for c in claims] == [first.execution_id]
    keeper = rt.keeper()
    assert keeper.held() == {first.execution_id: claims[0].epoch}
    lease = keeper.hold(first.execution_id, claims[0].epoch)
    assert before <= lease.confirmed <= after, "confirmed from when the claim was sent"

    with rt._lock:  # this process drives it (the driving thread is elsewhere)
        rt._driving.add(first.execution_id)
    with rt.transaction() as conn:  # its lease looks expired to the database
        conn.execute(
            ex.update()
            .where(ex.c.id == first.execution_id)
            .values(wake_at=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
        )
    assert rt.claim_due(10) == [], "never a run this process still drives"
    with rt._lock:
        rt._driving.discard(first.execution_id)
    rt.closing = True
    assert rt.claim_due(10) == [], "a closing runtime claims nothing"
    rt.closing = False
    assert rt.claim_due(0) == []
    assert [c.execution_id for c in rt.claim_due(10)] == [first.execution_id]


def test_a_pool_is_comfortable_from_the_concurrency_plus_one_up_to_ten(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """README: ``start_worker`` warns below ``concurrency + 1`` connections, at most 10."""
    engine = create_engine(db_url, pool_size=5, max_overflow=5)  # 10 connections
    small = create_engine(db_url, pool_size=5, max_overflow=0)
    rt, tight = wp.Runtime(engine), wp.Runtime(small)
    try:
        with caplog.at_level(logging.WARNING, logger="wf_persist.runtime"):
            rt.check_pool(500)  # 10 serve any concurrency: quiet
            tight.check_pool(4)  # 5 for concurrency 4: quiet
            assert not caplog.records
            tight.check_pool(5)  # wants 6: says so, with the numbers
        assert [r.getMessage() for r in caplog.records] == [
            "the engine's pool gives 5 connections; a worker with concurrency 5 runs best "
            "with 6 (runs wait for a connection at each write, and steps under a "
            "database-wide concurrency limit hold one while they run)"
        ]
    finally:
        rt.close()
        tight.close()
        engine.dispose()
        small.dispose()


def test_the_journal_reads_attempts_failures_and_retry_times_from_step_events() -> None:
    """What a replay learns about a step from its events: the highest attempt (an event
    without one is attempt 1), that a failure without ``final`` is final, and for a failure
    that will be retried, the count and the recorded retry time. Kills the
    ``Journal._step_event`` mutants."""
    from wf_persist.replay import Journal

    def ev(etype: str, act: str, **fields: object) -> dict[str, object]:
        return {"type": etype, "activityName": act, "stepName": act.split("#")[0], **fields}

    at = "2026-12-01T10:00:00.250000+00:00"
    journal = Journal.from_events(
        [
            ev("step.started", "plain#1"),
            ev("step.failed", "legacy#1", error={"name": "E"}),
            ev("step.failed", "retried#1", attempt=1, final=False, retryAt=at),
            ev("step.failed", "retried#1", attempt=2, final=False),
            ev("step.failed", "again#1", attempt=3, final=False, retryAt=at),
        ]
    )
    assert journal.steps["plain#1"].last_attempt == 1
    assert "plain#1" not in journal.outcomes
    assert journal.outcomes["legacy#1"][0] is False, "a failure without 'final' is final"
    retried = journal.steps["retried#1"]
    assert (retried.last_attempt, retried.failures, retried.retry_at) == (2, 2, None)
    again = journal.steps["again#1"]
    assert (again.last_attempt, again.failures) == (3, 1)
    assert again.retry_at == dt.datetime(2026, 12, 1, 10, 0, 0, 250000, tzinfo=dt.UTC)
    assert "retried#1" not in journal.outcomes and "again#1" not in journal.outcomes


# woken before its time: a sleep or a signal wait parks again ----------------------------


@wp.workflow(name="mutation-woken-early", version=1)
def woken_early_wf(ctx: wp.Context) -> str:
    ctx.sleep(1.0)
    ctx.wait_for_signal("go")
    late = ctx.wait_for_signal("late", timeout=1.0)
    return "timed out" if isinstance(late, wp.TimedOut) else "received"


def _woken_early_reparks(runtime: wp.Runtime, execution_id: str) -> dict[str, object]:
    """Make the parked run due now, drive it, check it parked again unchanged."""
    before = _row(runtime, execution_id)
    events_before = history_types(runtime.client(), execution_id)
    with runtime.transaction() as conn:
        executions.wake(conn, runtime.backend, execution_id)
    assert runtime.drive(execution_id)
    after = _row(runtime, execution_id)
    assert after["status"] == "suspended" and after["drive_failures"] == 0
    assert after["lease_owner"] is None and after["lease_expires_at"] is None
    assert after["wake_at"] == before["wake_at"], "parked again until the same time"
    assert history_types(runtime.client(), execution_id) == events_before
    return after


def _drive_when_due(runtime: wp.Runtime, execution_id: str) -> None:
    wait_until(lambda: runtime.drive(execution_id), timeout=10, what="the wake time")


def test_a_run_woken_before_its_time_parks_again_until_then(runtime: wp.Runtime) -> None:
    """README: a sleep or a timed signal wait parks the run "until" its time, and it "is
    resumed when due". A run made due before then (``store.executions.wake``, as a
    delivered signal does) replays to the same call and parks again with the same wake
    time (NULL for a wait without a timeout), recording nothing and counting no failed
    drive; the sleep and the timeout still end at their time, and every event names the
    run (``sleep.completed``: name, invocation, activity, duration). Kills the
    ``Context.sleep`` and ``Context.wait_for_signal`` mutants that re-park without events,
    without the wake time, or read a missing deadline, and those that drop a field of the
    sleep's events or the run id of every call's events (``Context._who``)."""
    runtime.register(woken_early_wf)
    client = runtime.client()
    execution_id = client.start(woken_early_wf).execution_id
    assert runtime.drive(execution_id)
    asleep = _woken_early_reparks(runtime, execution_id)
    assert asleep["wake_at"] is not None
    _drive_when_due(runtime, execution_id)
    assert history_types(client, execution_id)[-2:] == ["sleep.completed", "signal.waiting"]
    assert _woken_early_reparks(runtime, execution_id)["wake_at"] is None
    client.signal(execution_id, "go", None)
    assert runtime.drive(execution_id)
    waiting = _woken_early_reparks(runtime, execution_id)
    assert waiting["wake_at"] is not None
    _drive_when_due(runtime, execution_id)
    assert client.result(execution_id, timeout=5).unwrap() == "timed out"
    events = [r.event for r in client.history(execution_id)]
    assert all(e["executionId"] == execution_id for e in events)
    slept = next(e for e in events if e["type"] == "sleep.completed")
    expected = ("sleep:1s", 1, "sleep:1s#1", 1.0)
    assert (slept["name"], slept["invocation"], slept["activityName"], slept["duration"]) == (
        expected
    )


# store.history.append and the park/wake writes ------------------------------------------


def test_append_raises_naming_the_run_and_stores_mixed_batches_in_order(
    runtime: wp.Runtime,
) -> None:
    """``history.append`` (its docstring): an unknown run raises ``UnknownExecutionError``,
    a stale ``epoch`` ``LeaseLostError``, a client event after ``seen_through``
    ``StaleHistoryError``, the first two naming the run; a batch mixing plain events and events with
    a dedupe key is stored whole, in order, on consecutive sequences. Kills the
    ``history.append`` mutants that drop the run id of an error, the news check, or the
    plain events written before a keyed one."""
    execution_id = _started(runtime)
    backend = runtime.backend
    now = runtime.clock()
    with runtime.transaction() as conn:
        claim = backend.claim(conn, execution_id, runtime.owner, 30)
    assert claim is not None

    def event(kind: str, key: str | None = None) -> NewEvent:
        return NewEvent({"type": kind, "executionId": execution_id}, now, key)

    missing = str(uuid.uuid4())
    with pytest.raises(wp.UnknownExecutionError) as unknown, runtime.transaction() as conn:
        history.append(conn, backend, missing, [event("step.completed")], now=now)
    assert unknown.value.execution_id == missing
    with pytest.raises(wp.LeaseLostError) as lost, runtime.transaction() as conn:
        history.append(conn, backend, execution_id, [], now=now, epoch=claim.epoch + 1)
    assert lost.value.execution_id == execution_id
    batch = [event("step.started"), event("step.completed", "k1"), event("step.failed")]
    with runtime.transaction() as conn:
        done = history.append(
            conn, backend, execution_id, batch, now=now, epoch=claim.epoch, seen_through=1
        )
    assert done.sequences == [2, 3, 4]
    types = history_types(runtime.client(), execution_id)
    assert types[-3:] == ["step.started", "step.completed", "step.failed"]
    with runtime.transaction() as conn:  # a client's event after sequence 4
        history.append(conn, backend, execution_id, [event("signal.buffered")], now=now)
    with pytest.raises(StaleHistoryError), runtime.transaction() as conn:
        history.append(conn, backend, execution_id, [], now=now, seen_through=4)


def test_park_and_wake_touch_only_their_run(runtime: wp.Runtime) -> None:
    """``executions.park`` gives up the lease of its run only, and only at the current
    epoch, setting the wake time; ``executions.wake`` makes its parked run due now and
    leaves a leased run (and every other run) alone (their docstrings; docs/sql.md:
    ``wake_at`` is a leased run's lease expiry). Kills the ``park`` and ``wake`` mutants
    that drop the run, the epoch or the lease condition of their WHERE, or keep the lease
    owner."""
    first, second, third = _started(runtime), _started(runtime), _started(runtime)
    backend = runtime.backend
    with runtime.transaction() as conn:
        claims = [backend.claim(conn, i, runtime.owner, 3600) for i in (first, second, third)]
    epochs = {c.epoch for c in claims if c is not None}
    assert len(claims) == 3 and len(epochs) == 1, "three runs held at one epoch"
    (epoch,) = epochs
    later = runtime.clock() + dt.timedelta(hours=2)
    held_second = _row(runtime, second)
    with runtime.transaction() as conn:
        executions.park(conn, first, epoch + 1, later)
    assert _row(runtime, first)["lease_owner"] == runtime.owner, "a stale epoch parks nothing"
    with runtime.transaction() as conn:
        executions.park(conn, first, epoch, later)
    parked = _row(runtime, first)
    assert parked["lease_owner"] is None and parked["lease_expires_at"] is None
    assert _seconds(parked["wake_at"], held_second["wake_at"]) > 3600
    assert _row(runtime, second) == held_second, "another run keeps its lease"
    with runtime.transaction() as conn:
        executions.park(conn, third, epoch, None)
    asleep = _row(runtime, third)
    assert asleep["lease_owner"] is None and asleep["wake_at"] is None
    with runtime.transaction() as conn:
        executions.wake(conn, backend, second)
    assert _row(runtime, second) == held_second, "a leased run is left alone"
    with runtime.transaction() as conn:
        executions.wake(conn, backend, third)
    assert _row(runtime, third)["wake_at"] is not None
    assert _row(runtime, first) == parked, "another parked run is not woken"


@pytest.fixture
def local_time_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time zone is not UTC for the test."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_write_of_its_own_is_fenced_guarded_and_returns_its_sequences(
    runtime: wp.Runtime, local_time_zone: None
) -> None:
    """``Backend.write`` is ``fenced`` as a write of its own (its docstring; SQLite sends it
    straight to the driver): it appends the events on the next sequences and returns them
    with the status, writes time columns as the other writes do, and a stale epoch or a
    status outside the guard raises ``LeaseLostError`` naming the run and writes nothing.
    Times are stored as the same instant whatever their time zone or the process's. Kills
    the ``SQLiteBackend.write`` mutants that lose the guard, the time conversion, the run id
    of the error or the returned sequences, and the ``_ts`` mutant that converts to local
    time."""
    execution_id = _started(runtime)
    backend = runtime.backend
    now = runtime.clock()
    with runtime.transaction() as conn:
        claim = backend.claim(conn, execution_id, runtime.owner, 30)
    assert claim is not None

    def event(name: str) -> NewEvent:
        doc = {"type": "step.completed", "executionId": execution_id, "activityName": name}
        return NewEvent(doc, now)

    with backend.connection() as conn:
        done = backend.write(conn, execution_id, claim.epoch, [event("a#1"), event("b#1")], now=now)
        assert (done.sequences, done.status) == ([2, 3], "running")
        with pytest.raises(wp.LeaseLostError) as lost:
            backend.write(conn, execution_id, claim.epoch + 1, [event("c#1")], now=now)
        assert lost.value.execution_id == execution_id
        with pytest.raises(wp.LeaseLostError):
            backend.write(
                conn,
                execution_id,
                claim.epoch,
                [event("c#1")],
                now=now,
                values={"status": "completed"},
                guard=("suspended",),
            )
        assert _row(runtime, execution_id)["status"] == "running", "refused: nothing written"
        done = backend.write(
            conn,
            execution_id,
            claim.epoch,
            [event("c#1")],
            now=now,
            values={"status": "completed", "finished_at": T0.astimezone(TOKYO)},
            guard=("running",),
        )
    assert (done.sequences, done.status) == ([4], "completed")
    row = _row(runtime, execution_id)
    assert row["finished_at"] == T0
    assert history_types(runtime.client(), execution_id).count("step.completed") == 3


# secrets: arguments rejected once resolved -------------------------------------------------

LONG_SECRET = "resolved-secret-value-0123456789"


@wp.step
def reference_only(key: Annotated[str, StringConstraints(pattern=r"^secret:")]) -> int:
    return len(key)  # a type only a reference passes: the resolved value is refused


@wp.workflow(name="mutation-rejected-secret", version=1)
def rejected_secret_wf(ctx: wp.Context, key: str) -> int:
    return ctx.run(reference_only, key)


def test_arguments_rejected_after_resolving_secrets_say_where_without_the_secret(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """README: step arguments are "validated again" once their secrets are resolved, and a
    resolved secret never reaches the database. A resolved value the step's type refuses
    fails the step with ``InvalidPayloadError`` for "arguments of step ..." whose ``errors``
    give each problem's ``loc`` and ``type`` (its docstring) and say only that it was
    "rejected after resolving secrets": the value is in no stored error or event (the
    ``loc`` is relative to the argument, validated on its own). Kills the
    ``StepRunner._resolved`` mutants that drop or rename those fields or the error's
    arguments."""
    runtime = make_runtime(secret_resolver=lambda name: LONG_SECRET)
    runtime.register(rejected_secret_wf)
    client = runtime.client()
    execution_id = client.start(rejected_secret_wf, wp.secret("api-key")).execution_id
    outcome = client.result(execution_id, timeout=20)
    assert isinstance(outcome, wp.Failed)
    cause = outcome.error["cause"]
    assert cause["name"] == "InvalidPayloadError"
    assert cause["what"] == "arguments of step reference_only"
    assert cause["errors"] == [
        {"loc": [], "type": "string_pattern_mismatch", "msg": "rejected after resolving secrets"}
    ]
    stored = repr([r.event for r in client.history(execution_id)]) + repr(outcome.error)
    assert LONG_SECRET not in stored


@wp.step
def add(a: int, b: int = 0) -> int:
    return a + b


@wp.workflow(name="mutation-step-arguments", version=1)
def step_arguments_wf(ctx: wp.Context) -> dict[str, Any]:
    total = ctx.run(add, 1, b=2)
    try:
        ctx.run(add, 1, 2, 3)
    except wp.InvalidPayloadError as exc:
        return {"total": total, "what": exc.what, "errors": exc.errors}
    return {"total": total}


def test_step_arguments_bind_by_keyword_and_misfits_name_the_step(runtime: wp.Runtime) -> None:
    """``ctx.run(step, *args, **kwargs)`` binds keyword arguments as Python does; arguments
    that do not fit the step's signature raise ``InvalidPayloadError`` for "arguments of
    step ..." whose ``errors`` hold the problem's ``loc`` and ``msg`` (its docstring).
    Kills the ``StepRunner.bind`` mutants that drop the keyword arguments or change the
    error."""
    runtime.register(step_arguments_wf)
    client = runtime.client()
    done = client.result(client.start(step_arguments_wf).execution_id, timeout=20).unwrap()
    assert done == {
        "total": 3,
        "what": "arguments of step add",
        "errors": [{"loc": [], "msg": "too many positional arguments"}],
    }


# misuse of the context: errors say what was wrong ------------------------------------------


@wp.step(name="mutation-twin")
def twin_a() -> int:
    return 1


@wp.step(name="mutation-twin")
def twin_b() -> int:
    return 2


MISUSES: dict[str, Callable[[wp.Context], object]] = {
    "sleep-bool": lambda ctx: ctx.sleep(True),
    "sleep-too-long": lambda ctx: ctx.sleep(MAX_DURATION_SECONDS * 2),
    "sleep-name": lambda ctx: ctx.sleep(1, name=""),
    "signal-name": lambda ctx: ctx.wait_for_signal(""),
    "signal-timeout": lambda ctx: ctx.wait_for_signal("go", timeout=-1),
    "all-name": lambda ctx: ctx.all([], name=""),
    "run-not-a-step": lambda ctx: ctx.run(len),  # type: ignore[arg-type]
    "twin-steps": lambda ctx: (ctx.run(twin_a), ctx.run(twin_b)),
}


@wp.workflow(name="mutation-context-misuse", version=1)
def context_misuse_wf(ctx: wp.Context, case: str) -> None:
    MISUSES[case](ctx)


@pytest.mark.parametrize(
    ("case", "error", "says"),
    [
        ("sleep-bool", "InvalidArgumentError", "sleep duration must be a non-negative duration"),
        ("sleep-too-long", "InvalidArgumentError", "sleep duration must be finite and at most"),
        ("sleep-name", "InvalidArgumentError", "sleep name must be a non-empty string"),
        ("signal-name", "InvalidArgumentError", "signal name must be a non-empty string"),
        ("signal-timeout", "InvalidArgumentError", "signal timeout must be a non-negative"),
        ("all-name", "InvalidArgumentError", "ctx.all name must be a non-empty string"),
        ("run-not-a-step", "WorkflowDefinitionError", "ctx.run needs a step declared with"),
        ("twin-steps", "WorkflowDefinitionError", "two different steps are named"),
    ],
)
def test_context_misuse_fails_the_run_saying_what_is_wrong(
    runtime: wp.Runtime, case: str, error: str, says: str
) -> None:
    """A duration that is not a non-negative number of seconds (a bool is not one) or is
    over 1000 years, an empty call name, a function that is not a step, or two steps of one
    name fail the run with an error that names the argument and what is wrong with it.
    Kills the mutants of ``_seconds``, ``Context.sleep``, ``wait_for_signal``, ``all``,
    ``run`` and ``_check_step`` that accept a bool or drop or change what the message
    names."""
    runtime.register(context_misuse_wf)
    client = runtime.client()
    outcome = client.result(client.start(context_misuse_wf, case).execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == error
    assert says in outcome.message, outcome.message
    if case == "twin-steps":
        assert "; their results would be recorded under one activity name: rename one" in (
            outcome.message
        )


@wp.workflow(name="mutation-longest-sleep", version=1)
def longest_sleep_wf(ctx: wp.Context) -> None:
    ctx.sleep(dt.timedelta(seconds=MAX_DURATION_SECONDS))


def test_a_sleep_of_exactly_1000_years_is_accepted(runtime: wp.Runtime) -> None:
    """Durations are "at most" 1000 years: exactly that parks the run. Kills
    ``_seconds__mutmut_12`` (``<`` for ``<=``)."""
    runtime.register(longest_sleep_wf)
    execution_id = runtime.client().start(longest_sleep_wf).execution_id
    assert runtime.drive(execution_id)
    assert _row(runtime, execution_id)["status"] == "suspended"


# a drive's lease, and close() ---------------------------------------------------------------

LONG_STEP = threading.Event()


@wp.step
def longer_than_the_lease(seconds: float) -> float:
    LONG_STEP.set()
    time.sleep(seconds)
    return seconds


@wp.workflow(name="mutation-longer-than-the-lease", version=1)
def longer_than_the_lease_wf(ctx: wp.Context, seconds: float) -> float:
    return ctx.run(longer_than_the_lease, seconds)


def test_a_run_driven_past_its_ttl_keeps_its_lease(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A drive's lease is renewed while it runs (README: leases are renewed every quarter
    of the TTL): a step longer than the TTL is never taken over by another runtime, and the
    run is held under this runtime's name meanwhile (docs/sql.md: ``lease_owner``). Kills
    the ``Runtime._drive`` and ``drive_for_outcome`` mutants that hold the lease under
    another id or claim it under no owner."""
    LONG_STEP.clear()
    # A TTL of 2 s, renewed every 0.5 s: at 1 s a loaded machine (CI's, SQLite's write
    # lock taken by the other runtime's tries every 50 ms) starved a renewal now and then.
    driving, other = make_runtime(lease_ttl=2.0), make_runtime(lease_ttl=2.0)
    driving.register(longer_than_the_lease_wf)
    other.register(longer_than_the_lease_wf)
    execution_id = driving.client().start(longer_than_the_lease_wf, 5.0).execution_id
    thread = threading.Thread(target=driving.drive, args=(execution_id,))
    thread.start()
    try:
        assert LONG_STEP.wait(10)
        assert _row(driving, execution_id)["lease_owner"] == driving.owner
        deadline = time.monotonic() + 4.9
        while time.monotonic() < deadline:
            assert other.drive(execution_id) is False, "a live lease was taken over"
            time.sleep(0.05)
    finally:
        thread.join(20)
    outcome = driving.client().result(execution_id, timeout=10)
    assert outcome.unwrap() == 5.0
    assert history_types(driving.client(), execution_id).count("step.started") == 1


def test_close_waits_for_runs_in_flight_then_disposes_of_its_engine(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``Runtime.close(timeout)`` lets runs in flight stop at their next step, waiting up to
    ``timeout`` seconds, then disposes of the engine it created (its docstring): when it
    returns, the drive has stopped, the run is due again for others, and no pooled
    connection is left open. Kills the ``Runtime.close`` mutants that do not wait without a
    worker or skip the disposal."""
    LONG_STEP.clear()
    runtime = make_runtime()
    runtime.register(longer_than_the_lease_wf)
    execution_id = runtime.client().start(longer_than_the_lease_wf, 0.8).execution_id
    thread = threading.Thread(target=runtime.drive, args=(execution_id,))
    thread.start()
    assert LONG_STEP.wait(10)
    runtime.close(timeout=20)
    # Read as close returns: the drive had recorded its step and stopped (the thread
    # itself may take a moment longer to return from ``drive``).
    recorded = _types_of(runtime.engine.url, execution_id)
    thread.join(20)
    assert not thread.is_alive()
    assert "step.completed" in recorded, "close returned while a run was still being driven"
    assert _pooled(runtime.engine) == 0, "the engine was not disposed of"
    row = _row_of(runtime.engine.url, execution_id)
    assert row["lease_owner"] is None and row["status"] == "running"
    idle = make_runtime()  # nothing in flight: close disposes of the engine itself
    idle.register(longer_than_the_lease_wf)
    assert idle.client().result(execution_id, timeout=20).unwrap() == 0.8
    assert _pooled(idle.engine) > 0
    idle.close()
    assert _pooled(idle.engine) == 0, "the engine was not disposed of"


def _pooled(engine: Engine) -> int:
    """Connections idle in the engine's pool (a QueuePool on every test backend)."""
    pool = engine.pool
    assert isinstance(pool, QueuePool)
    return pool.checkedin()


def _row_of(url: object, execution_id: str) -> dict[str, object]:
    engine = create_engine(url)  # type: ignore[call-overload]
    try:
        with engine.connect() as conn:
            return dict(conn.execute(select(ex).where(ex.c.id == execution_id)).mappings().one())
    finally:
        engine.dispose()


def _types_of(url: object, execution_id: str) -> list[str]:
    engine = create_engine(url)  # type: ignore[call-overload]
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(hist.c.type)
                .where(hist.c.execution_id == execution_id)
                .order_by(hist.c.sequence)
            )
            return [str(t) for (t,) in rows]
    finally:
        engine.dispose()


def test_claims_take_only_the_pinned_workflows_and_keep_the_first_start_time(
    runtime: wp.Runtime,
) -> None:
    """``claim_due`` claims only runs of the ``(name, version)`` pairs it is given (a
    worker never takes a run it has no code for); a run's ``started_at`` is set by its
    first claim and kept by later ones. Kills the ``pinned`` mutants that match on the
    version or the name alone and the ``claim_values`` mutants of ``started_at``."""
    execution_id = _started(runtime)  # echo, version 1
    backend = runtime.backend
    with runtime.transaction() as conn:
        assert backend.claim_due(conn, runtime.owner, 30, 10, [("other-name", 1)], ()) == []
        assert backend.claim_due(conn, runtime.owner, 30, 10, [(w.echo_wf.name, 99)], ()) == []
        claims = backend.claim_due(conn, runtime.owner, 30, 10, [(w.echo_wf.name, 1)], ())
    assert [c.execution_id for c in claims] == [execution_id]
    first = _row(runtime, execution_id)["started_at"]
    assert first is not None
    with runtime.transaction() as conn:
        assert backend.release(conn, {execution_id: claims[0].epoch}) == 1
    time.sleep(0.05)
    with runtime.transaction() as conn:
        assert backend.claim(conn, execution_id, "another", 30) is not None
    assert _row(runtime, execution_id)["started_at"] == first


def test_history_events_carry_their_documented_fields(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """What ``client.history`` shows of a run's start, its recorded values, a ``ctx.all``
    and a failed code block: the fields people read (and docs/sql.md queries)."""
    s.reset()
    rt = make_runtime()
    rt.register(w.determinism_wf, s.parallel_wf, s.code_wf)
    client = rt.client()

    def events(execution_id: str) -> dict[str, dict[str, Any]]:
        client.result(execution_id, timeout=10)
        return {r.event["type"]: r.event for r in client.history(execution_id)}

    run = client.start(w.determinism_wf).execution_id
    seen = events(run)
    assert seen["workflow.started"] == {
        "type": "workflow.started",
        "executionId": run,
        "workflowName": "determinism",
        "version": 1,
    }
    for kind in ("now", "random", "uuid"):
        recorded = seen[f"{kind}.recorded"]
        assert (recorded["name"], recorded["invocation"], recorded["activityName"]) == (
            kind,
            1,
            f"{kind}#1",
        )
        assert recorded["executionId"] == run
    parallel = client.start(s.parallel_wf, 3).execution_id
    finished = events(parallel)["all.completed"]
    assert (finished["name"], finished["invocation"], finished["branches"]) == ("parallel", 1, 2)
    assert finished["activityName"] == "parallel#1" and finished["executionId"] == parallel
    failing = client.start(s.code_wf, True).execution_id
    failed = events(failing)["code.failed"]
    assert (failed["name"], failed["invocation"], failed["activityName"]) == (
        "build-value",
        1,
        "build-value#1",
    )
    assert failed["error"]["message"] == "callback failed" and "result" not in failed
