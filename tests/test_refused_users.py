"""A database user the server refuses some writes (granted SELECT only, no DELETE, no
UPDATE on the append-only history, privileges revoked while it runs; a host's SQLite
authorizer): one typed error at the entry point that meets the refusal, nothing
half-written, and every legal grant that covers what wf_persist does keeps working. These
were the driver's errors (MariaDB's 1142, PostgreSQL's ``InsufficientPrivilege``)."""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, make_url, text

import wf_persist as wp

from .fixtures import workflows as w
from .helpers import wait_until

WRITES = ("INSERT", "UPDATE", "DELETE")


class Restricted:
    """One way per backend to take writes away from an engine's user: a role or user of
    its own on a server, an authorizer on SQLite (a host may install one)."""

    def __init__(self, backend: str, db_url: str, make_engine: Callable[..., Engine]) -> None:
        self.backend, self.db_url, self.make_engine = backend, db_url, make_engine
        self.name = f"wf_limited_{uuid.uuid4().hex[:10]}"
        self.denied: set[tuple[str, str | None]] = set()
        self.hidden: str | None = None
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

    def deny(self, *verbs: str, table: str | None = None) -> None:
        """Take these writes away (on ``table``, else on every table); grant the others."""
        self.denied = {(verb, table) for verb in verbs}
        if self.backend == "sqlite":
            return
        if self.backend == "postgresql":
            user, qualified = self.name, "{}"
        else:
            # Table by table: MySQL applies a database-wide grant's change to a connection
            # only at its next USE, a table's at its next statement.
            user, qualified = f"'{self.name}'@'%'", f"`{make_url(self.db_url).database}`.{{}}"
        statements = []
        for each in ("wf_workflows", "wf_executions", "wf_history"):
            name = qualified.format(each)
            given = [
                v for v in WRITES if (v, None) not in self.denied and (v, each) not in self.denied
            ]
            statements += [f"GRANT SELECT ON {name} TO {user}"]
            statements += [f"REVOKE {', '.join(WRITES)} ON {name} FROM {user}"]
            statements += [f"GRANT {', '.join(given)} ON {name} TO {user}"] if given else []
        self._sql(*statements)

    def hide(self, view: str) -> None:
        """Take reading ``view`` away (its tables stay readable)."""
        self.hidden = view
        if self.backend == "postgresql":
            self._sql(f"REVOKE SELECT ON {view} FROM {self.name}")
        elif self.backend == "mysql":  # a database-wide SELECT covers views: table by table
            database = make_url(self.db_url).database
            user = f"'{self.name}'@'%'"
            tables = ("wf_workflows", "wf_executions", "wf_history", "wf_persist_alembic_version")
            self._sql(
                f"REVOKE SELECT ON `{database}`.* FROM {user}",
                *(f"GRANT SELECT ON `{database}`.{t} TO {user}" for t in tables),
            )

    def engine(self) -> Engine:
        if self.backend != "sqlite":
            return self.make_engine(make_url(self.db_url).set(username=self.name))
        engine = self.make_engine(self.db_url)
        actions = {
            sqlite3.SQLITE_INSERT: "INSERT",
            sqlite3.SQLITE_UPDATE: "UPDATE",
            sqlite3.SQLITE_DELETE: "DELETE",
        }

        def authorize(action: int, table: str | None, *rest: Any) -> int:
            verb, name = actions.get(action), table or ""
            refused = name.startswith("wf_") and (
                (verb, None) in self.denied or (verb, name) in self.denied
            )
            through = rest[-1] if rest else None  # the view a read goes through
            hidden = action == sqlite3.SQLITE_READ and through and through == self.hidden
            return sqlite3.SQLITE_DENY if refused or hidden else sqlite3.SQLITE_OK

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


REFUSED = "refused this engine"


