"""A lease confirmation that comes back late does not vouch for the lease.

Found by the chaos suite on MariaDB: right before a step, a driver asked the database to
confirm its lease; the server renewed it, and the process was frozen (SIGSTOP) before the
answer was read. Thawed after another worker had taken the run over and recorded that very
step, the driver read "still yours" and ran the step again. A confirmation now counts only
while it is young (half the TTL; on PostgreSQL, once the process's presence lock is in doubt,
the margin before others may take its runs); else the driver asks again, and a run that has
become another's is not touched.

The freeze is played in-process: the step's own lease check (the last before its call; the
step's argument validator forgets the keeper's word so that the check asks the database) is
answered by the real database, then held back while a second runtime takes the run over, as
a paused process would see it. The lease keeper is held back meanwhile too (a paused process
renews nothing).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any

import pytest
from pydantic import AfterValidator
from sqlalchemy import Connection, Engine, select

import wf_persist as wp
from tests.helpers import history_types, wait_until
from tests.tcpproxy import TCPProxy
from tests.test_presence import _silence_listener, proxied  # noqa: F401 (a fixture)
from wf_persist.driver import RunDriver
from wf_persist.lease_checks import CONFIRM_TRIES, LATE_HAND_OVER_DELAY
from wf_persist.models import executions_table as ex
from wf_persist.wakeups import PRESENCE_GRACE

TTL = 1.0
FIRST = "first-driver"
SECOND = "second-driver"

RAN: list[tuple[str, str]] = []
SCENE: dict[str, Any] = {}


def _before_the_steps_check(tag: str) -> str:
    """Validating step b's argument in the first driver, before the lease checks of the
    call: the keeper's last word is forgotten (as after a pause), so the checks ask the
    database, and its answers are played from here on."""
    if tag == "b" and threading.current_thread().name == FIRST and not SCENE.get("calm"):
        first: wp.Runtime = SCENE["first"]
        execution_id: str = SCENE["execution_id"]
        keeper = first.keeper()
        lease = keeper.hold(execution_id, keeper.held()[execution_id])
        lease.confirmed = -math.inf
        SCENE.setdefault("asks", 0)
    return tag


@wp.step
def mark(tag: Annotated[str, AfterValidator(_before_the_steps_check)]) -> str:
    RAN.append((tag, threading.current_thread().name))
    SCENE.setdefault("asks_before", {})[tag] = SCENE.get("asks")
    return tag


def _between_the_steps() -> None:
    hook = SCENE.get("between")
    if hook is not None and threading.current_thread().name == FIRST:
        hook()


@wp.workflow(name="late-confirmation", version=1)
def late_confirmation_wf(ctx: wp.Context) -> list[str]:
    out = [ctx.run(mark, "a")]
    _between_the_steps()
    out.append(ctx.run(mark, "b"))
    return out


Answer = Callable[[Callable[[], set[str]], int], set[str]]


@pytest.fixture
def scene(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``play(first, second, answer)``: the first runtime's lease confirmations asked by
    the driver (once step b's check began) go through ``answer(real, n)``."""
    RAN.clear()
    SCENE.clear()
    frozen = threading.Event()
    SCENE["frozen"] = frozen

    def play(first: wp.Runtime, second: wp.Runtime, answer: Answer) -> None:
        for rt in (first, second):
            rt.register(late_confirmation_wf)
        SCENE.update(first=first, second=second)
        real = first.backend.renew_alone

        def renew_alone(
            conn: Connection, held: Mapping[str, int], ttl: float, owner: str | None = None
        ) -> set[str]:
            renamed = [] if owner is None else [owner]
            if threading.current_thread().name == FIRST and "asks" in SCENE:
                SCENE["asks"] += 1
                return answer(lambda: real(conn, held, ttl, *renamed), SCENE["asks"])
            while frozen.is_set():  # the keeper of a frozen process renews nothing
                time.sleep(0.01)
            return real(conn, held, ttl, *renamed)

        real_free = first.backend.renew_free

        def renew_free(conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
            while frozen.is_set():  # the keeper of a frozen process renews nothing
                time.sleep(0.01)
            return real_free(conn, held, ttl)

        monkeypatch.setattr(first.backend, "renew_alone", renew_alone)
        monkeypatch.setattr(first.backend, "renew_free", renew_free)

    yield play
    SCENE.clear()


def _start() -> str:
    first: wp.Runtime = SCENE["first"]
    execution_id = first.client().start(late_confirmation_wf).execution_id
    SCENE["execution_id"] = execution_id
    return execution_id


def _drive_in(runtime: wp.Runtime, name: str) -> bool:
    driven: dict[str, bool] = {}
    driver = threading.Thread(
        target=lambda: driven.update(ok=runtime.drive(SCENE["execution_id"])), name=name
    )
    driver.start()
    driver.join(60)
    assert not driver.is_alive()
    return driven.get("ok", False)


def _take_over_while_frozen(wait: Callable[[], None]) -> None:
    """The first process is frozen: after ``wait`` the second runtime takes the run over
    and drives it to its end."""
    SCENE["frozen"].set()
    try:
        wait()
        SCENE["taken"] = _drive_in(SCENE["second"], SECOND)
    finally:
        SCENE["frozen"].clear()


def _row(runtime: wp.Runtime, execution_id: str) -> dict[str, Any]:
    with runtime.transaction() as conn:
        return dict(conn.execute(select(ex).where(ex.c.id == execution_id)).mappings().one())


def test_a_confirmation_answered_after_a_takeover_does_not_run_the_step_again(
    scene: Callable[..., None], make_runtime: Callable[..., wp.Runtime]
) -> None:
    """The chaos finding: the step's own check was answered "renewed", read after another
    worker took the run over and recorded the step."""

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        found = renew()  # the server renewed the lease...
        if n == 1:  # ...and the process froze before reading so, past the lease
            _take_over_while_frozen(lambda: time.sleep(TTL * 1.5))
        return found

    scene(make_runtime(lease_ttl=TTL), make_runtime(lease_ttl=TTL), answer)
    execution_id = _start()
    _drive_in(SCENE["first"], FIRST)
    assert SCENE.get("taken") is True, "the second runtime did not take the run over"
    client = SCENE["first"].client()
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    # Step b ran once, in the runtime that took the run over; the thawed first driver
    # asked again, learned the run was another's and stopped.
    assert RAN == [("a", FIRST), ("b", SECOND)]
    assert SCENE["asks"] == 2
    assert history_types(client, execution_id).count("step.completed") == 2


def test_a_slow_confirmation_of_a_lease_still_held_is_asked_again_and_the_drive_goes_on(
    scene: Callable[..., None], make_runtime: Callable[..., wp.Runtime]
) -> None:
    """A late answer is asked again, not taken as a loss: with nobody taking the run over
    meanwhile, the next (timely) answer confirms the lease and the same drive goes on."""

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        found = renew()
        if n == 1:
            time.sleep(TTL * 0.6)  # past half the TTL, within the lease
        return found

    scene(make_runtime(lease_ttl=TTL), make_runtime(lease_ttl=TTL), answer)
    execution_id = _start()
    _drive_in(SCENE["first"], FIRST)
    client = SCENE["first"].client()
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    assert RAN == [("a", FIRST), ("b", FIRST)]
    # The late first answer is asked again (the drive's check before the call and the
    # step's own may each ask: the arguments are validated before both).
    assert SCENE["asks_before"]["b"] >= 2, "step b ran on the late answer"
    assert "drive.failed" not in history_types(client, execution_id)


def test_a_lease_never_confirmed_in_time_is_handed_over_for_a_moment_not_failed(
    scene: Callable[..., None], make_runtime: Callable[..., wp.Runtime]
) -> None:
    """Every answer late (the database stalls each one past half the TTL): after
    ``CONFIRM_TRIES`` asks the drive stops before the step and hands the run over, due
    again after ``LATE_HAND_OVER_DELAY`` (not at once: the database is struggling) and
    counted as no failure (a slow database fails no run, as an unreachable one fails
    none); a later drive finishes it."""

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        found = renew()
        time.sleep(TTL * 0.6)
        return found

    first = make_runtime(lease_ttl=TTL)
    scene(first, make_runtime(lease_ttl=TTL), answer)
    execution_id = _start()
    _drive_in(first, FIRST)
    handed_over = time.monotonic()
    assert RAN == [("a", FIRST)]
    assert SCENE["asks"] == CONFIRM_TRIES
    client = first.client()
    assert "drive.failed" not in history_types(client, execution_id)
    row = _row(first, execution_id)
    assert row["status"] == "running" and row["lease_owner"] is None, "handed over"
    assert row["drive_failures"] == 0
    SCENE["calm"] = True  # the database answers in time again
    SCENE.pop("asks")
    wait_until(lambda: _drive_in(first, FIRST), what="the drive once due again", timeout=15)
    assert time.monotonic() - handed_over >= LATE_HAND_OVER_DELAY * 0.5, "due at once"
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    assert RAN == [("a", FIRST), ("b", FIRST)]


@pytest.mark.needs("presence")
def test_a_drive_whose_listener_died_renames_its_lease_and_no_reap_takes_the_run(
    scene: Callable[..., None],
    proxied: tuple[TCPProxy, str],  # noqa: F811
    db_url: str,
    make_runtime: Callable[..., wp.Runtime],
    make_engine: Callable[..., Engine],
) -> None:
    """On PostgreSQL another worker takes a run over ``PRESENCE_GRACE`` after it finds the
    owner's presence lock free, whatever the TTL. The first runtime's listening connection
    dies without a word between the steps (the server frees its lock); the next check asks
    the database and renames the lease after the runtime's plain name. Step b's own check
    is answered, then held back past the grace while the other runtime reaps and tries to
    claim: the renamed run is neither reaped nor claimed (before, it was taken over and
    step b ran in both), and step b runs once, in the first runtime."""
    proxy, proxy_url = proxied
    first = wp.Runtime(proxy_url, lease_ttl=30)
    try:
        second = make_runtime(lease_ttl=30)
        admin = make_engine(db_url)

        def listener_dies() -> None:
            if SCENE.get("silenced"):
                return
            SCENE["silenced"] = True
            _silence_listener(admin, proxy)
            wait_until(lambda: first.presence_since() == math.inf, what="distrust", timeout=5)

        def reaps() -> None:
            execution_id = SCENE["execution_id"]
            until = time.monotonic() + PRESENCE_GRACE + 0.2
            reaped: list[str] = []
            while time.monotonic() < until:
                reaped += second.reap()
                time.sleep(0.02)
            SCENE["reaped"] = execution_id in reaped
            SCENE["owner"] = second.client().describe(execution_id).lease_owner

        def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
            found = renew()
            if n == 1:
                _take_over_while_frozen(reaps)
            return found

        scene(first, second, answer)
        first.wakeups()
        second.wakeups()
        assert first.owner.endswith("!")
        SCENE["between"] = listener_dies
        execution_id = _start()
        _drive_in(first, FIRST)
        assert SCENE["reaped"] is False, "the run was reaped"
        assert SCENE.get("taken") is False
        assert SCENE["owner"] == first.plain_owner, "the lease was not renamed"
        assert first.client().result(execution_id, timeout=10).unwrap() == ["a", "b"]
        assert RAN == [("a", FIRST), ("b", FIRST)]
    finally:
        proxy.close()
        first.close()


@wp.step
def counted() -> str:
    RAN.append(("counted", threading.current_thread().name))
    return "ok"


@wp.workflow(name="late-confirmation-doubt", version=1)
def doubt_wf(ctx: wp.Context) -> str:
    return ctx.run(counted)


@pytest.mark.needs("presence")
def test_a_drive_in_doubt_of_its_presence_lock_renames_its_lease_so_no_reap_takes_it(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where its presence lock is in doubt (the listening connection died without a word,
    or the link is too slow for a heartbeat to vouch), a drive's own renewal names the
    lease after the runtime's plain name: a reaper that finds the lock free then leaves the
    run alone, and only a lapsed lease frees it. So an answer read late (here: the process
    froze after the renewal committed, while another worker reaped and tried to claim) is
    as good as it is young, and the step runs once. Before, a reap 0.2 s after the renewal
    let the other worker take the run and record the step, and the thawed drive ran it
    again."""
    RAN.clear()
    first = make_runtime(lease_ttl=30)
    second = make_runtime(lease_ttl=30)
    for rt in (first, second):
        rt.register(doubt_wf)
    second.wakeups()  # the second runtime holds its presence lock: it reaps
    assert second.owner.endswith("!")
    execution_id = first.client().start(doubt_wf).execution_id
    # The first runtime's claims carry a presence name whose lock nobody holds (its
    # listener died at the server), and no heartbeat vouches for it here.
    monkeypatch.setattr(first, "wakeups", lambda: None)
    first.owner = "t-late-host:1:gone!"
    monkeypatch.setattr(first, "presence_since", lambda: math.inf)
    real = RunDriver._renew
    seen: dict[str, Any] = {}

    def renew(self: RunDriver, ttl: float, owner: str | None) -> set[str]:
        still = real(self, ttl, owner)  # committed at the server
        if self.runtime is first and "reaped" not in seen:
            seen["owner"] = owner

            def take_over() -> None:  # meanwhile, as the first process is frozen
                seen["reaped"] = second.backend.reap(second.owner, PRESENCE_GRACE)
                time.sleep(PRESENCE_GRACE + 0.1)
                seen["taken"] = second.drive(execution_id)

            other = threading.Thread(target=take_over, name=SECOND)
            other.start()
            other.join(20)
        return still

    monkeypatch.setattr(RunDriver, "_renew", renew)
    assert first.drive(execution_id)
    assert seen["owner"] == first.plain_owner, "the renewal did not rename the lease"
    assert execution_id not in seen["reaped"], "a renamed lease was reaped"
    assert seen["taken"] is False
    assert first.client().result(execution_id, timeout=10).unwrap() == "ok"
    assert [who for _, who in RAN] == ["MainThread"]
