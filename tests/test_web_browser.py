"""The web view in a real headless browser (Chromium from the distribution, driven by
Playwright): the list, its filters and live refresh, a run's timeline, and a signal sent
from the page resuming a run that a worker process drives."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from pydantic import BaseModel

import wf_persist as wp
from wf_persist.web import create_app

from .fixtures import workflows as w
from .helpers import Processes, wait_status
from .webserver import serving


def chromium_path() -> str:
    """``$WF_PERSIST_TEST_CHROMIUM``, else ``chromium`` on the PATH (``apt-get install
    chromium``; ``.ci/run`` installs it). Missing, the tests fail: they are never skipped."""
    found = os.environ.get("WF_PERSIST_TEST_CHROMIUM") or shutil.which("chromium")
    if not found:
        pytest.fail("no Chromium: apt-get install chromium, or set WF_PERSIST_TEST_CHROMIUM")
    return found


@pytest.fixture
def browser() -> Iterator[Browser]:
    # Per test, never longer: while Playwright's synchronous API is open it marks an event
    # loop as running in this thread, and asyncio.run() (other tests') refuses to run.
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    opened = context.new_page()
    opened.set_default_timeout(20_000)
    refused: list[str] = []  # what the pages' security policy blocked, if anything
    opened.on("console", lambda m: refused.append(m.text) if "Security Policy" in m.text else None)
    yield opened
    context.close()
    assert not refused, refused


@pytest.fixture
def app_client(runtime: wp.Runtime, db_url: str) -> Iterator[wp.Client]:
    runtime.register(*w.ALL)
    with wp.Client(db_url) as client:
        yield client


def _labels(page: Page) -> list[str]:
    return [t.strip() for t in page.locator("#timeline li .label").all_inner_texts()]


def test_the_list_renders_filters_and_refreshes_itself(
    runtime: wp.Runtime, app_client: wp.Client, page: Page
) -> None:
    echoes = [runtime.client().start(w.echo_wf, i).execution_id for i in range(2)]
    for run in echoes:
        runtime.client().result(run, timeout=30)
    waiting = runtime.client().start(w.approval_wf, 30.0).execution_id
    with serving(create_app(client=app_client)) as base:
        page.goto(base + "/")
        expect(page.locator("#runs tbody tr.run")).to_have_count(3)
        page.select_option("select[name=workflow]", "approval")
        page.click("#filters button[type=submit]")
        expect(page.locator("#runs tbody tr.run")).to_have_count(1)
        expect(page.locator("#runs tbody tr.run td a")).to_have_text(waiting)
        assert "workflow=approval" in page.url
        # A run started meanwhile appears without a reload (live refresh).
        later = runtime.client().start(w.approval_wf, 5.5).execution_id
        expect(page.locator(f"#runs tbody tr[data-id='{later}']")).to_have_count(1)
        page.click(f"#runs tbody tr[data-id='{later}'] a")
        expect(page.locator("h1")).to_contain_text("approval")
        expect(page.locator("#input")).to_have_text("5.5")


def test_a_runs_timeline_shows_its_steps_in_order(
    runtime: wp.Runtime, app_client: wp.Client, page: Page, tmp_path: Path
) -> None:
    inp = w.CrashInput(marks=str(tmp_path / "marks"), hang_file=str(tmp_path / "absent"))
    run = runtime.client().start(w.three_steps_wf, inp).execution_id
    assert runtime.client().result(run, timeout=30).unwrap() == "abc"
    with serving(create_app(client=app_client)) as base:
        page.goto(f"{base}/runs/{run}")
        expect(page.locator("#status")).to_have_text("completed")
        steps = [label for label in _labels(page) if "attempt" in label]
        assert steps == ["step_a#1 attempt 1", "step_b#1 attempt 1", "step_c#1 attempt 1"]
        assert _labels(page)[-1] == "completed"
        expect(page.locator("#result")).to_have_text('"abc"')


def test_a_signal_sent_from_the_page_resumes_a_run_a_worker_drives(
    runtime: wp.Runtime, app_client: wp.Client, page: Page, db_url: str, procs: Processes
) -> None:
    run = runtime.client().start(w.approval_wf, 60.0).execution_id
    worker = procs.worker(db_url)
    wait_status(app_client, run, "suspended")
    app = create_app(client=app_client, allow_actions=True, token="page-token")
    with serving(app) as base:
        page.goto(f"{base}/runs/{run}")
        form = page.locator("form.signal-form[data-name='approval']")
        expect(form).to_be_visible()
        form.locator("input[name=approved]").check()
        form.locator("button[type=submit]").click()  # no token yet: refused
        expect(page.locator("#action-result")).to_contain_text("refused")
        assert app_client.status(run) == "suspended"
        page.fill("#token", "page-token")
        page.locator("#token").dispatch_event("change")
        form.locator("button[type=submit]").click()
        expect(page.locator("#status")).to_have_text("completed", timeout=30_000)
        expect(page.locator("#result")).to_have_text('"approved"')
    assert app_client.result(run, timeout=5).unwrap() == "approved"
    assert "signal delivered approval#1" in [r for r in _labels_of(app_client, run)]
    worker.stop()


def test_a_run_no_worker_unwinds_is_ended_from_its_page(
    runtime: wp.Runtime, app_client: wp.Client, page: Page
) -> None:
    """A run cancelled with compensation that no worker unwinds (its version served
    nowhere) stays compensating: its page offers to end it without the compensations."""
    run = runtime.client().start(w.approval_wf, 60.0).execution_id
    with pytest.raises(wp.ResultTimeoutError):
        runtime.client().result(run, timeout=1.5)  # driven here up to its signal wait
    app = create_app(client=app_client, allow_actions=True, token="page-token")
    with serving(app) as base:
        page.goto(f"{base}/runs/{run}")
        page.fill("#token", "page-token")
        page.locator("#token").dispatch_event("change")
        expect(page.locator("#end-now")).to_have_count(0)  # only for a compensating run
        page.locator("#cancel").click()
        expect(page.locator("#status")).to_have_text("compensating")
        page.locator("#end-now").click()
        expect(page.locator("#status")).to_have_text("failed")
        expect(page.locator("#end-now")).to_have_count(0)
    outcome = app_client.result(run, timeout=5)
    assert isinstance(outcome, wp.Failed) and outcome.error["compensate"] is False


def _labels_of(client: wp.Client, run: str) -> list[str]:
    from wf_persist.web import data

    found: dict[str, Any] = data.run(client, run)
    return [str(t["label"]) for t in found["timeline"]]


class Verdict(BaseModel):
    kind: Literal["verdict"] = "verdict"
    approved: bool
    note: str = "none"
    level: int = 3
    lines: str = "a\nb"
    maybe: str = None  # type: ignore[assignment]  # {"type": "string", "default": null}


@wp.workflow(name="verdict", version=1)
def verdict_wf(ctx: wp.Context) -> str:
    got = ctx.wait_for_signal("verdict", Verdict)
    assert not isinstance(got, wp.TimedOut)  # no timeout given
    v = got.value
    return f"{v.kind} {v.approved} {v.note!r} {v.level} {v.lines!r} {v.maybe!r}"


def test_a_signal_form_starts_at_the_defaults(
    runtime: wp.Runtime, app_client: wp.Client, page: Page
) -> None:
    """A constant field (``Literal`` with its default) came as an empty box that sent ""
    and was refused: the form could not send a valid payload without the operator typing
    the constant by hand. Each field starts at its default (line breaks kept); an emptied
    text field sends "" (one whose default is null starts empty, not as the text "null")."""
    runtime.register(verdict_wf)
    run = runtime.client().start(verdict_wf).execution_id
    runtime.drive(run)
    wait_status(app_client, run, "suspended")
    app = create_app(client=app_client, allow_actions=True, token="page-token")
    with serving(app) as base:
        page.goto(f"{base}/runs/{run}")
        page.fill("#token", "page-token")
        page.locator("#token").dispatch_event("change")
        form = page.locator("form.signal-form[data-name='verdict']")
        expect(form.locator("input[name=kind]")).to_have_value("verdict")
        expect(form.locator("input[name=note]")).to_have_value("none")
        expect(form.locator("textarea[name=lines]")).to_have_value("a\nb")
        expect(form.locator("input[name=maybe]")).to_have_value("")
        form.locator("input[name=approved]").check()
        form.locator("input[name=note]").fill("")
        form.locator("input[name=level]").fill("7")
        form.locator("button[type=submit]").click()
        wait_status(app_client, run, "running")
    runtime.drive(run)
    assert app_client.result(run, timeout=10).unwrap() == "verdict True '' 7 'a\\nb' ''"
