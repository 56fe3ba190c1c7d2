"""Step concurrency limits and secrets (seed scenarios 49-56)."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

import wf_persist as wp
from wf_persist.store import slots as slot_store

from .fixtures import saga as s
from .helpers import Processes, history_types, wait_status, wait_until

SECRET_VALUE = "sk_live_0123456789abcdef-very-secret"


pytestmark = pytest.mark.usefixtures("saga_reset")


def _drain(client: wp.WorkflowClient, ids: list[str], timeout: float = 30) -> None:
    for execution_id in ids:
        wait_status(client, execution_id, "completed", timeout)


def test_limit_holds_for_concurrent_runs(runtime: wp.Runtime) -> None:  # 49
    runtime.register(*s.ALL)
    runtime.start_worker(concurrency=10, poll_interval=0.02)
    client = runtime.client()
    _drain(client, [client.start(s.limited_wf, i).execution_id for i in range(10)])
    assert s.MAX_IN_FLIGHT["limited"] == 2


def test_keyed_limit_is_per_key(runtime: wp.Runtime) -> None:  # 50
    runtime.register(*s.ALL)
    runtime.start_worker(concurrency=8, poll_interval=0.02)
    client = runtime.client()
    jobs = [{"tenant": t, "n": i} for i in range(4) for t in ("acme", "globex")]
    _drain(client, [client.start(s.per_tenant_wf, job).execution_id for job in jobs])
    assert s.MAX_IN_FLIGHT["tenant:acme"] == 1 and s.MAX_IN_FLIGHT["tenant:globex"] == 1
    assert s.MAX_IN_FLIGHT["total"] == 2


def queued_behind_the_limit(runtime: wp.Runtime, execution_id: str) -> None:
    """Wait until the run's attempt of ``exclusive`` started (its ``step.started`` is
    recorded at once: ``record_start_after=0``) but its function did not: it waits for the
    slot the holder has."""
    client = runtime.client()
    wait_until(
        lambda: "step.started" in history_types(client, execution_id),
        what="the queued run's attempt",
    )
    assert execution_id in runtime._driving and s.CALLS["exclusive:queued"] == 0


def holder_and_queued(runtime: wp.Runtime) -> tuple[wp.ExecutionHandle, wp.ExecutionHandle]:
    """A worker drives two runs of ``exclusive`` (a limit of one): the holder is inside
    the step, the other run's attempt waits for the slot (``record_start_after=0``)."""
    runtime.register(*s.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.02)
    client = runtime.client()
    holder = client.start(s.exclusive_wf, "holder")
    wait_until(lambda: s.CALLS["exclusive:holder"] > 0, what="the holder's step")
    queued = client.start(s.exclusive_wf, "queued")
    queued_behind_the_limit(runtime, queued.execution_id)
    return holder, queued


def test_cancelled_run_queued_behind_a_limit_never_starts(
    make_runtime: Callable[..., wp.Runtime],
) -> None:  # 51
    runtime = make_runtime(record_start_after=0)
    client = runtime.client()
    holder, queued = holder_and_queued(runtime)
    client.cancel(queued.execution_id, compensate=False)
    # Its driver notices while it waits for the slot, and gives up without the step.
    wait_until(lambda: queued.execution_id not in runtime._driving, what="the queued drive ends")
    assert client.status(queued.execution_id) == "failed"
    s.GATE.set()
    assert client.result(holder.execution_id, timeout=10).unwrap() == "holder"
    assert s.CALLS["exclusive:queued"] == 0
    assert client.status(queued.execution_id) == "failed"
    assert "step.completed" not in history_types(client, queued.execution_id)


@pytest.mark.parametrize("compensate", [False, True])
def test_a_run_cancelled_just_before_the_slot_frees_never_starts(
    make_runtime: Callable[..., wp.Runtime], compensate: bool
) -> None:
    """The cancel lands between the queued run's last look at its run (every 0.2 s while
    it waits) and the slot freeing: it took the slot and ran the step, after its run had
    been cancelled. Now a run that waited looks once more with the slot in hand."""
    runtime = make_runtime(record_start_after=0)
    client = runtime.client()
    holder, queued = holder_and_queued(runtime)
    time.sleep(0.3)  # a look or two while it waits
    client.cancel(queued.execution_id, compensate=compensate)
    s.GATE.set()  # the slot frees at once
    assert client.result(holder.execution_id, timeout=10).unwrap() == "holder"
    assert isinstance(client.result(queued.execution_id, timeout=30), wp.Failed)
    assert s.CALLS["exclusive:queued"] == 0
    assert "step.completed" not in history_types(client, queued.execution_id)


