"""A lease confirmation that comes back late does not vouch for the lease.

Found by the chaos suite on MariaDB: right before a step, a driver asked the database to
confirm its lease; the server renewed it, and the process was frozen (SIGSTOP) before the
answer was read. Thawed after another worker had taken the run over and recorded that very
step, the driver read "still yours" and ran the step again. A confirmation now counts only if
it came within half the TTL of being asked; else the driver asks again, and a run that has
become another's is not touched.

The freeze is played in-process: the drive's renewal is answered by the real database, then
held back past the lease while a second runtime takes the run over, as a paused process would
see it. The lease keeper is held back meanwhile too (a paused process renews nothing).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from sqlalchemy import Connection, select

import wf_persist as wp
from tests.helpers import history_types
from wf_persist.driver import CONFIRM_TRIES
from wf_persist.models import executions_table as ex

TTL = 1.0
FIRST = "first-driver"
SECOND = "second-driver"

RAN: list[tuple[str, str]] = []
SCENE: dict[str, Any] = {}


@wp.step
def mark(tag: str) -> str:
    RAN.append((tag, threading.current_thread().name))
    return tag


def _forget_the_keepers_word(execution_id: str) -> None:
    """In the first driver only: the keeper's last confirmation is forgotten (as after a
    pause), so the next step's check asks the database; its answers are played from here."""
    if threading.current_thread().name != FIRST or SCENE.get("calm"):
        return
    first: wp.Runtime = SCENE["first"]
    keeper = first.keeper()
    lease = keeper.hold(execution_id, keeper.held()[execution_id])
    lease.confirmed = -math.inf
    SCENE["asks"] = 0


@wp.workflow(name="late-confirmation", version=1)
def late_confirmation_wf(ctx: wp.Context) -> list[str]:
    out = [ctx.run(mark, "a")]
    _forget_the_keepers_word(ctx.execution_id)
    out.append(ctx.run(mark, "b"))
    return out


Answer = Callable[[Callable[[], set[str]], int], set[str]]


@pytest.fixture
def scene(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[Answer], None]]:
    """Two runtimes with a short lease; ``play(answer)`` routes the first driver's lease
    confirmations (after the keeper's word is forgotten) through ``answer(real, n)``."""
    RAN.clear()
    SCENE.clear()
    first = make_runtime(lease_ttl=TTL)
    second = make_runtime(lease_ttl=TTL)
    for rt in (first, second):
        rt.register(late_confirmation_wf)
    frozen = threading.Event()
    SCENE.update(first=first, second=second, frozen=frozen)
    real = first.backend.renew_alone

    def play(answer: Answer) -> None:
        def renew_alone(conn: Connection, held: Mapping[str, int], ttl: float) -> set[str]:
            if threading.current_thread().name == FIRST and "asks" in SCENE:
                SCENE["asks"] += 1
                return answer(lambda: real(conn, held, ttl), SCENE["asks"])
            while frozen.is_set():  # the keeper of a frozen process renews nothing
                time.sleep(0.01)
            return real(conn, held, ttl)

        monkeypatch.setattr(first.backend, "renew_alone", renew_alone)

    yield play
    SCENE.clear()


def _drive_in_first(execution_id: str) -> None:
    first: wp.Runtime = SCENE["first"]
    driver = threading.Thread(target=first.drive, args=(execution_id,), name=FIRST)
    driver.start()
    driver.join(60)
    assert not driver.is_alive()


def _row(execution_id: str) -> dict[str, Any]:
    first: wp.Runtime = SCENE["first"]
    with first.transaction() as conn:
        return dict(conn.execute(select(ex).where(ex.c.id == execution_id)).mappings().one())


def test_a_confirmation_answered_after_a_takeover_does_not_run_the_step_again(
    scene: Callable[[Answer], None],
) -> None:
    first: wp.Runtime = SCENE["first"]
    second: wp.Runtime = SCENE["second"]
    client = first.client()
    execution_id = client.start(late_confirmation_wf).execution_id

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        if n == 1:  # slow to come (a lock wait): the check right before the step asks again
            time.sleep(TTL * 0.6)
            return renew()
        found = renew()
        if n == 2:  # the last ask before the step: the server renews, then the freeze
            SCENE["frozen"].set()
            try:
                time.sleep(TTL * 1.5)  # past the lease: the second runtime takes the run
                taker = threading.Thread(
                    target=lambda: SCENE.update(taken=second.drive(execution_id)), name=SECOND
                )
                taker.start()
                taker.join(30)
            finally:
                SCENE["frozen"].clear()
        return found

    scene(answer)
    _drive_in_first(execution_id)
    assert SCENE.get("taken") is True, "the second runtime did not take the run over"
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    # Step b ran once, in the runtime that took the run over; the thawed first driver
    # asked again, learned the run was another's and stopped.
    assert RAN == [("a", FIRST), ("b", SECOND)]
    assert SCENE["asks"] == 3
    assert history_types(client, execution_id).count("step.completed") == 2


def test_a_slow_confirmation_of_a_lease_still_held_lets_the_same_drive_go_on(
    scene: Callable[[Answer], None],
) -> None:
    """A late answer is asked again, not taken as a loss: with nobody taking the run over
    meanwhile, the next (timely) answer confirms the lease and the same drive goes on."""
    first: wp.Runtime = SCENE["first"]
    client = first.client()
    execution_id = client.start(late_confirmation_wf).execution_id

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        found = renew()
        if n == 1:
            time.sleep(TTL * 0.6)  # past half the TTL, within the lease
        return found

    scene(answer)
    _drive_in_first(execution_id)
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    assert RAN == [("a", FIRST), ("b", FIRST)]
    assert SCENE["asks"] == 2
    assert "drive.failed" not in history_types(client, execution_id)


def test_a_lease_never_confirmed_in_time_is_handed_over_not_failed(
    scene: Callable[[Answer], None],
) -> None:
    """Every answer late (the database stalls each one past half the TTL): after
    ``CONFIRM_TRIES`` asks the drive stops before the step and hands the run over, due at
    once and counted as no failure; a later drive finishes it."""
    first: wp.Runtime = SCENE["first"]
    client = first.client()
    execution_id = client.start(late_confirmation_wf).execution_id

    def answer(renew: Callable[[], set[str]], n: int) -> set[str]:
        found = renew()
        time.sleep(TTL * 0.6)
        return found

    scene(answer)
    _drive_in_first(execution_id)
    assert RAN == [("a", FIRST)]
    assert SCENE["asks"] == CONFIRM_TRIES
    row = _row(execution_id)
    assert row["status"] == "running" and row["lease_owner"] is None, "handed over"
    assert row["drive_failures"] == 0
    assert "drive.failed" not in history_types(client, execution_id)
    SCENE["calm"] = True  # the database answers in time again
    _drive_in_first(execution_id)
    assert client.result(execution_id, timeout=10).unwrap() == ["a", "b"]
    assert RAN == [("a", FIRST), ("b", FIRST)]
