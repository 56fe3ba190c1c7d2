"""What notifications spare a thin client and a worker: the look before the end at a run
the client has just started, the catalog read before each start, and a worker's question
about its next timer after a notified claim; and what they must never cost (an end nobody
announces, a hostile payload on the channel).

Reads are counted on the client's engine (``before_cursor_execute``), and its looks at runs
(which PostgreSQL sends straight to libpq) where the backend makes them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import delete, func, select

import wf_persist as wp
from wf_persist.models import executions_table as ex
from wf_persist.models import history_table as hist
from wf_persist.models import workflows_table as wf
from wf_persist.wakeups import END, MAX_EXPECTED, WAKE, Ends

from .fixtures import workflows as w
from .helpers import Processes, client_statements, wait_until
from .test_wakeups import _napping

RUN_READ = "FROM wf_executions"
CATALOG_READ = "FROM wf_workflows"


def _reads(seen: list[str], what: str) -> int:
    return sum(1 for s in seen if what in s and s.lstrip().upper().startswith("SELECT"))


@pytest.fixture
def served(db_url: str, procs: Processes) -> Iterator[wp.Client]:
    """A worker process (polling every 30 s: only notifications explain fast pickups) and
    a thin client (looking every 30 s) that already listens: its first result started it."""
    procs.worker(db_url, app_poll_interval=30).wait_for_stderr("serving")
    with wp.Client(db_url, poll_interval=30) as client:
        first = client.start("echo", 2)
        assert client.result(first.execution_id, timeout=30).unwrap() == [1, 2]
        yield client


# waits for runs this client started ------------------------------------------------------


@pytest.mark.needs("notify")
def test_a_run_this_client_started_is_read_only_once_its_end_is_heard(
    served: wp.Client,
) -> None:
    for workflow, payload in (("echo", 4), ("explode", "boom: ünïcode ✓")):
        handle = served.start(workflow, payload)
        began = time.monotonic()
        with client_statements(served) as seen:
            outcome = served.result(handle.execution_id, timeout=30)
        assert time.monotonic() - began < 5, "woken by the end, not by a 30 s poll"
        assert _reads(seen, RUN_READ) == 1, seen
        assert outcome == served.outcome(handle.execution_id)
    assert isinstance(outcome, wp.Failed) and "ünïcode ✓" in str(outcome.error)


@pytest.mark.needs("notify")
def test_an_end_heard_before_the_wait_begins_is_not_missed(served: wp.Client) -> None:
    """The run ends while nobody waits for it yet: its end was kept for the wait."""
    handle = served.start("echo", 3)
    wait_until(lambda: served.outcome(handle.execution_id) is not None, what="the end")
    time.sleep(0.2)  # the end notification has long arrived
    began = time.monotonic()
    assert served.result(handle.execution_id, timeout=30).unwrap() == [1, 2, 3]
    assert time.monotonic() - began < 5


@pytest.mark.needs("notify")
def test_an_end_that_comes_before_the_start_returns_is_not_missed(
    served: wp.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker may end the run before the starting thread gets the CPU back after its
    commit: the client expects the run from before the start is sent."""
    started = served._started

    def slow(*args: Any) -> None:
        time.sleep(1.0)  # meanwhile the worker drives the run to its end
        started(*args)

    monkeypatch.setattr(served, "_started", slow)
    handle = served.start("echo", 3)
    began = time.monotonic()
    assert served.result(handle.execution_id, timeout=30).unwrap() == [1, 2, 3]
    assert time.monotonic() - began < 5, "its end went unheard: found by a 30 s poll"


