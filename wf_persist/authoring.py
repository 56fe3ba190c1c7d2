"""Authoring: ``@workflow`` and ``@step`` definitions and their pydantic types (a version's
source hash is :mod:`.sources`', a step's policies :mod:`.policies`')."""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import (
    Any,
    Final,
    Generic,
    Protocol,
    TypeVar,
    cast,
    get_type_hints,
    overload,
)

from pydantic import PydanticUserError, TypeAdapter

from .error_documents import shown
from .errors import InvalidArgumentError, WorkflowDefinitionError
from .models import CALL_NAME_WIDTH, WORKFLOW_NAME_WIDTH
from .policies import Limit, Retry
from .sources import source_hash
from .timeouts import duration_seconds
from .values import json_schema_of, unstorable

I = TypeVar("I")  # noqa: E741
O = TypeVar("O")  # noqa: E741
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_ANY_ADAPTER: TypeAdapter[Any] = TypeAdapter(Any)


@functools.lru_cache(maxsize=512)
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def adapter_for(tp: Any) -> TypeAdapter[Any]:
    """A (cached) pydantic TypeAdapter; unannotated means ``Any``."""
    if tp is inspect.Parameter.empty or tp is Any:
        return _ANY_ADAPTER
    try:
        try:
            return _adapter(tp)
        except TypeError:  # unhashable annotation objects
            return TypeAdapter(tp)
    except PydanticUserError as exc:  # not a type pydantic can validate
        reason = str(exc).splitlines()[0]
        raise WorkflowDefinitionError(f"cannot validate values of type {tp!r}: {reason}") from exc


def _check_name(name: object, what: str, width: int, error: type[Exception]) -> str:
    """``name`` as a plain ``str`` (a subclass's own length, hash or equality may raise)."""
    # type(), not isinstance(): an object's __class__ may claim str.
    if not issubclass(type(name), str) or not str.__len__(name):  # type: ignore[arg-type]
        raise error(f"{what} must be a non-empty string, got {shown(name)}")
    name = str.__str__(name)
    if len(name) > width:
        raise error(f"{what} is {len(name)} characters; at most {width} fit the history columns")
    if unstorable(name) is not None:
        raise error(
            f"{what} must not contain NUL or invalid UTF-8 (databases reject it), got {shown(name)}"
        )
    return name


def check_call_name(name: object, what: str) -> str:
    """A step, sleep, signal or code block name that fits its activity and dedupe columns."""
    return _check_name(name, what, CALL_NAME_WIDTH, InvalidArgumentError)


#: What a child call's name is: this prefix and the child's workflow name.
CHILD_PREFIX: Final = "child:"


def child_call_name(workflow_name: str) -> str:
    """A child call's name (``child:<workflow>``), checked as the workflow's name: every
    workflow name fits. Its activity name (``child:<workflow>#<n>``, at most 217
    characters) and the dedupe keys made of it (``child.started:``, ``child.waiting:``,
    at most 231) fit the key columns (255)."""
    width, refusal = WORKFLOW_NAME_WIDTH, InvalidArgumentError
    return CHILD_PREFIX + _check_name(workflow_name, "child workflow name", width, refusal)


def _check_plain(fn: Callable[..., Any], what: str) -> None:
    """Generators would be "called" without running: refuse them now. ``async def``
    functions are fine (an async step runs only where an async workflow awaits it)."""
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise WorkflowDefinitionError(
            f"{what} {shown(getattr(fn, '__name__', fn))} is a generator; it must return its result"
        )


#: How a workflow's parameters are passed (``fn(ctx, input)``) and a step's (by name, as
#: its arguments are recorded): a parameter that cannot take them so would fail every run.
_POSITIONAL: Final = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
)
_NAMED: Final = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _check_kinds(
    params: Iterable[inspect.Parameter],
    kinds: tuple[inspect._ParameterKind, ...],
    what: str,
    how: str,
) -> None:
    """Refuse, at definition, a parameter its calls could never fill."""
    for param in params:
        if param.kind not in kinds:
            stars = "*" if param.kind is inspect.Parameter.VAR_POSITIONAL else ""
            stars = "**" if param.kind is inspect.Parameter.VAR_KEYWORD else stars
            label = stars + param.name
            raise WorkflowDefinitionError(
                f"{what}: parameter {label} ({param.kind.description}) cannot be passed "
                f"{how}; declare each parameter as a plain one"
            )


class _BodyState(threading.local):
    """True while this thread runs a workflow body (not a step inside it)."""

    in_body = False


body_state = _BodyState()


