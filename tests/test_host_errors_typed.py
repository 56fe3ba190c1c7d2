"""Failures a host application's own setup causes come out typed (a ``WfPersistError``),
not as SQLAlchemy's or the driver's raw error:

- the host's pool exhausted (its sessions hold every connection the runtime shares);
- PostgreSQL failing a start in a host transaction at REPEATABLE READ whose snapshot
  predates a concurrent change (a run started with the same key, say);
- a session whose connection does not see the runtime's tables (an engine without the
  ``schema_translate_map`` of the runtime's).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist import migrate

from .fixtures import workflows as w


def test_an_exhausted_host_pool_is_typed(db_url: str, make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    with wp.Runtime(engine) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        with Session(engine) as held:
            held.execute(text("SELECT 1"))  # the pool's one connection, held
            for call in (lambda: client.start(w.echo_wf, 1), lambda: client.list("echo")):
                with pytest.raises(wp.PoolExhaustedError) as info:
                    call()
                assert isinstance(info.value, PoolTimeout)  # what a host caught before
                assert isinstance(info.value, wp.DatabaseUnavailableError)
        assert client.list("echo").items == []  # nothing was written


@pytest.mark.needs("server")
def test_an_idempotent_start_unseen_by_a_repeatable_read_snapshot_is_typed(
    runtime: wp.Runtime, db_engine: Engine, backend: str
) -> None:
    """MySQL's insert finds no row of the key (IdempotencyConflictError); PostgreSQL fails
    it as a serialization failure, which says nothing of the key (a SERIALIZABLE host
    transaction fails so on any concurrent change): a cancelled statement to retry."""
    runtime.register(w.echo_wf)
    client = runtime.client()
    with Session(db_engine.execution_options(isolation_level="REPEATABLE READ")) as host:
        host.execute(text("SELECT count(*) FROM wf_workflows")).all()  # the snapshot
        first = client.start(w.echo_wf, 1, idempotency_key="k").execution_id
        raised = wp.IdempotencyConflictError
        if backend == "postgresql":
            raised = wp.StatementCancelledError  # type: ignore[assignment]
        with pytest.raises(raised, match="retry"):
            client.start(w.echo_wf, 1, idempotency_key="k", session=host)
        host.rollback()
    with Session(db_engine) as fresh:  # in a new transaction: the run started
        again = client.start(w.echo_wf, 1, idempotency_key="k", session=fresh)
        assert (again.execution_id, again.created) == (first, False)


@pytest.mark.needs("schemas")
def test_a_session_not_seeing_the_runtimes_schema_is_typed(
    blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    app = make_engine(blank_db_url)
    with app.begin() as conn:
        conn.execute(text("CREATE SCHEMA wf"))
    ours = app.execution_options(schema_translate_map={None: "wf"})
    migrate.upgrade(ours)
    with wp.Runtime(ours) as rt:
        rt.register(w.echo_wf)
        refused = pytest.raises(wp.UnsupportedDatabaseError, match="not where this connection")
        with Session(app) as host, refused:  # the application's engine: no map
            rt.client().start(w.echo_wf, 1, session=host)
        with Session(ours) as host:  # the runtime's engine: the run starts
            rt.client().start(w.echo_wf, 1, session=host)
            host.commit()
        assert len(rt.client().list("echo").items) == 1
