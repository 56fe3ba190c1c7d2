"""The web view's JSON API and pages over real HTTP (uvicorn), on every backend."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import wf_persist as wp
from wf_persist.web import create_app

from .fixtures import workflows as w
from .helpers import wait_until
from .webserver import serving


@pytest.fixture
def served(runtime: wp.Runtime, db_url: str) -> Iterator[tuple[wp.Runtime, httpx.Client]]:
    runtime.register(*w.ALL)
    with (
        wp.Client(db_url) as client,
        serving(create_app(client=client)) as base,
        httpx.Client(base_url=base, timeout=30) as http,
    ):
        yield runtime, http


def _run_approval(rt: wp.Runtime) -> str:
    run = rt.client().start(w.approval_wf, 30.0, actor="alice").execution_id
    with pytest.raises(wp.ResultTimeoutError):
        rt.client().result(run, timeout=1.5)  # driven here up to its signal wait
    return run


def test_the_api_lists_filters_and_pages_runs(
    served: tuple[wp.Runtime, httpx.Client],
) -> None:
    rt, http = served
    client = rt.client()
    done = [client.start(w.echo_wf, i, actor="bob").execution_id for i in range(3)]
    for run in done:
        client.result(run, timeout=30)
    waiting = _run_approval(rt)
    everything = http.get("/api/runs").json()
    assert [r["id"] for r in everything["runs"]] == [*done, waiting]  # oldest first
    assert everything["nextCursor"] is None
    assert [r["id"] for r in http.get("/api/runs", params={"actor": "alice"}).json()["runs"]] == [
        waiting
    ]
    suspended = http.get("/api/runs", params={"status": "suspended"}).json()["runs"]
    assert [r["id"] for r in suspended] == [waiting]
    assert [r["workflow"] for r in suspended] == ["approval"]
    page = http.get("/api/runs", params={"workflow": "echo", "limit": 2}).json()
    assert [r["id"] for r in page["runs"]] == done[:2]
    rest = http.get(
        "/api/runs", params={"workflow": "echo", "limit": 2, "cursor": page["nextCursor"]}
    ).json()
    assert [r["id"] for r in rest["runs"]] == done[2:] and rest["nextCursor"] is None
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    assert http.get("/api/runs", params={"after": later}).json()["runs"] == []
    assert http.get("/api/runs", params={"workflow": "echo", "version": 2}).json()["runs"] == []


def test_a_run_its_events_and_its_timeline(served: tuple[wp.Runtime, httpx.Client]) -> None:
    rt, http = served
    run = _run_approval(rt)
    found = http.get(f"/api/runs/{run}").json()
    assert found["run"]["status"] == "suspended" and found["run"]["input"] == 30.0
    assert found["pendingSignals"][0]["name"] == "approval"
    assert found["pendingSignals"][0]["schema"]["properties"]["approved"]["type"] == "boolean"
    assert found["wait"]["kind"] == "signal"
    labels = [t["label"] for t in found["timeline"]]
    assert labels[:4] == ["first driven", "reserve_budget#1 attempt 1", "sleeps sleep:0.01s#1",
                          "woke sleep:0.01s#1"]  # fmt: skip
    assert labels[-1] == "waits for signal approval#1"
    events = http.get(f"/api/runs/{run}/events").json()
    assert events["run"]["id"] == run
    assert [e["sequence"] for e in events["events"]] == list(range(1, len(events["events"]) + 1))
    assert events["events"][0]["type"] == "execution.started"
    catalog = http.get("/api/workflows").json()
    assert {"name": "approval", "version": 1} in [
        {"name": c["name"], "version": c["version"]} for c in catalog
    ]


def test_a_failed_run_shows_its_error_and_its_retries(
    served: tuple[wp.Runtime, httpx.Client],
) -> None:
    rt, http = served
    run = rt.client().start(w.explode_wf, "boom <b>").execution_id
    assert isinstance(rt.client().result(run, timeout=30), wp.Failed)
    found = http.get(f"/api/runs/{run}").json()
    assert found["run"]["error"]["message"].endswith("boom <b>")
    attempts = [t for t in found["timeline"] if t["kind"] == "step"]
    assert [t["outcome"] for t in attempts] == ["failed"] * len(attempts)
    assert found["timeline"][-1]["label"] == "failed"
    html = http.get(f"/runs/{run}").text
    assert "boom &lt;b&gt;" in html and "boom <b>" not in html  # escaped
    assert "Traceback" in html


def test_unknown_runs_and_bad_filters_are_clear_errors(
    served: tuple[wp.Runtime, httpx.Client],
) -> None:
    _rt, http = served
    for path in ("/api/runs/nope", "/api/runs/nope/events", "/api/runs/..%2F..%2Fetc%2Fpasswd"):
        answer = http.get(path)
        assert answer.status_code == 404 and answer.json() == {"error": "Run not found"}
    answer = http.post("/api/runs/a%2Fb/cancel", json={})  # no run has a "/" in its id
    assert answer.status_code == 404 and answer.json() == {"error": "Run not found"}
    not_allowed = http.get("/api/runs/nope/cancel")  # a route, another method: JSON too
    assert not_allowed.status_code == 405 and set(not_allowed.json()) == {"error"}
    assert not_allowed.headers["allow"] == "POST"
    assert http.post("/workflows").status_code == 405
    assert http.get("/api/runs/", follow_redirects=False).status_code in (307, 308)
    assert http.get("/runs/nope").status_code == 404
    assert http.get("/api/runs", params={"limit": "200"}).status_code == 200  # the README's
    for params in ({"status": "bogus"}, {"limit": "0"}, {"limit": "x"}, {"after": "yesterday"},
                   {"cursor": "garbage"}, {"version": "2"}, {"limit": "201"}):  # fmt: skip
        answer = http.get("/api/runs", params=params)
        assert answer.status_code == 400, params
        assert set(answer.json()) == {"error"}
        assert http.get("/", params=params).status_code == 400
    # Past UTC's range: named as the query string names it (not created_after).
    for key, moment in (
        ("after", "0001-01-01T00:00:00+05:00"),
        ("before", "9999-12-31T23:59-05:00"),
    ):
        answer = http.get("/api/runs", params={key: moment})
        assert answer.status_code == 400 and answer.json()["error"].startswith(f"{key} is out")


def test_pages_render(served: tuple[wp.Runtime, httpx.Client]) -> None:
    rt, http = served
    run = _run_approval(rt)
    listing = http.get("/").text
    assert run in listing and "approval" in listing
    page = http.get(f"/runs/{run}").text
    assert "Waiting for signals" in page and "signal-form" not in page  # read-only
    assert "approval" in http.get("/workflows").text
    assert http.get("/static/app.js").status_code == 200


def test_actions_need_the_flag_and_the_token(
    runtime: wp.Runtime, db_url: str, tmp_path: Path
) -> None:
    runtime.register(*w.ALL)
    run = _run_approval(runtime)
    with wp.Client(db_url) as client:
        with serving(create_app(client=client)) as base, httpx.Client(base_url=base) as http:
            refused = http.post(f"/api/runs/{run}/cancel", json={})
            assert refused.status_code == 403  # read-only: no token opens it
        app = create_app(client=client, allow_actions=True, token="s3cret")
        with serving(app) as base, httpx.Client(base_url=base) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                answer = http.post(f"/api/runs/{run}/cancel", json={}, headers=headers)
                assert answer.status_code == 401
            assert client.status(run) == "suspended"  # nothing was done
            token = {"Authorization": "Bearer s3cret"}
            bad = http.post(
                f"/api/runs/{run}/signal",
                json={"name": "approval", "payload": {"approved": "maybe"}},
                headers=token,
            )
            assert bad.status_code == 400 and "approved" in bad.json()["error"]
            broken = http.post(f"/api/runs/{run}/signal", content=b"[", headers=token)
            assert broken.status_code == 400
            ok = http.post(
                f"/api/runs/{run}/signal",
                json={"name": "approval", "payload": {"approved": True}},
                headers=token,
            )
            assert ok.status_code == 200
            assert runtime.client().result(run, timeout=30).unwrap() == "approved"
            again = http.post(f"/api/runs/{run}/retry", json={}, headers=token).json()
            assert again["id"] != run
            assert client.describe(again["id"]).input == 30.0
            assert client.describe(again["id"]).actor == "web"
            wait_until(lambda: client.status(again["id"]) in ("running", "suspended"))
            assert http.post(f"/api/runs/{run}/cancel", json={}, headers=token).status_code == 400
            # A run still going is not retried (the page offers it for ended runs only): it
            # would run twice at once.
            listed = len(client.list(limit=100).items)
            going = http.post(f"/api/runs/{again['id']}/retry", json={}, headers=token)
            assert going.status_code == 400 and "ended" in going.json()["error"]
            assert len(client.list(limit=100).items) == listed


def test_every_answer_forbids_framing_and_foreign_scripts(
    served: tuple[wp.Runtime, httpx.Client],
) -> None:
    """A page that framed the view could lead a visitor, token pasted, into clicking an
    action: pages, the API, static files and errors all say no frames, only our scripts."""
    rt, http = served
    run = _run_approval(rt)
    answers = [
        http.get("/"),
        http.get(f"/runs/{run}"),
        http.get("/api/runs"),
        http.get("/static/app.js"),
        http.get("/api/runs/nope"),  # 404 in JSON
        http.get("/nowhere"),  # no route
        http.get("/", params={"status": "bogus"}),  # 400 page
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 404, 404, 400]
    for answer in answers:
        policy = answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'self'" in policy
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
        assert len(answer.headers.get_list("x-frame-options")) == 1


def test_an_unexpected_error_answers_500_with_the_same_headers(
    served: tuple[wp.Runtime, httpx.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starlette answers an unexpected error outside every middleware: the 500 came
    without the security headers."""
    from wf_persist.web import data

    def broken(*_: object) -> object:  # a defect of the view's own code, not of the data
        raise RuntimeError("unexpected")

    _, http = served
    monkeypatch.setattr(data, "workflows", broken)
    answer = http.get("/workflows")
    assert (answer.status_code, answer.text) == (500, "Internal Server Error")
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
    assert answer.headers["x-frame-options"] == "DENY"
    assert "unexpected" not in answer.text


