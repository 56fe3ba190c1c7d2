"""Child workflows: start, wait, fail, cancel with the parent, SQL, crashes."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

import wf_persist as wp
from wf_persist.children import child_execution_id
from wf_persist.replaycheck import check_replay

from .fixtures import family as fam
from .fixtures import workflows as w
from .helpers import Processes, history_types, wait_status, wait_until


@pytest.fixture(autouse=True)
def _reset() -> None:
    fam.UNDONE.clear()


def _job(tmp_path: Path, label: str, hang: Path | None = None) -> fam.ChildJob:
    return fam.ChildJob(
        marks=str(tmp_path / "marks"), label=label, hang=None if hang is None else str(hang)
    )


def _children(client: wp.WorkflowClient | wp.Client, parent_id: str) -> list[str]:
    return [
        r.event["childExecutionId"]
        for r in client.history(parent_id)
        if r.event["type"] == "child.started"
    ]


def test_a_parent_starts_children_waits_parked_and_gets_their_results(
    runtime: wp.Runtime, tmp_path: Path, db_engine: Engine
) -> None:
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)
    client = runtime.client()
    handle = client.start(fam.parent_wf, _job(tmp_path, "x"))
    assert client.result(handle.execution_id, timeout=30).unwrap() == ["v2:X-A", "X-B"]
    kids = _children(client, handle.execution_id)
    assert kids == [
        child_execution_id(handle.execution_id, "child:family_child#1"),
        child_execution_id(handle.execution_id, "child:family_child#2"),
    ]
    infos = [client.describe(k) for k in kids]
    assert [(i.workflow_name, i.version, i.status) for i in infos] == [
        ("family_child", 2, "completed"),
        ("family_child", 1, "completed"),
    ]
    assert {i.parent_id for i in infos} == {handle.execution_id}
    assert client.describe(handle.execution_id).parent_id is None
    assert Counter(w.marks(tmp_path / "marks")) == Counter({"x-a": 1, "x-b": 1})
    types = history_types(client, handle.execution_id)
    assert types.count("child.started") == 2 and types.count("child.finished") == 2
    with db_engine.connect() as conn:
        tree = conn.execute(
            text(
                "SELECT execution_id, parent_workflow, workflow_name, status FROM wf_run_tree "
                "WHERE parent_id = :p ORDER BY created_at, execution_id"
            ),
            {"p": handle.execution_id},
        ).all()
    assert sorted(tuple(r) for r in tree) == sorted(
        (k, "family_parent", "family_child", "completed") for k in kids
    )
    (report,) = check_replay(runtime, [handle.execution_id])
    assert report.divergence is None


def test_a_failed_child_raises_child_workflow_error_in_its_parent(runtime: wp.Runtime) -> None:
    runtime.register(*fam.ALL)
    client = runtime.client()
    handle = client.start(fam.catches_wf, "no stock")
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    assert client.result(handle.execution_id, timeout=30).unwrap() == "caught ValueError: no stock"


def test_a_parked_parent_is_woken_by_its_childs_end(runtime: wp.Runtime) -> None:
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=4, poll_interval=30)  # only wake-ups, no polling
    client = runtime.client()
    handle = client.start(fam.waits_wf, "p")
    wait_until(lambda: len(_children(client, handle.execution_id)) == 2, what="two children")
    kept, tied = _children(client, handle.execution_id)
    for child in (kept, tied):
        wait_status(client, child, "suspended")
    wait_status(client, handle.execution_id, "suspended")
    client.signal(tied, "go", True)
    client.signal(kept, "go", False)
    assert client.result(handle.execution_id, timeout=10).unwrap() == (
        "p-tied go=True / p-kept go=False"
    )


@pytest.mark.parametrize("compensate", [True, False])
def test_cancelling_a_parent_cancels_its_children_but_not_one_let_go(
    runtime: wp.Runtime, compensate: bool
) -> None:
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)
    client = runtime.client()
    handle = client.start(fam.waits_wf, "c")
    wait_until(lambda: len(_children(client, handle.execution_id)) == 2, what="two children")
    kept, tied = _children(client, handle.execution_id)
    wait_status(client, handle.execution_id, "suspended")
    client.cancel(handle.execution_id, compensate=compensate)
    parent = client.result(handle.execution_id, timeout=30)
    assert isinstance(parent, wp.Failed)
    if parent.error["name"] == "ChildWorkflowError":
        # The child, cancelled with it, ended before the unwinding parent looked at its
        # wait again: the parent took that outcome first, as it takes a delivered signal.
        assert compensate and parent.error["error"]["name"] == "Cancelled"
    else:
        assert parent.error["name"] == "Cancelled"
    try:
        child = client.result(tied, timeout=30)
    except wp.ResultTimeoutError:
        info = client.describe(tied)
        types = history_types(client, tied)
        raise AssertionError(f"the cancelled child did not end: {info}, events {types}") from None
    assert isinstance(child, wp.Failed) and child.error["name"] == "Cancelled"
    assert child.error.get("compensate") is compensate
    assert (["c"] if compensate else []) == fam.UNDONE
    wait_status(client, kept, "suspended")
    client.signal(kept, "go", True)
    assert client.result(kept, timeout=30).unwrap() == "c-kept go=True"


def test_a_parent_timing_out_cancels_its_children(runtime: wp.Runtime) -> None:
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=4, poll_interval=0.05)
    client = runtime.client()
    handle = client.start(fam.waits_wf, "t", timeout=1.0)
    outcome = client.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error["name"] == "WorkflowTimeoutError"
    kept, tied = _children(client, handle.execution_id)
    wait_status(client, tied, "failed")
    assert client.status(kept) == "suspended"


def test_a_child_cancelled_on_its_own_fails_its_waiting_parent(runtime: wp.Runtime) -> None:
    """A child failed at once (no compensation, no driver) still tells its parent."""
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=4, poll_interval=30)
    client = runtime.client()
    handle = client.start(fam.waits_wf, "k")
    wait_until(lambda: len(_children(client, handle.execution_id)) == 2, what="two children")
    _, tied = _children(client, handle.execution_id)
    wait_status(client, handle.execution_id, "suspended")
    client.cancel(tied, compensate=False)
    outcome = client.result(handle.execution_id, timeout=10)
    assert isinstance(outcome, wp.Failed)
    assert outcome.error["name"] == "ChildWorkflowError"
    assert outcome.error["error"]["name"] == "Cancelled"


def test_bad_child_input_fails_the_parent_and_starts_nothing(runtime: wp.Runtime) -> None:
    runtime.register(*fam.ALL)
    client = runtime.client()
    handle = client.start(fam.bad_input_wf)
    outcome = client.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.error["name"] == "InvalidPayloadError"
    assert _children(client, handle.execution_id) == []
    assert [i.workflow_name for i in client.list().items] == ["family_bad_input"]


def test_a_parent_waiting_on_children_survives_sigkill_of_its_worker(
    runtime: wp.Runtime, db_url: str, tmp_path: Path, procs: Processes
) -> None:
    """The worker driving the parent and its children is killed while the children run;
    another worker finishes everything: each child's step ran once per attempt the crash
    cut short at most, exactly two children exist, and the parent gets both results."""
    runtime.register(*fam.ALL)
    client = runtime.client()
    hang = tmp_path / "hang"
    hang.touch()
    handle = client.start(fam.parent_wf, _job(tmp_path, "k", hang))
    first = procs.worker(db_url, lease_ttl=1.0)
    wait_until(
        lambda: Counter(w.marks(tmp_path / "marks")) == Counter({"k-a": 1, "k-b": 1}),
        what="both children in their step",
        timeout=30,
    )
    first.stop(signal.SIGKILL)
    hang.unlink()
    second = procs.worker(db_url, lease_ttl=1.0)
    with wp.Client(db_url) as thin:  # never drives: the second worker does
        assert thin.result(handle.execution_id, timeout=60).unwrap() == ["v2:K-A", "K-B"]
    second.wait_for_stderr("serving")
    assert second.stop(signal.SIGTERM) == 0
    kids = _children(client, handle.execution_id)
    assert len(kids) == 2 == len({*kids})
    assert [i.workflow_name for i in client.list("family_child").items] == ["family_child"] * 2
    # The killed attempts may run again (at-least-once), nothing more.
    assert Counter(w.marks(tmp_path / "marks")) == Counter({"k-a": 2, "k-b": 2})
    for kid in kids:
        completed = [r for r in client.history(kid) if r.event["type"] == "step.completed"]
        assert len(completed) == 1


def test_child_calls_refuse_what_is_not_a_child(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    @wp.workflow(name="family_misuse", version=1)
    def misuse(ctx: wp.Context) -> str:
        fake: wp.ChildHandle[str] = wp.ChildHandle(
            "nope", "family_child", 1, "child:family_child#9"
        )
        try:
            ctx.child_result(fake)
        except wp.InvalidArgumentError as exc:
            return str(exc)
        return "accepted"

    rt = make_runtime()
    rt.register(misuse)
    client = rt.client()
    got = client.result(client.start(misuse).execution_id, timeout=30).unwrap()
    assert "is not a child this run started" in got


def test_a_child_pinned_to_another_version_is_decoded_by_that_version_on_replay(
    runtime: wp.Runtime,
) -> None:
    runtime.register(*fam.ALL)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    client = runtime.client()
    handle = client.start(fam.pins_v1_wf, 7)
    assert client.result(handle.execution_id, timeout=30).unwrap() == "int"


#: Children of the parent below: enough that cancelling them one transaction each took a
#: while after the parent's own cancellation had committed.
MANY = 40


@wp.workflow(name="children-waiting-kid", version=1)
def waiting_kid(ctx: wp.Context, i: int) -> int:
    ctx.wait_for_signal("go")
    return i


@wp.workflow(name="children-many-parent", version=1)
def many_parent(ctx: wp.Context, n: int) -> int:
    kids = [ctx.start_child(waiting_kid, i) for i in range(n)]
    return sum(int(ctx.child_result(kid)) for kid in kids)


@pytest.mark.parametrize("compensate", [False, True], ids=["no-compensate", "compensate"])
def test_a_cancel_killed_once_its_run_ended_leaves_no_child_running(
    runtime: wp.Runtime, db_url: str, procs: Processes, compensate: bool
) -> None:
    """``wf-persist runs cancel`` is SIGKILLed the moment its run reads as cancelled: every
    child was cancelled in that same commit. (Each child was cancelled in a transaction of
    its own after the parent's; killed in between, a parent cancelled without compensation
    left its children waiting forever, and a second cancel could not reach them.)"""
    runtime.register(many_parent, waiting_kid)
    runtime.start_worker(concurrency=8, poll_interval=0.05)
    client = runtime.client()
    parent = client.start(many_parent, MANY).execution_id

    def parked() -> bool:
        kids = _children(client, parent)
        return (
            len(kids) == MANY
            and client.status(parent) == "suspended"
            and all(client.status(k) == "suspended" for k in kids)
        )

    wait_until(parked, what="the parent and its children parked", timeout=60)
    kids = _children(client, parent)
    args = ["-m", "wf_persist.cli", "runs", "cancel", parent, "--url", db_url]
    canceller = procs.python(*args, *([] if compensate else ["--no-compensate"]))
    ended = "failed" if not compensate else "compensating"
    wait_until(lambda: client.status(parent) in (ended, "failed"), what="the cancel", timeout=60)
    canceller.kill()
    statuses = {client.status(k) for k in kids}
    assert statuses <= {"failed", "compensating"}, statuses
    for kid in kids:
        outcome = client.result(kid, timeout=30)
        assert isinstance(outcome, wp.Failed) and outcome.error["name"] == "Cancelled"
        assert outcome.error.get("compensate") is compensate


@wp.workflow(name="children-tree-mid", version=1)
def tree_mid(ctx: wp.Context, n: int) -> int:
    kids = [ctx.start_child(waiting_kid, i) for i in range(n)]
    return sum(int(ctx.child_result(kid)) for kid in kids)


@wp.workflow(name="children-tree-root", version=1)
def tree_root(ctx: wp.Context, spec: list[int]) -> int:
    mids = [ctx.start_child(tree_mid, spec[1]) for _ in range(spec[0])]
    return sum(int(ctx.child_result(m)) for m in mids)


def test_cancelling_a_tree_while_its_leaves_finish_meets_no_deadlock(
    runtime: wp.Runtime,
) -> None:
    """A root, 6 children, 36 grandchildren; the grandchildren are signalled (so they end,
    each recording its outcome in its parent) while the root is cancelled. Cancelling the
    tree in one transaction from the root down deadlocked with them (PostgreSQL failed the
    cancel with a raw error after its retries, MariaDB failed the finishing drives): the
    tree is locked from the leaves up, and everything ends with no failed drive."""
    runtime.register(tree_root, tree_mid, waiting_kid)
    runtime.start_worker(concurrency=16, poll_interval=0.05)
    client = runtime.client()
    root = client.start(tree_root, [6, 6]).execution_id

    def tree() -> list[str]:
        return [leaf for mid in _children(client, root) for leaf in _children(client, mid)]

    def parked() -> bool:
        leaves = tree()
        return len(leaves) == 36 and all(client.status(x) == "suspended" for x in leaves)

    wait_until(parked, what="the tree parked", timeout=120)
    leaves = tree()
    stop = threading.Event()
    unexpected: list[BaseException] = []

    def signal_leaves(mine: list[str]) -> None:
        for leaf in mine:
            if stop.is_set():
                return
            try:
                client.signal(leaf, "go", None)
            except wp.WfPersistError:
                pass  # cancelled first
            except BaseException as exc:
                unexpected.append(exc)

    signallers = [threading.Thread(target=signal_leaves, args=(leaves[i::3],)) for i in range(3)]
    for t in signallers:
        t.start()
    time.sleep(0.05)
    client.cancel(root, compensate=False)
    stop.set()
    for t in signallers:
        t.join(60)
    assert not unexpected, unexpected
    everyone = [root, *_children(client, root), *leaves]
    for run in everyone:
        client.result(run, timeout=60)
    infos = [client.describe(run) for run in everyone]
    assert all(i.status in ("completed", "failed") for i in infos), infos
    assert all(i.drive_failures == 0 for i in infos), [i for i in infos if i.drive_failures]


@wp.workflow(name="children-quick-kid", version=1)
def quick_kid(ctx: wp.Context, i: int) -> int:
    return i


@wp.workflow(name="children-tree-grow", version=1)
def tree_grow(ctx: wp.Context, n: int) -> int:
    kids = [ctx.start_child(quick_kid if i % 2 else waiting_kid, i) for i in range(n)]
    return sum(int(ctx.child_result(k)) for k in kids)


@wp.workflow(name="children-growing-root", version=1)
def growing_root(ctx: wp.Context, spec: list[int]) -> int:
    mids = [ctx.start_child(tree_grow, spec[1]) for _ in range(spec[0])]
    return sum(int(ctx.child_result(m)) for m in mids)


def test_cancelling_a_tree_that_is_still_growing_ends_every_run(runtime: wp.Runtime) -> None:
    """The root's children are still starting theirs (half of which end at once) while the
    root is cancelled: a tree read before its locks has grown by the time they are taken,
    which on PostgreSQL deadlocked every try (a raw error, nothing cancelled). The cancel
    tries again, and in the end cancels top down one transaction at a time: it returns,
    and every run ends with no failed drive."""
    runtime.register(growing_root, tree_grow, quick_kid, waiting_kid)
    runtime.start_worker(concurrency=12, poll_interval=0.05)
    client = runtime.client()
    root = client.start(growing_root, [6, 30]).execution_id
    wait_until(
        lambda: sum(len(_children(client, m)) for m in _children(client, root)) >= 3,
        what="the tree growing",
        timeout=60,
    )
    client.cancel(root, compensate=False)

    def everyone() -> list[str]:
        mids = _children(client, root)
        return [root, *mids, *(kid for mid in mids for kid in _children(client, mid))]

    wait_until(
        lambda: all(client.status(run) in ("completed", "failed") for run in everyone()),
        what="every run ended",
        timeout=60,
    )
    infos = [client.describe(run) for run in everyone()]
    assert all(i.drive_failures == 0 for i in infos), [i for i in infos if i.drive_failures]


def test_result_without_a_worker_drives_the_children_its_run_waits_for(
    runtime: wp.Runtime, tmp_path: Path
) -> None:
    """No worker anywhere: the caller's ``result`` drives the parent, then the children it
    parks for (as it drives any due run nobody holds), so the run ends; each step once."""
    runtime.register(*fam.ALL)
    client = runtime.client()
    handle = client.start(fam.parent_wf, _job(tmp_path, "y"))
    assert client.result(handle.execution_id, timeout=60).unwrap() == ["v2:Y-A", "Y-B"]
    assert Counter(w.marks(tmp_path / "marks")) == Counter({"y-a": 1, "y-b": 1})
    (report,) = check_replay(runtime, [handle.execution_id])
    assert report.divergence is None
    executed = client.execute(fam.parent_wf, _job(tmp_path, "z"), timeout=60)
    assert executed.unwrap() == ["v2:Z-A", "Z-B"]


@pytest.mark.parametrize("compensate", [True, False])
def test_a_cancelled_parent_whose_child_ended_first_ends_cancelled(
    runtime: wp.Runtime, compensate: bool
) -> None:
    """The tree's cancel is recorded for the parent, then its child's drive ends the child
    (``child.finished`` after the parent's ``execution.cancelled``) before the parent's drive
    runs: the parent's wait ends with the cancellation, not with the child's error."""
    runtime.register(*fam.ALL)
    client = runtime.client()
    handle = client.start(fam.waits_wf, "c")
    runtime.drive(handle.execution_id)
    wait_status(client, handle.execution_id, "suspended")
    tied = _children(client, handle.execution_id)[1]
    runtime.drive(tied)
    client.cancel(handle.execution_id, compensate=compensate)
    runtime.drive(tied)  # the child ends first
    assert client.status(tied) == "failed"
    if compensate:  # (without, the cancel ended the parent at once: nothing came after)
        last = history_types(client, handle.execution_id)[-2:]
        assert last == ["execution.cancelled", "child.finished"]
    outcome = client.result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Failed) and outcome.matches(wp.Cancelled), outcome
    types = history_types(client, handle.execution_id)
    assert ("cancellation.received" in types) is compensate
    assert ("compensation.completed" in types) is compensate
    (report,) = check_replay(runtime, [handle.execution_id])
    assert report.divergence is None


@wp.workflow(name="c" * 200, version=1)
def longest_named_kid(ctx: wp.Context, n: int) -> int:
    return n + 1


@wp.workflow(name="longest_named_parent", version=1)
def longest_named_parent(ctx: wp.Context, n: int) -> int:
    return int(ctx.child_result(ctx.start_child(longest_named_kid, n)))


def test_a_workflow_with_the_longest_name_runs_as_a_child(runtime: wp.Runtime) -> None:
    """A 200-character name is a legal workflow's, but started as a child its call name
    (``child:`` and the name) was refused as longer than other calls' names may be."""
    runtime.register(longest_named_kid, longest_named_parent)
    client = runtime.client()
    run = client.start(longest_named_parent, 4).execution_id
    assert client.result(run, timeout=30).unwrap() == 5
    activities = {r.event.get("activityName") for r in client.history(run)}
    assert f"child:{'c' * 200}#1" in activities


class _Version(int):
    """A version type of the caller's own whose equality refuses plain ints."""

    def __eq__(self, other: object) -> bool:
        raise TypeError("compare versions with .same()")

    __hash__ = int.__hash__


class _NoRepr:
    def __repr__(self) -> str:
        raise KeyError("repr")


@wp.workflow(name="odd_child_calls", version=1)
def odd_child_calls_wf(ctx: wp.Context) -> list[str]:
    refused = []
    calls: tuple[Callable[[], object], ...] = (
        lambda: ctx.start_child(_NoRepr(), None),  # type: ignore[arg-type]
        lambda: ctx.start_child("echo", 1, cancel_with_parent=_NoRepr()),  # type: ignore[arg-type]
        lambda: ctx.child_result(_NoRepr()),  # type: ignore[arg-type]
    )
    for call in calls:
        try:
            call()
        except wp.InvalidArgumentError as exc:
            refused.append(type(exc).__name__)
    handle = ctx.start_child(w.echo_wf, 5, version=_Version(w.echo_wf.version))
    return [*refused, str(ctx.child_result(handle))]


def test_odd_values_given_to_child_calls_are_refused_or_taken_as_plain_ints(
    runtime: wp.Runtime,
) -> None:
    """A version given as an int subclass started its child, then failed the parent's
    replay (its own equality ran against the recorded version); arguments whose repr
    raises gave the body a raw KeyError in place of ``InvalidArgumentError``."""
    runtime.register(odd_child_calls_wf, w.echo_wf)
    runtime.start_worker(concurrency=2, poll_interval=0.05)
    handle = runtime.client().start(odd_child_calls_wf)
    outcome = runtime.client().result(handle.execution_id, timeout=30)
    assert isinstance(outcome, wp.Completed), outcome
    assert outcome.value[:3] == ["InvalidArgumentError"] * 3
    assert len(outcome.value) == 4


def test_a_divergence_at_a_child_call_names_it_once() -> None:
    """It read "expected child:child:kid#1": the kind said twice."""
    from wf_persist.replay import describe

    assert describe("child", "child:kid#1") == "child:kid#1"
    assert describe("step", "charge#1") == "step:charge#1"
