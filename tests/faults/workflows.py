"""Workflows of the fault-injection suite, importable by worker and racer processes.

Every chaos step appends to an external *ledger* when it starts and when it ends: one
append-only JSON-lines file per process in ``$WF_FAULTS_LEDGER`` (nothing in the wf_ tables).
At its start a step also asks the database, on a connection of its own and with plain SQL,
whether its completion is already recorded: a step that finds it was started after its result
was committed, which durable execution promises never happens.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

import wf_persist as wp
from wf_persist.lease_checks import lease_checked_at

LEDGER_ENV = "WF_FAULTS_LEDGER"
URL_ENV = "WF_PERSIST_DATABASE_URL"

_COMPLETED_SQL = text(
    "SELECT 1 FROM wf_history WHERE execution_id = :eid AND activity_name = :act"
    " AND type = 'step.completed'"
)
_FAILED_SQL = text(
    "SELECT count(*) FROM wf_history WHERE execution_id = :eid AND activity_name = :act"
    " AND type = 'step.failed'"
)

_lock = threading.Lock()
_ledger: dict[str, Any] = {"pid": None, "fd": None}
_probe: dict[str, Any] = {"pid": None, "engine": None}


def ledger_write(record: dict[str, Any]) -> None:
    """Append one record to this process's ledger file (one ``write``: never torn)."""
    directory = os.environ.get(LEDGER_ENV)
    if not directory:
        return
    with _lock:
        if _ledger["pid"] != os.getpid():
            path = Path(directory) / f"{os.getpid()}.jsonl"
            _ledger["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _ledger["pid"] = os.getpid()
        fd = _ledger["fd"]
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


def probe_engine() -> Engine:
    """This process's own engine for the steps' checks (not the runtime's)."""
    with _lock:
        if _probe["pid"] != os.getpid():
            url = make_url(os.environ[URL_ENV])
            if url.get_backend_name() == "sqlite":
                engine = create_engine(
                    url, isolation_level="AUTOCOMMIT", connect_args={"timeout": 30}
                )
            else:
                timeout = {"connect_timeout": 5}
                engine = create_engine(
                    url,
                    isolation_level="AUTOCOMMIT",
                    pool_pre_ping=True,
                    pool_size=2,
                    max_overflow=30,
                    connect_args=timeout,
                )
            _probe["engine"], _probe["pid"] = engine, os.getpid()
        found: Engine = _probe["engine"]
        return found


def completion_recorded(execution_id: str, activity: str) -> bool | str:
    """Whether the step's ``step.completed`` is committed; the error text if the database
    could not say (it is down, say)."""
    try:
        with probe_engine().connect() as conn:
            row = conn.execute(_COMPLETED_SQL, {"eid": execution_id, "act": activity}).first()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row is not None


def failures_recorded(execution_id: str, activity: str) -> int | None:
    try:
        with probe_engine().connect() as conn:
            found = conn.execute(_FAILED_SQL, {"eid": execution_id, "act": activity}).scalar()
    except Exception:
        return None
    return int(found or 0)


def _begin(execution_id: str, activity: str) -> str:
    checked = lease_checked_at()  # the word this call was made on
    entered = time.time()  # before the probe: a pause during it found the step in flight
    token = uuid.uuid4().hex[:12]
    visible = completion_recorded(execution_id, activity)
    ledger_write(
        {
            "k": "start",
            "entered": entered,
            "checked": checked,
            "t": time.time(),
            "pid": os.getpid(),
            "eid": execution_id,
            "act": activity,
            "tok": token,
            "visible": visible,
        }
    )
    return token


def _end(token: str, execution_id: str, activity: str, *, raised: bool = False) -> None:
    ledger_write(
        {
            "k": "end",
            "t": time.time(),
            "pid": os.getpid(),
            "eid": execution_id,
            "act": activity,
            "tok": token,
            "raised": raised,
        }
    )


def wait_for_file(path: Path, timeout: float = 60.0, interval: float = 0.0005) -> None:
    """Poll for a handshake file; raise if it does not appear in time."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(interval)


def step_value(index: int, value: int) -> int:
    return (value * 7919 + index * 104729) % 1_000_003


def flaky_value(value: int) -> int:
    return value * 3 + 1


class FlakyError(Exception):
    """The first attempt of ``chaos_flaky`` fails; a retry succeeds."""


@wp.step
def chaos_step(execution_id: str, activity: str, index: int, value: int, sleep_ms: int) -> int:
    token = _begin(execution_id, activity)
    time.sleep(sleep_ms / 1000)
    _end(token, execution_id, activity)
    return step_value(index, value)


@wp.step(retry=wp.Retry(attempts=8, backoff="exponential", base=0.05, factor=2, max_delay=0.4))
def chaos_flaky(execution_id: str, activity: str, value: int) -> int:
    token = _begin(execution_id, activity)
    if failures_recorded(execution_id, activity) == 0:
        _end(token, execution_id, activity, raised=True)
        raise FlakyError(f"{activity} fails until one failure is recorded")
    _end(token, execution_id, activity)
    return flaky_value(value)


class StepPlan(BaseModel):
    value: int
    sleep_ms: int


class ChaosPlan(BaseModel):
    """What one run does: its steps, and where a retried step and a durable sleep go."""

    seed: int
    steps: list[StepPlan]
    flaky_after: int | None = None
    nap_after: int | None = None
    nap_seconds: float = 0.0


@wp.workflow(name="chaos", version=1)
def chaos_wf(ctx: wp.Context, plan: ChaosPlan) -> dict[str, Any]:
    values: list[int] = []
    for i, s in enumerate(plan.steps):
        act = f"chaos_step#{i + 1}"
        values.append(ctx.run(chaos_step, ctx.execution_id, act, i, s.value, s.sleep_ms))
        if plan.flaky_after == i:
            values.append(ctx.run(chaos_flaky, ctx.execution_id, "chaos_flaky#1", s.value))
        if plan.nap_after == i:
            ctx.sleep(plan.nap_seconds, name="nap")
    return {"seed": plan.seed, "values": values, "total": sum(values)}


def expected_result(plan: ChaosPlan) -> dict[str, Any]:
    """The result ``chaos_wf`` must return: a function of its input alone."""
    values: list[int] = []
    for i, s in enumerate(plan.steps):
        values.append(step_value(i, s.value))
        if plan.flaky_after == i:
            values.append(flaky_value(s.value))
    return {"seed": plan.seed, "values": values, "total": sum(values)}


def expected_activities(plan: ChaosPlan) -> list[str]:
    acts = [f"chaos_step#{i + 1}" for i in range(len(plan.steps))]
    return acts + (["chaos_flaky#1"] if plan.flaky_after is not None else [])


# A driver stopped mid-step and continued later -----------------------------------------


class HoldPlan(BaseModel):
    token: str
    release: str
    nap: float


@wp.step
def held_step(execution_id: str, activity: str, token: str, release: str) -> int:
    """The first execution (whoever creates ``token``) holds until ``release`` exists;
    any later execution passes straight through."""
    began = _begin(execution_id, activity)
    try:
        os.close(os.open(token, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        first = True
    except FileExistsError:
        first = False
    if first:
        wait_for_file(Path(release), timeout=120)
    _end(began, execution_id, activity)
    return 1


@wp.workflow(name="stale-driver", version=1)
def stale_driver_wf(ctx: wp.Context, plan: HoldPlan) -> list[int]:
    held = ctx.run(held_step, ctx.execution_id, "held_step#1", plan.token, plan.release)
    first = ctx.run(chaos_step, ctx.execution_id, "chaos_step#1", 0, 11, 0)
    ctx.sleep(plan.nap, name="nap")
    second = ctx.run(chaos_step, ctx.execution_id, "chaos_step#2", 1, 12, 0)
    return [held, first, second]


# Racing processes --------------------------------------------------------------------------


@wp.workflow(name="race-echo", version=1)
def race_echo_wf(ctx: wp.Context, n: int) -> int:
    return n


class Ping(BaseModel):
    sender: str


@wp.workflow(name="race-wait", version=1)
def race_wait_wf(ctx: wp.Context) -> str:
    got = ctx.wait_for_signal("ping", Ping)
    assert isinstance(got, wp.Received)
    return got.value.sender


class Gate(BaseModel):
    directory: str
    round: int


@wp.step
def gate_step(directory: str, round: int) -> int:
    """Say it reached the gate, then wait for the go of its round."""
    (Path(directory) / f"at-gate-{round}").touch()
    wait_for_file(Path(directory) / f"go-{round}")
    return round


@wp.workflow(name="race-gate", version=1)
def race_gate_wf(ctx: wp.Context, gate: Gate) -> int:
    return ctx.run(gate_step, gate.directory, gate.round)


ALL: list[wp.Workflow[Any, Any]] = [
    chaos_wf,
    stale_driver_wf,
    race_echo_wf,
    race_wait_wf,
    race_gate_wf,
]
