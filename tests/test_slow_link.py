"""A PostgreSQL server whose round trip is longer than a heartbeat's trust (0.1 s).

With a 120 ms round trip (a database in another region, a pooler in between) the listener's
heartbeats are never younger than 0.1 s, so the presence lock is always in doubt and no
answer to a lease check is ever young enough for that doubt. Such a link must still run
workflows: the last of the tries is taken (within half the TTL), and no drive fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import make_url

import wf_persist as wp
from tests.tcpproxy import delaying_proxy

pytestmark = pytest.mark.needs("presence")

#: Half the added round trip (the proxy delays the server's answers by twice this).
DELAY = 0.06


@wp.step
def _slow_step() -> str:
    return "done"


@wp.workflow(name="t-slow-link", version=1)
def _slow_wf(ctx: wp.Context) -> str:
    return ctx.run(_slow_step)


@pytest.fixture
def slow_url(db_url: str) -> Iterator[str]:
    """The test database behind a proxy (a process of its own) adding 120 ms to every
    answer: a round trip of about 0.12 s."""
    url = make_url(db_url)
    with delaying_proxy(url.host or "127.0.0.1", url.port or 5432, 2 * DELAY) as port:
        yield url.set(host="127.0.0.1", port=port).render_as_string(False)


def test_a_run_completes_on_a_postgresql_120ms_away(
    slow_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    rt = wp.Runtime(slow_url, max_drive_failures=2)
    try:
        rt.register(_slow_wf)
        client = rt.client()
        execution_id = client.start(_slow_wf).execution_id
        rt.wakeups()
        assert rt.owner.endswith("!"), "presence lock not taken: nothing to show"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rt.drive(execution_id)
            if client.status(execution_id) in ("completed", "failed"):
                break
            time.sleep(0.5)
        failures = [
            r.event for r in client.history(execution_id) if r.event["type"] == "drive.failed"
        ]
        outcome = client.result(execution_id, timeout=5)
        assert not failures, failures[0]
        assert outcome.unwrap() == "done"
    finally:
        rt.close()