def test_limit_holds_across_worker_processes(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    runtime.register(*s.ALL)
    client = runtime.client()
    marks = tmp_path / "marks"
    workers = [procs.worker(db_url, "--concurrency", "4") for _ in range(2)]
    for proc in workers:  # both serve before there is work: the limit is tested across them
        proc.wait_for_stderr("serving")
    ids = [client.start(s.serialized_wf, str(marks)).execution_id for _ in range(12)]
    _drain(client, ids, timeout=120)
    for proc in workers:
        proc.send(signal.SIGTERM)
    assert [proc.wait() for proc in workers] == [0, 0]
    spans: dict[str, list[int]] = {}
    pids = set()
    for line in marks.read_text().splitlines():
        _kind, stamp, label, pid = line.split()
        spans.setdefault(label, []).append(int(stamp))
        pids.add(pid)
    intervals = sorted((v[0], v[1]) for v in spans.values())
    assert len(intervals) == 12
    assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(intervals))
    assert len(pids) == 2, "both worker processes ran the limited step"


def test_env_secret_resolver_rules(monkeypatch: pytest.MonkeyPatch) -> None:  # 52
    monkeypatch.setenv("X_BEARER_TOKEN", "t1")
    monkeypatch.setenv("CUSTOM_VAR", "t2")
    monkeypatch.delenv("MISSING_SECRET", raising=False)
    resolve = wp.env_secret_resolver(mapping={"custom": "CUSTOM_VAR"})
    assert resolve("x-bearer-token") == "t1"
    assert resolve("custom") == "t2"
    assert wp.env_secret_resolver(fallback="")("missing-secret") == ""
    with pytest.raises(
        wp.SecretError, match='Secret "missing-secret" not found: set env var MISSING_SECRET'
    ):
        resolve("missing-secret")
    assert wp.secret("stripe-key") == "secret:stripe-key"


def _raw_bytes(db_url: str, backend: str, tmp_path: Path) -> bytes:
    if backend == "sqlite":
        path = Path(make_url(db_url).database or "")
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
    url = make_url(db_url)
    if backend == "mysql":
        dump = subprocess.run(
            [
                "mysqldump",
                "-h",
                url.host or "127.0.0.1",
                "-P",
                str(url.port or 3306),
                "-u",
                url.username or "root",
                url.database or "",
            ],
            capture_output=True,
            check=True,
        )
        return dump.stdout
    dump = subprocess.run(
        [
            "pg_dump",
            "-h",
            url.host or "127.0.0.1",
            "-p",
            str(url.port or 5432),
            "-U",
            url.username or "postgres",
            url.database or "",
        ],
        capture_output=True,
        check=True,
    )
    return dump.stdout


def test_secrets_are_resolved_in_the_step_and_never_stored(
    make_runtime: object, db_url: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # 53, 54, 7
    monkeypatch.setenv("STRIPE_KEY", SECRET_VALUE)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())  # type: ignore[operator]
    rt.register(*s.ALL)
    client = rt.client()
    handle = client.start(s.pay_wf, {"amount": 5, "api_key": wp.secret("stripe-key")})
    assert (
        client.result(handle.execution_id).unwrap()
        == f"charged 5 with key of length {len(SECRET_VALUE)}"
    )
    assert s.LOG == [("api_key", SECRET_VALUE)]
    started = next(
        r.event for r in client.history(handle.execution_id) if r.event["type"] == "step.started"
    )
    assert started["input"] == {"charge": {"amount": 5, "api_key": "secret:stripe-key"}}
    rt.close()
    raw = _raw_bytes(db_url, backend, tmp_path)
    assert b"secret:stripe-key" in raw
    assert SECRET_VALUE.encode() not in raw


def test_without_a_resolver_the_step_never_runs(runtime: wp.Runtime) -> None:  # 55
    runtime.register(*s.ALL)
    client = runtime.client()
    outcome = client.result(
        client.start(s.pay_wf, {"amount": 1, "api_key": wp.secret("stripe-key")}).execution_id
    )
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["cause"]["message"] == "No secret resolver configured for stripe-key"
    assert s.CALLS["charge_card"] == 0


def test_the_resolver_of_the_resuming_process_is_used(
    make_runtime: object, monkeypatch: pytest.MonkeyPatch
) -> None:  # 56
    monkeypatch.setenv("STRIPE_KEY", SECRET_VALUE)
    starter = make_runtime()  # type: ignore[operator]
    starter.register(*s.ALL)
    handle = starter.client().start(
        s.pay_after_approval_wf, {"amount": 2, "api_key": wp.secret("stripe-key")}
    )
    with pytest.raises(wp.ResultTimeoutError):
        starter.client().result(handle.execution_id, timeout=0.2)
    starter.close()
    resumer = make_runtime(secret_resolver=wp.env_secret_resolver())  # type: ignore[operator]
    resumer.register(*s.ALL)
    client = resumer.client()
    client.signal(handle.execution_id, "approval", {"approved": True})
    assert client.result(handle.execution_id, timeout=10).unwrap().startswith("charged 2")
    assert s.LOG == [("api_key", SECRET_VALUE)]


