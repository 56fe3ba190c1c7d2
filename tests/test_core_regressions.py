"""Regressions of the exactly-once issue: endless runs, invisible attempts, replays that
ended early or changed a parallel block, secrets in stored errors, host sessions in a
named schema, and the lifecycle rules every writer uses."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session

import wf_persist as wp
from wf_persist import lifecycle, migrate
from wf_persist.models import executions_table as ex
from wf_persist.replaycheck import check_replay

from .fixtures import fencing as f
from .fixtures.workflows import SimulatedCrash
from .test_limits_secrets import SECRET_VALUE, _raw_bytes


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    f.reset()
    yield
    f.reset()


def _types(rt: wp.Runtime, execution_id: str) -> list[str]:
    return [r.event["type"] for r in rt.client().history(execution_id)]


# endless runs -------------------------------------------------------------------------

_REFUSE = {
    "sqlite": [
        """CREATE TRIGGER wf_test_refuse BEFORE INSERT ON wf_history
           WHEN NEW.type = 'step.completed' AND NEW.activity_name = 'doomed#1'
           BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END"""
    ],
    "postgresql": [
        """CREATE FUNCTION wf_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF NEW.type = 'step.completed' AND NEW.activity_name = 'doomed#1' THEN
               RAISE EXCEPTION 'refused by a test trigger';
             END IF;
             RETURN NEW;
           END $$""",
        """CREATE TRIGGER wf_test_refuse BEFORE INSERT ON wf_history
           FOR EACH ROW EXECUTE FUNCTION wf_test_refuse()""",
    ],
    "mysql": [
        """CREATE TRIGGER wf_test_refuse BEFORE INSERT ON wf_history FOR EACH ROW
           BEGIN
             IF NEW.type = 'step.completed' AND NEW.activity_name = 'doomed#1' THEN
               SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by a test trigger';
             END IF;
           END""",
    ],
}
_DROP = {
    "sqlite": ["DROP TRIGGER IF EXISTS wf_test_refuse"],
    "postgresql": [
        "DROP TRIGGER IF EXISTS wf_test_refuse ON wf_history",
        "DROP FUNCTION IF EXISTS wf_test_refuse()",
    ],
    "mysql": ["DROP TRIGGER IF EXISTS wf_test_refuse"],
}


@pytest.fixture
def refusing_db(db_url: str, backend: str) -> Iterator[str]:
    """The test database, with a trigger that refuses the completion of ``doomed#1``."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        for sql in _REFUSE[backend]:
            conn.execute(text(sql))
    try:
        yield db_url
    finally:
        with engine.begin() as conn:
            for sql in _DROP[backend]:
                conn.execute(text(sql))
        engine.dispose()


def test_a_run_failing_the_same_way_every_drive_ends(refusing_db: str) -> None:
    """Its step's write is refused by the database every time: each drive is counted, the
    run backs off between drives, and after max_drive_failures it fails for good, with a
    typed error that says what kept failing; operators find it with SQL."""
    rt = wp.Runtime(refusing_db, max_drive_failures=3, lease_ttl=5)
    try:
        rt.register(*f.ALL)
        client = rt.client()
        handle = client.start(f.doomed_wf, 7)
        began = time.monotonic()
        outcome = client.result(handle.execution_id, timeout=60)
        assert isinstance(outcome, wp.Failed) and outcome.matches(wp.DriveFailedError)
        assert outcome.error["failures"] == 3
        assert "refused by a test trigger" in outcome.error["cause"]["message"]
        assert f.CONTROL["doomed_runs"] == 3, "bounded: the step ran once per drive"
        assert time.monotonic() - began >= 2.5, "drives backed off (1 s, then 2 s)"
        types = _types(rt, handle.execution_id)
        assert types.count("drive.failed") == 3 and types[-1] == "workflow.failed"
        with rt.transaction() as conn:
            stuck = conn.execute(
                select(ex.c.id, ex.c.drive_failures).where(ex.c.drive_failures > 0)
            ).all()
        assert [tuple(r) for r in stuck] == [(handle.execution_id, 3)]
        # The runtime gave the run up, not its body: replaying it shows no divergence.
        [report] = check_replay(rt, [handle.execution_id])
        assert report.ok, report
    finally:
        rt.close()


