"""The invariants of durable execution, checked after a fault run.

Inputs are what the database recorded (read with plain SQL over the documented tables), the
external ledger the steps wrote (one JSON-lines file per process) and the log of injected
faults. The result is a :class:`Report`: per invariant, how often it was broken and examples
with the relevant history rows and ledger entries.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

#: Invariant name -> what it promises. Every violation is filed under one of these.
INVARIANTS: dict[str, str] = {
    "run.result": "every run completed, with the result its input determines",
    "run.stuck": "no run left unfinished a bounded time after the faults stopped",
    "history.duplicate-event": "no event recorded twice (a step's completion, a run's outcome)",
    "history.sequence": "each run's sequences are exactly 1..n",
    "history.after-outcome": "nothing recorded after a run's workflow.completed/failed",
    "step.rerun-after-commit": "no step started after its completion was committed",
    "step.concurrent-without-fault": (
        "no two executions of one step overlapped while neither process was stopped or killed"
    ),
    "step.rerun-without-fault": (
        "a step ran again only after a fault (a process stopped or killed, the database out)"
    ),
    "step.completed-without-execution": "every recorded step completion was really executed",
    "lease.on-finished-run": "no lease left on a finished run",
    "db.workers-recover": "workers recover from database outages by themselves",
    "db.resume-within-lease": (
        "runs that were mid-step resume within about one lease after the database is back"
    ),
    "db.log-once-per-outage": (
        "a worker logs a database outage once (then backs off), not on every poll"
    ),
}

TERMINAL = ("completed", "failed")
#: How long before a step execution's start a pause of its process still explains it: a
#: process thawed inside the window between its lease check and the step's call enters the
#: step at once (the ledger's start and the injector's SIGCONT then lie microseconds apart).
THAW_GRACE = 0.25
#: Step events whose (activity, attempt) may be recorded once only.
_ONCE_PER_ATTEMPT = ("step.started", "step.failed")
#: Events a run records at most once per activity (or once at all for activity-less ones).
_ONCE = (
    "step.completed",
    "sleep.started",
    "sleep.completed",
    "workflow.started",
    "workflow.completed",
    "workflow.failed",
    "signal.waiting",
    "signal.received",
    "signal.delivered",
    "execution.cancelled",
    "cancellation.received",
)


def as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def as_utc(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    assert isinstance(value, dt.datetime)
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


@dataclass(frozen=True)
class HistoryRow:
    execution_id: str
    sequence: int
    type: str
    activity: str | None
    created_at: dt.datetime
    event: dict[str, Any]

    @property
    def attempt(self) -> Any:
        return self.event.get("attempt")

    def describe(self, t0: float) -> str:
        at = self.created_at.timestamp() - t0
        extra = f" attempt={self.attempt}" if self.attempt is not None else ""
        return (
            f"#{self.sequence:<3} {self.type:<20} {self.activity or '-':<16}{extra} at {at:+.3f}s"
        )


@dataclass(frozen=True)
class ExecutionRow:
    id: str
    workflow_name: str
    status: str
    result: Any
    error: Any
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    wake_at: dt.datetime | None
    updated_at: dt.datetime | None

    def describe(self, t0: float) -> str:
        def rel(when: dt.datetime | None) -> str:
            return "NULL" if when is None else f"{when.timestamp() - t0:+.3f}s"

        return (
            f"status={self.status} lease_owner={self.lease_owner or 'NULL'} "
            f"lease_expires_at={rel(self.lease_expires_at)} wake_at={rel(self.wake_at)} "
            f"updated_at={rel(self.updated_at)}"
        )


def load_database(
    engine: Engine, workflow_names: Iterable[str]
) -> tuple[dict[str, ExecutionRow], dict[str, list[HistoryRow]]]:
    """The runs of these workflows and their history, read with plain SQL."""
    names = sorted(set(workflow_names))
    params = {f"n{i}": n for i, n in enumerate(names)}
    in_list = ", ".join(f":n{i}" for i in range(len(names)))
    executions: dict[str, ExecutionRow] = {}
    history: dict[str, list[HistoryRow]] = defaultdict(list)
    with engine.connect() as conn:
        for r in conn.execute(
            text(
                "SELECT id, workflow_name, status, result, error, lease_owner, lease_expires_at,"
                f" wake_at, updated_at FROM wf_executions WHERE workflow_name IN ({in_list})"
            ),
            params,
        ):
            executions[r.id] = ExecutionRow(
                r.id,
                r.workflow_name,
                r.status,
                as_json(r.result),
                as_json(r.error),
                r.lease_owner,
                as_utc(r.lease_expires_at),
                as_utc(r.wake_at),
                as_utc(r.updated_at),
            )
        for r in conn.execute(
            text(
                "SELECT h.execution_id, h.sequence, h.type, h.activity_name, h.created_at,"
                " h.event FROM wf_history h JOIN wf_executions e ON e.id = h.execution_id"
                f" WHERE e.workflow_name IN ({in_list}) ORDER BY h.execution_id, h.sequence"
            ),
            params,
        ):
            created = as_utc(r.created_at)
            assert created is not None
            history[r.execution_id].append(
                HistoryRow(
                    r.execution_id,
                    int(r.sequence),
                    r.type,
                    r.activity_name,
                    created,
                    dict(as_json(r.event)),
                )
            )
    return executions, dict(history)


@dataclass
class StepExecution:
    """One execution of a step body, from the ledger: start (and end, unless it died)."""

    execution_id: str
    activity: str
    pid: int
    start: float
    visible: Any
    end: float | None = None
    raised: bool = False
    #: When the body was entered, before it asked the database whether the step's
    #: completion was already committed (``start`` is after that question).
    entered: float | None = None
    #: When the driver last found its lease good before calling the step (its own word,
    #: taken before the finding); ``None`` if it did not say.
    checked: float | None = None

    def describe(self, t0: float) -> str:
        end = "no end" if self.end is None else f"end {self.end - t0:+.3f}s"
        flags = " raised" if self.raised else ""
        seen = "" if self.visible is False else f" completion-visible-at-start={self.visible}"
        checked = "" if self.checked is None else f", lease checked {self.checked - t0:+.3f}s"
        return f"pid {self.pid}: start {self.start - t0:+.3f}s, {end}{flags}{seen}{checked}"


def load_ledger(directory: Path) -> list[StepExecution]:
    """Every step execution the ledger files record, start paired with end by token."""
    by_token: dict[str, StepExecution] = {}
    ends: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("k") == "start":
                by_token[rec["tok"]] = StepExecution(
                    rec["eid"],
                    rec["act"],
                    int(rec["pid"]),
                    float(rec["t"]),
                    rec.get("visible"),
                    entered=float(rec.get("entered", rec["t"])),
                    checked=None if rec.get("checked") is None else float(rec["checked"]),
                )
            elif rec.get("k") == "end":
                ends[rec["tok"]] = rec
    for token, rec in ends.items():
        found = by_token.get(token)
        if found is not None:
            found.end = float(rec["t"])
            found.raised = bool(rec.get("raised"))
    return sorted(by_token.values(), key=lambda e: e.start)


@dataclass(frozen=True)
class FaultEvent:
    t: float
    kind: str
    target: str
    pid: int | None = None
    detail: str = ""


@dataclass
class FaultLog:
    """What was done to which process (or to the database), and when."""

    events: list[FaultEvent] = field(default_factory=list)
    #: pid -> [start, end] intervals during which the process was stopped.
    stops: dict[int, list[list[float]]] = field(default_factory=lambda: defaultdict(list))
    kills: dict[int, float] = field(default_factory=dict)
    #: Database outages (restarts, terminated backends): [start, end, label].
    outages: list[tuple[float, float, str]] = field(default_factory=list)

    def record(self, t: float, kind: str, target: str, pid: int | None, detail: str = "") -> None:
        self.events.append(FaultEvent(t, kind, target, pid, detail))

    def stopped(self, t: float, target: str, pid: int) -> None:
        self.stops[pid].append([t, math.inf])
        self.record(t, "sigstop", target, pid)

    def continued(self, t: float, pid: int) -> None:
        if self.stops.get(pid) and self.stops[pid][-1][1] == math.inf:
            self.stops[pid][-1][1] = t

    def dump(self, path: Path, t0: float) -> None:
        """Write the faults (times relative to ``t0``) as JSON, next to the logs."""
        doc = {
            "t0": t0,
            "events": [
                {"t": round(e.t - t0, 4), "kind": e.kind, "target": e.target, "pid": e.pid}
                for e in self.events
            ],
            "stops": {
                str(pid): [[round(a - t0, 4), round(b - t0, 4)] for a, b in spans]
                for pid, spans in self.stops.items()
            },
            "kills": {str(pid): round(t - t0, 4) for pid, t in self.kills.items()},
            "outages": [
                [round(a - t0, 4), round(b - t0, 4), label] for a, b, label in self.outages
            ],
        }
        path.write_text(json.dumps(doc, indent=1))

    def killed(self, t: float, target: str, pid: int, was_stopped: bool) -> None:
        self.kills[pid] = t
        self.continued(t, pid)
        self.record(t, "sigkill-stopped" if was_stopped else "sigkill", target, pid)

    def outage(self, start: float, end: float, label: str, grace: float = 0.0) -> None:
        """The database was out from ``start`` to ``end``. Connections it dropped fail when
        next used, up to ``grace`` seconds later: that time counts as disturbed too."""
        self.outages.append((start, end + grace, label))
        self.record(start, label, "database", None, f"{end - start:.2f}s")

    def counts(self) -> Counter[str]:
        return Counter(e.kind for e in self.events)

    @property
    def total(self) -> int:
        return len(self.events)

    def disturbance(self, pid: int, start: float, end: float) -> str | None:
        """Why a process may have lost its lease between ``start`` and ``end``, if it did."""
        for s, e in self.stops.get(pid, []):
            if s <= end and e >= start:
                return "stopped"
        killed = self.kills.get(pid)
        if killed is not None and start <= killed <= end + 1e-3:
            return "killed"
        for s, e, label in self.outages:
            if s <= end and e >= start:
                return label
        return None

    def stopped_between(self, pid: int, start: float, end: float) -> bool:
        """Whether the process was paused at some point between ``start`` and ``end``."""
        return any(s <= end and e >= start for s, e in self.stops.get(pid, []))

    def stop_began_between(self, pid: int, start: float, end: float) -> bool:
        """Whether a pause of the process began between ``start`` and ``end`` (one that
        began earlier and ended in the window does not count)."""
        return any(start <= s <= end for s, _ in self.stops.get(pid, []))

    def any_between(self, start: float, end: float) -> bool:
        """Whether any fault at all (on any process, or the database) touched the window."""
        if any(s <= end and e >= start for spans in self.stops.values() for s, e in spans):
            return True
        if any(start <= t <= end for t in self.kills.values()):
            return True
        return any(s <= end and e >= start for s, e, _ in self.outages)

    def end_of(self, execution: StepExecution) -> float:
        """When a step execution stopped running: its end, else its process's death."""
        if execution.end is not None:
            return execution.end
        return self.kills.get(execution.pid, math.inf)

    def history_of(self, pid: int, t0: float) -> str:
        """What was done to one process: its stops (start..end) and its kill."""
        parts = []
        for a, b in self.stops.get(pid, []):
            until = "(never continued)" if b == math.inf else f"{b - t0:+.3f}s"
            parts.append(f"stopped {a - t0:+.3f}s..{until}")
        if pid in self.kills:
            parts.append(f"killed {self.kills[pid] - t0:+.3f}s")
        return f"pid {pid}: " + (", ".join(parts) if parts else "never stopped or killed")

    def around(self, t: float, window: float, t0: float) -> str:
        near = [e for e in self.events if abs(e.t - t) <= window]
        return ", ".join(f"{e.kind} {e.target} pid {e.pid} at {e.t - t0:+.3f}s" for e in near)