def test_a_slot_whose_give_back_fails_lapses_within_the_lease(
    make_runtime: Callable[..., wp.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """If deleting a slot's row fails, the step's outcome stands and the slot is no longer
    renewed: it lapses one lease TTL later, and the next run through the same ``Limit(1)``
    gets it."""
    runtime = make_runtime(lease_ttl=1.0)
    failures: list[str] = []

    def failing_give_back(backend: Any, conn: Connection, holder: str) -> None:
        failures.append(holder)
        raise OperationalError("DELETE FROM wf_slots", {}, Exception("the delete failed"))

    monkeypatch.setattr(slot_store, "give_back", failing_give_back)
    runtime.register(*s.ALL)
    runtime.start_worker(concurrency=2, poll_interval=0.02)
    client = runtime.client()
    first = client.start(s.exclusive_wf, "first")
    assert client.result(first.execution_id, timeout=30).unwrap() == "first"
    assert len(failures) == 1
    monkeypatch.undo()
    began = time.monotonic()
    second = client.start(s.exclusive_wf, "second")
    assert client.result(second.execution_id, timeout=10).unwrap() == "second"
    assert 0.5 < time.monotonic() - began < 5  # the lapse, not at once, not for good
    assert s.CALLS["exclusive:first"] == 1 and s.CALLS["exclusive:second"] == 1


@pytest.mark.needs("server")
def test_two_deployments_on_one_server_have_their_own_limits(
    backend: str, db_url: str, make_engine: Callable[..., Any]
) -> None:
    """A server's session locks are shared by all its databases (MySQL's named locks) or
    all schemas of one (PostgreSQL's advisory locks): when slots were such locks, a
    ``Limit(1)`` step of one deployment waited for the slot the same-named step held in
    another. Slots are rows of each deployment's tables. Within a deployment the limit
    holds."""
    from .conftest import CAPABILITIES

    admin = make_engine(db_url)
    name = f"wf_other_{uuid.uuid4().hex[:8]}"
    by_schema = "schemas" in CAPABILITIES[backend]
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE {'SCHEMA' if by_schema else 'DATABASE'} {name}")
    other_url = db_url if by_schema else make_url(db_url).set(database=name)
    try:
        wp.migrate.upgrade(other_url, schema=name if by_schema else None)
        with (
            wp.Runtime(db_url) as ours,
            wp.Runtime(db_url) as ours_too,
            wp.Runtime(other_url, schema=name if by_schema else None) as theirs,
            ours.slots.slot("charge", "k", 1, "run") as take,
            ours_too.slots.slot("charge", "k", 1, "run") as take_too,
            theirs.slots.slot("charge", "k", 1, "run") as take_theirs,
        ):
            assert take()
            assert take_theirs(), "another deployment's slot is its own"
            assert not take_too(), "within one deployment the limit holds"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(
                f"DROP SCHEMA {name} CASCADE" if by_schema else f"DROP DATABASE {name}"
            )


@pytest.mark.needs("schemas")
def test_a_search_path_with_an_empty_schema_first_shares_the_limit(
    db_url: str, make_engine: Callable[..., Any]
) -> None:
    """The limit is the deployment's, named by the schema of its tables: a worker whose
    search path starts with an empty schema of its own (``"$user", public`` for a role
    with a schema of its name) took a slot another worker held."""
    admin = make_engine(db_url)
    empty = f"wf_empty_{uuid.uuid4().hex[:8]}"
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {empty}")
    try:
        own_first = make_engine(db_url, connect_args={"options": f"-c search_path={empty},public"})
        with (
            wp.Runtime(db_url) as one,
            wp.Runtime(own_first) as other,
            one.slots.slot("charge", "k", 1, "run") as take,
            other.slots.slot("charge", "k", 1, "run") as take_too,
        ):
            assert take()
            assert not take_too(), "one deployment, one limit"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {empty} CASCADE")


@wp.step(concurrency=wp.Limit(1, key=lambda tag: f"a\ud800{tag}"))
def _surrogate_keyed(tag: str) -> str:
    return tag


@wp.workflow(name="surrogate-keyed", version=1)
def surrogate_keyed_wf(ctx: wp.Context, tag: str) -> str:
    return str(ctx.run(_surrogate_keyed, tag))


def test_a_key_with_a_lone_surrogate_is_a_key_like_another(runtime: wp.Runtime) -> None:
    """Any str is a key: one with a lone surrogate failed the step (UnicodeEncodeError
    hashing it into the lock's name) on PostgreSQL and MySQL/MariaDB, not on SQLite."""
    runtime.register(surrogate_keyed_wf)
    assert runtime.client().execute(surrogate_keyed_wf, "b").unwrap() == "b"


def test_a_slot_taken_after_its_context_ended_is_given_back(runtime: wp.Runtime) -> None:
    """On the async worker a try for the slot runs on an io thread; a cancel of the step's
    call ran the slot's exit meanwhile, and the try then took the slot and kept it (and
    its heartbeat kept it) until the runtime closed: every run behind it waited."""
    slots = runtime.slots
    context = slots.slot("heartbeat-step", "late", 1, "run")
    acquire = context.__enter__()
    context.__exit__(None, None, None)  # the cancel's exit, before the try finished
    assert acquire() is False
    with slots.slot("heartbeat-step", "late", 1, "run") as again:
        assert again()  # not kept by the late try
    assert not slots._held