@pytest.mark.parametrize("denied", ["INSERT", "UPDATE"])
def test_a_user_refused_writes_reads_and_every_write_is_one_typed_error(
    denied: str,
    db_url: str,
    restricted: Restricted,
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    writer = make_runtime()
    writer.register(w.two_approvals_wf, w.echo_wf)
    run = writer.client().start(w.two_approvals_wf).execution_id
    assert writer.drive(run)
    fresh = writer.client().start(w.echo_wf, 2).execution_id  # due, never claimed
    before = _counts(db_url)
    restricted.deny(denied, "DELETE")
    engine = restricted.engine()
    # It opens: what it may not do is refused where it is done.
    with wp.Runtime(engine) as rt:
        if denied == "INSERT":
            with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
                rt.register(w.approval_wf)  # not cataloged yet
        else:
            rt.register(w.echo_wf)  # cataloged as is: nothing to write
            with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
                rt.drive(fresh)  # its claim
    with wp.Client(engine) as client:
        assert client.status(run) == "suspended"
        assert [p.name for p in client.pending_signals(run)] == ["approval"]
        writes: list[Callable[[], object]] = [
            lambda: client.signal(run, "approval", {"approved": True}),
            lambda: client.cancel(run),
        ]
        if denied == "INSERT":
            writes.append(lambda: client.start("echo", 2))
        for write in writes:
            with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
                write()
    assert _counts(db_url) == before
    assert writer.client().status(run) == "suspended"
    assert writer.client().status(fresh) == "running"
    if denied == "UPDATE":  # a process that only starts runs needs no UPDATE
        with wp.Client(engine) as starter:
            first = starter.start("echo", 2, idempotency_key="k")
            again = starter.start("echo", 2, idempotency_key="k")
        assert (first.created, again.created) == (True, False)
        assert again.execution_id == first.execution_id


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
        with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
            client.purge(older_than=dt.timedelta(0))
        assert _counts(db_url) == before
        assert client.status(done) == "completed"


def test_a_purging_user_granted_select_and_delete_only_purges(
    db_url: str, restricted: Restricted, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A retention job's usual grant: it reads and deletes, never starts a run."""
    writer = make_runtime()
    writer.register(w.echo_wf)
    done = writer.client().start(w.echo_wf, 2).execution_id
    assert writer.client().result(done, timeout=20).unwrap() == [1, 2]
    restricted.deny("INSERT", "UPDATE")
    with wp.Client(restricted.engine()) as janitor:
        assert janitor.purge(older_than=dt.timedelta(0)) == 1
    assert _counts(db_url)[1:] == (0, 0)


def test_a_purging_user_not_granted_wf_slots_still_purges_runs_and_says_so(
    db_url: str,
    restricted: Restricted,
    make_runtime: Callable[..., wp.Runtime],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A retention role granted what the README asked before ``wf_slots`` existed: its
    purges failed once a dead worker's slot had lapsed (the runs deleted, the count
    lost). The runs are purged and counted; the slot waits, and a warning names the grant."""
    from sqlalchemy import insert

    from wf_persist.models import slots_table

    writer = make_runtime()
    writer.register(w.echo_wf)
    done = writer.client().start(w.echo_wf, 2).execution_id
    assert writer.client().result(done, timeout=20).unwrap() == [1, 2]
    past = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    with writer.engine.begin() as conn:
        conn.execute(
            insert(slots_table).values(
                slot_key="k" * 64, slot=0, holder=uuid.uuid4().hex, owner="dead!",
                execution_id="gone", step_name="s", taken_at=past, expires_at=past,
            )
        )  # fmt: skip
    restricted.deny("INSERT", "UPDATE")
    restricted.denied.add(("DELETE", "wf_slots"))  # on a server: never granted
    with wp.Client(restricted.engine()) as janitor:
        assert janitor.purge(older_than=dt.timedelta(0)) == 1
    assert _counts(db_url)[1:] == (0, 0)
    assert "grant SELECT and DELETE on wf_slots" in caplog.text
    with writer.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM wf_slots")).scalar_one() == 1


def test_an_append_only_history_grant_runs_every_kind_of_workflow(
    db_url: str, restricted: Restricted
) -> None:
    """wf_persist never updates its history: a host that takes UPDATE away from it (an
    append-only audit trail) runs steps, sleeps, signals, sagas and cancellations."""
    from .fixtures import fencing as f
    from .fixtures import saga as s

    s.reset()
    restricted.deny("UPDATE", "DELETE", table="wf_history")
    with wp.Runtime(restricted.engine(), lease_ttl=5) as rt:
        rt.register(*w.ALL, *s.ALL, *f.ALL)
        client = rt.client()
        rt.start_worker(concurrency=2, poll_interval=0.02)
        assert client.result(client.start(w.echo_wf, 3).execution_id, timeout=20).unwrap() == [
            1,
            2,
            3,
        ]
        napped = client.start(f.nap_wf, 0.2).execution_id
        assert client.result(napped, timeout=20).unwrap() == "rested"
        saga = client.result(client.start(s.saga_wf, 1).execution_id, timeout=20)
        assert isinstance(saga, wp.Failed)
        waiting = client.start(w.approval_wf, None).execution_id
        wait_until(lambda: client.pending_signals(waiting), 20, "the signal wait")
        client.signal(waiting, "approval", {"approved": True})
        assert client.result(waiting, timeout=20).unwrap() == "approved"
        cancelled = client.start(w.approval_wf, None).execution_id
        wait_until(lambda: client.pending_signals(cancelled), 20, "the signal wait")
        client.cancel(cancelled)
        assert isinstance(client.result(cancelled, timeout=20), wp.Failed)


@pytest.mark.needs("server")
def test_privileges_revoked_while_a_worker_runs(db_url: str, restricted: Restricted) -> None:
    """Revoked while a runtime and its worker run: starts are one typed error, nothing is
    written; granted again, the same runtime starts and finishes runs."""
    restricted.deny()
    with wp.Runtime(restricted.engine(), lease_ttl=5) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        rt.start_worker(concurrency=2, poll_interval=0.05)
        first = client.start(w.echo_wf, 2).execution_id
        assert client.result(first, timeout=20).unwrap() == [1, 2]
        restricted.deny("INSERT", "UPDATE", "DELETE")
        before = _counts(db_url)
        with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
            client.start(w.echo_wf, 2)
        assert _counts(db_url) == before
        restricted.deny()
        again = client.start(w.echo_wf, 2).execution_id
        assert client.result(again, timeout=20).unwrap() == [1, 2]


HOLD_HISTORY = {
    "sqlite": "BEGIN IMMEDIATE",
    "postgresql": "BEGIN; LOCK TABLE wf_history IN SHARE MODE",
    "mysql": "LOCK TABLES wf_history READ",
}


def test_a_client_and_a_runtime_open_while_another_session_locks_the_history(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """Opening writes nothing and waits on no lock: a migration or a host's long
    transaction holding the history does not hold up a process that opens."""
    holder = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with holder.connect() as conn:
            raw: Any = conn.connection.driver_connection
            cursor = raw.cursor()
            for statement in HOLD_HISTORY[backend].split("; "):
                cursor.execute(statement)
            began = time.monotonic()
            with wp.Client(make_engine(db_url)) as client:
                assert client.list().items == []
            with wp.Runtime(make_engine(db_url)):
                pass
            assert time.monotonic() - began < 3
            cursor.execute("UNLOCK TABLES" if backend == "mysql" else "ROLLBACK")
            cursor.close()
    finally:
        holder.dispose()


def test_an_upgrade_through_a_read_only_engine_is_one_typed_error(
    backend: str, blank_db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """A deploy pipeline's upgrade on a read-only engine (a standby, a read-only session)
    raised the driver's error."""
    from wf_persist import migrate

    from .test_review_hunt import read_only_engine

    engine = read_only_engine(backend, blank_db_url, make_engine)
    with pytest.raises(wp.UnsupportedDatabaseError, match=REFUSED):
        migrate.upgrade(engine)
    assert migrate.current(blank_db_url) is None


def test_the_web_view_on_a_user_not_granted_its_views_answers_with_the_refusal(
    restricted: Restricted, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """The run page reads the waits view: a user granted the tables only got a raw error
    (a 500); it is the refusal, the server's trouble, not the request's (503)."""
    import httpx

    from wf_persist.web import create_app

    from .webserver import serving

    writer = make_runtime()
    writer.register(w.two_approvals_wf)
    run = writer.client().start(w.two_approvals_wf).execution_id
    assert writer.drive(run)
    restricted.deny("INSERT", "UPDATE", "DELETE")
    restricted.hide("wf_execution_waits")
    with wp.Client(restricted.engine()) as client:
        assert client.status(run) == "suspended"  # its tables read
        app = create_app(client=client)
        with serving(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            answer = http.get(f"/api/runs/{run}")
    assert answer.status_code == 503, answer.text
    assert REFUSED in answer.json()["error"]


@pytest.mark.needs("embedded")
def test_only_sqlite_refusals_a_grant_could_lift_count_as_refused(tmp_path: Any) -> None:
    """A database file moved away under an open connection is SQLITE_READONLY_DBMOVED, an
    accident of the file system: not the engine's user refused (a worker would wait for a
    grant forever); an authorizer's denial and a read-only file are."""
    from sqlalchemy.exc import DBAPIError

    from wf_persist.backends.sqlite import SQLiteBackend

    path = tmp_path / "moved.sqlite3"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE t (x)")
    raw.commit()
    path.rename(tmp_path / "elsewhere.sqlite3")
    with pytest.raises(sqlite3.OperationalError) as moved:
        raw.execute("INSERT INTO t VALUES (1)")
    assert moved.value.sqlite_errorcode == 8 | 4 << 8  # SQLITE_READONLY_DBMOVED
    raw.set_authorizer(lambda *_: sqlite3.SQLITE_DENY)
    with pytest.raises(sqlite3.DatabaseError) as denied:
        raw.execute("SELECT 1")
    raw.close()

    def wrapped(exc: Exception) -> Any:
        return DBAPIError.instance(None, None, exc, sqlite3.Error)

    assert not SQLiteBackend.refused(wrapped(moved.value))
    assert SQLiteBackend.refused(wrapped(denied.value))
