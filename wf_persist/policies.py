"""A step's policies, given at its definition: how it retries (:class:`Retry`) and how many
of its executions may run at once (:class:`Limit`). Checked when defined, so a bad policy
fails at import, not in the first run that needs it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from .error_documents import shown
from .errors import InvalidArgumentError, WorkflowDefinitionError
from .timeouts import MAX_DURATION_SECONDS, duration_seconds, plain_number

#: The largest backoff factor: past it the second retry's delay is already any cap.
MAX_FACTOR: Final = 1e6


@dataclass(frozen=True)
class Retry:
    """How often a step is attempted and how long to wait between attempts.

    Args:
        attempts: total attempts (>= 1).
        backoff: ``"none"`` (retry at once) or ``"exponential"``: the delay before attempt
            k >= 2 is ``base * factor ** (k - 2)`` seconds, capped at ``max_delay`` (and at
            1000 years). ``base`` and ``max_delay`` are seconds (finite, not negative);
            ``factor`` is from 1 to 1,000,000.
        jitter: scale each delay by a random factor in [0.5, 1) so retries of many runs
            spread out. The chosen retry time is recorded, so a replay waits the same.
    """

    attempts: int = 1
    backoff: Literal["none", "exponential"] = "none"
    base: float = 0.01
    factor: float = 2.0
    max_delay: float | None = None
    jitter: bool = False

    def __post_init__(self) -> None:
        attempts = plain_number(self.attempts)
        if not isinstance(attempts, int) or attempts < 1:
            raise WorkflowDefinitionError(
                f"retry attempts must be an integer >= 1, got {shown(self.attempts)}"
            )
        if not isinstance(self.backoff, str) or self.backoff not in ("none", "exponential"):
            raise WorkflowDefinitionError(f"unknown backoff {shown(self.backoff)}")
        base = _seconds(self.base, "retry base")
        factor = plain_number(self.factor)
        if factor is None or not 1 <= factor <= MAX_FACTOR:
            raise WorkflowDefinitionError(
                f"retry factor must be a number from 1 to {MAX_FACTOR:,.0f}, "
                f"got {shown(self.factor)}"
            )
        most = None if self.max_delay is None else _seconds(self.max_delay, "retry max_delay")
        if not isinstance(self.jitter, bool):
            raise WorkflowDefinitionError(
                f"retry jitter must be True or False, got {self.jitter!r:.80}"
            )
        # The plain values (a subclass's own arithmetic may raise or lie).
        object.__setattr__(self, "attempts", attempts)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "factor", float(factor))
        object.__setattr__(self, "max_delay", most)

    def delay(self, attempt: int, rng: Callable[[], float]) -> float:
        """Seconds to wait before ``attempt`` (2, 3, ...), at most ``max_delay`` and 1000
        years (a long run of failures would otherwise overflow the float)."""
        if self.backoff == "none" or attempt < 2:
            return 0.0
        cap = MAX_DURATION_SECONDS if self.max_delay is None else self.max_delay
        try:
            delay = min(self.base * self.factor ** (attempt - 2), cap)
        except OverflowError:
            delay = cap
        if self.jitter:
            delay *= 0.5 + rng() / 2
        return delay


def _seconds(value: object, what: str) -> float:
    """A delay of a policy in seconds (a number or a ``timedelta``), as durations are."""
    try:
        return duration_seconds(value, what)  # type: ignore[arg-type]
    except InvalidArgumentError as exc:
        raise WorkflowDefinitionError(str(exc)) from None


@dataclass(frozen=True)
class Limit:
    """At most ``limit`` executions of a step at once, per ``key(*args, **kwargs)`` if given.

    The limit holds across every process sharing the database: a slot is a row of
    ``wf_slots`` (see :mod:`wf_persist.slots`), which outlives database sessions and
    lapses a lease TTL after its holder died or froze. A run cancelled while it waits for
    a slot never starts the step.
    """

    limit: int
    key: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        limit = plain_number(self.limit)
        # Below 2**31: a slot's number is a 32-bit integer column.
        if not isinstance(limit, int) or not 1 <= limit < 2**31:
            raise WorkflowDefinitionError(
                f"concurrency limit must be an integer from 1 to 2,147,483,647, "
                f"got {shown(self.limit)}"
            )
        if self.key is not None and not callable(self.key):
            raise WorkflowDefinitionError(
                f"a concurrency limit's key must be a function of the step's arguments, "
                f"got {shown(self.key)}"
            )
        object.__setattr__(self, "limit", limit)


def key_text(key: Any) -> str:
    """The text a limit's key is compared by, the same in every process: a ``str`` as it
    is; anything else as its JSON, a set's items in order (``str()`` of a set depends on
    its process's string hashing, and two workers held one key's slots apart). So ``1``,
    ``1.0`` and ``True`` are three keys, and the int ``1`` is not the str ``"1"``. A value
    JSON cannot write is compared by its ``str()``."""
    if isinstance(key, str):
        return key
    try:
        return "\0json:" + json.dumps(_canonical(key), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return "\0str:" + str(key)


def _canonical(value: Any) -> Any:
    """``value`` with its sets as sorted lists and its tuples as lists (raises TypeError
    for what JSON cannot write)."""
    if isinstance(value, set | frozenset):
        items = [_canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False))
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value
