"""A step's policies, given at its definition: how it retries (:class:`Retry`) and how many
of its executions may run at once (:class:`Limit`). Checked when defined, so a bad policy
fails at import, not in the first run that needs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .error_documents import shown
from .errors import WorkflowDefinitionError


@dataclass(frozen=True)
class Retry:
    """How often a step is attempted and how long to wait between attempts.

    Args:
        attempts: total attempts (>= 1).
        backoff: ``"none"`` (retry at once) or ``"exponential"``: the delay before attempt
            k >= 2 is ``base * factor ** (k - 2)`` seconds, capped at ``max_delay``.
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
        if (
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise WorkflowDefinitionError(
                f"retry attempts must be an integer >= 1, got {shown(self.attempts)}"
            )
        if self.backoff not in ("none", "exponential"):
            raise WorkflowDefinitionError(f"unknown backoff {self.backoff!r}")
        if self.base < 0 or self.factor < 1 or (self.max_delay is not None and self.max_delay < 0):
            raise WorkflowDefinitionError("backoff needs base >= 0, factor >= 1, max_delay >= 0")

    def delay(self, attempt: int, rng: Callable[[], float]) -> float:
        """Seconds to wait before ``attempt`` (2, 3, ...)."""
        if self.backoff == "none" or attempt < 2:
            return 0.0
        delay = self.base * self.factor ** (attempt - 2)
        if self.max_delay is not None:
            delay = min(delay, self.max_delay)
        if self.jitter:
            delay *= 0.5 + rng() / 2
        return delay


@dataclass(frozen=True)
class Limit:
    """At most ``limit`` executions of a step at once, per ``key(*args, **kwargs)`` if given.

    On PostgreSQL the limit holds across every worker sharing the database (session
    advisory locks, released if a worker dies); elsewhere it holds within one process.
    """

    limit: int
    key: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise WorkflowDefinitionError(
                f"concurrency limit must be an integer >= 1, got {shown(self.limit)}"
            )
