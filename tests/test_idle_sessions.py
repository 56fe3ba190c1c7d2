"""Servers that end idle sessions, and servers that answer in another language.

Managed PostgreSQL often sets ``idle_session_timeout`` (for a database or a role), and a
MySQL/MariaDB host may run with a short ``wait_timeout``: the server then ends a session
that sent nothing for that long. A drive keeps no connection idle while user code runs, and
a concurrency slot's session (idle while its step runs, its lock going with it) is kept
from being ended. A server whose messages are not in English (``lc_messages``) still has
its expected duplicate keys recognised.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import DBAPIError

import wf_persist as wp
from wf_persist import migrate

from .conftest import has
from .helpers import Processes, history_types, wait_until

#: How long the server lets a session sit idle (1 s), and a step outlasting it.
STEP_SECONDS = 2.5


@pytest.fixture(params=["ours", "host"])
def idle_ending(
    request: pytest.FixtureRequest,
    backend: str,
    db_url: str,
    blank_db_url: str,
    make_engine: Callable[..., Engine],
) -> str | Engine:
    """A database whose sessions the server ends after 1 s of silence: reached by a URL
    (wf_persist's own engine; a database setting on PostgreSQL, the session's on MySQL), or
    by a host's engine, which is used as is: its ``pool_pre_ping`` (what a host facing such
    a server sets) replaces the pooled connections the server ended, and only what
    wf_persist holds itself is left to it."""
    mysql = has(backend, "sql_mode")
    if request.param == "host":
        args = (
            {"init_command": "SET SESSION wait_timeout = 1"}
            if mysql
            else {"options": "-c idle_session_timeout=1000"}
        )
        return make_engine(db_url, connect_args=args, pool_pre_ping=True)
    if mysql:
        url = make_url(db_url).update_query_dict({"init_command": "SET SESSION wait_timeout = 1"})
        return url.render_as_string(hide_password=False)
    migrate.upgrade(blank_db_url)
    with make_engine(blank_db_url, isolation_level="AUTOCOMMIT").connect() as admin:
        name = admin.execute(text("SELECT current_database()")).scalar_one()
        admin.execute(text(f'ALTER DATABASE "{name}" SET idle_session_timeout = 1000'))
    return blank_db_url


ran: list[int] = []
inside = {"now": 0, "peak": 0}
inside_lock = threading.Lock()


@wp.step
def slow(i: int) -> int:
    ran.append(i)
    time.sleep(STEP_SECONDS)
    return i * 10


@wp.step(concurrency=wp.Limit(1))
def limited(i: int) -> int:
    with inside_lock:
        inside["now"] += 1
        inside["peak"] = max(inside["peak"], inside["now"])
    try:
        time.sleep(STEP_SECONDS)
    finally:
        with inside_lock:
            inside["now"] -= 1
    return i


@wp.workflow(name="idle_slow", version=1)
def idle_slow_wf(ctx: wp.Context, i: int) -> int:
    return ctx.run(slow, i) + 1


@wp.workflow(name="idle_limited", version=1)
def idle_limited_wf(ctx: wp.Context, i: int) -> int:
    return ctx.run(limited, i)


@pytest.mark.needs("server")
@pytest.mark.parametrize("worker", [True, False], ids=["worker", "caller"])
@pytest.mark.parametrize("start_after", [1.0, None], ids=["start-recorded", "one-write"])
def test_a_step_outlasting_the_servers_idle_limit_runs_once(
    idle_ending: str | Engine, worker: bool, start_after: float | None
) -> None:
    """The outcome's write after a step longer than the server's idle limit met a
    connection the server had ended: the attempt's start, recorded after 1 s, had kept its
    connection idle for the rest of the step; or, with no lease renewals to keep the pool's
    connections busy (a long lease), the pooled connection it took had sat idle through the
    step. Every drive ran the step again until the run failed with DriveFailedError."""
    ran.clear()
    engine = idle_ending
    options: dict[str, Any] = {"lease_ttl": 60.0, "record_start_after": start_after}
    with wp.Runtime(engine, max_drive_failures=2, **options) as rt:
        rt.register(idle_slow_wf)
        run = rt.client().start(idle_slow_wf, 4).execution_id
        if worker:
            rt.start_worker(concurrency=2)
        assert rt.client().result(run, timeout=60).unwrap() == 41
        assert ran == [4]
        assert "drive.failed" not in history_types(rt.client(), run)


@wp.step
def shorter(i: int) -> int:
    ran.append(-i)
    time.sleep(1.3)
    return i


@wp.workflow(name="idle_all", version=1)
def idle_all_wf(ctx: wp.Context, i: int) -> int:
    a, b = ctx.all([wp.call(shorter, i), wp.call(slow, i)])
    return int(a) + int(b)


@pytest.mark.needs("server")
def test_parallel_branches_keep_no_connection_idle_while_a_sibling_runs(
    idle_ending: str | Engine,
) -> None:
    """The shorter branch's outcome write kept the drive's connection while the longer
    branch ran on; the server ended it and the longer branch's write failed on it: the
    longer step ran again."""
    ran.clear()
    engine = idle_ending
    with wp.Runtime(engine, max_drive_failures=2, lease_ttl=60.0) as rt:
        rt.register(idle_all_wf)
        run = rt.client().start(idle_all_wf, 3).execution_id
        assert rt.client().result(run, timeout=60).unwrap() == 33
        assert sorted(ran) == [-3, 3]
        assert "drive.failed" not in history_types(rt.client(), run)


@pytest.mark.needs("server")
def test_a_limit_holds_when_the_server_ends_idle_sessions(idle_ending: str | Engine) -> None:
    """A slot is a session lock on a connection that sits idle while its step runs: the
    server ended that session and its lock, and a second run entered the ``Limit(1)``."""
    inside.update(now=0, peak=0)
    engine = idle_ending
    with wp.Runtime(engine, record_start_after=None) as rt:
        rt.register(idle_limited_wf)
        runs = [rt.client().start(idle_limited_wf, i).execution_id for i in range(2)]
        rt.start_worker(concurrency=4)
        assert [rt.client().result(r, timeout=60).unwrap() for r in runs] == [0, 1]
    assert inside["peak"] == 1


@wp.workflow(name="spoken", version=1)
def spoken_wf(ctx: wp.Context, x: int) -> int:
    return x + 1


@pytest.mark.needs("sql_mode")
def test_duplicate_keys_are_recognised_in_the_servers_language(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """MariaDB in German (``lc_messages``): a repeated idempotent start and a second
    process registering a cataloged version raised the server's raw duplicate-key error."""
    kwargs: dict[str, Any] = {"connect_args": {"init_command": "SET lc_messages = 'de_DE'"}}
    with wp.Runtime(make_engine(db_url, **kwargs)) as first:
        first.register(spoken_wf)
        client = first.client()
        run = client.start(spoken_wf, 1, idempotency_key="order-1").execution_id
        assert client.start(spoken_wf, 1, idempotency_key="order-1").execution_id == run
        with wp.Runtime(make_engine(db_url, **kwargs)) as second:
            second.register(spoken_wf)
            assert second.client().result(run, timeout=30).unwrap() == 2


