"""Values refused where they are given, not later: a durable call the body catches takes no
place among the run's calls (its replay met the refusal, then a NonDeterminismError), and a
signal or input the run could not read is refused at the call (it was "delivered", or the
run started, and the run then failed on it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, Field, field_serializer, field_validator

import wf_persist as wp

from .helpers import wait_until


class Even(BaseModel):
    x: int

    @field_validator("x")
    @classmethod
    def even(cls, value: int) -> int:
        if value % 2:
            raise ValueError("odd")
        return value


@wp.step
def doubled(n: int) -> int:
    return n * 2


@wp.workflow(name="refused-calls-caught", version=1)
def refused_calls_caught(ctx: wp.Context) -> list[Any]:
    caught = []
    for call in (
        lambda: ctx.set_event("bad", float("nan")),
        lambda: ctx.run(doubled, "not a number"),
        lambda: ctx.run(doubled, float("nan")),
    ):
        try:
            call()
        except wp.WfPersistError as exc:
            caught.append(type(exc).__name__)
    ctx.set_event("good", 1)
    got = ctx.run(doubled, 2)
    ctx.sleep(0.2)  # a new drive: the body replays over the refusals
    return [caught, got, ctx.run(doubled, 3)]


def test_refused_calls_the_body_catches_replay_as_they_ran(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(refused_calls_caught)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    run = client.start(refused_calls_caught).execution_id
    assert client.result(run, timeout=30).unwrap() == [
        ["NotSerializableError", "InvalidPayloadError", "InvalidPayloadError"],
        4,
        6,
    ]


@wp.workflow(name="waits-even", version=1)
def waits_even(ctx: wp.Context) -> int:
    got = ctx.wait_for_signal("s", Even)
    assert isinstance(got, wp.Received)
    return got.value.x


@wp.workflow(name="waits-int", version=1)
def waits_int(ctx: wp.Context) -> int:
    got = ctx.wait_for_signal("s", int)
    assert isinstance(got, wp.Received)
    return int(got.value)


@pytest.mark.parametrize(
    ("workflow", "bad", "good", "out"),
    [
        (waits_even, Even.model_construct(x=3), Even(x=4), 4),
        (waits_int, True, 5, 5),
    ],
)
def test_a_signal_the_wait_would_refuse_is_refused_at_the_call_and_the_run_waits_on(
    make_runtime: Callable[..., wp.Runtime], workflow: Any, bad: Any, good: Any, out: int
) -> None:
    rt = make_runtime()
    rt.register(workflow)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    run = client.start(workflow).execution_id
    wait_until(lambda: bool(client.pending_signals(run)), what="the wait")
    with pytest.raises(wp.SignalPayloadError):
        client.signal(run, "s", bad)
    assert client.status(run) == "suspended"
    assert client.signal(run, "s", good) == "delivered"
    assert client.result(run, timeout=30).unwrap() == out


@wp.workflow(name="takes-even", version=1)
def takes_even(ctx: wp.Context, even: Even) -> int:
    return even.x


def test_an_input_made_without_validation_is_refused_at_the_start(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(takes_even)
    client = rt.client()
    with pytest.raises(wp.InvalidPayloadError, match="odd"):
        client.start(takes_even, Even.model_construct(x=3))
    assert client.list(takes_even).items == []
    assert client.execute(takes_even, Even(x=2)).unwrap() == 2


refunds: list[int] = []


def refund(result: int, n: int) -> None:
    refunds.append(n)


@wp.step(compensate=refund)
def charge(n: int) -> int:
    return n


@wp.workflow(name="refused-branch-caught", version=1)
def refused_branch_caught(ctx: wp.Context) -> None:
    with contextlib.suppress(wp.InvalidPayloadError):
        ctx.all([wp.call(doubled, 1), wp.call(doubled, "bad")])
    ctx.run(charge, 7)
    ctx.wait_for_signal("go")


def test_a_refused_branch_caught_replays_as_it_ran_and_its_later_steps_compensate(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A ``ctx.all`` branch refused its arguments after the block took its place: every
    replay met it as a new call in the middle of the history, and a cancellation raised
    there unwound only what came before it (``charge`` was never refunded)."""
    refunds.clear()
    rt = make_runtime()
    rt.register(refused_branch_caught)
    client = rt.client()
    run = client.start(refused_branch_caught).execution_id
    with pytest.raises(wp.ResultTimeoutError):
        client.result(run, timeout=1.0)  # driven here up to its signal wait
    assert client.status(run) == "suspended"
    client.cancel(run, compensate=True)
    with pytest.raises(wp.WorkflowFailedError):
        client.result(run, timeout=30).unwrap()
    assert refunds == [7]


class Stringly(BaseModel):
    n: int

    @field_serializer("n")
    def as_text(self, value: int) -> str:
        return str(value)


class Aliased(BaseModel):
    foo_bar: int = Field(alias="fooBar")


@wp.workflow(name="waits-stringly", version=1)
def waits_stringly(ctx: wp.Context) -> int:
    got = ctx.wait_for_signal("s", Stringly)
    assert isinstance(got, wp.Received)
    return got.value.n


@wp.workflow(name="waits-aliased", version=1)
def waits_aliased(ctx: wp.Context) -> int:
    got = ctx.wait_for_signal("s", Aliased)
    assert isinstance(got, wp.Received)
    return got.value.foo_bar


def test_a_signal_is_judged_as_the_wait_reads_it(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """An instance whose own serializer writes another JSON type (an int as text) is read
    by the wait, so it is taken; a document the wait could not read back (an alias it
    does not populate by name) is refused at the call, not delivered to fail the run."""
    rt = make_runtime()
    rt.register(waits_stringly, waits_aliased)
    rt.start_worker(concurrency=2, poll_interval=0.05)
    client = rt.client()
    stringly = client.start(waits_stringly).execution_id
    aliased = client.start(waits_aliased).execution_id
    wait_until(
        lambda: all(client.pending_signals(r) for r in (stringly, aliased)), what="the waits"
    )
    assert client.signal(stringly, "s", Stringly(n=3)) == "delivered"
    assert client.result(stringly, timeout=30).unwrap() == 3
    with pytest.raises(wp.SignalPayloadError):
        client.signal(aliased, "s", {"fooBar": 1})
    assert client.status(aliased) == "suspended"