def test_the_runs_pages_next_link_keeps_every_filter(
    served: tuple[wp.Runtime, httpx.Client],
) -> None:
    """The "Next page" link dropped ``after`` and ``before``: page 2 listed runs created
    outside the range the first page was filtered by."""
    import html
    import re

    rt, http = served
    client = rt.client()
    runs = [client.start(w.echo_wf, i, actor="bob").execution_id for i in range(4)]
    created = {i.execution_id: i.created_at for i in client.list(limit=10).items}
    runs.sort(key=lambda r: created[r])
    before = created[runs[2]].isoformat()  # the first two only
    after = (created[runs[0]] - dt.timedelta(seconds=1)).isoformat()
    query = {"workflow": "echo", "actor": "bob", "after": after, "before": before, "limit": "1"}
    shown: list[str] = []
    path = "/?" + str(httpx.QueryParams(query))
    while path:
        page = http.get(path).text
        shown += [r for r in runs if f'data-id="{r}"' in page]
        link = re.search(r'id="next" href="([^"]+)"', page)
        path = "/" + html.unescape(link.group(1)) if link else ""
        if link:
            kept = httpx.QueryParams(html.unescape(link.group(1))[1:])
            assert {k: kept[k] for k in ("workflow", "actor", "limit")} == {
                "workflow": "echo",
                "actor": "bob",
                "limit": "1",
            }
    assert shown == runs[:2]


