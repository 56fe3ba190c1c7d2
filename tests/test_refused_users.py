"""A database user the server refuses writes (granted SELECT only, or no DELETE): one
typed error where wf_persist meets it, nothing half-written. Without the
write probe a runtime opened, then its catalog write, every start and every claim was the
driver's error (MariaDB's 1142, PostgreSQL's ``InsufficientPrivilege``)."""

from __future__ import annotations

import datetime as dt
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, make_url, text

import wf_persist as wp

from .fixtures import workflows as w


class Restricted:
    """One way per backend to take writes away from an engine's user: a role or user of
    its own on a server, an authorizer on SQLite (a host may install one)."""

    def __init__(self, backend: str, db_url: str, make_engine: Callable[..., Engine]) -> None:
        self.backend, self.db_url, self.make_engine = backend, db_url, make_engine
        self.name = f"wf_limited_{uuid.uuid4().hex[:10]}"
        self.denied: set[str] = set()
        self._admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
        if backend == "postgresql":
            self._sql(
                f"CREATE ROLE {self.name} LOGIN",
                f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {self.name}",
                f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {self.name}",
            )
        elif backend == "mysql":
            database = make_url(db_url).database
            self._sql(
                f"CREATE USER '{self.name}'@'%'",
                f"GRANT SELECT ON `{database}`.* TO '{self.name}'@'%'",
            )

    def _sql(self, *statements: str) -> None:
        with self._admin.connect() as conn:
            for statement in statements:
                conn.execute(text(statement))

    def deny(self, *verbs: str) -> None:
        """Take these writes away (the others are granted)."""
        self.denied = set(verbs)
        if self.backend == "sqlite":
            return
        granted = ", ".join(v for v in ("INSERT", "UPDATE", "DELETE") if v not in verbs)
        taken = ", ".join(verbs)
        on = "ALL TABLES IN SCHEMA public" if self.backend == "postgresql" else "*"
        if self.backend == "mysql":
            on = f"`{make_url(self.db_url).database}`.*"
        user = self.name if self.backend == "postgresql" else f"'{self.name}'@'%'"
        statements = [f"GRANT {granted} ON {on} TO {user}"] if granted else []
        if verbs:
            statements.append(f"REVOKE {taken} ON {on} FROM {user}")
        self._sql(*statements)

    def engine(self) -> Engine:
        if self.backend != "sqlite":
            return self.make_engine(make_url(self.db_url).set(username=self.name))
        engine = self.make_engine(self.db_url)
        actions = {
            sqlite3.SQLITE_INSERT: "INSERT",
            sqlite3.SQLITE_UPDATE: "UPDATE",
            sqlite3.SQLITE_DELETE: "DELETE",
        }

        def authorize(action: int, table: str | None, *_rest: Any) -> int:
            refused = actions.get(action) in self.denied and (table or "").startswith("wf_")
            return sqlite3.SQLITE_DENY if refused else sqlite3.SQLITE_OK

        @event.listens_for(engine, "connect")
        def _authorizer(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.set_authorizer(authorize)

        return engine

    def close(self) -> None:
        if self.backend == "postgresql":
            self._sql(f"DROP OWNED BY {self.name}", f"DROP ROLE {self.name}")
        elif self.backend == "mysql":
            self._sql(f"DROP USER '{self.name}'@'%'")
        self._admin.dispose()


@pytest.fixture
def restricted(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> Iterator[Restricted]:
    made = Restricted(backend, db_url, make_engine)
    try:
        yield made
    finally:
        made.close()


def _counts(db_url: str) -> tuple[int, ...]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return tuple(
                int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())
                for table in ("wf_workflows", "wf_executions", "wf_history")
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize("denied", ["INSERT", "UPDATE"])
def test_a_user_refused_writes_is_refused_by_a_runtime_and_only_reads_through_a_client(
    denied: str,
    db_url: str,
    restricted: Restricted,
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    writer = make_runtime()
    writer.register(w.two_approvals_wf)
    run = writer.client().start(w.two_approvals_wf).execution_id
    assert writer.drive(run)
    before = _counts(db_url)
    restricted.deny(denied, "DELETE")
    engine = restricted.engine()
    with pytest.raises(wp.UnsupportedDatabaseError, match=f"refuses this engine's user {denied}"):
        wp.Runtime(engine)
    with wp.Client(engine) as client:
        assert client.status(run) == "suspended"
        assert [p.name for p in client.pending_signals(run)] == ["approval"]
        for write in (
            lambda: client.start("two-approvals"),
            lambda: client.signal(run, "approval", {"approved": True}),
            lambda: client.cancel(run),
            lambda: client.purge(older_than=dt.timedelta(0)),
        ):
            with pytest.raises(wp.UnsupportedDatabaseError, match="refuses this engine's user"):
                write()
    assert _counts(db_url) == before
    assert writer.client().status(run) == "suspended"


def test_a_user_refused_only_delete_runs_workflows_and_its_purge_is_one_typed_error(
    db_url: str, restricted: Restricted
) -> None:
    restricted.deny("DELETE")
    with wp.Runtime(restricted.engine()) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        done = client.start(w.echo_wf, 2).execution_id
        assert client.result(done, timeout=20).unwrap() == [1, 2]
        before = _counts(db_url)
        with pytest.raises(wp.UnsupportedDatabaseError, match="a purge's DELETE"):
            client.purge(older_than=dt.timedelta(0))
        assert _counts(db_url) == before
        assert client.status(done) == "completed"
