"""A write of wf_persist's own that the database rolls back to break a deadlock is sent
again, instead of failing its drive (and running again the step whose result it carried).

A child's last write locks the child's row, then its parent's (to tell it); a lease
renewal of both, or an application's transaction, may lock them the other way round. Here
an application's transaction does, deterministically: it holds the parent's row while the
child's last write waits for it, then asks for the child's. PostgreSQL's deadlock check
runs first in the process that waited first, the child's write: that one is rolled back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

import wf_persist as wp

from .helpers import wait_until

pytestmark = pytest.mark.needs("skip_locked")  # row locks: PostgreSQL, MySQL/MariaDB

RAN: list[str] = []
GO = threading.Event()


@wp.step
def _child_step() -> int:
    RAN.append("child")
    GO.wait(20)
    return 7


@wp.workflow(name="deadlock_child", version=1)
def deadlock_child_wf(ctx: wp.Context) -> int:
    return ctx.run(_child_step)


@wp.workflow(name="deadlock_parent", version=1)
def deadlock_parent_wf(ctx: wp.Context) -> int:
    handle = ctx.start_child(deadlock_child_wf, None)
    return int(ctx.child_result(handle))


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            query = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        else:
            query = (
                "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            )
        return bool(conn.execute(text(query)).scalar())


def test_a_deadlocked_write_is_sent_again(
    runtime: wp.Runtime, make_engine: Callable[..., Engine], db_url: str
) -> None:
    RAN.clear()
    GO.clear()
    runtime.register(deadlock_parent_wf, deadlock_child_wf)
    runtime.start_worker(concurrency=4)
    parent = runtime.client().start(deadlock_parent_wf).execution_id
    wait_until(lambda: "child" in RAN, what="the child's step", timeout=30)
    child = runtime.client().list("deadlock_child").items[0].execution_id
    admin = make_engine(db_url)
    with make_engine(db_url).connect() as host:
        lock = "SELECT id FROM wf_executions WHERE id = :i FOR UPDATE"
        host.execute(text(lock), {"i": parent})  # the application holds the parent's row
        GO.set()  # the child's last write locks the child's row, then waits for the parent's
        wait_until(lambda: _waiting_on_a_lock(admin), what="the child's write", timeout=20)
        try:
            host.execute(text(lock), {"i": child})  # the other way round: a deadlock
        except Exception:  # chosen as the victim (MariaDB may): the write went through
            host.rollback()
        else:
            host.commit()
    assert runtime.client().result(parent, timeout=60).unwrap() == 7
    assert RAN == ["child"]  # its result was written once, never lost to the deadlock
    for run in (parent, child):
        assert runtime.client().describe(run).drive_failures == 0