class Findings:
    """Violations per invariant (counted, first examples kept) and notes."""

    def __init__(self, keep: int = 6) -> None:
        self.keep = keep
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.note_counts: Counter[str] = Counter()
        self.note_examples: dict[str, list[str]] = defaultdict(list)

    def violation(self, invariant: str, example: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.counts[invariant] += 1
        if len(self.examples[invariant]) < self.keep:
            self.examples[invariant].append(example)

    def note(self, name: str, example: str) -> None:
        self.note_counts[name] += 1
        if len(self.note_examples[name]) < self.keep:
            self.note_examples[name].append(example)


@dataclass
class Report:
    title: str
    findings: Findings
    stats: dict[str, Any] = field(default_factory=dict)
    logs: str = ""

    @property
    def ok(self) -> bool:
        return not self.findings.counts

    def summary(self) -> dict[str, int]:
        return dict(self.findings.counts)

    def verdict(self) -> str:
        """The violations in a few lines: printed last in a failure's message, so they
        survive when only the tail of a long message is kept."""
        f = self.findings
        lines = [f"VERDICT {self.title}"]
        for name, count in f.counts.most_common():
            first = f.examples[name][0].splitlines()[0][:300] if f.examples[name] else ""
            lines.append(f"  [{name}] x{count}: {first}")
        return "\n".join(lines)

    def format(self, with_logs: bool = False) -> str:
        f = self.findings
        lines = [self.title]
        lines += [f"  {k}: {v}" for k, v in self.stats.items()]
        if not f.counts:
            lines.append("  invariants: all held")
        else:
            lines.append("VIOLATIONS")
            for name, count in f.counts.most_common():
                lines.append(f"  [{name}] {INVARIANTS[name]}: {count} violation(s)")
                for example in f.examples[name]:
                    lines.append("    - " + example.replace("\n", "\n      "))
        if f.note_counts:
            lines.append("NOTES")
            for name, count in f.note_counts.most_common():
                lines.append(f"  [{name}]: {count}")
                for example in f.note_examples[name]:
                    lines.append("    - " + example.replace("\n", "\n      "))
        if with_logs and self.logs:
            lines.append("WORKER OUTPUT (tails)")
            lines.append(self.logs)
        return "\n".join(lines)


def history_text(rows: list[HistoryRow], t0: float, activity: str | None = None) -> str:
    chosen = [r for r in rows if activity is None or r.activity in (activity, None)]
    if len(chosen) > 24:
        chosen = chosen[:6] + chosen[-18:]
    return "history:\n" + "\n".join("  " + r.describe(t0) for r in chosen)


def ledger_text(executions: list[StepExecution], t0: float) -> str:
    return "ledger:\n" + "\n".join("  " + e.describe(t0) for e in executions)


def check_history(findings: Findings, history: Mapping[str, list[HistoryRow]], t0: float) -> None:
    """Sequences 1..n, nothing recorded twice, nothing after the outcome."""
    for eid, rows in history.items():
        seqs = [r.sequence for r in rows]
        if seqs != list(range(1, len(seqs) + 1)):
            missing = sorted(set(range(1, max(seqs) + 1)) - set(seqs)) if seqs else []
            findings.violation(
                "history.sequence",
                f"run {eid}: sequences {seqs[:3]}..{seqs[-3:]} (n={len(seqs)}), "
                f"missing {missing[:10]}",
            )
        once: Counter[tuple[str, str | None]] = Counter()
        per_attempt: Counter[tuple[str, str | None, Any]] = Counter()
        for r in rows:
            if r.type in _ONCE:
                once[(r.type, r.activity)] += 1
            elif r.type in _ONCE_PER_ATTEMPT:
                per_attempt[(r.type, r.activity, r.attempt)] += 1
        dupes = [f"{t} {a or ''} x{n}" for (t, a), n in once.items() if n > 1]
        dupes += [f"{t} {a} attempt {k} x{n}" for (t, a, k), n in per_attempt.items() if n > 1]
        if dupes:
            activity = next((a for (t, a), n in once.items() if n > 1 and a is not None), None)
            findings.violation(
                "history.duplicate-event",
                f"run {eid}: {', '.join(sorted(dupes))}\n{history_text(rows, t0, activity)}",
            )
        ends = [r.sequence for r in rows if r.type in ("workflow.completed", "workflow.failed")]
        if ends:
            late = [r for r in rows if r.sequence > ends[0]]
            if late:
                findings.violation(
                    "history.after-outcome",
                    f"run {eid}: {len(late)} event(s) after the outcome at #{ends[0]}: "
                    + ", ".join(f"#{r.sequence} {r.type}" for r in late[:5])
                    + f"\n{history_text(rows, t0)}",
                )


def check_leases(findings: Findings, executions: Mapping[str, ExecutionRow], t0: float) -> None:
    for row in executions.values():
        if row.status in TERMINAL and (
            row.lease_owner is not None or row.lease_expires_at is not None
        ):
            findings.violation("lease.on-finished-run", f"run {row.id}: {row.describe(t0)}")


def check_steps(
    findings: Findings,
    ledger: list[StepExecution],
    history: Mapping[str, list[HistoryRow]],
    faults: FaultLog,
    t0: float,
) -> dict[str, int]:
    """The ledger against history and the faults: no re-run after a committed completion, no
    unexplained concurrent execution, no completion without an execution."""
    by_activity: dict[tuple[str, str], list[StepExecution]] = defaultdict(list)
    for e in ledger:
        by_activity[(e.execution_id, e.activity)].append(e)

    def context(eid: str, act: str) -> str:
        return (
            f"{history_text(history.get(eid, []), t0, act)}\n"
            f"{ledger_text(by_activity[(eid, act)], t0)}"
        )

    unchecked = 0
    for e in ledger:
        entered = e.start if e.entered is None else e.entered
        if e.visible is True and faults.stopped_between(e.pid, entered, e.start):
            # The step's code was already running when its process was paused; the pause
            # outlived the lease and another worker recorded the step meanwhile: a step in
            # flight at a fault runs again (at-least-once), its late result is fenced off.
            findings.note(
                "step in flight when its process was paused re-ran elsewhere (at-least-once)",
                f"run {e.execution_id} {e.activity} pid {e.pid}: entered "
                f"{entered - t0:+.3f}s, {faults.history_of(e.pid, t0)}",
            )
        elif (
            e.visible is True
            and e.checked is not None
            and faults.stop_began_between(e.pid, e.checked, entered)
        ):
            # Paused in the instant between the driver's last lease check and the step's
            # call, past the lease (README, "At-least-once for the step in flight"): no
            # lease stops a process that is not running. A pause that began before the
            # check (while its answer was on its way, say) does not get here, though its
            # SIGCONT may be logged after the check: the check must then ask again.
            findings.note(
                "step called after its process was paused between the lease check and the "
                "call (at-least-once)",
                f"run {e.execution_id} {e.activity} pid {e.pid}: lease checked "
                f"{e.checked - t0:+.3f}s, entered {entered - t0:+.3f}s, "
                f"{faults.history_of(e.pid, t0)}",
            )
        elif e.visible is True:
            mine = [x for x in ledger if x.execution_id == e.execution_id and x.pid == e.pid]
            findings.violation(
                "step.rerun-after-commit",
                f"run {e.execution_id} {e.activity}: started in pid {e.pid} at "
                f"{e.start - t0:+.3f}s although its step.completed was already committed; "
                f"{faults.history_of(e.pid, t0)}\n"
                f"{history_text(history.get(e.execution_id, []), t0)}\n"
                f"{ledger_text(by_activity[(e.execution_id, e.activity)], t0)}\n"
                f"steps of this run in pid {e.pid}:\n"
                + "\n".join(f"  {x.activity}: {x.describe(t0)}" for x in mine),
            )
        elif e.visible is not False:
            unchecked += 1
            if unchecked <= 3:
                findings.note(
                    "step start not checked (database unreachable)",
                    f"run {e.execution_id} {e.activity} pid {e.pid}: {e.visible}",
                )
    reruns = explained = 0
    for (eid, act), runs in by_activity.items():
        for i, first in enumerate(runs):
            first_end = faults.end_of(first)
            for second in runs[i + 1 :]:
                if second.start >= first_end:
                    continue
                # From a moment before each start: a process frozen between its driver's
                # last lease check and the step's call (README, "At-least-once for the step
                # in flight") enters the step the instant it is thawed.
                a = faults.disturbance(first.pid, first.start - THAW_GRACE, first_end)
                b = faults.disturbance(second.pid, second.start - THAW_GRACE, faults.end_of(second))
                if a is None and b is None:
                    findings.violation(
                        "step.concurrent-without-fault",
                        f"run {eid} {act}: pid {first.pid} and pid {second.pid} ran it at "
                        f"the same time, neither stopped nor killed meanwhile; "
                        f"{faults.history_of(first.pid, t0)}; "
                        f"{faults.history_of(second.pid, t0)}; faults nearby: "
                        f"{faults.around(second.start, 3.0, t0) or 'none'}\n" + context(eid, act),
                    )
        for before, after in itertools.pairwise(runs):
            reruns += 1
            why = "raised" if before.raised else None
            why = why or faults.disturbance(before.pid, before.start, after.start)
            if why is not None:
                explained += 1
            elif faults.any_between(before.start, after.start):
                findings.note(
                    "step re-ran although its first executor was neither stopped nor killed "
                    "(its lease expired while other processes were faulted)",
                    f"run {eid} {act}: faults nearby: "
                    f"{faults.around(after.start, 5.0, t0) or 'none'}\n" + context(eid, act),
                )
            else:
                findings.violation(
                    "step.rerun-without-fault",
                    f"run {eid} {act}: ran again in pid {after.pid} at "
                    f"{after.start - t0:+.3f}s, no fault anywhere since its first execution "
                    f"began in pid {before.pid} at {before.start - t0:+.3f}s\n" + context(eid, act),
                )
    for eid, rows in history.items():
        for r in rows:
            if r.type == "step.completed" and r.activity and not by_activity.get((eid, r.activity)):
                findings.violation(
                    "step.completed-without-execution",
                    f"run {eid} {r.activity}: completion #{r.sequence} recorded, the ledger "
                    f"has no execution\n{history_text(rows, t0, r.activity)}",
                )
    return {
        "executions": len(ledger),
        "activities": len(by_activity),
        "reruns": reruns,
        "reruns_explained": explained,
        "unchecked_starts": unchecked,
    }


def check_outcomes(
    findings: Findings,
    expected: Mapping[str, Any],
    executions: Mapping[str, ExecutionRow],
    history: Mapping[str, list[HistoryRow]],
    unfinished_at_deadline: set[str],
    t0: float,
) -> None:
    """Every run completed with the expected result; none stuck."""
    for eid, want in expected.items():
        row = executions.get(eid)
        if row is None:
            findings.violation("run.result", f"run {eid}: missing from wf_executions")
            continue
        rows = history.get(eid, [])
        if eid in unfinished_at_deadline and row.status not in TERMINAL:
            findings.violation(
                "run.stuck",
                f"run {eid}: {row.describe(t0)}\n{history_text(rows[-8:], t0)}",
            )
            continue
        if row.status != "completed":
            findings.violation(
                "run.result",
                f"run {eid}: status {row.status}, error {json.dumps(row.error)[:300]}\n"
                f"{history_text(rows, t0)}",
            )
        elif row.result != want:
            findings.violation(
                "run.result",
                f"run {eid}: result {json.dumps(row.result)[:200]} != expected "
                f"{json.dumps(want)[:200]}",
            )