def test_a_drive_that_makes_progress_resets_the_count(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(*f.ALL)
    client = rt.client()
    handle = client.start(f.slow_wf, 0.0)
    with rt.transaction() as conn:  # two failed drives before this one
        conn.execute(ex.update().where(ex.c.id == handle.execution_id).values(drive_failures=2))
    assert client.result(handle.execution_id, timeout=10).unwrap() == 0.0
    with rt.transaction() as conn:
        count = conn.execute(
            select(ex.c.drive_failures).where(ex.c.id == handle.execution_id)
        ).scalar_one()
    assert count == 0


# attempts ------------------------------------------------------------------------------


def test_an_attempt_cut_short_by_a_crash_stays_visible(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime(record_start_after=0.1)
    rt.register(*f.ALL)
    client = rt.client()
    handle = client.start(f.crashes_once_wf, 0.4)
    with pytest.raises(SimulatedCrash):  # the process "dies" inside its first attempt
        client.result(handle.execution_id, timeout=10)
    assert client.result(handle.execution_id, timeout=10).unwrap() == "done"
    steps = [
        (r.event["type"], r.event["attempt"])
        for r in client.history(handle.execution_id)
        if r.event["type"].startswith("step.")
    ]
    assert steps == [("step.started", 1), ("step.started", 2), ("step.completed", 2)]
    with rt.transaction() as conn:
        rows = conn.execute(
            text(
                "SELECT attempt, outcome FROM wf_step_attempts WHERE execution_id = :id "
                "ORDER BY attempt"
            ),
            {"id": handle.execution_id},
        ).all()
    assert [tuple(r) for r in rows] == [(1, "abandoned"), (2, "completed")]


def test_short_attempts_cost_one_write(make_runtime: Callable[..., wp.Runtime]) -> None:
    rt = make_runtime()  # record_start_after=1.0: the start is written with the outcome
    rt.register(*f.ALL)
    client = rt.client()
    handle = client.start(f.slow_wf, 0.0)
    client.result(handle.execution_id, timeout=10)
    seqs = {r.event["type"]: r.sequence for r in client.history(handle.execution_id)}
    assert seqs["step.completed"] == seqs["step.started"] + 1


# replays that diverge -------------------------------------------------------------------


def _crash_after_d(rt: wp.Runtime) -> str:
    client = rt.client()
    handle = client.start(f.editable_wf)
    f.CONTROL["crash_after_d"] = True
    with pytest.raises(SimulatedCrash):
        client.result(handle.execution_id, timeout=10)
    f.CONTROL.pop("crash_after_d")
    return handle.execution_id


def test_a_replay_that_returns_early_is_a_divergence(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(*f.ALL)
    execution_id = _crash_after_d(rt)
    ran = dict(f.CONTROL)
    f.CONTROL["return_early"] = True
    outcome = rt.client().result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert outcome.error["expected"] == "all:all#1"
    assert outcome.error["actual"] == "the end of the workflow"
    assert {k: v for k, v in f.CONTROL.items() if k.startswith("ran:")} == {
        k: v for k, v in ran.items() if k.startswith("ran:")
    }, "nothing ran again"


def test_a_parallel_block_with_other_branches_is_a_divergence(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(*f.ALL)
    execution_id = _crash_after_d(rt)
    f.CONTROL["branch"] = "changed"  # same count, a different step in the second branch
    outcome = rt.client().result(execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert "plain#3" in outcome.message and "other#1" in outcome.message
    assert "ran:x" not in f.CONTROL
    assert Counter(_types(rt, execution_id))["all.started"] == 1


# secrets --------------------------------------------------------------------------------


@pytest.fixture
def dump(db_url: str, backend: str, tmp_path: Path) -> Callable[[], bytes]:
    """The database's bytes as stored (its files, or a dump of it)."""
    return lambda: _raw_bytes(db_url, backend, tmp_path)


def test_resolved_secrets_are_scrubbed_from_every_stored_error(
    make_runtime: Callable[..., wp.Runtime],
    dump: Callable[[], bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STRIPE_KEY", SECRET_VALUE)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())
    rt.register(*f.ALL)
    client = rt.client()
    handle = client.start(f.leaky_wf, {"api_key": wp.secret("stripe-key")})
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "LeakyError"
    assert f.CONTROL["charge_key"] == SECRET_VALUE
    assert f.CONTROL["refund_key"] == SECRET_VALUE, "the compensation got the resolved value"
    assert "secret:stripe-key" in outcome.message and SECRET_VALUE not in str(outcome.error)
    # The stored traceback is scrubbed too (it repeats the message).
    assert "LeakyError: card declined for key secret:stripe-key" in outcome.error["traceback"]
    stored = [r.event for r in client.history(handle.execution_id)]
    assert SECRET_VALUE not in str(stored)
    rt.close()
    raw = dump()
    assert b"card declined for key secret:stripe-key" in raw
    assert SECRET_VALUE.encode() not in raw


#: A long key (pydantic quotes a value of more than 50 characters by its two ends) and one
#: whose repr escapes characters (a line break, a quote, a backslash, non-ASCII).
LONG_KEY = "sk_live_Q7x9Zr2LmN4pW8vT1kJ6hG3fD5sA0yUeBcXoIiRtYqP"
ODD_KEY = "line1-of-pass\n'line2'\\of-pässword"


@wp.step(retry=wp.Retry(attempts=1))
def _returns_the_key(key: str) -> int:
    return key  # type: ignore[return-value]  # not an int: the result's validation fails


@wp.step(retry=wp.Retry(attempts=1))
def _quotes_the_key(key: str) -> int:
    raise ValueError(f"refused key {key!r} ({key.encode()!r})")


@wp.workflow(name="regress-printed-secret", version=1)
def _printed_secret_wf(ctx: wp.Context, how: str) -> int:
    step = _returns_the_key if how == "result" else _quotes_the_key
    return ctx.run(step, wp.secret("long-key" if how == "result" else "odd-key"))


def test_a_secret_as_messages_print_it_is_scrubbed_too(
    make_runtime: Callable[..., wp.Runtime],
    dump: Callable[[], bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the value as it was got replaced: a step result failing its validation stored
    pydantic's ``input_value='sk_live_Q7x9Zr2LmN4pW8vT...IiRtYqP'`` (both ends of the key)
    in the traceback, and an error quoting the key with ``!r`` stored it escaped, whole."""
    monkeypatch.setenv("LONG_KEY", LONG_KEY)
    monkeypatch.setenv("ODD_KEY", ODD_KEY)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())
    rt.register(_printed_secret_wf)
    client = rt.client()
    for how in ("result", "raised"):
        outcome = client.execute(_printed_secret_wf, how)
        assert isinstance(outcome, wp.Failed) and outcome.error_type == "StepExecutionError"
    rt.close()
    raw = dump()
    assert b"secret:long-key...secret:long-key" in raw  # pydantic's input_value=
    assert raw.count(b"secret:odd-key") >= 2  # the key's repr and its bytes' repr
    for key in (LONG_KEY, ODD_KEY):
        forms = {key, repr(key)[1:-1], repr(key.encode())[2:-1], json.dumps(key)[1:-1]}
        for form in forms:
            for i in range(len(form) - 11):
                assert form[i : i + 12].encode() not in raw, (form, i)


class _UpstreamError(Exception):
    pass


@wp.step(retry=wp.Retry(attempts=1))
def _charges_with_the_key(key: str) -> str:
    raise _UpstreamError(f"401 from https://api.example.com/v1/charges?key={key}")


@wp.workflow(name="regress-drive-failed-secret", version=1)
def _drive_failed_secret_wf(ctx: wp.Context) -> str:
    return ctx.run(_charges_with_the_key, wp.secret("long-key"))


def test_a_failed_drive_stores_no_secret_of_the_error_being_handled(
    make_runtime: Callable[..., wp.Runtime],
    dump: Callable[[], bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write of a step's failure itself failed (the database lost just then): the
    ``drive.failed`` document's traceback holds the step's error it was handling, and that
    was stored unscrubbed (the drive's failure passed through no redactor)."""
    from sqlalchemy.exc import OperationalError

    monkeypatch.setenv("LONG_KEY", LONG_KEY)
    rt = make_runtime(secret_resolver=wp.env_secret_resolver())
    write = rt.backend.write
    lost: list[bool] = []

    def losing(conn: Any, execution_id: str, epoch: int, evs: Any, **kwargs: Any) -> Any:
        if not lost and any(e.event["type"] == "step.failed" for e in evs):
            lost.append(True)
            try:  # as a driver raises it: its own error, wrapped by SQLAlchemy
                raise ConnectionResetError("connection lost")
            except ConnectionResetError as err:
                raise OperationalError("INSERT ...", {}, err) from err
        return write(conn, execution_id, epoch, evs, **kwargs)

    monkeypatch.setattr(rt.backend, "write", losing)
    rt.register(_drive_failed_secret_wf)
    client = rt.client()
    run = client.start(_drive_failed_secret_wf).execution_id
    rt.start_worker(poll_interval=0.05)
    outcome = client.result(run, timeout=60)
    assert isinstance(outcome, wp.Failed) and lost == [True]
    (failure,) = [r.event for r in client.history(run) if r.event["type"] == "drive.failed"]
    assert "key=secret:long-key" in failure["error"]["traceback"]
    rt.close()
    raw = dump()
    for i in range(len(LONG_KEY) - 11):
        assert LONG_KEY[i : i + 12].encode() not in raw, i


def test_a_redactor_shared_by_parallel_branches_scrubs_while_another_adds() -> None:
    """``ctx.all`` branches share the drive's redactor: a scrub while a sibling resolved a
    secret failed with "dictionary changed size during iteration" (the run failed with it)."""
    from wf_persist.secrets import Redactor

    redactor = Redactor()
    redactor.add("secret:first", "first-secret-value")
    stop = threading.Event()

    def adding() -> None:
        n = 0
        while not stop.is_set():
            redactor.add(f"secret:k{n}", f"value-number-{n}-of-many")
            n += 1

    adder = threading.Thread(target=adding)
    adder.start()
    try:
        for _ in range(300):
            assert redactor.scrub({"m": "a first-secret-value b"}) == {"m": "a secret:first b"}
    finally:
        stop.set()
        adder.join()
    assert redactor.scrub({"pin": 1234567890123, "flag": True}) == {
        "pin": 1234567890123,
        "flag": True,
    }
    redactor.add("secret:pin", "1234567890123")
    assert redactor.scrub([1234567890123, True, 5]) == ["secret:pin", True, 5]


# host integration -----------------------------------------------------------------------


def test_host_session_start_in_a_named_schema(blank_db_url: str) -> None:
    engine = create_engine(blank_db_url)
    try:
        if not wp.backends.backend_type(engine.dialect.name).supports_schemas:
            with pytest.raises(wp.UnsupportedDatabaseError, match="named schema"):
                wp.Runtime(engine, schema="wf")
            return
        migrate.upgrade(blank_db_url, schema="wf")
        with wp.Runtime(engine, schema="wf") as rt:
            with Session(engine) as session:  # the host's session, its default schema
                handle = rt.client().start(f.slow_wf, 0.0, session=session)
                session.commit()
            assert rt.client().result(handle.execution_id, timeout=10).unwrap() == 0.0
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT count(*) FROM wf.wf_executions WHERE id = :id"),
                {"id": handle.execution_id},
            ).scalar_one()
            public = conn.execute(
                text("SELECT to_regclass('public.wf_executions') IS NOT NULL")
            ).scalar_one()
        assert found == 1 and public is False
    finally:
        engine.dispose()


def test_host_session_start_registers_in_the_same_transaction(db_url: str) -> None:
    """Starting a workflow this runtime never registered, inside a host transaction that
    already wrote (on SQLite: holds the write lock), registers it in that transaction
    instead of waiting on a second one; a rollback leaves no run and no catalog row."""
    engine = create_engine(db_url)
    try:
        with wp.Runtime(engine) as rt:
            for commit in (False, True):
                began = time.monotonic()
                with Session(engine) as session:
                    session.execute(ex.update().where(ex.c.id == "nothing").values(actor="x"))
                    handle = rt.client().start(f.nap_wf, 0.0, session=session)
                    if commit:
                        session.commit()
                    else:
                        session.rollback()
                assert time.monotonic() - began < 5
                with engine.connect() as conn:
                    runs = conn.execute(select(ex.c.id).where(ex.c.id == handle.execution_id)).all()
                    cataloged = conn.execute(
                        text("SELECT count(*) FROM wf_workflows WHERE name = 'nap'")
                    ).scalar_one()
                assert (len(runs), cataloged) == ((1, 1) if commit else (0, 0))
                rt._registry.clear()
                rt._latest.clear()
    finally:
        engine.dispose()


@pytest.mark.needs("sql_mode")
def test_a_mysql_engine_outside_strict_mode_is_refused(db_url: str) -> None:
    engine = create_engine(db_url, connect_args={"init_command": "SET SESSION sql_mode = ''"})
    try:
        with pytest.raises(wp.UnsupportedDatabaseError, match="strict"):
            wp.Runtime(engine)
    finally:
        engine.dispose()


# the lifecycle ---------------------------------------------------------------------------


def test_lifecycle_rules() -> None:
    L = lifecycle
    assert set(L.STATUSES) == {"running", "suspended", "compensating", "completed", "failed"}
    assert {"completed", "failed"} == L.TERMINAL
    assert {"running", "suspended"} == L.CANCELLABLE
    for terminal in L.TERMINAL:
        assert not any(L.can_transition(terminal, s) for s in L.STATUSES if s != terminal)
    assert L.can_transition("compensating", "failed")
    assert not L.can_transition("compensating", "completed")
    assert not L.can_transition("compensating", "running")
    assert L.event_transition("running", "sleep.started") == "suspended"
    assert L.event_transition("suspended", "signal.received") == "running"
    assert L.event_transition("compensating", "signal.received") is None
    assert L.event_transition("completed", "signal.delivered") is None
    assert L.event_transition("running", "step.completed") is None
    assert L.cancellation_status(True) == "compensating"
    assert L.cancellation_status(False) == "failed"


def test_an_error_carrying_data_no_database_keeps_is_recorded_once(
    rt: wp.Runtime, tmp_path: Path
) -> None:
    """A step raises an error whose arguments and fields are nested deeper than MariaDB's
    JSON allows, hold integers beyond 64 bits and NaN. The failure is recorded at the first
    attempt (those parts as text, the rest as JSON) instead of failing the write at every
    drive and running the step again each time."""
    rt.register(*f.ALL)
    marks = tmp_path / "marks"
    handle = rt.client().start(f.awkward_wf, str(marks))
    outcome = rt.client().result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "Awkward"
    assert [label for label, _ in f.marks_of(marks)] == ["awkward"], "the step ran once"
    error = outcome.error
    assert isinstance(error["tree"], str) and error["tree"].startswith("[[[")
    assert error["huge"] == str(2**80)
    assert error["plain"] == {"kept": [1, 2]}
    assert error["args"][0] == "awkward" and error["args"][2:] == [str(2**70), "nan"]
    assert "drive.failed" not in _types(rt, handle.execution_id)


class Tightened(BaseModel):
    """A step's result type whose validation a deploy made stricter."""

    n: int

    @field_validator("n")
    @classmethod
    def _strict(cls, n: int) -> int:
        if TIGHT["on"]:
            raise ValueError("n is no longer accepted")
        return n


TIGHT = {"on": False, "runs": 0}


@wp.step
def give_tightened() -> Tightened:
    TIGHT["runs"] += 1
    return Tightened(n=5)


@wp.step
def tighten() -> None:
    TIGHT["on"] = True


@wp.workflow(name="core-tightened", version=1)
def tightened_wf(ctx: wp.Context) -> int:
    got = ctx.run(give_tightened)
    ctx.run(tighten)
    ctx.sleep(0.05)
    return got.n


def test_a_replay_that_raises_on_a_recorded_value_says_what_it_raised(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A recorded result that no longer fits its type ended the replayed body; the run
    failed with only "expected step:tighten#1 but saw the end of the workflow", the cause
    recorded nowhere. The step is still never run again."""
    TIGHT.update(on=False, runs=0)
    rt = make_runtime()
    rt.register(tightened_wf)
    outcome = rt.client().execute(tightened_wf)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert outcome.error["expected"] == "step:tighten#1"
    assert outcome.error["actual"].startswith("the end of the workflow, which raised ")
    assert "InvalidPayloadError" in outcome.error["actual"]
    assert "n is no longer accepted" in outcome.error["actual"]
    assert TIGHT["runs"] == 1, "the recorded step never ran again"


class Unsayable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


@wp.step
def first_of_two() -> int:
    TIGHT["runs"] += 1
    return 1


@wp.workflow(name="core-unsayable", version=1)
def unsayable_wf(ctx: wp.Context) -> int:
    if TIGHT["on"]:
        raise Unsayable()
    got = ctx.run(first_of_two)
    ctx.run(tighten)
    ctx.sleep(0.05)
    return got


def test_a_replay_that_raises_an_exception_without_text_still_fails_the_run(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """Saying what the body raised must not fail itself: an exception whose ``__str__``
    raises left the run retrying its drives instead of failing."""
    TIGHT.update(on=False, runs=0)
    rt = make_runtime()
    rt.register(unsayable_wf)
    client = rt.client()
    handle = client.start(unsayable_wf)  # its replay after the sleep raises
    outcome = client.result(handle.execution_id, timeout=20)
    assert isinstance(outcome, wp.Failed) and outcome.error_type == "NonDeterminismError"
    assert outcome.error["actual"] == "the end of the workflow, which raised Unsayable"
    assert TIGHT["runs"] == 1
