"""The replay checker on every backend: stored histories replayed against current code."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

import pytest

import wf_persist as wp
from wf_persist.testing import check_replay

from .fixtures import saga as s
from .fixtures import workflows as w


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    s.reset()
    w.CONTROL["diverge"] = False
    yield
    w.CONTROL["diverge"] = False


def test_runs_in_every_state_replay_and_a_changed_body_is_reported(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(w.determinism_wf, s.saga_wf, w.two_approvals_wf, w.versioned_v1)
    client = rt.client()
    done = client.start(w.determinism_wf).execution_id
    failed = client.start(s.saga_wf, 1).execution_id
    waiting = client.start(w.two_approvals_wf).execution_id
    cancelled = client.start(w.two_approvals_wf).execution_id
    for run in (done, failed):
        client.result(run, timeout=10)
    for run in (waiting, cancelled):
        assert rt.drive(run)
    client.signal(waiting, "approval", {"approved": True})
    assert rt.drive(waiting)  # parked on the second approval
    client.cancel(cancelled, compensate=False)
    assert client.status(cancelled) == "failed"
    old_version = client.start(w.versioned_v1, "x").execution_id  # never driven

    reports = {r.execution_id: r for r in check_replay(rt)}
    assert set(reports) == {done, failed, waiting, cancelled, old_version}
    assert all(r.ok for r in reports.values()), [r for r in reports.values() if not r.ok]
    assert (reports[done].workflow_name, reports[done].version, reports[done].status) == (
        "determinism",
        1,
        "completed",
    )

    w.CONTROL["diverge"] = True  # same source hash, another step: what a helper edit does
    later = make_runtime()
    later.register(w.determinism_wf, s.saga_wf, w.two_approvals_wf)  # v1 of "versioned" gone
    reports = {r.execution_id: r for r in check_replay(later)}
    assert "expected step:first#1 but saw step:second#1" in str(reports[done].divergence)
    assert reports[failed].ok and reports[waiting].ok and reports[cancelled].ok
    assert old_version not in reports  # not a workflow this runtime serves
    [missing] = check_replay(later, [old_version])
    assert "versioned@v1 is not registered" in str(missing.divergence)
    assert check_replay(later, since=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)) == []
    with pytest.raises(wp.InvalidArgumentError, match="aware datetime"):
        check_replay(later, since=dt.datetime(2026, 1, 1))


def test_finished_runs_with_ctx_all_replay_without_a_false_divergence(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """``ctx.all`` records its start and end again on every replay (deduplicated by key);
    the checker must not take that as a call the history lacks."""
    rt = make_runtime()
    rt.register(s.parallel_wf, s.parallel_fails_wf)
    client = rt.client()
    done = client.start(s.parallel_wf, 2).execution_id
    failed = client.start(s.parallel_fails_wf).execution_id
    for run in (done, failed):
        client.result(run, timeout=10)
    reports = check_replay(rt, [done, failed])
    assert [(r.status, r.divergence) for r in reports] == [("completed", None), ("failed", None)]


def test_a_code_block_never_runs_while_checking(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    rt = make_runtime()
    rt.register(s.code_wf)
    client = rt.client()
    pending = client.start(s.code_wf, False).execution_id  # never driven: next is the block
    [report] = check_replay(rt, [pending])
    assert report.ok and s.CALLS["compute"] == 0
    assert client.result(pending, timeout=10).unwrap() == 42
    assert s.CALLS["compute"] == 1
    assert check_replay(rt, [pending])[0].ok and s.CALLS["compute"] == 1


def test_a_result_a_backend_stored_as_another_number_is_no_divergence(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """JSONB keeps 1e23 as the decimal 100000000000000000000000 (read back as an int, not
    the float the run returned): the same number, so no divergence."""
    rt = make_runtime()
    rt.register(w.numbers_wf)
    client = rt.client()
    run = client.start(w.numbers_wf, 1e23).execution_id
    client.result(run, timeout=10)
    [report] = check_replay(rt, [run])
    assert report.ok, report.divergence


@pytest.mark.parametrize("runs", ["one-execution-id", 5, [5], ["x" * 37], [None]])
def test_bad_run_ids_are_typed_errors(
    make_runtime: Callable[..., wp.Runtime], runs: object
) -> None:
    """Not a silent empty report (a string is not a list of ids), nor a raw driver error."""
    rt = make_runtime()
    with pytest.raises(wp.InvalidArgumentError):
        check_replay(rt, runs)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["sqlite://", "x", None])
def test_what_is_not_a_runtime_is_a_typed_error(given: object) -> None:
    """A URL where the runtime goes raised a bare AttributeError."""
    with pytest.raises(wp.InvalidArgumentError, match=r"wp\.Runtime"):
        check_replay(given)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["sqlite://", "x"])
def test_what_is_not_a_client_is_a_typed_error(
    make_runtime: Callable[..., wp.Runtime], given: object
) -> None:
    """A URL where the reading client goes raised a bare AttributeError."""
    with pytest.raises(wp.InvalidArgumentError, match=r"wp\.Client"):
        check_replay(make_runtime(), database=given)  # type: ignore[arg-type]


def test_an_unknown_run_id_given_is_an_error_not_a_pass(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A well-formed id of no run was skipped: a gate given a mistyped id passed."""
    rt = make_runtime()
    rt.register(w.echo_wf)
    known = rt.client().start(w.echo_wf, 1).execution_id
    with pytest.raises(wp.UnknownExecutionError):
        check_replay(rt, [known, "00000000-0000-4000-8000-000000000000"])


@wp.workflow(name="replay_tags", version=1)
def tags_wf(ctx: wp.Context, names: list[str]) -> set[str]:
    return set(names)


@wp.workflow(name="replay_names", version=1)
def names_wf(ctx: wp.Context, names: list[str]) -> list[str]:
    return list(names)


def test_a_set_returned_in_another_processs_order_is_the_same_output(
    make_runtime: Callable[..., wp.Runtime],
) -> None:
    """A set is stored in the order its process's hash seed gave; a check run in another
    process (another seed) reported the run diverged and failed a deploy, now and then.
    A list in another order still diverges."""
    from sqlalchemy import select, update

    from wf_persist.models import executions_table as ex

    rt = make_runtime()
    rt.register(tags_wf, names_wf)
    client = rt.client()
    names = ["alpha", "beta", "gamma", "delta", "epsilon"]
    as_set = client.execute(tags_wf, names).execution_id
    as_list = client.execute(names_wf, names).execution_id
    with rt.engine.begin() as conn:
        for run in (as_set, as_list):
            stored = list(conn.execute(select(ex.c.result).where(ex.c.id == run)).scalar_one())
            other_order = sorted(stored, reverse=stored == sorted(stored))
            assert other_order != stored
            conn.execute(update(ex).where(ex.c.id == run).values(result=other_order))
    reports = {r.execution_id: r for r in check_replay(rt, [as_set, as_list])}
    assert reports[as_set].ok, reports[as_set]
    assert not reports[as_list].ok and "would return" in str(reports[as_list].divergence)
