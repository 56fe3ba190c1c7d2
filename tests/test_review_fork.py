"""A runtime belongs to the process that made it, further: nothing a forked child does
with the parent's runtime (reads, controls, a worker loop, close(), its exit) reaches the
parent's connections, locks or private database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import wf_persist as wp
from wf_persist.testing import TestRuntime

from .fixtures import workflows as w
from .test_fork import _in_child

ROOT = Path(__file__).resolve().parent.parent


def test_every_use_of_the_embedded_client_in_a_forked_child_is_refused(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The README: "In a child forked afterwards, every use raises ForkedRuntimeError".
    The client's reads and controls run in the child, on connections of the parent's pool
    (a DBAPI connection shared by two processes) and through the parent's locks."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    other = client.start(w.echo_wf, 3).execution_id
    rt.wakeups()
    rt.keeper()
    ended = _in_child(
        {
            "status": lambda: client.status(run),
            "describe": lambda: client.describe(run),
            "outcome": lambda: client.outcome(run),
            "history": lambda: client.history(run),
            "cancel": lambda: client.cancel(other, compensate=False),
        },
        rt,
    )
    assert ended == {
        **{n: "refused" for n in ("status", "describe", "outcome", "history", "cancel")},
        "close": "closed",
    }


_SHARED_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    import wf_persist as wp
    from tests.fixtures import workflows as w

    rt = wp.Runtime({url!r}, lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    rt.engine.dispose()
    client.status(run)  # one connection, idle in the pool, in both processes after the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(10)  # a child stuck on the shared socket is killed
            seen = "ok"
            for _ in range(200):
                try:
                    client.status(run)
                except wp.ForkedRuntimeError:
                    seen = "refused"
                    break
                except BaseException as exc:
                    seen = type(exc).__name__ + ": " + str(exc)[:100]
            os.write(write_end, seen.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    errors = []
    for _ in range(200):
        try:
            assert client.status(run) == "running"
        except BaseException as exc:
            errors.append(type(exc).__name__ + ": " + str(exc)[:100])
    with os.fdopen(read_end, "rb") as pipe:
        child = pipe.read().decode() or "killed (hung)"
    os.waitpid(pid, 0)
    print(json.dumps({{"errors": errors[:3], "child": child}}), flush=True)
    os._exit(0)
    """
)


@pytest.mark.needs("server")
def test_a_forked_child_reading_through_the_runtime_does_not_share_the_parents_connection(
    db_url: str, backend: str
) -> None:
    """The parent's idle pooled connection is the first the child's pool hands out: both
    processes then talk over one socket. The parent's reads must go on unharmed (run in a
    subprocess: the parent hangs for good on a socket whose answer the child read)."""
    script = _SHARED_SCRIPT.format(root=str(ROOT), url=db_url)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=40, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the parent hung on the connection it shares with the forked child")
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["errors"] == [] and got["child"] in ("refused", "ok"), got


def test_a_forked_child_does_not_deadlock_on_a_lock_the_parent_held_at_the_fork(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """The check comes "before any of its locks": a signal from the child's client takes
    the runtime's ``_changed`` lock first (it wakes waiters), which a parent thread held
    at the fork, so the child hangs instead of raising."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    signal_it = lambda: client.signal(run, "nobody-waits", 1, buffer=True)  # noqa: E731
    assert _with_lock_held_at_fork(rt._changed, signal_it) == "refused"


def test_test_runtime_closed_in_a_forked_child_leaves_the_parents_database() -> None:
    """TestRuntime.close() in the child removes the parent's private SQLite directory
    (dispose_engine on the test engine, whatever the process)."""
    rt = TestRuntime(w.echo_wf)
    try:
        run = rt.start(w.echo_wf, 2)
        path = Path(str(rt._test_engine.url.database))
        assert path.exists()
        ended = _in_child({}, rt)
        assert ended == {"close": "closed"}
        assert path.exists(), "the child's close() removed the parent's database"
        rt._test_engine.dispose()  # a fresh connection, as the pool opens one any time
        assert rt.result(run).unwrap() == [1, 2]
    finally:
        rt.close()


_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {root!r})
    import wf_persist as wp
    from tests.fixtures import workflows as w

    rt = wp.Runtime("sqlite://", lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    path = rt.engine.url.database
    pid = os.fork()
    if pid == 0:
        # A gunicorn worker forked after the app (and its runtime) loaded: it exits normally
        # (sys.exit), so atexit hooks run; it may or may not call close() itself.
        if {close!r}:
            rt.close(timeout=1)
        sys.exit(0)
    os.waitpid(pid, 0)
    found = os.path.exists(path)
    rt.engine.dispose()  # a fresh connection, as the pool opens one any time
    try:
        status = client.status(run)
    except Exception as exc:
        status = type(exc).__name__ + ": " + str(exc)[:100]
    print(json.dumps({{"exists": found, "status": status}}))
    rt.close()
    """
)