class _InBody:
    """Sets, for a ``with`` block, whether this thread runs the workflow body (a class, not
    a generator: entered around every step, where a generator's cost shows)."""

    __slots__ = ("_saved", "_value")

    def __init__(self, value: bool) -> None:
        self._value = value
        self._saved = False

    def __enter__(self) -> None:
        self._saved = body_state.in_body
        body_state.in_body = self._value

    def __exit__(self, *exc: object) -> None:
        body_state.in_body = self._saved


def outside_body() -> AbstractContextManager[None]:
    """Run user code that is not the workflow body (a step, a code block, a compensation)."""
    return _InBody(False)


def inside_body() -> AbstractContextManager[None]:
    """Run the workflow body: a step called directly here is refused."""
    return _InBody(True)


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (ValueError, TypeError) as exc:  # a builtin without one, a bogus __signature__
        raise WorkflowDefinitionError(
            f"cannot read the parameters of {shown(fn)}: {shown(exc, 200)}"
        ) from exc


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:  # a wrapper made by functools.update_wrapper is read as what it wraps
        target = inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        target = fn
    if not (inspect.isroutine(target) or inspect.isclass(target)):  # a partial, a __call__
        raise WorkflowDefinitionError(
            f"{shown(fn)} is not a function: declare it with def or async def, whose annotations "
            "say what its arguments and result are"
        )
    try:
        return get_type_hints(fn, include_extras=True)
    except Exception as exc:  # unresolvable forward references and the like
        raise WorkflowDefinitionError(
            f"cannot resolve the annotations of {shown(fn)}: {shown(exc, 200)}"
        ) from exc


