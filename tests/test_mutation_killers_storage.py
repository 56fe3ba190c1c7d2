"""Mutant killers for what the store and the backends keep per run and per version: the
schemas a registration fills in, the run an idempotency key finds, the dedupe keys the
replay checker reads, the epochs the lease keeper compares, and what a SQLite error says.

Like ``tests/test_mutation_killers.py``: each test pins documented behaviour (README,
docstrings, docs/sql.md) that a mutation run (docs/mutation.md) showed no selected test
asserted, and its docstring names the mutants it kills.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

import wf_persist as wp
from wf_persist.models import workflows_table as wft
from wf_persist.testing import check_replay

from .helpers import wait_until
from .test_mutation_killers import _row, _started
from .test_mutation_killers_backends import _claim

# the catalog: schemas filled in per version -----------------------------------------------


@wp.workflow(name="mutation-storage-versions", version=1)
def versions_v1(ctx: wp.Context, n: int) -> int:
    return n


@wp.workflow(name="mutation-storage-versions", version=2)
def versions_v2(ctx: wp.Context, text: str) -> str:
    return text


def _schemas(runtime: wp.Runtime) -> dict[int, tuple[Any, Any]]:
    rows = [r for r in runtime.client().workflows() if r.name == "mutation-storage-versions"]
    return {r.version: (r.input_schema, r.output_schema) for r in rows}


def test_a_registration_fills_in_the_schemas_of_its_own_version_only(
    runtime: wp.Runtime, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """README, "Versions and the catalog": "a version cataloged before schemas were
    recorded gets them at its next registration" (docs/sql.md: NULL "until the next
    registration"); another version of the same workflow keeps its NULL until its own. Kills
    ``catalog_version`` mutant 59 (the UPDATE that fills them in without the version: every
    version of the name would get this version's schemas)."""
    runtime.register(versions_v1, versions_v2)
    full = _schemas(runtime)
    assert full[1][0] == {"type": "integer"} and full[2][0] == {"type": "string"}
    with runtime.transaction() as conn:
        conn.execute(
            update(wft)
            .where(wft.c.name == "mutation-storage-versions")
            .values(input_schema=None, output_schema=None)
        )
    make_runtime().register(versions_v2)  # a process that only has the new version
    assert _schemas(runtime) == {1: (None, None), 2: full[2]}
    make_runtime().register(versions_v1)
    assert _schemas(runtime) == full


# idempotency keys are per workflow --------------------------------------------------------


@wp.workflow(name="mutation-storage-orders", version=1)
def orders_wf(ctx: wp.Context, n: int) -> int:
    return n


@wp.workflow(name="mutation-storage-refunds", version=1)
def refunds_wf(ctx: wp.Context, n: int) -> int:
    return n


def test_an_idempotency_key_finds_the_run_of_its_own_workflow(runtime: wp.Runtime) -> None:
    """README: "The same ``(workflow name, idempotency_key)`` returns the same handle and
    records nothing new"; docs/sql.md: keys are "unique per (workflow, key)". One key used
    by two workflows, and a workflow with runs under two keys: a repeated start finds the
    one run of its own workflow and key. Kills ``store.executions.create`` mutants 54 and 55
    (the lookup of the existing run by the key alone, or by the workflow alone)."""
    runtime.register(orders_wf, refunds_wf)
    client = runtime.client()
    order = client.start(orders_wf, 1, idempotency_key="A-1").execution_id
    refund = client.start(refunds_wf, 2, idempotency_key="A-1").execution_id
    other = client.start(orders_wf, 3, idempotency_key="A-2").execution_id
    assert len({order, refund, other}) == 3
    assert client.start(orders_wf, 1, idempotency_key="A-1").execution_id == order
    assert client.start(refunds_wf, 2, idempotency_key="A-1").execution_id == refund
    assert client.start(orders_wf, 3, idempotency_key="A-2").execution_id == other
    for execution_id in (order, refund, other):
        assert [r.event["type"] for r in client.history(execution_id)] == ["execution.started"]


# the replay checker reads the run's own dedupe keys ----------------------------------------

EDITED: dict[str, bool] = {"publishes": False}


@wp.step
def mutation_storage_value(n: int) -> int:
    return n


@wp.workflow(name="mutation-storage-parallel", version=1)
def parallel_wf(ctx: wp.Context) -> list[int]:
    got = ctx.all([wp.call(mutation_storage_value, 1), wp.call(mutation_storage_value, 2)])
    if EDITED["publishes"]:  # the edit a deploy would bring
        ctx.set_event("progress", got)
    return got


@wp.workflow(name="mutation-storage-publisher", version=1)
def publisher_wf(ctx: wp.Context) -> None:
    ctx.set_event("progress", [1, 2])


def test_the_replay_checker_judges_a_run_by_its_own_recorded_events(
    runtime: wp.Runtime,
) -> None:
    """README, "Replay checking": a finished run diverges when the code "would record
    something new although the run finished", and a keyed event its history holds (a
    replayed ``ctx.all`` records its start and end again) is nothing new. Whether an event
    is new is judged by the run's own history (``history.dedupe_keys``), not by another
    run's that recorded the same key. Kills ``dedupe_keys`` mutants 9 and 10 (the run's own
    keys lost: a false divergence) and 4 and 6 (every run's keys: a real one hidden)."""
    EDITED["publishes"] = False
    runtime.register(parallel_wf, publisher_wf)
    client = runtime.client()
    parallel = client.start(parallel_wf).execution_id
    publisher = client.start(publisher_wf).execution_id
    assert client.result(parallel, timeout=10).unwrap() == [1, 2]
    client.result(publisher, timeout=10).unwrap()
    [report] = check_replay(runtime, [parallel])
    assert report.ok, report.divergence
    EDITED["publishes"] = True
    try:
        [report] = check_replay(runtime, [parallel])
    finally:
        EDITED["publishes"] = False
    assert report.divergence == "would record event.set, but the run has finished"


# the lease keeper: epochs of leases a renewal did not find --------------------------------


def test_a_lease_its_driver_gave_up_at_its_epoch_is_not_reported_taken(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``LeaseKeeper._taken``: of the leases a renewal did not find, only those another
    claim took (the run's epoch moved) are marked lost, "not the ones their driver released
    meanwhile by parking or finishing the run"; ``Backend.epochs`` gives "the current claim
    epoch of each run" asked about (a run that is gone is left out). Kills ``_taken``
    mutant 12 and ``Backend.epochs`` mutants 3, 4, 10 and 11."""
    runtime = make_runtime(lease_ttl=0.6)
    given_up, held, bystander = _started(runtime), _started(runtime), _started(runtime)
    keeper = runtime.keeper()
    leases = {}
    for execution_id in (given_up, held):
        asked = time.monotonic()
        leases[execution_id] = keeper.hold(
            execution_id, _claim(runtime, execution_id, 0.6).epoch, asked
        )
    with runtime.transaction() as conn:  # parked by its driver, which still holds it here
        assert runtime.backend.release(conn, {given_up: leases[given_up].epoch}, 3600) == 1

    def a_renewal() -> None:
        before = _row(runtime, held)["lease_expires_at"]
        wait_until(lambda: _row(runtime, held)["lease_expires_at"] != before, 5, "a renewal")

    a_renewal()  # two renewals of the other lease: the keeper asked about both
    a_renewal()
    assert leases[given_up].lost is False and leases[held].lost is False
    gone = "00000000-0000-4000-8000-000000000000"
    with runtime.transaction() as conn:
        found = runtime.backend.epochs(conn, [given_up, held, gone])
    assert found == {given_up: leases[given_up].epoch, held: leases[held].epoch}
    assert bystander not in found


# the size limit of one value ----------------------------------------------------------------


def test_a_value_of_exactly_the_size_limit_is_taken(runtime: wp.Runtime) -> None:
    """README, "Bad input": a recorded value may be "at most
    ``runtime.backend.max_value_bytes`` as sent"; one byte more is a ``ValueTooLargeError``
    naming the value, its size and the limit. Kills ``Backend.check_size`` mutant 5 (a value
    of exactly the limit refused; ``tests/test_bad_input.py``, outside the mutation
    selection, pins it through whole runs)."""
    backend = runtime.backend
    value = "x" * 100
    size = backend.value_size(json.dumps(value))  # as this database receives it
    real, backend.max_value_bytes = backend.max_value_bytes, size
    try:
        backend.check_size("result of step exact", value)
        with pytest.raises(wp.ValueTooLargeError) as over:
            backend.check_size("result of step over", value + "x")
    finally:
        backend.max_value_bytes = real
    assert (over.value.what, over.value.limit) == ("result of step over", size)
    assert over.value.size == backend.value_size(json.dumps(value + "x")) > size


# SQLite: only a locked database is contention ----------------------------------------------


@pytest.mark.needs("embedded")
def test_only_a_locked_database_is_contention_as_sqlalchemy_or_the_driver_raises_it(
    runtime: wp.Runtime,
) -> None:
    """``Backend.contention``: an error that "says another transaction was in the way
    (...): nothing happened, try again later" (a claim that meets one is retried quietly),
    whether SQLAlchemy wrapped it or the driver raised it (a direct write path); any other
    driver error, such as a missing table, is not, and reaches the worker's outage
    handling. Kills ``SQLiteBackend.contention`` mutants 4 and 7 (the driver's own error
    misread) and 10 (every ``OperationalError`` taken for contention)."""
    with runtime.engine.connect() as conn, pytest.raises(OperationalError) as missing:
        conn.execute(text("SELECT * FROM wf_no_such_table"))
    raw = missing.value.orig
    assert isinstance(raw, sqlite3.OperationalError) and "no such table" in str(raw)
    assert not runtime.backend.contention(missing.value)
    assert not runtime.backend.contention(raw)
    path = make_url(runtime.engine.url).database
    assert path is not None
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as locked:
            other.execute("BEGIN IMMEDIATE")
    finally:
        other.close()
        holder.close()
    assert runtime.backend.contention(locked.value)