@pytest.mark.parametrize("close_in_child", [False, True])
def test_a_forked_childs_normal_exit_leaves_the_parents_private_sqlite_file(
    close_in_child: bool,
) -> None:
    """weakref.finalize(engine, shutil.rmtree, tempdir) runs at interpreter exit (atexit)
    in every process that has it: a child exiting normally removes the parent's file."""
    script = _SCRIPT.format(root=str(ROOT), close=close_in_child)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"exists": True, "status": "running"}


def test_a_worker_loop_run_directly_in_a_forked_child_is_refused_without_the_parents_lock(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Worker(rt).run() (what the CLI runs directly) attaches the worker under the
    runtime's lock before any check: with that lock held at the fork, the child hangs."""
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    loop = lambda: wp.Worker(rt, concurrency=2).run()  # noqa: E731 - made in the child
    assert _with_lock_held_at_fork(rt._lock, loop) == "refused"


def _with_lock_held_at_fork(lock: Any, call: Callable[[], Any]) -> str:
    """Fork while a parent thread holds ``lock``; in the child, make ``call`` (a 3 s alarm
    turns a hang into ``"hung"``): how it ended."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError()))
                signal.alarm(3)
                try:
                    call()
                    got = "ran"
                except wp.ForkedRuntimeError:
                    got = "refused"
                except TimeoutError:
                    got = "hung"
                except BaseException as exc:
                    got = type(exc).__name__
                os.write(write_end, got.encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            got = pipe.read().decode()
        os.waitpid(pid, 0)
    finally:
        release.set()
        t.join()
    return got


_HELD_AT_FORK_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys, threading
    sys.path.insert(0, {root!r})
    import wf_persist as wp
    from tests.fixtures import workflows as w

    rt = wp.Runtime({url!r}, lease_ttl=300)
    rt.register(w.echo_wf)
    run = rt.client().start(w.echo_wf, 2).execution_id
    forked, resumed, result = threading.Event(), threading.Event(), {{}}

    def hold():
        # A connection checked out, in a transaction, by a thread of the parent's: in the
        # child only the forking thread lives on, and this one's objects with it.
        with rt.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            forked.set()
            resumed.wait(30)
            try:
                result["after"] = conn.exec_driver_sql("SELECT 2").scalar()
                conn.commit()
            except BaseException as exc:
                result["after"] = type(exc).__name__ + ": " + str(exc)[:200]

    thread = threading.Thread(target=hold)
    thread.start()
    forked.wait(30)
    pid = os.fork()
    if pid == 0:
        gc.collect()
        sys.exit(0)  # a whole interpreter exit: every finalizer it runs
    os.waitpid(pid, 0)
    resumed.set()
    thread.join(30)
    result["status"] = rt.client().status(run)
    rt.close()
    print(json.dumps(result), flush=True)
    """
)


@pytest.mark.needs("server")
def test_a_connection_a_parent_thread_holds_at_the_fork_survives_the_childs_exit(
    db_url: str,
) -> None:
    """The child's copy of a connection checked out by another thread must not be closed,
    rolled back or terminated on the shared socket when the child collects or exits."""
    script = _HELD_AT_FORK_SCRIPT.format(root=str(ROOT), url=db_url)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"after": 2, "status": "running"}, (got, done.stderr[-2000:])
