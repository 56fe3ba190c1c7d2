"""The libpq path (``pg_wire``): what each connection keeps between statements follows the
connection (its encoding now, its lifetime), as a cursor's does."""

from __future__ import annotations

import gc
from collections.abc import Callable

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.pool import NullPool

import wf_persist as wp

from .fixtures import workflows as w

pytestmark = pytest.mark.needs("libpq")


def test_a_client_encoding_the_host_set_later_is_the_one_values_are_sent_in(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """The host changes ``client_encoding`` on a pooled connection after wf_persist used it:
    a cursor would dump text in the new encoding; the kept transformer must too, or
    non-ASCII text is stored as mojibake (``José`` -> ``JosÃ©``) without any error."""
    engine = make_engine(db_url, pool_size=1, max_overflow=0)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        client.start(w.echo_wf, 2, actor="first")  # the connection's pg_wire session exists
        with engine.connect() as conn:  # the host, on the same pooled connection
            conn.exec_driver_sql("SET client_encoding TO 'LATIN1'")
            conn.commit()
        handle = client.start(w.echo_wf, 2, actor="José Müller")
    with make_engine(db_url).connect() as conn:
        actor = conn.execute(
            text("SELECT actor FROM wf_executions WHERE id = :id"), {"id": handle.execution_id}
        ).scalar_one()
        conn.rollback()
    assert actor == "José Müller"


def _live_connections() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, psycopg.Connection))


def test_a_closed_connection_leaves_nothing_behind(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """What the libpq path keeps per connection (prepared names, a transformer) goes with
    the connection: with NullPool (each checkout a new connection) no psycopg Connection
    outlives the engine, nor does its last result."""
    engine = make_engine(db_url, poolclass=NullPool)
    before = _live_connections()
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        for _ in range(3):
            handle = client.start(w.echo_wf, 3)
            assert rt.drive(handle.execution_id)
            assert client.result(handle.execution_id, timeout=10).unwrap() == [1, 2, 3]
    engine.dispose()
    assert _live_connections() <= before
