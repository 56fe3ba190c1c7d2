"""Racing processes on every backend, each round started by a handshake (go-files), never by
a sleep: idempotent starts, concurrent signal deliveries, concurrent cancels, and a cancel
racing the run's completion."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

import wf_persist as wp

from .chaos import plain_engine
from .conftest import Race
from .procs import Processes, wait_ready, worker_argv
from .workflows import ALL, LEDGER_ENV, URL_ENV, Gate, race_gate_wf, race_wait_wf

RACERS = 3
ROUNDS = 8
#: Delays (ms after the go) the racers but the first take, round by round.
SWEEP_MS = (0, 1, 2, 4, 8, 16, 32)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    found = plain_engine(db_url)
    yield found
    found.dispose()


@pytest.fixture
def rt(db_url: str) -> Iterator[wp.Runtime]:
    runtime = wp.Runtime(db_url, lease_ttl=1.5)
    runtime.register(*ALL)
    yield runtime
    runtime.close()


def _events(engine: Engine, execution_id: str) -> list[tuple[int, str, str | None]]:
    with engine.connect() as conn:
        return [
            (int(r.sequence), r.type, r.activity_name)
            for r in conn.execute(
                text(
                    "SELECT sequence, type, activity_name FROM wf_history"
                    " WHERE execution_id = :e ORDER BY sequence"
                ),
                {"e": execution_id},
            )
        ]


def _park(rt: wp.Runtime, execution_id: str, timeout: float = 30) -> None:
    """Drive a run in this process until it waits for its signal."""
    client = rt.client()
    deadline = time.monotonic() + timeout
    while not client.pending_signals(execution_id):
        assert time.monotonic() < deadline, f"{execution_id} never reached its wait"
        rt.drive(execution_id)
        time.sleep(0.005)


def _report(title: str, problems: list[str], tally: Counter[str]) -> str:
    lines = [f"{title}: {len(problems)} violation(s); outcomes {dict(tally)}"]
    return "\n".join(lines + [f"  - {p}" for p in problems])


Problems = tuple[list[str], Counter[str]]


def _check_starts(
    engine: Engine, keys: list[str], rounds: dict[int, list[dict[str, Any]]]
) -> Problems:
    problems: list[str] = []
    tally: Counter[str] = Counter()
    for r, key in enumerate(keys):
        outcomes = rounds[r]
        tally.update(o["outcome"] for o in outcomes)
        ids = {o.get("id") for o in outcomes}
        created = [o for o in outcomes if o.get("created")]
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT id FROM wf_executions WHERE idempotency_key = :k"), {"k": key}
            ).all()
        if len(ids) != 1 or None in ids or len(created) != 1 or len(rows) != 1:
            problems.append(
                f"key {key}: ids returned {sorted(map(str, ids))}, {len(created)} reported "
                f"created, {len(rows)} row(s) stored; {outcomes}"
            )
            continue
        events = _events(engine, rows[0].id)
        if [t for _, t, _ in events] != ["execution.started"]:
            problems.append(f"key {key}: run {rows[0].id} history {events}")
    return problems, tally


def _check_signals(
    engine: Engine,
    client: wp.WorkflowClient,
    runs: list[str],
    first: int,
    rounds: dict[int, list[dict[str, Any]]],
) -> Problems:
    problems: list[str] = []
    tally: Counter[str] = Counter()
    for i, execution_id in enumerate(runs):
        outcomes = rounds[first + i]
        tally.update(o["outcome"] for o in outcomes)
        winners = [o["name"] for o in outcomes if o["outcome"] == "ok"]
        delivered = [e for e in _events(engine, execution_id) if e[1] == "signal.delivered"]
        if len(winners) != 1 or len(delivered) != 1:
            problems.append(
                f"run {execution_id}: {len(winners)} deliveries succeeded, {len(delivered)} "
                f"signal.delivered recorded; {outcomes}"
            )
        began = min(o["t"] for o in outcomes)
        for lost in outcomes:
            if lost["outcome"] not in ("ok", "SignalAlreadyDeliveredError"):
                problems.append(
                    f"run {execution_id}: a losing delivery ({lost['name']}, called "
                    f"{(lost['t'] - began) * 1000:.1f} ms after the first) got "
                    f"{lost['outcome']}: {lost['message']!r}, not SignalAlreadyDeliveredError"
                )
        outcome = client.result(execution_id, timeout=30)
        if len(winners) == 1 and outcome.unwrap() != winners[0]:
            problems.append(f"run {execution_id}: received {outcome.unwrap()!r}, winner {winners}")
    return problems, tally


def _check_cancels(
    engine: Engine,
    client: wp.WorkflowClient,
    runs: list[str],
    kinds: list[str],
    first: int,
    rounds: dict[int, list[dict[str, Any]]],
) -> Problems:
    problems: list[str] = []
    tally: Counter[str] = Counter()
    for i, execution_id in enumerate(runs):
        outcomes = rounds[first + i]
        tally.update(o["outcome"] for o in outcomes)
        won = [o for o in outcomes if o["outcome"] == "ok"]
        cancelled = [e for e in _events(engine, execution_id) if e[1] == "execution.cancelled"]
        if len(won) != 1 or len(cancelled) != 1:
            problems.append(
                f"run {execution_id} ({kinds[i]}): {len(won)} cancels succeeded, "
                f"{len(cancelled)} execution.cancelled recorded; {outcomes}"
            )
        for o in outcomes:
            if o["outcome"] not in ("ok", "CannotCancelError"):
                problems.append(
                    f"run {execution_id} ({kinds[i]}): a losing cancel got {o['outcome']}: "
                    f"{o['message']!r}, not CannotCancelError"
                )
        outcome = client.result(execution_id, timeout=30)
        if not (isinstance(outcome, wp.Failed) and outcome.error_type == "Cancelled"):
            problems.append(f"run {execution_id}: ended {outcome}, not Cancelled")
    return problems, tally


@pytest.mark.timeout(240)
def test_racing_processes(
    race: Race, rt: wp.Runtime, engine: Engine, subtests: pytest.Subtests
) -> None:
    """RACERS processes, each round released by one go-file once all are ready:

    * idempotent start: all start ``race-echo`` with one key: one run, one creator, and
      every caller gets its id;
    * signal delivery: all signal one parked wait: exactly one delivery is recorded and
      succeeds, every loser gets SignalAlreadyDeliveredError (also one that asks a few ms
      after the winner committed: the wait is delivered, not gone), the run receives the
      winner's payload;
    * cancel: all cancel one parked run (with and without compensation): exactly one
      ``execution.cancelled``, the others get CannotCancelError, the run ends Cancelled.
    """
    client = rt.client()
    keys = [f"race-{uuid.uuid4().hex[:8]}-{r}" for r in range(ROUNDS)]
    to_signal = [client.start(race_wait_wf).execution_id for _ in range(ROUNDS)]
    to_cancel = [client.start(race_wait_wf).execution_id for _ in range(ROUNDS)]
    for execution_id in to_signal + to_cancel:
        _park(rt, execution_id)
    kinds = ["cancel" if r % 2 == 0 else "cancel-abrupt" for r in range(ROUNDS)]
    targets = [f"start:{k}" for k in keys] + [f"signal:{e}" for e in to_signal]
    targets += [f"{k}:{e}" for k, e in zip(kinds, to_cancel, strict=True)]
    for i in range(RACERS):
        # Racer 0 goes at the go; the others a few ms later, a different delay each round,
        # sweeping the interleavings from "all at once" to "just after the winner".
        delays = [
            0 if i == 0 else SWEEP_MS[(i * r + i) % len(SWEEP_MS)] for r in range(len(targets))
        ]
        specs = [f"{t}@{d}" for t, d in zip(targets, delays, strict=True)]
        race.racer(f"racer{i}", "start", specs)
    for r in range(len(targets)):
        race.run_round(r)
    rounds = race.results()
    checks: dict[str, Callable[[], Problems]] = {
        "idempotent start": lambda: _check_starts(engine, keys, rounds),
        "signal delivery": lambda: _check_signals(engine, client, to_signal, ROUNDS, rounds),
        "cancel": lambda: _check_cancels(engine, client, to_cancel, kinds, 2 * ROUNDS, rounds),
    }
    for name, check in checks.items():
        with subtests.test(msg=name):
            problems, tally = check()
            print(f"racing {name}: outcomes {dict(tally)}")
            assert not problems, _report(f"racing {name}", problems, tally)


def _cancel_vs_completion_problems(
    engine: Engine, execution_id: str, attempt: dict[str, Any], final: wp.Outcome, r: int
) -> list[str]:
    events = _events(engine, execution_id)
    types = [t for _, t, _ in events]
    where = f"round {r} ({attempt.get('kind')}, cancel {attempt['outcome']}) run {execution_id}"
    history = " ".join(f"#{s}:{t}" for s, t, _ in events)
    found = []
    terminal = [t for t in types if t in ("workflow.completed", "workflow.failed")]
    if len(terminal) > 1 or ("workflow.completed" in types and "execution.cancelled" in types):
        found.append(f"{where}: completed and cancelled both recorded: {history}")
    if "workflow.completed" in types:
        done = types.index("workflow.completed")
        late = [
            t for t in types[done + 1 :] if t in ("execution.cancelled", "cancellation.received")
        ]
        if late:
            found.append(f"{where}: {late} recorded after workflow.completed: {history}")
    if attempt["outcome"] == "ok":
        if not (isinstance(final, wp.Failed) and final.error_type == "Cancelled"):
            found.append(f"{where}: the cancel was accepted but the run ended {final}: {history}")
    elif attempt["outcome"] == "CannotCancelError":
        if not isinstance(final, wp.Completed):
            found.append(f"{where}: the cancel was refused but the run ended {final}: {history}")
    else:
        found.append(f"{where}: the cancel raised {attempt['outcome']}: {attempt['message']}")
    return found


@pytest.mark.timeout(240)
def test_cancel_racing_completion(
    race: Race, rt: wp.Runtime, engine: Engine, procs: Processes, db_url: str, tmp_path: Path
):
    """A worker process finishes a run the moment a go-file appears, while another process
    cancels it at that moment (delays swept over a few ms): the run ends either completed
    (the cancel refused) or failed with Cancelled (the cancel accepted), never both, and no
    cancellation is recorded after workflow.completed."""
    rounds = 12
    client = rt.client()
    directory = str(race.directory)
    runs = [
        client.start(race_gate_wf, Gate(directory=directory, round=r)).execution_id
        for r in range(rounds)
    ]
    env = {
        **os.environ,
        URL_ENV: db_url,
        LEDGER_ENV: "",
        "WF_FAULTS_LEASE_TTL": "1.5",
        "WF_FAULTS_POLL_INTERVAL": "0.05",
    }
    worker = procs.spawn("worker", worker_argv("tests.faults.app:runtime", rounds), env)
    wait_ready([worker])
    kinds = ["cancel" if r % 2 == 0 else "cancel-abrupt" for r in range(rounds)]
    delays = [r // 2 for r in range(rounds)]  # 0..5 ms after the go, each kind
    race.racer(
        "canceller",
        "cancel",
        [f"{k}:{eid}@{d}" for k, eid, d in zip(kinds, runs, delays, strict=True)],
    )
    for r in range(rounds):
        race.run_round(r, also=[f"at-gate-{r}"])
    attempts = race.results()
    problems: list[str] = []
    tally: Counter[str] = Counter()
    for r, execution_id in enumerate(runs):
        final = client.result(execution_id, timeout=60)
        attempt = {**attempts[r][0], "kind": kinds[r]}
        tally[f"{kinds[r]} {attempt['outcome']} -> {final.status}"] += 1
        problems += _cancel_vs_completion_problems(engine, execution_id, attempt, final, r)
        info = client.describe(execution_id)
        with engine.connect() as conn:
            lease = conn.execute(
                text("SELECT lease_owner, lease_expires_at FROM wf_executions WHERE id = :e"),
                {"e": execution_id},
            ).one()
        if lease.lease_owner is not None or lease.lease_expires_at is not None:
            problems.append(f"round {r}: finished run {execution_id} ({info.status}) keeps {lease}")
    assert not problems, (
        _report("cancel racing completion", problems, tally) + "\n" + worker.describe()
    )
    print(json.dumps(dict(tally)))
