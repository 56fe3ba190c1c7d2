"""A runtime belongs to the process that made it: in a child forked after, every use is
refused with one clear error (its threads, leases and claim name are the parent's), and
the parent goes on as if nothing happened."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import wf_persist as wp

from .fixtures import workflows as w


def _in_child(calls: dict[str, Callable[[], Any]], rt: wp.Runtime) -> dict[str, str]:
    """Fork; in the child, make each call and say how it ended; then close the runtime."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        ended: dict[str, str] = {}
        try:
            for name, call in calls.items():
                try:
                    call()
                    ended[name] = "ran"
                except wp.ForkedRuntimeError:
                    ended[name] = "refused"
                except BaseException as exc:
                    ended[name] = f"{type(exc).__name__}: {exc}"
            try:
                rt.close(timeout=1)
                ended["close"] = "closed"
            except BaseException as exc:
                ended["close"] = f"{type(exc).__name__}: {exc}"
            os.write(write_end, json.dumps(ended).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        got = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return dict(json.loads(got))


def test_a_runtime_used_in_a_forked_child_refuses_and_the_parent_goes_on(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(lease_ttl=300)
    rt.register(w.echo_wf)
    client = rt.client()
    run = client.start(w.echo_wf, 2).execution_id
    rt.wakeups()  # the listener, and on PostgreSQL the presence lock, are the parent's
    rt.keeper()
    ended = _in_child(
        {
            "client": rt.client,
            "start": lambda: client.start(w.echo_wf, 1),
            "execute": lambda: client.execute(w.echo_wf, 1),
            "result": lambda: client.result(run, timeout=1),
            "drive": lambda: rt.drive(run),
            "worker": lambda: rt.start_worker(concurrency=2),
            "wakeups": rt.wakeups,
            "keeper": rt.keeper,
        },
        rt,
    )
    assert ended == {
        **{name: "refused" for name in ("client", "start", "execute", "result", "drive")},
        **{name: "refused" for name in ("worker", "wakeups", "keeper")},
        "close": "closed",
    }
    # Nothing of the parent's was touched: the run is still due, and is driven here.
    assert client.status(run) == "running"
    assert client.result(run, timeout=20).unwrap() == [1, 2]
    assert client.execute(w.echo_wf, 3).unwrap() == [1, 2, 3]
