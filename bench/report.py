"""Results and the report: per-repetition samples, the rows of the table with their targets,
Markdown, JSON lines, and the README block between the ``bench`` markers."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

BEGIN: Final = "<!-- bench:begin -->"
END: Final = "<!-- bench:end -->"


@dataclass
class Results:
    """Samples of one backend run, keyed ``<workload>.<system>.<field>``, one per repetition,
    plus what could not be measured (``errors``, by ``<workload>.<system>``) and notes."""

    backend: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def get(self, key: str) -> list[float]:
        return self.samples.get(key, [])

    def median(self, key: str) -> float | None:
        values = self.get(key)
        return statistics.median(values) if values else None

    def error(self, key: str) -> str | None:
        """Why ``<workload>.<system>[.<field>]`` has no samples, if it is known."""
        system = ".".join(key.split(".")[:2])
        return self.errors.get(system)

    def pick_best(self, workload: str, systems: dict[str, str], best: str) -> None:
        """Copy the samples of the system with the highest median ``per_s`` to ``best``;
        ``systems`` maps each candidate to how the report names it."""
        medians = {s: self.median(f"{workload}.{s}.per_s") for s in systems}
        found = {s: m for s, m in medians.items() if m is not None}
        if not found:
            reasons = [self.errors.get(f"{workload}.{s}") for s in systems]
            first = next((r for r in reasons if r), None)
            if first:
                self.errors[f"{workload}.{best}"] = first
            return
        chosen = max(found, key=lambda s: found[s])
        prefix = f"{workload}.{chosen}."
        for key, values in list(self.samples.items()):
            if key.startswith(prefix):
                self.samples[f"{workload}.{best}.{key[len(prefix) :]}"] = list(values)
        self.labels[f"{workload}.{best}"] = systems[chosen]


@dataclass(frozen=True)
class Target:
    op: str  # ">=" or "<="
    value: float
    text: str

    def holds(self, value: float) -> bool:
        return value >= self.value if self.op == ">=" else value <= self.value


@dataclass(frozen=True)
class Row:
    """One line of the table: a measured figure (``key``) or a ratio (``key`` ÷ ``den``)."""

    workload: str
    label: str
    key: str
    den: str | None = None
    spec: str = ",.0f"
    target: Target | None = None
    cpu: bool = False  # show the client (and server) CPU µs per operation
    note_fields: tuple[tuple[str, str, str], ...] = ()  # (field, label, format) from key's system


@dataclass
class Cell:
    """A row's computed values."""

    row: Row
    median: float | None
    low: float | None
    high: float | None
    cpu: str
    verdict: str
    notes: str


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _system(key: str) -> str:
    return ".".join(key.split(".")[:2])


def compute(res: Results, row: Row) -> Cell:
    notes: list[str] = []
    if row.den is None:
        values = res.get(row.key)
        median = statistics.median(values) if values else None
        low, high = (min(values), max(values)) if values else (None, None)
        missing = [row.key]
    else:
        top, bottom = res.median(row.key), res.median(row.den)
        median = top / bottom if top is not None and bottom else None
        paired = [a / b for a, b in zip(res.get(row.key), res.get(row.den), strict=False) if b]
        low, high = (min(paired), max(paired)) if paired else (None, None)
        missing = [k for k in (row.key, row.den) if not res.get(k)]
    for key in missing:
        reason = res.error(key)
        if reason and reason not in notes:
            notes.append(reason)
    for k in [row.key] if row.den is None else [row.key, row.den]:
        chosen = res.labels.get(_system(k))
        if chosen:
            notes.append(chosen)
    system = _system(row.key)
    for fld, label, spec in row.note_fields:
        value = res.median(f"{system}.{fld}")
        if value is not None:
            notes.append(f"{label} {format(value, spec)}")
    cpu = ""
    if row.cpu and row.den is None:
        parts = []
        client = res.median(f"{system}.cpu_us")
        worker = res.median(f"{system}.worker_cpu_us")
        server = res.median(f"{system}.server_cpu_us")
        if client is not None:
            parts.append(f"{client:,.0f}" + (f" + worker {worker:,.0f}" if worker else ""))
        if server is not None:
            parts.append(f"server {server:,.0f}")
        cpu = " · ".join(parts)
    if row.target is None:
        verdict = ""
    elif median is None:
        verdict = "FAIL (not measured)" if notes else "n/a"
    else:
        verdict = "PASS" if row.target.holds(median) else "FAIL"
    return Cell(row, median, low, high, cpu, verdict, "; ".join(notes))


def markdown_table(res: Results, rows: Iterable[Row]) -> list[str]:
    lines = [
        "| # | measurement | median | per-rep range | CPU µs/op | target | result | notes |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    shown: set[str] = set()
    for row in rows:
        cell = compute(res, row)
        if cell.notes and cell.notes in shown and cell.median is None:
            cell.notes = "not measured (see above)"
        shown.add(cell.notes)
        spread = (
            f"{fmt(cell.low, row.spec)}-{fmt(cell.high, row.spec)}" if cell.low is not None else ""
        )
        target = row.target.text if row.target else ""
        verdict = f"**{cell.verdict}**" if cell.verdict.startswith("FAIL") else cell.verdict
        notes = cell.notes.replace("|", "/").replace("\n", " ")
        if len(notes) > 240:
            notes = notes[:237] + "..."
        lines.append(
            f"| {row.workload} | {row.label} | {fmt(cell.median, row.spec)} | {spread} | "
            f"{cell.cpu} | {target} | {verdict} | {notes} |"
        )
    return lines


def json_lines(res: Results, rows: Iterable[Row]) -> list[str]:
    out = []
    for row in rows:
        cell = compute(res, row)
        record: dict[str, Any] = {
            "backend": res.backend,
            "workload": row.workload,
            "measurement": row.label,
            "key": row.key if row.den is None else f"{row.key}/{row.den}",
            "median": cell.median,
            "min": cell.low,
            "max": cell.high,
            "target": f"{row.target.op} {row.target.value}" if row.target else None,
            "verdict": cell.verdict or None,
            "notes": cell.notes or None,
        }
        out.append(json.dumps(record))
    for key, values in sorted(res.samples.items()):
        out.append(json.dumps({"backend": res.backend, "sample": key, "values": values}))
    return out


def verdicts(res: Results, rows: Iterable[Row]) -> tuple[int, int]:
    """(passed, failed) among rows with a target."""
    cells = [compute(res, r) for r in rows if r.target is not None]
    passed = sum(1 for c in cells if c.verdict == "PASS")
    failed = sum(1 for c in cells if c.verdict.startswith("FAIL"))
    return passed, failed


def write_readme(readme: Path, block: str) -> None:
    """Replace what stands between the markers (which must exist) with ``block``."""
    text = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} block to replace")
    replacement = f"{BEGIN}\n{block.strip()}\n{END}"
    readme.write_text(pattern.sub(lambda _m: replacement, text, count=1))
