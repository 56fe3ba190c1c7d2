"""What notifications spare a thin client and a worker: the outcome an end carries, the
first look at a run the client has just started, the catalog read before each start, and a
worker's question about its next timer after a notified claim.

Reads are counted on the client's engine (``before_cursor_execute``): the thin client reads
runs and the catalog through SQLAlchemy.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, func, select

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.wakeups import (
    MAX_END_PAYLOAD,
    MAX_EXPECTED,
    WAKE,
    Ended,
    Ends,
    end_note,
    parse_end,
)

from .fixtures import workflows as w
from .helpers import Processes, wait_until

RUN_READ = "FROM wf_executions"
CATALOG_READ = "FROM wf_workflows"


@contextmanager
def statements(client: wp.Client) -> Iterator[list[str]]:
    """Every statement this client sends through SQLAlchemy while the block runs."""
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(client.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(client.engine, "before_cursor_execute", record)


def _reads(seen: list[str], what: str) -> int:
    return sum(1 for s in seen if what in s and s.lstrip().upper().startswith("SELECT"))


@pytest.fixture
def served(db_url: str, procs: Processes) -> Iterator[wp.Client]:
    """A worker process (polling every 30 s: only notifications explain fast pickups) and
    a thin client that already listens (its first result started the listener)."""
    procs.worker(db_url, app_poll_interval=30).wait_for_stderr("serving")
    with wp.Client(db_url, poll_interval=30) as client:
        first = client.start("echo", 2)
        assert client.result(first.execution_id, timeout=30).unwrap() == [1, 2]
        yield client


# outcomes carried by end notifications ----------------------------------------------------


@pytest.mark.needs("notify")
def test_a_run_this_client_started_is_awaited_without_reading_it(served: wp.Client) -> None:
    """Started while the client listens: no look before its end (which cannot go unheard)
    and none after (the end carries the outcome), and the outcome is the stored one."""
    handle = served.start("echo", 4)
    with statements(served) as seen:
        outcome = served.result(handle.execution_id, timeout=30)
    assert _reads(seen, RUN_READ) == 0, seen
    assert outcome == wp.Completed(handle.execution_id, [1, 2, 3, 4])
    assert served.outcome(handle.execution_id) == outcome


@pytest.mark.needs("notify")
def test_a_failed_runs_error_is_carried_as_stored(served: wp.Client) -> None:
    handle = served.start("explode", "boom: ünïcode ✓")
    with statements(served) as seen:
        outcome = served.result(handle.execution_id, timeout=30)
    assert _reads(seen, RUN_READ) == 0, seen
    assert isinstance(outcome, wp.Failed)
    assert outcome == served.outcome(handle.execution_id)  # read back from the row
    assert "ünïcode ✓" in str(outcome.error)


@pytest.mark.needs("notify")
def test_an_outcome_too_large_for_a_notification_is_read_once(served: wp.Client) -> None:
    handle = served.start("echo", 1500)  # about 7 KB of JSON: more than an end carries
    with statements(served) as seen:
        outcome = served.result(handle.execution_id, timeout=60)
    assert _reads(seen, RUN_READ) == 1, seen
    assert outcome == wp.Completed(handle.execution_id, list(range(1, 1501)))


@pytest.mark.needs("notify")
def test_a_second_wait_for_an_awaited_run_reads_it(served: wp.Client) -> None:
    """Once awaited, a run is forgotten: a later result() looks at the database."""
    handle = served.start("echo", 3)
    served.result(handle.execution_id, timeout=30)
    with statements(served) as seen:
        again = served.result(handle.execution_id, timeout=30)
    assert _reads(seen, RUN_READ) == 1
    assert again.unwrap() == [1, 2, 3]


def test_end_payloads_carry_small_outcomes_and_refuse_what_does_not_fit() -> None:
    run = "0b7e4a57-2d4c-4c1e-9d55-000000000001"
    small = end_note(run, True, {"a": [1, "ü"], "b": None})
    assert small.isascii() and parse_end(small[len("end ") :]) == (
        run,
        Ended(True, {"a": [1, "ü"], "b": None}),
    )
    large = end_note(run, True, "x" * MAX_END_PAYLOAD)
    assert large == f"end {run}" and parse_end(large[len("end ") :]) == (run, None)
    assert end_note(run, True, float("nan")) == f"end {run}"  # not JSON: id only
    assert end_note(run, False, {"message": "m"}).startswith(f"end {run} [false,")


@pytest.mark.parametrize(
    "rest",
    [
        "id-1 {not json",
        "id-1 [true]",
        "id-1 [1, 2]",
        'id-1 [false, "an error must be an object"]',
        "id-1 [true, 1, 2]",
        "id-1 null",
    ],
)
def test_a_malformed_end_payload_is_heard_as_a_bare_end(rest: str) -> None:
    """A payload from anyone on the channel: never an outcome unless it is well formed."""
    assert parse_end(rest) == ("id-1", None)


def test_expected_runs_are_bounded_and_forgotten_once_awaited() -> None:
    ends = Ends()
    for i in range(MAX_EXPECTED + 5):
        ends.expect(f"run-{i}")
        ends.heard(f"run-{i}")
        ends.carried(f"run-{i}", Ended(True, i))
    assert len(ends._expected) == MAX_EXPECTED
    assert ends.unread("run-0") is None and ends.outcome("run-0") is None
    last = f"run-{MAX_EXPECTED + 4}"
    assert ends.unread(last) == (0, 0) and ends.outcome(last) == Ended(True, MAX_EXPECTED + 4)
    with ends.watching(last):
        pass
    assert ends.unread(last) is None and ends.outcome(last) is None
    assert len(ends._ended) == len(ends._outcomes) == MAX_EXPECTED - 1
    ends.heard("")  # a reconnection: an end may have gone unheard since any start
    assert ends.unread(f"run-{MAX_EXPECTED}") is None


def test_an_outcome_of_a_run_nobody_awaits_is_not_kept() -> None:
    ends = Ends()
    ends.carried("stranger", Ended(True, 1))
    ends.heard("stranger")
    assert ends.outcome("stranger") is None and not ends._ended


# the catalog a thin client read ----------------------------------------------------------


@wp.workflow(name="test_notified_versions", version=1)
def _numbers_v1(ctx: wp.Context, n: int) -> int:
    return n


@wp.workflow(name="test_notified_versions", version=2)
def _numbers_v2(ctx: wp.Context, s: str) -> str:
    return s


def _runs(client: wp.Client) -> int:
    with client.backend.read() as conn:
        return int(conn.execute(select(func.count()).select_from(ex)).scalar_one())


def test_a_start_by_name_takes_a_version_cataloged_since_the_client_last_read(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Where the start itself can check that its version is still the newest, the client
    reads the catalog once; a newer version is taken (and validated against) as soon as it
    is cataloged, and the refused attempt writes nothing."""
    make_runtime().register(_numbers_v1)
    with wp.Client(db_url) as client:
        assert client.start("test_notified_versions", 1).version == 1
        with statements(client) as seen:
            assert client.start("test_notified_versions", 2).version == 1
        assert _reads(seen, CATALOG_READ) == (0 if client.backend.checks_newest else 1)
        make_runtime().register(_numbers_v2)
        before = _runs(client)
        with pytest.raises(wp.InvalidPayloadError):
            client.start("test_notified_versions", 3)  # v1 took it; v2 does not
        assert _runs(client) == before
        handle = client.start("test_notified_versions", "c", idempotency_key="k")
        assert handle.version == 2
        again = client.start("test_notified_versions", "c", idempotency_key="k")
        assert (again.execution_id, again.created, again.version) == (handle.execution_id, False, 2)
        assert _runs(client) == before + 1