@pytest.mark.needs("notify")
def test_a_run_cancelled_without_compensation_wakes_its_waiter(
    served: wp.Client, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A forced cancellation ends a run without a drive: it announces the end too, so a
    client waiting for the run it started (without a first look) is not left waiting."""
    handle = served.start("approval", None)
    wait_until(lambda: bool(served.pending_signals(handle.execution_id)), what="the wait")
    make_runtime().client().cancel(handle.execution_id, compensate=False)
    began = time.monotonic()
    outcome = served.result(handle.execution_id, timeout=30)
    assert time.monotonic() - began < 5, "woken by the end, not by a 30 s poll"
    assert isinstance(outcome, wp.Failed)


@pytest.mark.needs("notify")
def test_a_second_wait_for_an_awaited_run_reads_it_at_once(served: wp.Client) -> None:
    handle = served.start("echo", 3)
    served.result(handle.execution_id, timeout=30)
    with client_statements(served) as seen:
        again = served.result(handle.execution_id, timeout=30)
    assert _reads(seen, RUN_READ) == 1
    assert again.unwrap() == [1, 2, 3]


@pytest.mark.needs("notify")
def test_hostile_payloads_on_the_channel_are_only_hints(
    served: wp.Client, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Anyone who can connect can NOTIFY on the channel: a forged end of a waiting run
    makes the client look (and go on waiting), and a payload made to break a parser does
    not take the listener down."""
    handle = served.start("approval", None)
    wait_until(lambda: bool(served.pending_signals(handle.execution_id)), what="the wait")
    listener = served._wakeups
    assert listener is not None and listener.listening
    connections = listener.connections
    forged = [
        f'{END}{handle.execution_id} [true,"forged"]',
        f"{END}{handle.execution_id} " + "[" * 5000,
        f"{END}{handle.execution_id}",
        WAKE + "not a time",
        END,
    ]
    announcer = make_runtime()
    with announcer.backend.engine.connect() as conn:
        for payload in forged:
            announcer.backend.announce(conn, payload)
        conn.commit()
    with pytest.raises(wp.ResultTimeoutError):
        served.result(handle.execution_id, timeout=1.0)
    assert served.outcome(handle.execution_id) is None
    assert listener.connections == connections and listener.listening


def test_expected_runs_are_bounded_and_forgotten_once_awaited() -> None:
    ends = Ends()
    for i in range(MAX_EXPECTED + 5):
        ends.expect(f"run-{i}")
        ends.heard(f"run-{i}")
    assert len(ends._expected) == len(ends._ended) == MAX_EXPECTED
    assert ends.unread("run-0") is None
    last = f"run-{MAX_EXPECTED + 4}"
    assert ends.unread(last) == (0, 0)
    with ends.watching(last):
        pass
    assert ends.unread(last) is None and last not in ends._ended
    ends.unexpect(f"run-{MAX_EXPECTED + 3}")  # a start that created nothing
    assert len(ends._expected) == len(ends._ended) == MAX_EXPECTED - 2
    ends.heard("")  # a reconnection: an end may have gone unheard since any start
    assert ends.unread(f"run-{MAX_EXPECTED}") is None
    ends.heard("stranger")  # neither watched nor expected: not kept
    assert "stranger" not in ends._ended


# the catalog a thin client read ----------------------------------------------------------


@wp.workflow(name="test_client_wakeups_versions", version=1)
def _numbers_v1(ctx: wp.Context, n: int) -> int:
    return n


@wp.workflow(name="test_client_wakeups_versions", version=2)
def _text_v2(ctx: wp.Context, s: str) -> str:
    return s


def _runs(client: wp.Client) -> int:
    with client.backend.read() as conn:
        return int(conn.execute(select(func.count()).select_from(ex)).scalar_one())


def test_a_start_by_name_takes_a_version_cataloged_since_the_client_last_read(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Where the start itself can check that its version is still the newest, the client
    reads the catalog once; a newer version is taken (and validated against) as soon as it
    is cataloged, whether or not the payload fits the version the client remembered, and a
    refused attempt writes nothing."""
    make_runtime().register(_numbers_v1)
    with wp.Client(db_url) as client:
        assert client.start("test_client_wakeups_versions", 1).version == 1
        with client_statements(client) as seen:
            assert client.start("test_client_wakeups_versions", 2).version == 1
        assert _reads(seen, CATALOG_READ) == (0 if client.backend.checks_newest else 1)
        make_runtime().register(_text_v2)
        before = _runs(client)
        with pytest.raises(wp.InvalidPayloadError):
            client.start("test_client_wakeups_versions", 3)  # v1 took it; v2 does not
        assert _runs(client) == before
        assert client.start("test_client_wakeups_versions", "b").version == 2
        handle = client.start("test_client_wakeups_versions", "c", idempotency_key="k")
        assert handle.version == 2
        again = client.start("test_client_wakeups_versions", "c", idempotency_key="k")
        assert (again.execution_id, again.created, again.version) == (handle.execution_id, False, 2)
        assert _runs(client) == before + 2


def test_a_payload_valid_only_for_a_newer_version_is_started_with_it(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    make_runtime().register(_numbers_v1)
    with wp.Client(db_url) as client:
        assert client.start("test_client_wakeups_versions", 1).version == 1
        make_runtime().register(_text_v2)
        assert client.start("test_client_wakeups_versions", "a").version == 2


@pytest.mark.parametrize("same_time", [False, True])
def test_a_version_cataloged_again_with_another_source_is_read_again(
    db_url: str, make_runtime: Callable[..., wp.Runtime], same_time: bool
) -> None:
    """The tables emptied and the same version cataloged with other code (and schema)
    under a long-lived client, even at the very same time by a runtime clock that repeats
    itself: its start is judged by the new entry, not the one it remembered."""

    @wp.workflow(name="test_client_wakeups_versions", version=1)
    def text_v1(ctx: wp.Context, s: str) -> str:
        return s

    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    clock: dict[str, Any] = {"clock": lambda: at} if same_time else {}
    make_runtime(**clock).register(_numbers_v1)
    with wp.Client(db_url) as client:
        assert client.start("test_client_wakeups_versions", 1).version == 1
        with client.backend.engine.begin() as conn:
            conn.execute(delete(hist))
            conn.execute(delete(ex))
            conn.execute(delete(wf).where(wf.c.name == "test_client_wakeups_versions"))
        make_runtime(**clock).register(text_v1)
        with pytest.raises(wp.InvalidPayloadError):
            client.start("test_client_wakeups_versions", 5)
        assert _runs(client) == 0
        assert client.start("test_client_wakeups_versions", "x").version == 1


# the worker after a notified claim -------------------------------------------------------


def _timer_questions(rt: wp.Runtime) -> list[float]:
    """When the runtime's worker asks the database for its next timer, from now on."""
    asked: list[float] = []
    seconds_to_next_wake = rt.seconds_to_next_wake

    def counted() -> float | None:
        asked.append(time.monotonic())
        return seconds_to_next_wake()

    rt.seconds_to_next_wake = counted  # type: ignore[method-assign]
    return asked


@pytest.mark.needs("notify")
def test_a_notified_claim_keeps_the_known_timer_unless_a_timer_was_announced(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Runs announced as due now are claimed without asking for the next timer again; a
    timer announced with them makes the look ask."""
    rt = make_runtime(poll_interval=30)
    rt.register(w.echo_wf)
    asked = _timer_questions(rt)
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


@pytest.mark.needs("notify")
def test_a_timer_announced_with_more_runs_than_slots_is_still_asked_for(
    db_url: str, make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A timer and three runs announced at once to a worker with two slots: the look that
    fills both slots asks for no timer; the one that takes the third run must."""
    rt = make_runtime(poll_interval=30)
    rt.register(_napping)
    asked = _timer_questions(rt)
    rt.start_worker(concurrency=2)
    wait_until(rt.listening, what="the worker listening")
    with wp.Client(db_url) as client:
        client.result(client.start("test_wakeups_napping", 0.0).execution_id, timeout=30)
        time.sleep(0.2)
        before = len(asked)
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
        with rt.backend.engine.connect() as conn:
            rt.backend.announce(conn, WAKE + at.isoformat())
            ids = [
                client.start("test_wakeups_napping", 0.3, session=conn).execution_id
                for _ in range(3)
            ]
            conn.commit()
        for execution_id in ids:
            assert client.result(execution_id, timeout=30).unwrap() == 0.3
        wait_until(lambda: len(asked) > before, what="the next timer asked for", timeout=5)


@pytest.mark.needs("notify")
@pytest.mark.needs("schemas")
@pytest.mark.parametrize("length", [16, 63])
def test_a_worker_on_a_schema_mapping_engine_hears_a_client_of_that_schema(
    db_url: str, make_engine: Callable[..., Any], length: int
) -> None:
    """The channel is the schema holding the tables, however each side names it: a host
    engine's translation on one side, ``schema=`` on the other; a name too long for a
    channel of its own is hashed into one."""
    from sqlalchemy import text

    from wf_persist import migrate

    name = f"wf_chan_{uuid.uuid4().hex}"[:length].ljust(length, "x")
    admin = make_engine(db_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {name}"))
    try:
        mapped = make_engine(db_url).execution_options(schema_translate_map={None: name})
        migrate.upgrade(mapped)
        with wp.Runtime(mapped, poll_interval=30) as rt:
            rt.register(w.echo_wf)
            rt.start_worker()
            wait_until(rt.listening, what="the worker listening")
            with wp.Client(db_url, schema=name, poll_interval=30) as client:
                for n in (2, 3):
                    began = time.monotonic()
                    handle = client.start("echo", n)
                    assert client.result(handle.execution_id, timeout=20).unwrap() == list(
                        range(1, n + 1)
                    )
                    assert time.monotonic() - began < 5, "not heard: found by a 30 s poll"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {name} CASCADE"))


@dataclasses.dataclass
class _Double:
    """A callable object that cannot be hashed (a dataclass with ``eq``)."""

    n: int

    def __call__(self) -> int:
        return self.n * 2


class _Big:
    def __init__(self) -> None:
        self.data = bytearray(1024)


_CODE_SEEN: list[weakref.ref[_Big]] = []


@wp.workflow(name="test_client_wakeups_code", version=1)
def _code_wf(ctx: wp.Context, n: int) -> int:
    big = _Big()
    _CODE_SEEN.append(weakref.ref(big))
    doubled = ctx.code("double", _Double(n))
    return doubled + ctx.code("size", lambda: len(big.data))


def test_code_blocks_may_be_any_callable_and_are_not_kept(runtime: wp.Runtime) -> None:
    """An unhashable callable object works as a code block, and a closure (with what it
    captured) is not kept once its run is done."""
    runtime.register(_code_wf)
    client = runtime.client()
    _CODE_SEEN.clear()
    for n in (1, 2, 3):
        assert client.result(client.start(_code_wf, n).execution_id).unwrap() == n * 2 + 1024
    gc.collect()
    assert _CODE_SEEN and all(ref() is None for ref in _CODE_SEEN)
