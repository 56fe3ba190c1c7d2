"""What an operator meets at the edges of the CLI and the web view: a viewer that must not
migrate, telemetry settings the SDK refuses, console exporters beside ``--json``, relative
revisions past the end, addresses that cannot be listened on, names that look like options,
and a connection the server ends while a command waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import socket
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

import wf_persist as wp
from wf_persist import migrate

from .conftest import has
from .fixtures import workflows as w
from .fixtures.revisions import below_head
from .helpers import Finished, Processes, wait_status, wait_until


@wp.workflow(name="dashed", version=1)
def dashed_wf(ctx: wp.Context) -> object:
    got = ctx.wait_for_signal("-x")
    assert isinstance(got, wp.Received)
    return got.value


def _one_error_line(out: Finished, code: int = 1) -> str:
    returncode, stderr = out.returncode, out.stderr
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return str(errors[0])


@pytest.mark.needs("embedded")
def test_the_web_view_never_creates_or_migrates_a_database(
    tmp_path: Path, procs: Processes
) -> None:
    missing = tmp_path / "typo.sqlite3"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    out = procs.cli("web", "--url", f"sqlite:///{missing}", "--port", port, check=False)
    assert "not migrated" in _one_error_line(out)
    assert not list(tmp_path.glob("typo.sqlite3*"))
    behind = tmp_path / "behind.sqlite3"
    migrate.upgrade(f"sqlite:///{behind}", below_head())
    pytest.importorskip("starlette")
    from wf_persist.web import create_app

    with pytest.raises(wp.SchemaVersionError):
        create_app(f"sqlite:///{behind}")
    assert migrate.current(f"sqlite:///{behind}") == below_head()
    with pytest.raises(wp.SchemaVersionError):
        create_app(f"sqlite:///{missing}")
    assert not missing.exists()
    with wp.Client(f"sqlite:///{behind}", auto_migrate=True) as client:  # a schema ignored
        for given in ({"database": f"sqlite:///{missing}"}, {"schema": "wf"}):
            with pytest.raises(wp.InvalidArgumentError, match="not both"):
                create_app(client=client, **given)  # type: ignore[arg-type]
    assert not missing.exists()


def test_telemetry_settings_the_sdk_refuses_leave_telemetry_off(
    db_url: str, procs: Processes
) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_BSP_MAX_QUEUE_SIZE": "0",
        "OTEL_BSP_SCHEDULE_DELAY": "-5",
    }
    out = procs.cli("runs", "list", "--url", db_url, "--json", env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "telemetry stays off" in out.stderr
    json.loads(out.stdout)


def test_console_exporters_leave_json_output_whole(db_url: str, procs: Processes) -> None:
    with wp.Runtime(db_url) as rt:
        rt.register(w.echo_wf)
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    out = procs.cli(
        "runs", "start", "echo", "--input", "2", "--url", db_url, "--json", env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # one document: the spans and metrics went to stderr
    assert doc["workflow_name"] == "echo"
    assert "trace_id" in out.stderr


def test_a_relative_revision_past_the_end_is_one_error_line(
    blank_db_url: str, procs: Processes
) -> None:
    for revision in ("head+5", f"{migrate.SCHEMA_HEAD}+1"):
        out = procs.cli("db", "upgrade", revision, "--url", blank_db_url, check=False)
        assert "past the last one" in _one_error_line(out)
    assert migrate.current(blank_db_url) is None
    with pytest.raises(wp.InvalidArgumentError):
        migrate.upgrade(blank_db_url, "head+5")


@pytest.mark.needs("embedded")
def test_an_address_the_web_view_cannot_listen_on(db_url: str, procs: Processes) -> None:
    for port in ("99999", "-1", "0"):
        out = procs.cli("web", "--url", db_url, "--port", port, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr  # a usage error
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = procs.cli("web", "--url", db_url, "--port", port, check=False)
        assert "cannot listen on 127.0.0.1" in _one_error_line(out)
    out = procs.cli("web", "--url", db_url, "--host", "no such host", check=False)
    assert "cannot listen on no such host" in _one_error_line(out)


def _waiting_dashed(runtime: wp.Runtime) -> tuple[wp.WorkflowClient, str]:
    """A run parked on its wait of a name like an option: its client and id."""
    runtime.register(dashed_wf)
    client = runtime.client()
    run = client.start(dashed_wf).execution_id
    runtime.drive(run)
    wait_status(client, run, "suspended")
    return client, run


def test_the_pasted_signal_command_of_a_name_like_an_option(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    client, run = _waiting_dashed(runtime)
    shown = procs.cli("runs", "show", run, "--url", db_url).stdout
    (line,) = [ln.strip() for ln in shown.splitlines() if "wf-persist runs signal" in ln]
    words = shlex.split(line)
    assert words[:4] == ["wf-persist", "runs", "signal", "--url"] and "--" in words
    procs.cli(*words[1:])
    runtime.drive(run)
    assert client.result(run, timeout=30).unwrap() is None


@pytest.mark.needs("schemas")  # PostgreSQL: trust, so a password in the URL is taken
def test_the_pasted_signal_command_leaves_out_a_url_with_its_password_in_the_query(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    _, run = _waiting_dashed(runtime)
    for secret in ("password=s3cretPW", "sslpassword=s3cretPW"):
        url = f"{db_url}{'&' if '?' in db_url else '?'}{secret}"
        for json_out in ((), ("--json",)):
            shown = procs.cli("runs", "show", run, "--url", url, *json_out)
            assert "wf-persist runs signal" in shown.stdout
            assert "s3cretPW" not in shown.stdout + shown.stderr
            assert "--url" not in shown.stdout.split("wf-persist runs signal", 1)[1]


def _end_connections(backend: str, engine: Engine) -> int:
    """End every other connection to this database (an operator's kill), as the server does
    while it stays up; how many."""
    with engine.connect() as conn:
        if has(backend, "schemas"):  # PostgreSQL
            ended = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        else:
            ids = conn.execute(
                text(
                    "SELECT ID FROM information_schema.PROCESSLIST "
                    "WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
                )
            ).scalars()
            ended = 0
            for pid in ids:
                conn.execute(text(f"KILL {int(pid)}"))
                ended += 1
    return int(ended)


@pytest.mark.needs("server")
def test_a_wait_rides_out_a_connection_the_server_ended(
    backend: str, db_url: str, procs: Processes, make_engine: Callable[..., Engine]
) -> None:
    """``runs result`` and ``runs history --follow`` wait for a run; an operator kills
    their connections twice meanwhile (the server stays up): both go on and see the end."""
    with wp.Runtime(db_url) as rt:
        rt.register(dashed_wf)
        handle = rt.client().start(dashed_wf)
        rt.drive(handle.execution_id)
    run = handle.execution_id
    cli = [sys.executable, "-m", "wf_persist.cli"]
    waiting = procs.spawn([*cli, "runs", "result", run, "--url", db_url])
    following = procs.spawn([*cli, "runs", "history", run, "--follow", "--url", db_url])
    admin = make_engine(db_url)
    # Both waiting before the first kill: one that ends a command's connection while it is
    # still opening its client fails the command (a loaded machine took over 2 s to start
    # them). The follower prints the events so far once it waits; the other started with it
    # and does the same work first.
    wait_until(lambda: "signal.waiting" in following.stdout(), what="the follower waiting")
    time.sleep(2.0)
    for _ in range(2):
        wait_until(lambda: _end_connections(backend, admin) > 0, what="their connections")
        time.sleep(1.0)
    assert waiting.popen.poll() is None and following.popen.poll() is None
    with wp.Runtime(db_url) as rt:
        rt.register(dashed_wf)
        rt.client().signal(run, "-x", "done")
        rt.drive(run)
    assert "done" in procs.finish(waiting, timeout=60).stdout
    assert "workflow.completed" in procs.finish(following, timeout=60).stdout


@pytest.mark.needs("server")
def test_async_reads_ride_out_a_connection_the_server_ended(
    backend: str, db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """``wp.AsyncClient``'s reads after an operator ended its idle pooled connection: on
    MariaDB its engine set READ COMMITTED at every checkout, and on a connection the server
    had ended that SET failed with the driver's raw error (read as the database out of
    reach, the connection leaked); ``get_event``'s looks were not tried again anywhere."""
    with wp.Runtime(db_url) as rt:
        rt.register(dashed_wf)
        run = rt.client().start(dashed_wf).execution_id
        rt.drive(run)
    admin = make_engine(db_url)

    async def reads() -> list[object]:
        found: list[object] = []
        async with wp.AsyncClient(db_url) as client:
            for read in (
                lambda: client.status(run),
                lambda: client.describe(run),
                lambda: client.history(run),
                lambda: client.pending_signals(run),
                lambda: client.events(run),
                lambda: client.get_event(run, "k", timeout=0.3),
            ):
                await client.status(run)  # leaves an idle connection in the pool
                assert _end_connections(backend, admin) > 0
                try:
                    found.append(await read())
                except wp.EventNotSetError as exc:
                    found.append(type(exc))
        return found

    status, info, history, pending, published, event = asyncio.run(reads())
    assert status == "suspended"
    assert isinstance(info, wp.ExecutionInfo) and info.status == "suspended"
    assert isinstance(history, list) and history
    assert isinstance(pending, list) and [p.name for p in pending] == ["-x"]
    assert (published, event) == ({}, wp.EventNotSetError)