# the worker after a notified claim -------------------------------------------------------


@pytest.mark.needs("notify")
def test_a_notified_claim_keeps_the_known_timer_unless_a_timer_was_announced(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Runs announced as due now are claimed without asking for the next timer again; a
    timer announced meanwhile (or with them) makes the next look ask."""
    rt = make_runtime(poll_interval=30)
    rt.register(w.echo_wf)
    asked: list[float] = []
    seconds_to_next_wake = rt.seconds_to_next_wake

    def counted() -> float | None:
        asked.append(time.monotonic())
        return seconds_to_next_wake()

    rt.seconds_to_next_wake = counted  # type: ignore[method-assign]
    rt.start_worker()
    wait_until(rt.listening, what="the worker listening")
    with wp.Client(db_url) as client:
        warm = client.start("echo", 2)
        client.result(warm.execution_id, timeout=30)
        time.sleep(0.2)
        before = len(asked)
        for n in range(3, 6):
            handle = client.start("echo", n)
            assert client.result(handle.execution_id, timeout=30).unwrap() == list(range(1, n + 1))
        assert len(asked) == before, "a claim of announced runs asked for the next timer"
        # A timer announced in the same transaction as a start: both arrive together, and
        # the look that claims the run still asks for the next timer.
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
        with rt.backend.engine.connect() as conn:
            rt.backend.announce(conn, WAKE + at.isoformat())
            handle = client.start("echo", 3, session=conn)
            conn.commit()
        assert client.result(handle.execution_id, timeout=30).unwrap() == [1, 2, 3]
        wait_until(lambda: len(asked) > before, what="the next timer asked for", timeout=5)