def test_a_schema_taken_down_under_a_running_view_is_a_503_naming_the_upgrade(
    blank_db_url: str,
) -> None:
    """An operator rolling a release's migration back under a running view: every request
    was a 500 (a raw "no such column" in the log); the library raises the typed refusal,
    and the view answers it as the server's trouble."""
    from wf_persist import migrate

    migrate.upgrade(blank_db_url)
    with (
        wp.Client(blank_db_url) as client,
        serving(create_app(client=client)) as base,
        httpx.Client(base_url=base, timeout=30) as http,
    ):
        assert http.get("/api/runs").status_code == 200
        migrate.downgrade(blank_db_url, "wf_0005")  # before run deadlines (a column)
        for path in ("/api/runs", "/"):
            answer = http.get(path)
            assert answer.status_code == 503, answer.text
            assert "wf-persist db upgrade" in answer.text
        with pytest.raises(wp.UnsupportedDatabaseError, match="column"):
            client.list()


def _holding(db_url: str, backend: str, run: str) -> tuple[Any, list[str]]:
    """A session of another application holding the run's row (and, on a server, the
    runs table) locked: the paths that then wait for it."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    conn = engine.connect()
    if backend == "sqlite":  # one writer at a time: a write waits for it
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        return (engine, conn), [f"/api/runs/{run}/cancel"]
    conn.begin()
    if backend == "postgresql":
        conn.execute(text("LOCK TABLE wf_executions IN ACCESS EXCLUSIVE MODE"))
    else:
        conn.execute(text("LOCK TABLES wf_executions WRITE"))
    return (engine, conn), ["/api/runs", f"/api/runs/{run}", f"/api/runs/{run}/cancel"]


def test_a_request_behind_another_sessions_lock_is_a_503_after_the_lock_timeout(
    runtime: wp.Runtime, db_url: str, backend: str
) -> None:
    """A migration's or an operator's lock held for minutes held every request (and the
    server's threads) as long: the view's own engine waits at most ``lock_timeout``."""
    runtime.register(*w.ALL)
    run = runtime.client().start(w.approval_wf, None).execution_id
    status = runtime.client().status(run)
    app = create_app(db_url, allow_actions=True, token="t", lock_timeout=1.0)
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        (engine, conn), paths = _holding(db_url, backend, run)
        try:
            for path in paths:
                began = time.monotonic()
                if path.endswith("/cancel"):
                    answer = http.post(path, json={}, headers={"Authorization": "Bearer t"})
                else:
                    answer = http.get(path)
                took = time.monotonic() - began
                assert answer.status_code == 503, (path, answer.text)
                assert 0.8 < took < 4, (path, took)  # once: a lock timeout is not retried
        finally:
            if backend == "mysql":
                conn.exec_driver_sql("UNLOCK TABLES")
            conn.close()
            engine.dispose()
        if backend != "sqlite":  # the row only: the cancel's read goes by, its write waits
            from sqlalchemy import create_engine, text

            holder = create_engine(db_url)
            try:
                with holder.begin() as conn:
                    sql = "SELECT id FROM wf_executions WHERE id = :run FOR UPDATE"
                    conn.execute(text(sql), {"run": run})
                    began = time.monotonic()
                    answer = http.post(
                        f"/api/runs/{run}/cancel", json={}, headers={"Authorization": "Bearer t"}
                    )
                    assert answer.status_code == 503, answer.text
                    assert time.monotonic() - began < 4, "a lock timeout is not retried"
            finally:
                holder.dispose()
        assert http.get(f"/api/runs/{run}").json()["run"]["status"] == status
    with pytest.raises(wp.ClosedError):  # the client it made ended with it
        app.state.view.client.status(run)


def test_one_app_served_twice_makes_its_client_again(db_url: str) -> None:
    """The lifespan closed the client the app made; a second server of the same app (a
    second test client, a restart in-process) answered every request "Client has been
    closed"."""
    app = create_app(db_url)
    for _ in range(2):
        with serving(app) as base, httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/api/runs").status_code == 200


def test_a_mounted_app_answers_its_api_in_json_and_its_allowed_hosts_take_patterns(
    db_url: str,
) -> None:
    """Under a mount (``/wf``) the API's 404 and 405 were plain text again; and
    ``allowed_hosts`` patterns (``*``, ``*.example.com``) that Starlette's check took
    refused every request."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    with wp.Client(db_url) as client:
        inner = create_app(client=client, allowed_hosts=["*.example.com", "exact.test"])
        host = Starlette(routes=[Mount("/wf", app=inner)])
        with serving(host) as base, httpx.Client(base_url=base, timeout=30) as http:
            for name, status in (
                ("a.example.com", 200),
                ("deep.a.example.com:80", 200),
                ("exact.test", 200),
                ("example.com", 400),
                ("evil.test", 400),
                ("a.example.com.evil", 400),
            ):
                got = http.get("/wf/api/runs", headers={"Host": name})
                assert got.status_code == status, name
            missing = http.get("/wf/api/runs/nope", headers={"Host": "exact.test"})
            assert missing.status_code == 404 and missing.json() == {"error": "Run not found"}
            wrong = http.get("/wf/api/runs/nope/cancel", headers={"Host": "exact.test"})
            assert wrong.status_code == 405 and set(wrong.json()) == {"error"}
        anyone = create_app(client=client, allowed_hosts=["*"])
        with serving(anyone) as base, httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/api/runs", headers={"Host": "whatever.test"}).status_code == 200


@pytest.mark.parametrize("hosts", ["*.example.com", ["*example.com"], [""], [1]])
def test_allowed_hosts_are_checked_when_the_app_is_made(db_url: str, hosts: Any) -> None:
    """A ``str`` allowed any host (``"*"`` in it anywhere); a pattern other than ``*`` or
    ``*.name`` was ignored; both only showed at the first request."""
    with wp.Client(db_url) as client, pytest.raises(wp.InvalidArgumentError, match="allowed_hosts"):
        create_app(client=client, allowed_hosts=hosts)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), "10", True])
def test_a_bad_lock_timeout_is_refused_before_anything_is_opened(
    blank_db_url: str, seconds: Any
) -> None:
    """Checked before the app makes its client: a blank database is neither migrated nor
    created (an embedded file stays absent)."""
    from wf_persist import migrate

    with pytest.raises(wp.InvalidArgumentError, match="lock_timeout"):
        create_app(blank_db_url, lock_timeout=seconds)
    assert migrate.current(blank_db_url) is None
