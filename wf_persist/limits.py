"""Step concurrency limits.

PostgreSQL: a slot is a session advisory lock ``(hash(step, key), slot)`` held on a
connection of its own while the step runs, so the limit holds across every worker sharing the
database, and a worker that dies releases its slots with its connection. Other backends: a
semaphore per (step, key) in this process.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, func, select

from . import _dialect


def lock_key(step_name: str, key: str) -> int:
    """A stable signed 32-bit key for (step, key)."""
    digest = hashlib.sha256(f"wf_persist\0{step_name}\0{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


class ConcurrencyLimits:
    """Hands out concurrency slots for steps run by one runtime."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._shared = _dialect.is_postgresql(engine.dialect)
        self._lock = threading.Lock()
        self._semaphores: dict[tuple[str, str, int], threading.Semaphore] = {}

    @contextmanager
    def slot(self, step_name: str, key: str, limit: int) -> Iterator[Callable[[], bool]]:
        """Yields ``acquire()`` (non-blocking; True once a slot is held); releases on exit."""
        if self._shared:
            with self._advisory(step_name, key, limit) as try_advisory:
                yield try_advisory
            return
        with self._lock:
            semaphore = self._semaphores.setdefault(
                (step_name, key, limit), threading.Semaphore(limit)
            )
        held = False

        def acquire() -> bool:
            nonlocal held
            held = held or semaphore.acquire(blocking=False)
            return held

        try:
            yield acquire
        finally:
            if held:
                semaphore.release()

    @contextmanager
    def _advisory(self, step_name: str, key: str, limit: int) -> Iterator[Callable[[], bool]]:
        k1 = lock_key(step_name, key)
        held: int | None = None
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")

            def acquire() -> bool:
                nonlocal held
                if held is None:
                    for slot in range(limit):
                        if conn.execute(select(func.pg_try_advisory_lock(k1, slot))).scalar():
                            held = slot
                            break
                return held is not None

            try:
                yield acquire
            finally:
                if held is not None:
                    conn.execute(select(func.pg_advisory_unlock(k1, held)))
