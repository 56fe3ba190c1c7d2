"""A registration the catalog does not hold drives nobody's runs, and registering is one
clean step in any transaction, any order, any isolation.

- A runtime whose registration rolled back with the host's transaction (or one built while
  :func:`~wf_persist.testing.without_cataloging` ran) drove, with its own body, the runs of
  another release that cataloged other code under the same version: its worker claimed
  them and its ``result()`` drove them.
- Two processes registering the same new versions in opposite orders deadlocked (an
  untyped error on PostgreSQL, a misleading one on MariaDB).
- A host's transaction on MariaDB at its default REPEATABLE READ, whose snapshot predates
  another process's registration, raised a raw ``NoResultFound`` from ``register`` and
  ``start``.
- ``register(a, b, session=s)`` with ``b`` conflicting left ``a`` written in the host's
  transaction: a host that caught the error and committed cataloged a version no runtime
  registered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist.models import workflows_table
from wf_persist.testing import without_cataloging


@wp.workflow(name="uncommitted", version=1)
def theirs(ctx: wp.Context, x: int) -> str:
    return f"theirs-{x}"


@wp.workflow(name="uncommitted", version=1)
def ours(ctx: wp.Context, x: int) -> str:
    return f"ours-{x}"


@wp.workflow(name="uncommitted_alpha", version=1)
def alpha(ctx: wp.Context, x: int) -> int:
    return x


@wp.workflow(name="uncommitted_beta", version=1)
def beta(ctx: wp.Context, x: int) -> int:
    return x + 1


@wp.workflow(name="uncommitted_zeta", version=1)
def zeta_theirs(ctx: wp.Context, x: int) -> int:
    return x * 2


@wp.workflow(name="uncommitted_zeta", version=1)
def zeta_ours(ctx: wp.Context, x: int) -> int:
    return x * 3


def _cataloged(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(workflows_table.c.name, workflows_table.c.version).order_by(
                workflows_table.c.name
            )
        ).all()
    return [(str(r.name), int(r.version)) for r in rows]


def _runs_of_theirs_are_not_ours(mine: wp.Runtime, make_runtime: Callable[..., wp.Runtime]) -> None:
    """Another release catalogs its body and starts a run: ``mine`` neither drives it
    through ``result()`` nor claims it with a worker; the other release completes it."""
    other = make_runtime()
    other.register(theirs)
    handle = other.client().start(theirs, 1)
    with pytest.raises(wp.WorkflowVersionConflictError):
        mine.client().result(handle.execution_id, timeout=2)
    assert mine.runnable_workflows() == []
    mine.start_worker(concurrency=2, poll_interval=0.05)
    time.sleep(1.0)
    assert other.client().status(handle.execution_id) != "completed"
    assert other.client().result(handle.execution_id, timeout=30).unwrap() == "theirs-1"


def test_a_registration_rolled_back_with_the_hosts_transaction_drives_no_other_code(
    db_engine: Engine,
    make_runtime: Callable[..., wp.Runtime],
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mine = wp.Runtime(db_engine)
    request.addfinalizer(mine.close)
    with Session(db_engine) as session:
        mine.register(ours, session=session)
        session.rollback()
    _runs_of_theirs_are_not_ours(mine, make_runtime)
    said = [r for r in caplog.records if "cataloged with another source" in r.getMessage()]
    assert len(said) == 1  # said once, not at every poll


def test_a_runtime_built_without_cataloging_drives_no_other_code(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    with without_cataloging():
        mine = make_runtime()
        mine.register(ours)
    _runs_of_theirs_are_not_ours(mine, make_runtime)


def test_a_registration_committed_by_the_host_later_drives_its_runs(
    db_engine: Engine, request: pytest.FixtureRequest
) -> None:
    """Not known cataloged until seen so: then its runs are driven as any."""
    mine = wp.Runtime(db_engine)
    request.addfinalizer(mine.close)
    with Session(db_engine) as session:
        mine.register(ours, session=session)
        handle = mine.client().start(ours, 2, session=session)
        session.commit()
    assert mine.client().result(handle.execution_id, timeout=30).unwrap() == "ours-2"


def test_registering_the_same_versions_in_opposite_orders_at_once_does_not_deadlock(
    db_engine: Engine, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A host's transaction holds alpha's new row; another process registers (beta, alpha)
    meanwhile and waits on it; the host's transaction then registers beta. Before, the
    other process had written beta first: each waited for the other."""
    host, other = make_runtime(), make_runtime()
    outcome: list[object] = []

    def register_both() -> None:
        try:
            other.register(beta, alpha)
            outcome.append("ok")
        except Exception as exc:  # reported below
            outcome.append(exc)

    with Session(db_engine) as session:
        host.register(alpha, session=session)
        waiting = threading.Thread(target=register_both)
        waiting.start()
        time.sleep(0.5)  # the other registration waits on alpha's row (or the database)
        host.register(beta, session=session)
        session.commit()
    waiting.join(timeout=60)
    assert outcome == ["ok"]
    assert _cataloged(db_engine) == [("uncommitted_alpha", 1), ("uncommitted_beta", 1)]


