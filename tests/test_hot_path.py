"""The step path's shortcuts give what the long way gives: arguments bound by position
without ``Signature.bind``, whether a function is async asked once, a pool's capacity read
once per pool."""

from __future__ import annotations

import functools
import gc
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import QueuePool

import wf_persist as wp
from wf_persist.steps import StepRunner


@wp.step
def two(a: int, b: int) -> int:
    return a + b


@wp.step
def defaulted(a: int, b: int = 5) -> int:
    return a + b


@wp.step
def keyword_only(a: int, *, b: int) -> int:
    return a + b


CASES: list[tuple[wp.Step[Any], tuple[Any, ...], dict[str, Any]]] = [
    (two, (1, 2), {}),
    (two, (1,), {"b": 2}),
    (two, (), {"a": 1, "b": 2}),
    (defaulted, (1,), {}),
    (defaulted, (1, 2), {}),
    (keyword_only, (1,), {"b": 2}),
]


@pytest.mark.parametrize(("step", "args", "kwargs"), CASES)
def test_bound_arguments_are_what_signature_bind_gives(
    step: wp.Step[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    expected = dict(step.signature.bind(*args, **kwargs).arguments)
    assert StepRunner.bind(step, args, kwargs) == expected


@pytest.mark.parametrize(
    ("step", "args", "kwargs"),
    [(two, (1, 2, 3), {}), (two, (1,), {}), (keyword_only, (1, 2), {}), (two, (1, 2), {"c": 3})],
)
def test_arguments_that_do_not_bind_are_refused(
    step: wp.Step[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(wp.InvalidPayloadError):
        StepRunner.bind(step, args, kwargs)


def test_positional_names_only_where_every_parameter_takes_a_position() -> None:
    assert two.positional == ("a", "b")
    assert defaulted.positional == ("a", "b")
    assert keyword_only.positional is None


def positional_only(a: int, /, b: int) -> int:
    return a + b


def star(*parts: int) -> int:
    return sum(parts)


def double_star(**named: int) -> int:
    return sum(named.values())


@pytest.mark.parametrize(
    ("fn", "shown"),
    [
        (positional_only, "parameter a (positional-only)"),
        (star, "parameter *parts (variadic positional)"),
        (double_star, "parameter **named (variadic keyword)"),
    ],
)
def test_a_step_parameter_its_recorded_call_cannot_fill_is_refused_at_definition(
    fn: Any, shown: str
) -> None:
    # A step is called with its recorded arguments by name: such a step failed every run.
    with pytest.raises(
        wp.WorkflowDefinitionError, match=rf"step {fn.__name__}: {re.escape(shown)}"
    ):
        wp.step(fn)


def body_keyword_only(ctx: wp.Context, *, payload: int) -> int:
    return payload


def body_variadic(ctx: wp.Context, **payload: int) -> int:
    return 0


@pytest.mark.parametrize("fn", [body_keyword_only, body_variadic])
def test_a_workflow_input_that_cannot_be_passed_by_position_is_refused(fn: Any) -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="cannot be passed by position"):
        wp.workflow(name=f"refused_{fn.__name__}", version=1)(fn)


def body_positional(ctx: wp.Context, payload: int, /) -> int:
    return payload


def body_rest(ctx: wp.Context, *rest: int) -> int:
    return sum(rest)


@pytest.mark.parametrize("fn", [body_positional, body_rest])
def test_a_workflow_input_passed_by_position_still_works(runtime: wp.Runtime, fn: Any) -> None:
    wf = wp.workflow(name=f"kept_{fn.__name__}", version=1)(fn)
    runtime.register(wf)
    assert runtime.client().execute(wf, 7).unwrap() == 7


@wp.workflow(name="hot_path_calls", version=1)
def calls(ctx: wp.Context, n: int) -> list[int]:
    return [
        ctx.run(two, n, 1),
        ctx.run(defaulted, n),
        ctx.run(two, n, b=2),
        ctx.run(defaulted, n, 3),
    ]


def test_recorded_inputs_follow_the_binding(runtime: wp.Runtime) -> None:
    runtime.register(calls)
    client = runtime.client()
    run = client.start(calls, 10).execution_id
    assert client.result(run).unwrap() == [11, 15, 12, 13]
    inputs = [r.event["input"] for r in client.history(run) if r.event["type"] == "step.started"]
    assert inputs == [{"a": 10, "b": 1}, {"a": 10}, {"a": 10, "b": 2}, {"a": 10, "b": 3}]


class Payload:
    """Big enough to notice, captured by a code block's closure."""


@wp.workflow(name="hot_path_code_blocks", version=1)
def code_blocks(ctx: wp.Context, n: int) -> int:
    payload = Payload()
    PAYLOADS.append(weakref.ref(payload))
    return ctx.code("measure", lambda: n + len(repr(payload)) * 0)


PAYLOADS: list[weakref.ref[Payload]] = []


def test_a_code_blocks_closure_is_not_kept_after_its_run(runtime: wp.Runtime) -> None:
    """Nothing of wf_persist's keeps a call's function (and what it captures, often the
    run's context) once the call is over."""
    runtime.register(code_blocks)
    client = runtime.client()
    PAYLOADS.clear()
    for n in range(5):
        assert client.execute(code_blocks, n).unwrap() == n
    gc.collect()
    assert [ref() for ref in PAYLOADS] == [None] * 5


def test_pool_full_reads_the_capacity_of_the_pool_in_use(tmp_path: Any) -> None:
    engine = create_engine(
        f"sqlite:///{tmp_path / 'pool.db'}", poolclass=QueuePool, pool_size=1, max_overflow=0
    )
    runtime = wp.Runtime(engine, auto_migrate=True)
    try:
        backend = runtime.database.backend
        assert backend.pool_full() is False
        with engine.connect():
            assert backend.pool_full() is True
            # A pool of another size in its place (as a host may set one): read again.
            engine.pool = QueuePool(engine.pool._creator, pool_size=2, max_overflow=0)
            assert backend.pool_full() is False
            with engine.connect():
                assert backend.pool_full() is False
                with engine.connect():
                    assert backend.pool_full() is True
    finally:
        runtime.close()
        engine.dispose()


def _added(a: int, b: int) -> int:
    return a + b


class _Callable:
    def __call__(self, ctx: wp.Context, x: int) -> int:
        return x


@pytest.mark.parametrize("fn", [functools.partial(_added, 1), _Callable()])
@pytest.mark.parametrize("named", [True, False])
def test_a_callable_that_is_no_function_is_refused_typed(fn: Any, named: bool) -> None:
    # Neither has a __name__ nor annotations get_type_hints reads: a workflow raised a raw
    # AttributeError (its name read before any check).
    name = "given" if named else None
    declarers: tuple[Callable[[Any], Any], ...] = (
        wp.step(name=name),
        wp.workflow(name=name, version=1),
    )
    for declare in declarers:
        with pytest.raises(wp.WorkflowDefinitionError, match=r"is not a function|name must be"):
            declare(fn)


class _Logged:
    """A decorator written as a class, the usual way (``functools.update_wrapper``, no
    ``__get__``): what it wraps is read through ``__wrapped__``."""

    def __init__(self, fn: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


@_Logged
def _doubled(x: int) -> int:
    return 2 * x


doubled = wp.step(_doubled)


@wp.workflow(name="hot_path_class_decorated", version=1)
@_Logged
def class_decorated(ctx: wp.Context, x: int) -> int:
    doubled_x: int = ctx.run(doubled, x)
    return doubled_x + 1


def test_a_function_behind_a_class_decorator_is_a_step_and_a_workflow(
    runtime: wp.Runtime,
) -> None:
    runtime.register(class_decorated)
    client = runtime.client()
    before = _doubled.calls
    assert client.execute(class_decorated, 20).unwrap() == 41
    assert _doubled.calls == before + 1
    with pytest.raises(wp.InvalidPayloadError):  # validated by the wrapped annotations
        client.start(class_decorated, "twenty")


def _bogus_signature(x: int) -> int:
    return x


_bogus_signature.__signature__ = 42  # type: ignore[attr-defined]


class _BadRepr:
    __name__ = "bad_repr"

    def __call__(self, ctx: wp.Context) -> None:
        return None

    def __repr__(self) -> str:
        raise RuntimeError("repr broken")


@pytest.mark.parametrize("fn", [max, dict, _bogus_signature, _BadRepr()])
def test_a_definition_whose_parameters_cannot_be_read_is_refused_typed(fn: Any) -> None:
    # inspect.signature raised ValueError/TypeError, a broken repr its own error: raw.
    declarers: tuple[Callable[[Any], Any], ...] = (
        wp.step(name="given"),
        wp.workflow(name="given", version=1),
    )
    for declare in declarers:
        with pytest.raises(wp.WorkflowDefinitionError):
            declare(fn)


lambda_on_a_continuation = (  # its source line does not parse on its own  # noqa: E731
    lambda ctx: None
)


def test_a_lambda_workflow_is_refused_typed() -> None:
    with pytest.raises(wp.WorkflowDefinitionError, match="not a plain function"):
        wp.workflow(name="lambda", version=1)(lambda_on_a_continuation)