@pytest.mark.needs("notify")
def test_the_listening_connection_outlives_the_servers_idle_limit(
    blank_db_url: str, make_engine: Callable[..., Engine], procs: Processes
) -> None:
    """A database whose sessions end after 1 s idle (as a managed service sets it): a
    worker whose listening connection went quiet that long (its process paused, here) had
    it ended by the server, and logged an ERROR for each time."""
    migrate.upgrade(blank_db_url)
    with make_engine(blank_db_url, isolation_level="AUTOCOMMIT").connect() as admin:
        name = admin.execute(text("SELECT current_database()")).scalar_one()
        admin.execute(text(f'ALTER DATABASE "{name}" SET idle_session_timeout = 1000'))
    worker = procs.worker(blank_db_url, lease_ttl=30.0, app_poll_interval=5.0)
    wait_until(lambda: "serving" in worker.stderr(), what="the worker", timeout=30)
    time.sleep(1.0)
    worker.popen.send_signal(signal.SIGSTOP)
    time.sleep(2.5)  # the listening connection quiet for longer than the limit
    worker.popen.send_signal(signal.SIGCONT)
    time.sleep(2.0)
    worker.popen.send_signal(signal.SIGTERM)
    assert "wake-ups" not in procs.finish(worker, timeout=60).stderr


@pytest.mark.needs("sql_mode")
def test_a_renewal_on_a_connection_the_server_ended_is_a_lost_connection(
    db_url: str, make_engine: Callable[..., Engine]
) -> None:
    """MySQL's renewal switches its connection to autocommit, a SET SQLAlchemy sends outside
    its error handling: on a connection the server had ended (a drive's, kept across a
    pause) the driver's raw error came out, recorded as a failed drive, where a connection
    to replace (and a renewal sent again on another) was meant."""
    admin = make_engine(db_url)
    with wp.Runtime(db_url) as rt:
        rt.register(idle_slow_wf)
        run = rt.client().start(idle_slow_wf, 1).execution_id
        with rt.backend.engine.connect() as conn:
            session = conn.execute(text("SELECT CONNECTION_ID()")).scalar_one()
            conn.commit()
            with admin.connect() as killer:
                killer.execute(text(f"KILL {int(session)}"))
            with pytest.raises(DBAPIError) as info:
                rt.backend.renew_alone(conn, {run: 0}, 5.0)
        assert info.value.connection_invalidated
