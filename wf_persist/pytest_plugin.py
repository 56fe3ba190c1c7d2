"""The pytest plugin of :mod:`wf_persist.testing` (registered through the ``pytest11``
entry point): the fixture ``wf_runtime``, a fresh :class:`~wf_persist.testing.TestRuntime`
per test, closed afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .testing import TestRuntime


@pytest.fixture
def wf_runtime() -> Iterator[TestRuntime]:
    """A :class:`TestRuntime` with time skipping; register your workflows on it."""
    runtime = TestRuntime()
    try:
        yield runtime
    finally:
        runtime.close()
