"""Schema names on PostgreSQL: any name PostgreSQL keeps whole works end to end (quoted as
the dialect quotes wherever SQL is written by hand: the migrations' ``CREATE SCHEMA`` and
search path, the reaper's statement), and a name it cannot keep is refused, typed, before
anything is sent. The migrations pasted the name between double quotes: a name with one
ran the SQL after it.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text

import wf_persist as wp
from wf_persist import migrate

from .fixtures import workflows as w
from .helpers import Processes, wait_until

HOSTILE = 'x"; CREATE TABLE public.pwned (i int); --'
ODD = 'wf "odd" 50% ü'


def _schemas(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(text("SELECT nspname FROM pg_namespace")).scalars())
    finally:
        engine.dispose()


def _table(url: str, name: str) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT to_regclass(:n)"), {"n": name}).scalar() is not None
    finally:
        engine.dispose()


@pytest.mark.needs("schemas")
@pytest.mark.parametrize("schema", [HOSTILE, ODD])
def test_a_schema_name_with_quotes_is_a_name_not_sql(blank_db_url: str, schema: str) -> None:
    migrate.upgrade(blank_db_url, schema=schema)
    assert not _table(blank_db_url, "public.pwned"), "the name's text ran as SQL"
    assert schema in _schemas(blank_db_url)
    assert migrate.current(blank_db_url, schema=schema) == migrate.SCHEMA_HEAD
    with wp.Runtime(blank_db_url, schema=schema) as rt:
        rt.register(w.echo_wf)
        client = rt.client()
        assert client.result(client.start(w.echo_wf, 2).execution_id, timeout=20).unwrap() == [1, 2]
        assert rt.reap() == []  # its own statement names the table in that schema
    migrate.downgrade(blank_db_url, "base", schema=schema)
    assert migrate.current(blank_db_url, schema=schema) is None


@pytest.mark.needs("schemas")
@pytest.mark.parametrize(
    "schema", ["", "pg_catalog", "pg_temp", "s" * 64, "a\x00b", "tenant[1]", "a]b"], ids=repr
)
def test_a_schema_name_postgresql_cannot_keep_is_refused_before_anything_is_sent(
    blank_db_url: str, make_engine: Callable[..., Engine], schema: str
) -> None:
    before = _schemas(blank_db_url)
    calls: tuple[Callable[[], object], ...] = (
        lambda: migrate.upgrade(blank_db_url, schema=schema),
        lambda: migrate.upgrade(blank_db_url, sql=True, schema=schema),
        lambda: migrate.downgrade(blank_db_url, "base", schema=schema),
        lambda: wp.Runtime(blank_db_url, schema=schema),
        lambda: wp.Client(blank_db_url, schema=schema),
        lambda: wp.Runtime(
            make_engine(blank_db_url).execution_options(schema_translate_map={None: schema})
        ),
    )
    for call in calls:
        with pytest.raises(wp.InvalidArgumentError, match="schema"):
            call()
    assert _schemas(blank_db_url) == before
    assert migrate.current(blank_db_url) is None


@pytest.mark.needs("schemas")
def test_the_web_command_serves_the_runs_of_a_schema(blank_db_url: str, procs: Processes) -> None:
    """Every other read command took --schema; the web view had none, and served nothing."""
    from .webserver import _free_port

    migrate.upgrade(blank_db_url, schema=ODD)
    with wp.Runtime(blank_db_url, schema=ODD) as rt:
        rt.register(w.echo_wf)
        run = rt.client().start(w.echo_wf, 2).execution_id
        rt.client().result(run, timeout=20)
    port = _free_port()
    served = procs.python(
        "-m", "wf_persist.cli", "web", "--url", blank_db_url, "--schema", ODD,
        "--port", str(port), name="web",
    )  # fmt: skip

    def listed() -> bool:
        try:
            found = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=5)
        except httpx.TransportError:
            return False
        return found.status_code == 200 and run in found.text

    wait_until(listed, what="the run in the web view", timeout=30)
    served.stop()
