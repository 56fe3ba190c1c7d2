"""Each backend as the README describes it: its capabilities, how wf_persist configures the
engines it creates, which driver a bare URL selects, and the DDL ``--sql`` renders."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from wf_persist import backends

from .conftest import CAPABILITIES, capabilities_of
from .fixtures import workflows as w
from .helpers import Processes

#: What each backend can do. The ``needs``/``lacks`` markers select backends by these, so a
#: capability lost by accident would quietly drop a backend from the tests that need it:
#: pinned here instead.
EXPECTED_CAPABILITIES = {
    "sqlite": {"embedded"},
    "postgresql": {
        "server",
        "skip_locked",
        "schemas",
        "initdb",
        "notify",
        "presence",
        "idle_limit",
        "libpq",
    },
    "mysql": {"server", "skip_locked", "sql_mode"},
}


def test_capabilities_of_every_backend(backend: str, runtime: wp.Runtime) -> None:
    assert capabilities_of(runtime.backend) == EXPECTED_CAPABILITIES[backend]
    assert CAPABILITIES[backend] == EXPECTED_CAPABILITIES[backend], "the session's probe"


def _settings(engine: Engine, backend: str) -> dict[str, Any]:
    """The session settings wf_persist promises for its own engines, as a connection of
    ``engine`` reports them."""
    with engine.connect() as conn:
        if backend == "sqlite":
            return {
                pragma: conn.exec_driver_sql(f"PRAGMA {pragma}").scalar()
                for pragma in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
            }
        found: dict[str, Any] = {"isolation": conn.get_isolation_level()}
        if backend == "mysql":
            mode = str(conn.execute(text("SELECT @@SESSION.sql_mode")).scalar())
            found["strict"] = "STRICT_ALL_TABLES" in mode.split(",")
        return found


#: What the engines wf_persist creates are set to (README, "Inside your application").
OWN_ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    # WAL, synchronous=FULL (2): a commit survives power loss; foreign keys; busy timeout.
    "sqlite": {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1, "busy_timeout": 30000},
    "postgresql": {"isolation": "READ COMMITTED"},
    "mysql": {"isolation": "READ COMMITTED", "strict": True},
}


def test_engines_wf_persist_creates_are_configured(backend: str, blank_db_url: str) -> None:
    """On a fresh database (a new SQLite file is in rollback-journal mode until told
    otherwise): ``wp.create_engine``, a runtime's own engine and its lease keeper's."""
    expected = OWN_ENGINE_SETTINGS[backend]
    engine = wp.create_engine(blank_db_url)
    try:
        assert _settings(engine, backend) == expected, "wp.create_engine"
    finally:
        engine.dispose()
    with wp.Runtime(blank_db_url, auto_migrate=True) as rt:
        assert _settings(rt.engine, backend) == expected, "a Runtime's own engine"
        assert _settings(rt.keeper().engine(), backend) == expected, "the lease keeper's"


#: The driver a URL without one selects (README: ``postgresql://`` is psycopg 3,
#: ``mysql://`` is PyMySQL).
BARE_SCHEMES = {
    "postgresql": ("postgresql", "psycopg"),
    "mysql": ("mysql", "pymysql"),
}


def test_url_schemes_select_the_drivers() -> None:
    cases = {
        "postgresql://u@h/db": "postgresql+psycopg",
        "postgres://u@h/db": "postgresql+psycopg",
        "mysql://u@h/db": "mysql+pymysql",
        "mariadb://u@h/db": "mariadb+pymysql",
        "sqlite:///x.sqlite3": "sqlite",
        "postgresql+psycopg://u@h/db": "postgresql+psycopg",
    }
    for url, driver in cases.items():
        assert backends.normalize_url(url).drivername == driver, url
    for bad in ("oracle://u@h/db", "not a url"):
        with pytest.raises(wp.UnsupportedDatabaseError):
            backends.normalize_url(bad)


@pytest.mark.needs("server")
def test_a_bare_url_connects_with_the_chosen_driver(backend: str, db_url: str) -> None:
    scheme, driver = BARE_SCHEMES[backend]
    bare = make_url(db_url).set(drivername=scheme).render_as_string(hide_password=False)
    assert "+" not in bare.split("://")[0]
    engine = wp.create_engine(bare)
    try:
        assert engine.dialect.driver == driver
    finally:
        engine.dispose()
    with wp.Runtime(bare) as rt:
        assert rt.engine.dialect.driver == driver
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.result(client.start(w.echo_wf, 3).execution_id).unwrap() == [1, 2, 3]


def test_offline_sql_for_a_mysql_url(procs: Processes) -> None:
    """``wf-persist db upgrade --sql --url mysql://...`` renders MySQL DDL without a server."""
    out = procs.cli("db", "upgrade", "--sql", "--url", "mysql://u@nowhere.invalid:1/app")
    script = out.stdout
    assert "CREATE TABLE wf_executions" in script and "ENGINE=InnoDB" in script
    assert "COLLATE utf8mb4_bin" in script and "event JSON NOT NULL" in script
    assert "INSERT INTO wf_persist_alembic_version" in script
    assert "CREATE VIEW wf_step_attempts" in script