def test_the_listen_check_binds_as_the_server_does() -> None:
    """Every address of the name, an IPv6 one for IPv6 only: ``::`` is free beside an IPv4
    wildcard listener of the same port (as asyncio binds it), ``0.0.0.0`` is not."""
    from wf_persist.cli.web import _check_listen

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(wp.InvalidArgumentError, match="in use"):
            _check_listen("0.0.0.0", port)
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6) as six:
                    six.bind(("::1", 0))
                usable = True
            except OSError:  # a kernel without IPv6: nothing to compare
                usable = False
            if usable:
                _check_listen("::", port)


def _journal(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


@pytest.mark.needs("embedded")
def test_a_mistyped_url_leaves_another_applications_file_as_it_was(
    tmp_path: Path, procs: Processes
) -> None:
    """WAL is written into the file: a command or client pointed at another application's
    database (rollback journal) or at an empty file converted the one to WAL and wrote a
    header into the other before refusing them. Both are refused now, byte for byte as
    they were."""
    app_db, empty = tmp_path / "app.sqlite3", tmp_path / "empty.sqlite3"
    with contextlib.closing(sqlite3.connect(app_db)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.commit()
    empty.touch()
    before = {path: path.read_bytes() for path in (app_db, empty)}
    for path in (app_db, empty):
        url = f"sqlite:///{path}"
        listed = procs.cli("runs", "list", "--url", url, check=False)
        assert "not migrated" in _one_error_line(listed)
        current = procs.cli("db", "current", "--url", url, check=False)
        assert (current.returncode, current.stdout) == (3, "none\n")
        with pytest.raises(wp.SchemaVersionError):
            wp.Client(url, auto_migrate=False)
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(p.name for p in tmp_path.glob("*.sqlite3*")) == ["app.sqlite3", "empty.sqlite3"]
    assert _journal(app_db) == "delete"


@pytest.mark.needs("embedded")
def test_our_database_in_a_rollback_journal_is_put_in_wal_by_our_engines_only(
    tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    """A database holding our schema in rollback-journal mode (a script migrated it, or a
    host's engine) gets WAL when a runtime's own engine opens it; a host's engine keeps
    the file's mode. A new file gets WAL from the first connection of an engine of ours."""
    path = tmp_path / "ours.sqlite3"
    url = f"sqlite:///{path}"
    with wp.Runtime(make_engine(url), auto_migrate=True):
        pass
    assert _journal(path) == "delete"  # a host's engine: its file, its mode
    with wp.Runtime(url):
        pass
    assert _journal(path) == "wal"
    fresh = tmp_path / "fresh.sqlite3"
    engine = wp.create_engine(f"sqlite:///{fresh}")
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()
    assert _journal(fresh) == "wal"