def test_a_hosts_snapshot_older_than_another_registration_registers_and_starts(
    db_engine: Engine, make_runtime: Callable[..., wp.Runtime], request: pytest.FixtureRequest
) -> None:
    """At each backend's default isolation (MariaDB's is REPEATABLE READ): the host's
    transaction read before another process cataloged the version."""
    mine = wp.Runtime(db_engine)
    request.addfinalizer(mine.close)
    other = make_runtime()
    with Session(db_engine) as session:
        session.execute(text("SELECT COUNT(*) FROM wf_workflows")).all()  # its snapshot
        other.register(alpha)
        mine.register(alpha, session=session)
        session.commit()
    with Session(db_engine) as session:
        session.execute(text("SELECT COUNT(*) FROM wf_workflows")).all()
        other.register(beta)
        handle = mine.client().start(beta, 1, session=session)
        session.commit()
    assert mine.client().result(handle.execution_id, timeout=30).unwrap() == 2


def test_a_conflicting_registration_in_the_hosts_transaction_writes_none_of_the_batch(
    db_engine: Engine, make_runtime: Callable[..., wp.Runtime], request: pytest.FixtureRequest
) -> None:
    make_runtime().register(theirs)
    mine = wp.Runtime(db_engine)
    request.addfinalizer(mine.close)
    with Session(db_engine) as session:
        with pytest.raises(wp.WorkflowVersionConflictError):
            mine.register(alpha, ours, session=session)
        session.commit()  # the host caught it and went on
    assert _cataloged(db_engine) == [("uncommitted", 1)]
    assert mine.runnable_workflows() == []


def test_a_conflict_past_the_hosts_snapshot_writes_none_of_the_batch(
    backend: str,
    db_url: str,
    make_engine: Callable[..., Engine],
    make_runtime: Callable[..., wp.Runtime],
    request: pytest.FixtureRequest,
) -> None:
    """At REPEATABLE READ (MariaDB's default): the read before the writes did not see a
    version another process cataloged after the host's snapshot; the conflict came up only
    once the batch's first row was written, and a host that caught it committed that row.
    (PostgreSQL refuses the write past the snapshot instead: the host rolls back.)"""
    engine = make_engine(db_url, isolation_level="REPEATABLE READ" if backend != "sqlite" else None)
    mine = wp.Runtime(engine)
    request.addfinalizer(mine.close)
    with Session(engine) as session:
        session.execute(text("SELECT COUNT(*) FROM wf_workflows")).all()  # its snapshot
        make_runtime().register(zeta_theirs)
        try:  # alpha's row comes first in the batch's order
            mine.register(alpha, zeta_ours, session=session)
        except wp.WorkflowVersionConflictError:
            session.commit()  # the host caught it and went on
        except wp.StatementCancelledError:
            session.rollback()
        else:
            raise AssertionError("registered over another source")
    assert _cataloged(engine) == [("uncommitted_zeta", 1)]
