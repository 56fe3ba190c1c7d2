"""Screenshots of the web view for the README (docs/images/), on a demo database.

    python docs/screenshots.py            # needs the dev extra and Chromium

Runs the order example and a few workflows of the test fixtures into a temporary SQLite
database, serves the web view on it and photographs the runs list, a run and the catalog.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

import wf_persist as wp
from wf_persist.web import create_app

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures import workflows as w  # noqa: E402
from tests.webserver import serving  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/demo.sqlite3"
        with wp.Runtime(url) as rt:
            rt.register(*w.ALL)
            c = rt.client()
            inp = w.CrashInput(marks=f"{tmp}/marks", hang_file=f"{tmp}/absent")
            done = c.start(w.three_steps_wf, inp, actor="alice").execution_id
            c.result(done, timeout=30)
            for i in range(3):
                c.result(c.start(w.echo_wf, i + 2, actor="bob").execution_id, timeout=30)
            c.result(c.start(w.explode_wf, "card declined").execution_id, timeout=30)
            waiting = c.start(w.approval_wf, 3600.0, actor="alice").execution_id
            with contextlib.suppress(wp.ResultTimeoutError):
                c.result(waiting, timeout=1)  # driven up to its signal wait
        with (
            wp.Client(url) as client,
            serving(create_app(client=client, allow_actions=True, token="demo")) as base,
            sync_playwright() as p,
        ):
            chromium = shutil.which("chromium") or "chromium"
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 720})
            page.goto(base + "/")
            page.screenshot(path=str(out / "web-runs.png"), full_page=True)
            page.goto(f"{base}/runs/{waiting}")
            page.screenshot(path=str(out / "web-run.png"), full_page=True)
            page.goto(f"{base}/runs/{done}")
            page.screenshot(path=str(out / "web-timeline.png"), full_page=True)
            page.goto(base + "/workflows")
            page.screenshot(path=str(out / "web-workflows.png"))
            browser.close()
    print(f"screenshots in {out}")


if __name__ == "__main__":
    main()