@dataclass(frozen=True, eq=False)
class Workflow(Generic[I, O]):
    """A registered-able workflow definition. Create with :func:`workflow`."""

    name: str
    version: int
    fn: Callable[..., O]
    input_adapter: TypeAdapter[Any]
    output_adapter: TypeAdapter[Any]
    takes_input: bool
    source_hash: str
    #: Seconds a run may take from its start before it is cancelled (with compensation)
    #: and fails with ``WorkflowTimeoutError``; ``start(timeout=...)`` overrides it.
    timeout: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)

    @property
    def is_async(self) -> bool:
        """An ``async def`` workflow: its body gets an :class:`AsyncContext` to await."""
        return inspect.iscoroutinefunction(self.fn)

    @functools.cached_property
    def schemas(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The JSON Schemas of the input and the output, as cataloged (``None`` where the
        type has none): what a process without this code validates a start against."""
        return (
            json_schema_of(self.input_adapter, "validation"),
            json_schema_of(self.output_adapter, "serialization"),
        )

    def __repr__(self) -> str:
        return f"<Workflow {self.name}@v{self.version}>"


class WorkflowDecorator(Protocol):
    """What ``@workflow(...)`` returns: an ``async def`` body's output is what it awaits to."""

    @overload
    def __call__(self, fn: Callable[..., Coroutine[Any, Any, O]], /) -> Workflow[Any, O]: ...
    @overload
    def __call__(self, fn: Callable[..., O], /) -> Workflow[Any, O]: ...


class StepDecorator(Protocol):
    """What ``@step(...)`` returns: an ``async def`` step's result is what it awaits to."""

    @overload
    def __call__(self, fn: Callable[..., Coroutine[Any, Any, R]], /) -> Step[R]: ...
    @overload
    def __call__(self, fn: Callable[..., R], /) -> Step[R]: ...


def workflow(
    *, name: str | None = None, version: int = 1, timeout: dt.timedelta | float | None = None
) -> WorkflowDecorator:
    """Declare a workflow: a plain function ``(ctx, input) -> output``.

    The input and output annotations are validated with pydantic (models, dataclasses or
    any type a ``TypeAdapter`` accepts). The body must be deterministic: its only contact with
    the outside world goes through ``ctx``.

    Args:
        name: the workflow's durable name (default: the function name).
        version: positive integer; a run stays pinned to the version it started with.
        timeout: seconds (or a ``timedelta``) a run may take from its start: past it, the
            run is cancelled with compensation at its next durable call (also if no
            process was alive when it passed) and fails with ``WorkflowTimeoutError``.
    """
    if isinstance(version, bool) or not isinstance(version, int):
        raise WorkflowDefinitionError(
            f"workflow version must be an integer >= 1, got {shown(version)}"
        )
    # A plain int from here on: an int subclass's own __str__ or __hash__ would enter the
    # source hash or the registry.
    version = int.__int__(version)
    if version < 1:
        raise WorkflowDefinitionError(
            f"workflow version must be an integer >= 1, got {shown(version)}"
        )
    if version > 2**31 - 1:
        raise WorkflowDefinitionError(f"workflow version must fit 32 bits, got {shown(version)}")
    if name is not None:
        _check_name(name, "workflow name", WORKFLOW_NAME_WIDTH, WorkflowDefinitionError)
    seconds = _definition_timeout(timeout, "workflow timeout")

    def decorate(fn: Callable[..., O]) -> Workflow[Any, O]:
        if not callable(fn):
            raise WorkflowDefinitionError(f"@workflow needs a function, got {shown(fn)}")
        _check_plain(fn, "workflow")
        # A callable without a __name__ (functools.partial, an object with __call__) needs
        # an explicit name=; its annotations are refused by _hints below.
        wf_name = _check_name(
            name or getattr(fn, "__name__", None),
            "workflow name",
            WORKFLOW_NAME_WIDTH,
            WorkflowDefinitionError,
        )
        params = list(_signature(fn).parameters.values())
        if len(params) not in (1, 2):
            raise WorkflowDefinitionError(
                f"workflow {wf_name} must take (ctx) or (ctx, input), got {len(params)} params"
            )
        _check_kinds(params, _POSITIONAL, f"workflow {wf_name}", "by position")
        hints = _hints(fn)
        takes_input = len(params) == 2
        in_type = hints.get(params[1].name, Any) if takes_input else type(None)
        return Workflow(
            name=wf_name,
            version=version,
            fn=fn,
            input_adapter=adapter_for(in_type),
            output_adapter=adapter_for(hints.get("return", Any)),
            takes_input=takes_input,
            source_hash=source_hash(wf_name, version, fn),
            timeout=seconds,
        )

    return cast(WorkflowDecorator, decorate)  # an async body's O is what it awaits to


@dataclass(frozen=True, eq=False)
class Step(Generic[R]):
    """A durable step definition. Create with :func:`step`; call through ``ctx.run``.

    Calling the object directly runs the function without recording anything (handy in
    unit tests of the step itself).
    """

    name: str
    fn: Callable[..., R]
    signature: inspect.Signature
    param_adapters: dict[str, TypeAdapter[Any]]
    output_adapter: TypeAdapter[Any]
    retry: Retry = field(default_factory=lambda: Retry())
    #: Exception types that fail the step terminally: never retried, raised as themselves.
    errors: tuple[type[BaseException], ...] = ()
    #: Undo, called as ``compensate(result, *args, **kwargs[, reason=...])`` during an unwind.
    compensate: Callable[..., Any] | None = None
    concurrency: Limit | None = None
    #: Seconds an attempt may take before it fails as :class:`StepTimeoutError` (None: no
    #: limit). See :mod:`wf_persist.timeouts` for what happens to the attempt's thread.
    timeout: float | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if body_state.in_body:
            raise WorkflowDefinitionError(
                f"step {self.name} was called directly inside a workflow, where it would run "
                f"unrecorded (and again on every replay): use ctx.run({self.name}, ...)"
            )
        return self.fn(*args, **kwargs)

    def is_terminal(self, exc: BaseException) -> bool:
        return isinstance(exc, self.errors)

    @functools.cached_property
    def positional(self) -> tuple[str, ...] | None:
        """The parameters' names if every one is a plain one (no positional-only, ``*args``,
        ``**kwargs`` or keyword-only): a call with exactly that many positional arguments
        binds them in order, without :meth:`inspect.Signature.bind` (a step's hot path)."""
        params = self.signature.parameters.values()
        plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return tuple(p.name for p in params) if all(p.kind is plain for p in params) else None

    @functools.cached_property
    def fn_is_async(self) -> bool:
        """Whether ``fn`` is a coroutine function (asked on every call: inspect's answer
        unwraps partials and methods first)."""
        return inspect.iscoroutinefunction(self.fn)

    def is_async(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn``, this step's function or one standing in for it, is async."""
        return self.fn_is_async if fn is self.fn else inspect.iscoroutinefunction(fn)

    def error_type(self, name: str | None) -> type[BaseException] | None:
        """The declared error class called ``name`` (to rebuild a recorded failure)."""
        return next((e for e in self.errors if e.__name__ == name), None)

    def __repr__(self) -> str:
        return f"<Step {self.name}>"


def _make_step(
    fn: Callable[..., R],
    name: str | None,
    retry: Retry | None,
    errors: tuple[type[BaseException], ...],
    compensate: Callable[..., Any] | None,
    concurrency: Limit | None,
    timeout: dt.timedelta | float | None = None,
) -> Step[R]:
    if not callable(fn):
        raise WorkflowDefinitionError(f"@step needs a function, got {shown(fn)}")
    _check_plain(fn, "step")
    step_name = _check_name(
        name if name is not None else getattr(fn, "__name__", None),
        "step name",
        CALL_NAME_WIDTH,
        WorkflowDefinitionError,
    )
    if compensate is not None and not callable(compensate):
        raise WorkflowDefinitionError(f"compensate must be callable, got {shown(compensate)}")
    if isinstance(compensate, Step):
        # Called as a function: its retries, timeout and concurrency limit would not apply.
        raise WorkflowDefinitionError(
            f"compensate must be a plain function, got the step {compensate.name!r} (a "
            f"compensation runs without a step's retries, timeout or limit); pass its "
            f"function, {compensate.name}.fn"
        )
    if compensate is not None:
        _check_plain(compensate, "compensation")
    if not isinstance(errors, tuple | list) or not all(
        isinstance(e, type) and issubclass(e, BaseException) for e in errors
    ):
        raise WorkflowDefinitionError(
            f"errors must be a tuple of exception classes, got {shown(errors)}"
        )
    if retry is not None and not isinstance(retry, Retry):
        raise WorkflowDefinitionError(f"retry must be a wp.Retry, got {shown(retry)}")
    if concurrency is not None and not isinstance(concurrency, Limit):
        raise WorkflowDefinitionError(f"concurrency must be a wp.Limit, got {shown(concurrency)}")
    sig = _signature(fn)
    _check_kinds(sig.parameters.values(), _NAMED, f"step {step_name}", "by name")
    hints = _hints(fn)
    return Step(
        name=step_name,
        fn=fn,
        signature=sig,
        param_adapters={p: adapter_for(hints.get(p, Any)) for p in sig.parameters},
        output_adapter=adapter_for(hints.get("return", Any)),
        retry=retry or Retry(),
        errors=tuple(errors),
        compensate=compensate,
        concurrency=concurrency,
        timeout=_definition_timeout(timeout, f"timeout of step {step_name}"),
    )


def _definition_timeout(timeout: dt.timedelta | float | None, what: str) -> float | None:
    if timeout is None:
        return None
    try:
        return duration_seconds(timeout, what, positive=True)
    except InvalidArgumentError as exc:
        raise WorkflowDefinitionError(str(exc)) from None


@overload
def step(fn: Callable[..., Coroutine[Any, Any, R]], /) -> Step[R]: ...
@overload
def step(fn: Callable[..., R], /) -> Step[R]: ...
@overload
def step(
    *,
    name: str | None = None,
    retry: Retry | None = None,
    errors: tuple[type[BaseException], ...] = (),
    compensate: Callable[..., Any] | None = None,
    concurrency: Limit | None = None,
    timeout: dt.timedelta | float | None = None,
) -> StepDecorator: ...


def step(
    fn: Callable[..., R] | None = None,
    /,
    *,
    name: str | None = None,
    retry: Retry | None = None,
    errors: tuple[type[BaseException], ...] = (),
    compensate: Callable[..., Any] | None = None,
    concurrency: Limit | None = None,
    timeout: dt.timedelta | float | None = None,
) -> Step[Any] | StepDecorator:
    """Declare a durable step. Its result is recorded and returned on replay without
    re-running it. Arguments and the result are validated against the annotations.

    Use bare (``@step``) or with options::

        @step(retry=Retry(attempts=5, backoff="exponential"), errors=(OutOfStock,),
              compensate=release_stock, concurrency=Limit(2))

    A raised exception is transient and retried per ``retry``; one of ``errors`` is
    terminal. ``compensate`` is registered once the step succeeded and runs if the workflow
    later fails (saga). ``timeout`` (seconds or a ``timedelta``) bounds each attempt: a
    longer one fails as :class:`StepTimeoutError`, retried like any transient error; its
    thread runs on and its late result is never recorded (:mod:`wf_persist.timeouts`).
    """
    if fn is not None:
        return _make_step(fn, name, retry, errors, compensate, concurrency, timeout)

    def decorate(f: Callable[..., R]) -> Step[R]:
        return _make_step(f, name, retry, errors, compensate, concurrency, timeout)

    return cast(StepDecorator, decorate)  # an async step's R is what it awaits to


@dataclass(frozen=True)
class Call(Generic[R]):
    """A step with its arguments, not yet run: a branch of ``ctx.all``."""

    step: Step[R]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def call(step: Step[R], *args: Any, **kwargs: Any) -> Call[R]:
    """Describe ``step(*args, **kwargs)`` for :meth:`Context.all`."""
    return Call(step, args, kwargs)
