"""Elapsed time is read from one clock, one that goes on while the machine is suspended:
a lease confirmed before a suspend must not look fresh after it."""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest

import wf_persist
from wf_persist import clocks

PACKAGE = Path(wf_persist.__file__).parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_BOOTTIME is Linux's")
def test_elapsed_time_counts_a_suspend_on_linux() -> None:
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    found = clocks.elapsed()
    after = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert before <= found <= after


def _monotonic_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("monotonic", "monotonic_ns")
            and isinstance(node.value, ast.Name)
            and node.value.id == "time"
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            lines += [node.lineno for a in node.names if a.name.startswith("monotonic")]
    return lines


def test_no_module_reads_another_clock() -> None:
    """A value of time.monotonic() compared with one of clocks.elapsed() would be off by
    every suspend since boot: nothing but clocks.py reads a clock of elapsed time."""
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "clocks.py" and (lines := _monotonic_reads(path))
    }
    assert found == {}
