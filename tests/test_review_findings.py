"""Regression tests for findings of a review of the hot path (lent connections, deferred
step outcomes, PostgreSQL's raw statements, presence and wake-ups, embedded hand-over)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, func, select

import wf_persist as wp

from .fixtures import workflows as w


def test_host_autocommit_connections_stay_autocommit(
    backend: str, db_url: str, make_engine: Callable[..., Engine], host_tables: Any
) -> None:
    """A host engine in AUTOCOMMIT gets its connections back in AUTOCOMMIT after wf_persist
    used them (a start, a result): a host write without commit() stays written."""
    engine = make_engine(db_url, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    table = Table("review_host_rows", MetaData(), Column("n", Integer))
    host_tables.create(engine, table)
    other = make_engine(db_url)
    with wp.Runtime(engine, lease_ttl=5) as rt:
        rt.register(*w.ALL)
        client = rt.client()
        for i in range(3):
            execution_id = client.start(w.echo_wf, 2).execution_id
            with engine.connect() as conn:  # the host's next use of its one connection
                conn.execute(table.insert().values(n=i))  # no commit(): AUTOCOMMIT
            with other.connect() as conn:
                assert conn.execute(select(func.count()).select_from(table)).scalar() == i + 1
            assert client.result(execution_id, timeout=20).unwrap() == [1, 2]
