"""``wf-persist workflows`` and ``wf-persist runs ...`` as a person or a script runs them:
real subprocesses on a real database of every backend, a ``wf-persist worker`` process
executing the runs, exit statuses asserted and ``--json`` parsed."""

from __future__ import annotations

import base64
import json
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

import wf_persist as wp
from wf_persist import migrate
from wf_persist.testing import without_cataloging

from .helpers import Finished, Processes, wait_until


def wf(procs: Processes, db_url: str, *args: str, code: int = 0) -> Finished:
    """``wf-persist ARGS`` on the test database; its exit status must be ``code``."""
    done = procs.cli(*args, check=False, env={"WF_PERSIST_DATABASE_URL": db_url})
    assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return done


def wf_json(procs: Processes, db_url: str, *args: str, code: int = 0) -> Any:
    return json.loads(wf(procs, db_url, *args, "--json", code=code).stdout)


def one_error_line(done: Finished, *says: str) -> str:
    """A refusal: exit status 1, nothing on stdout, one line 'error: ...' on stderr."""
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for text in says:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def start_worker(procs: Processes, db_url: str) -> None:
    procs.worker(db_url).wait_for_stderr("serving")


def test_the_full_loop_against_a_worker(db_url: str, procs: Processes) -> None:
    start_worker(procs, db_url)
    assert wf(procs, db_url, "runs", "start", "echo", "--input", "3", "--wait").stdout == (
        "[1, 2, 3]\n"
    )

    run_id = wf(procs, db_url, "runs", "start", "approval", "--input", "null").stdout.strip()
    with wp.Client(db_url) as client:
        wait_until(lambda: client.pending_signals(run_id), 30, "the approval wait")
    shown = wf(procs, db_url, "runs", "show", run_id).stdout
    assert run_id in shown and "suspended" in shown and '"approved"' in shown
    (command,) = [
        line.strip() for line in shown.splitlines() if line.strip().startswith("wf-persist ")
    ]
    words = shlex.split(command)
    assert words[:5] == ["wf-persist", "runs", "signal", run_id, "approval"]
    assert json.loads(words[5]) == {"approved": False}
    assert wf(procs, db_url, *words[1:]).stdout == "delivered\n"  # the printed command, as is
    assert wf(procs, db_url, "runs", "result", run_id, "--timeout", "30").stdout == '"rejected"\n'
    shown_json = wf_json(procs, db_url, "runs", "show", run_id)
    assert shown_json["status"] == "completed" and shown_json["pending_signals"] == []
    assert shown_json["result"] == "rejected" and shown_json["input"] is None

    pinned = wf_json(procs, db_url, "runs", "start", "echo@1", "--input", "2", "--actor", "ann")
    assert (pinned["workflow_name"], pinned["version"], pinned["created"]) == ("echo", 1, True)
    again = wf(procs, db_url, "runs", "start", "echo@1", "--input", "2", "--follow", "--json")
    streamed = [json.loads(line) for line in again.stdout.splitlines()]  # JSON Lines
    assert streamed[0]["event"]["type"] == "execution.started"
    assert streamed[0]["event"]["version"] == 1
    assert streamed[-2]["event"]["type"] == "workflow.completed"
    assert streamed[-1]["status"] == "completed" and streamed[-1]["value"] == [1, 2]
    outcome = wf_json(procs, db_url, "runs", "result", pinned["execution_id"], "--timeout", "30")
    assert outcome["value"] == [1, 2]
    one_error_line(
        wf(procs, db_url, "runs", "start", "echo@7", "--input", "2", code=1), "echo", "7"
    )

    failed_json = wf_json(
        procs, db_url, "runs", "start", "boom", "--input", "false", "--wait", code=3
    )
    assert failed_json["status"] == "failed" and failed_json["error"]["name"] == "Boom"
    shown = wf(procs, db_url, "runs", "show", failed_json["execution_id"]).stdout
    assert "Boom" in shown and "failed" in shown


def test_follow_timeout_cancel_and_events(db_url: str, procs: Processes) -> None:
    start_worker(procs, db_url)
    followed = wf(procs, db_url, "runs", "start", "echo", "--input", "4", "--follow")
    lines = followed.stdout.splitlines()
    assert lines[-1] == "[1, 2, 3, 4]"
    assert "execution.started" in lines[0] and "workflow.completed" in lines[-2]

    run_id = wf(procs, db_url, "runs", "start", "inbox", "--input", '{"count": 1}').stdout.strip()
    follower = procs.spawn(
        [sys.executable, "-m", "wf_persist.cli", "runs", "history", run_id, "--follow"],
        env={"WF_PERSIST_DATABASE_URL": db_url},
        name="history --follow",
    )
    wait_until(lambda: "signal.waiting" in follower.stdout(), 30, "the wait streamed")
    assert follower.popen.poll() is None, "a suspended run is followed, not left"
    wf(procs, db_url, "runs", "signal", run_id, "approval", '{"approved": true}', "--actor", "kim")
    streamed = procs.finish(follower, timeout=60).stdout.splitlines()
    sequences = [int(line.split()[0]) for line in streamed]
    assert sequences == list(range(1, len(sequences) + 1)), "each event once, in order"
    assert "workflow.completed" in streamed[-1]
    history = wf_json(procs, db_url, "runs", "history", run_id)
    assert [r["sequence"] for r in history] == sequences
    assert history[-1]["event"]["type"] == "workflow.completed"
    assert wf_json(procs, db_url, "runs", "show", run_id)["events"] == {
        "stage": "done",
        "received": 1,
    }

    nap = wf(procs, db_url, "runs", "start", "napper", "--input", "60").stdout.strip()
    late = wf(procs, db_url, "runs", "result", nap, "--timeout", "0.3", code=4)
    assert late.stdout == "" and "timeout" in late.stderr
    waited = wf_json(
        procs,
        db_url,
        "runs",
        "start",
        "napper",
        "--input",
        "60",
        "--wait",
        "--timeout",
        "0.2",
        code=4,
    )
    gone = waited["execution_id"]
    assert waited == {"execution_id": gone, "status": "suspended", "timed_out": True}
    cancelled = wf_json(procs, db_url, "runs", "cancel", nap, "--actor", "ops")
    assert cancelled["execution_id"] == nap
    assert cancelled["status"] in ("compensating", "failed")
    ended = wf(procs, db_url, "runs", "result", nap, "--timeout", "30", code=3)
    assert "Cancelled" in ended.stderr
    one_error_line(wf(procs, db_url, "runs", "cancel", nap, code=1), "Cannot cancel")
    assert wf(procs, db_url, "runs", "cancel", gone, "--no-compensate").stdout == "failed\n"
    streamed = wf(procs, db_url, "runs", "history", gone, "--follow").stdout.splitlines()
    assert "execution.cancelled" in streamed[-1]


def test_catalog_and_pages_as_json(db_url: str, procs: Processes, runtime: wp.Runtime) -> None:
    from .fixtures import workflows as w

    runtime.register(w.echo_wf, w.approval_wf)  # cataloged; no worker runs anything here
    catalog = wf_json(procs, db_url, "workflows")
    assert {e["name"] for e in catalog} == {"echo", "approval"}
    (echo,) = wf_json(procs, db_url, "workflows", "echo")
    assert (echo["version"], echo["input_schema"]) == (1, {"type": "integer"})
    assert echo["output_schema"] == {"items": {"type": "integer"}, "type": "array"}
    assert len(echo["source_hash"]) == 64 and "T" in echo["registered_at"]

    ids = [
        wf(procs, db_url, "runs", "start", "echo", "--input", str(n), "--actor", "ann").stdout
        for n in (1, 2, 3)
    ]
    ids.append(wf(procs, db_url, "runs", "start", "approval", "--actor", "bob").stdout)
    ids = [i.strip() for i in ids]
    first = wf_json(procs, db_url, "runs", "list", "--limit", "3")
    assert [r["execution_id"] for r in first["items"]] == ids[:3]
    assert first["next_cursor"]
    rest = wf_json(procs, db_url, "runs", "list", "--limit", "3", "--cursor", first["next_cursor"])
    assert [r["execution_id"] for r in rest["items"]] == ids[3:]
    assert rest["next_cursor"] is None
    assert rest["items"][0]["workflow_name"] == "approval" and rest["items"][0]["actor"] == "bob"

    def listed(*args: str) -> list[str]:
        return [r["execution_id"] for r in wf_json(procs, db_url, "runs", "list", *args)["items"]]

    assert listed("echo", "--actor", "ann", "--version", "1") == ids[:3]
    assert listed("--status", "running", "--since", "1h") == ids
    assert listed("--since", "2999-01-01T00:00:00+00:00") == []
    human = wf(procs, db_url, "runs", "list", "--limit", "2")
    assert ids[0] in human.stdout and ids[2] not in human.stdout
    assert "--cursor" in human.stderr


def test_bad_input_is_one_line_and_writes_nothing(
    db_url: str, procs: Processes, runtime: wp.Runtime, tmp_path: Path
) -> None:
    from .fixtures import workflows as w

    runtime.register(w.echo_wf, w.approval_wf)
    bad = [
        (("runs", "start", "echo", "--input", '"3"'), "input of workflow echo"),
        (("runs", "start", "nope", "--input", "1"), "nope"),
        (("runs", "list", "--status", "asleep"), "unknown status"),
        (("runs", "list", "--limit", "0"), "limit"),
        (("runs", "list", "--cursor", "garbage"), "cursor"),
        (("runs", "show", "4b1c3c2e-0000-4000-8000-000000000000"), "4b1c3c2e"),
    ]
    for args, says in bad:
        one_error_line(wf(procs, db_url, *args, code=1), says)

    payload = tmp_path / "input.json"
    payload.write_text("2")
    run_id = wf(procs, db_url, "runs", "start", "echo", "--input", f"@{payload}").stdout.strip()
    listed = wf_json(procs, db_url, "runs", "list")["items"]
    assert [r["execution_id"] for r in listed] == [run_id], "no refused start wrote a run"
    assert listed[0]["input"] == 2
    one_error_line(
        wf(procs, db_url, "runs", "signal", run_id, "approval", '{"approved": true}', code=1),
        "approval",
    )
    buffered = wf_json(
        procs, db_url, "runs", "signal", run_id, "approval", '{"approved": true}', "--buffer"
    )
    assert buffered == {"execution_id": run_id, "signal": "approval", "outcome": "buffered"}
    usage = wf(procs, db_url, "runs", "list", "--limit", "many", code=2)
    assert usage.stdout == "" and "--limit" in usage.stderr


def test_an_unmigrated_database_is_refused_without_writing(
    blank_db_url: str, procs: Processes
) -> None:
    for args in (("runs", "list"), ("runs", "start", "echo")):
        one_error_line(wf(procs, blank_db_url, *args, code=1), "not migrated", "db upgrade")
    assert wf(procs, blank_db_url, "db", "current", code=3).stdout == "none\n"


def test_version_help_arguments_and_connection_failures(procs: Processes, tmp_path: Path) -> None:
    """What fails before a database is opened, or because it cannot be (once: no backend)."""
    assert procs.cli("--version").stdout == f"wf-persist {metadata.version('wf-persist')}\n"
    text = " ".join(procs.cli("runs", "result", "--help", env={"COLUMNS": "200"}).stdout.split())
    assert "Exit status: 0 the run completed; 3 the run failed; 4 --timeout passed" in text

    url = "postgresql://postgres:secret@127.0.0.1:1/x"
    for args in (("runs", "list"), ("db", "upgrade")):
        done = procs.cli(*args, "--url", url, check=False)
        line = one_error_line(done, "postgresql+psycopg://postgres:***@127.0.0.1:1/x")
        assert "secret" not in done.stderr + done.stdout and "refused" in line.lower()
    # A password in the query (libpq's, a key's passphrase, PyMySQL's) is hidden too; a
    # password too short to look for leaves the driver's words whole.
    for url in (
        "postgresql://app@127.0.0.1:1/x?password=s3cretPW",
        "postgresql://app@127.0.0.1:1/x?sslpassword=s3cretPW",
        "mysql+pymysql://app@127.0.0.1:1/x?ssl_key_password=s3cretPW",
    ):
        done = procs.cli("runs", "list", "--url", url, check=False)
        assert "s3cretPW" not in done.stderr + done.stdout and "%2A%2A%2A" in done.stderr
    done = procs.cli("runs", "list", "--url", "postgresql://app:a@127.0.0.1:1/x", check=False)
    assert "port 1 failed" in one_error_line(done, "app:***@127.0.0.1:1/x")

    missing = tmp_path / "missing.sqlite3"
    refused: list[tuple[tuple[str, ...], str]] = [
        (("runs", "list"), "not migrated"),
        (("runs", "start", "echo", "--input", "{"), "not JSON"),
        (("runs", "start", "echo", "--input", f"@{tmp_path / 'nope.json'}"), "cannot read"),
        (("runs", "start", "echo@x"), "name@version"),
        (("runs", "start", "echo@1", "--version", "2"), "two versions"),
        (("runs", "list", "--since", "yesterday"), "--since"),
        (("runs", "signal", "id", "approval", f"@{tmp_path / 'nope.json'}"), "cannot read"),
        # A device that never ends is read up to the largest value a database stores.
        (("runs", "signal", "id", "approval", "@/dev/zero"), "larger than any value"),
        (("runs", "start", "echo", "--input", "@/dev/zero"), "larger than any value"),
    ]
    for words, says in refused:
        one_error_line(procs.cli(*words, "--url", f"sqlite:///{missing}", check=False), says)
    usage = procs.cli("runs", "show", check=False)
    assert usage.returncode == 2 and "Missing argument" in usage.stderr and usage.stdout == ""
    assert not missing.exists()


def test_replay_check_gates_a_deploy_and_the_worker_logs_json(
    db_url: str, procs: Processes, runtime: wp.Runtime
) -> None:
    from .fixtures import workflows as w

    runtime.register(w.determinism_wf, w.explode_wf)
    client = runtime.client()
    done = client.start(w.determinism_wf).execution_id
    client.result(done, timeout=10)
    app = ("replay-check", "--app", "tests.fixtures.app:runtime")
    env = {"WF_PERSIST_DATABASE_URL": db_url}
    ok = procs.cli(*app, "--json", check=False, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"checked": 1, "diverged": []}
    # The same runs read through --url, checked against code whose body changed.
    bad = procs.cli(
        *app, "--url", db_url, "--json", check=False, env={**env, "WF_TEST_DIVERGE": "1"}
    )
    assert bad.returncode == 3, bad.stderr
    [report] = json.loads(bad.stdout)["diverged"]
    assert report["execution_id"] == done and "saw step:second#1" in report["divergence"]
    table = procs.cli(*app, check=False, env={**env, "WF_TEST_DIVERGE": "1"})
    assert table.returncode == 3 and done in table.stdout and "1 diverge" in table.stderr
    assert procs.cli(*app, "--since", "1d", check=False, env=env).returncode == 0

    worker = procs.worker(db_url, "--log-format", "json")
    worker.wait_for_stderr("serving")
    failing = client.start(w.explode_wf, "kaboom").execution_id
    wait_until(lambda: client.status(failing) == "failed", 30, "the run to fail")
    wait_until(
        lambda: any(
            f'"execution_id": "{failing}"' in line and '"wf_persist.runtime"' in line
            for line in worker.stderr().splitlines()
        ),
        30,
        "its run's log line (written after its outcome)",
    )
    lines = [json.loads(line) for line in worker.stderr().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("execution_id") == failing]
    steps = [line for line in mine if line["logger"] == "wf_persist.steps"]
    assert steps and all(s["workflow"] == "explode" and s["step"] == "explode" for s in steps)
    assert steps[-1]["level"] == "ERROR" and steps[-1]["attempt"] >= 1
    assert any(line["logger"] == "wf_persist.runtime" for line in mine)
    bad_level = procs.cli(
        "worker", "--app", "tests.fixtures.app:runtime", "--log-level", "LOUD", check=False, env=env
    )
    one_error_line(bad_level, "--log-level")


def test_hostile_arguments_are_one_line_errors_that_write_nothing(
    db_url: str, procs: Processes, runtime: wp.Runtime, tmp_path: Path
) -> None:
    """Arguments past what the parser, the database integer or the arguments check takes:
    each is refused in one line, no traceback, and no run is left behind."""
    from .fixtures import workflows as w

    runtime.register(w.echo_wf)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    forged = base64.urlsafe_b64encode(b"[" * 3000).decode()
    refused: list[tuple[tuple[str, ...], str]] = [
        (("runs", "start", "echo", "--input", "[" * 3000 + "]" * 3000), "nested too deeply"),
        (("runs", "start", "echo", "--input", f"@{deep}"), "nested too deeply"),
        (("runs", "start", "echo", "--input", '{"n": 1, "n": 2}'), "key 'n' twice"),
        (("runs", "start", "echo@²"), "name@version"),
        (("runs", "start", "echo", "--input", "3", "--wait", "--timeout", "-1"), "timeout"),
        (("runs", "start", "echo", "--input", "3", "--follow", "--timeout", "nan"), "timeout"),
        (("runs", "list", "--limit", str(2**64)), "limit"),
        (("runs", "list", "--cursor", forged), "cursor"),
        (("purge", "--older-than", "1d", "--batch-size", str(2**64)), "batch_size"),
        (("purge", "--older-than", "\u0663d"), "an age like 30d"),  # an Arabic-Indic 3
        (("db", "upgrade", "nonsense"), "nonsense"),
        (("db", "downgrade", "nonsense"), "nonsense"),
    ]
    for args, says in refused:
        one_error_line(wf(procs, db_url, *args, code=1), says)
    secret = tmp_path / "secret.txt"
    secret.write_text("root:hunter2:20228:0:99999:7:::\n")
    shown = wf(procs, db_url, "runs", "start", "echo", "--input", f"@{secret}", code=1)
    one_error_line(shown, "is not JSON")
    assert "hunter2" not in shown.stdout + shown.stderr, "a file's text is not echoed"
    assert wf_json(procs, db_url, "runs", "list")["items"] == []
    assert wf(procs, db_url, "db", "current").stdout.strip() == migrate.SCHEMA_HEAD


def test_unparseable_urls_broken_apps_and_uri_filenames(procs: Processes, tmp_path: Path) -> None:
    """Failures before a database is used (once: no backend)."""
    done = procs.cli("runs", "list", "--url", "postgresql://u:s3cret@127.0.0.1:port/x", check=False)
    one_error_line(done, "not a database URL", "u:***@")
    assert "s3cret" not in done.stderr + done.stdout

    (tmp_path / "raises_app.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / "factory_app.py").write_text("def make():\n    raise ValueError('no db')\n")
    for app, says in (("raises_app:runtime", "broken at import"), ("factory_app:make", "no db")):
        for command in ("replay-check", "worker"):
            done = procs.cli(command, "--app", app, check=False, cwd=tmp_path)
            one_error_line(done, says)

    # A URI filename names a file too: reading commands must not create it.
    missing = tmp_path / "missing.sqlite3"
    done = procs.cli("workflows", "--url", f"sqlite:///file:{missing}?uri=true", check=False)
    one_error_line(done, "not migrated")
    assert not missing.exists()


def test_the_upgrade_command_quotes_the_schema() -> None:
    command = migrate.upgrade_command(make_url("postgresql://u:pw@h/db"), "a;b c")
    assert shlex.split(command)[-2:] == ["--schema", "a;b c"]
    assert "pw" not in command


@wp.workflow(name="cli-raises", version=1)
def raises_wf(ctx: wp.Context, message: str) -> None:
    raise ValueError(message)


def test_stored_values_reach_the_terminal_as_text_never_as_controls(
    db_url: str, procs: Processes, runtime: wp.Runtime
) -> None:
    """An actor holding escape sequences (retitle the window, clear the screen), a C1
    control and a right-to-left override, and an id carrying the same, are printed as
    their escapes by every human-readable command and by the error line; ``--json`` keeps
    the stored text exactly."""
    from .fixtures import workflows as w

    runtime.register(w.echo_wf)
    actor = "ev\x1b]0;PWNED\x07il\x1b[2J\x9b\u202e"
    run_id = runtime.client().start(w.echo_wf, 1, actor=actor).execution_id
    acting = ("\x1b", "\x07", "\x9b", "\u202e")
    for args in (("runs", "list"), ("runs", "show", run_id), ("runs", "history", run_id)):
        shown = wf(procs, db_url, *args).stdout
        assert not any(c in shown for c in acting), (args, shown)
    listed = wf(procs, db_url, "runs", "show", run_id).stdout
    assert "ev\\u001b]0;PWNED\\u0007il\\u001b[2J\\u009b\\u202e" in listed
    assert wf_json(procs, db_url, "runs", "show", run_id)["actor"] == actor
    refused = one_error_line(wf(procs, db_url, "runs", "show", "abc\x1b]0;PWNED\x07", code=1))
    assert "abc\\u001b]0;PWNED\\u0007" in refused
    runtime.register(raises_wf)
    broken = runtime.client().execute(raises_wf, actor).execution_id
    failed = wf(procs, db_url, "runs", "result", broken, code=3)
    assert "PWNED" in failed.stderr
    assert not any(c in failed.stderr + failed.stdout for c in acting), failed


@wp.workflow(name="cli-named-wait", version=1)
def named_wait_wf(ctx: wp.Context, name: str) -> str:
    ctx.wait_for_signal(name, dict[str, Any])
    return "heard"


def test_the_pasted_signal_command_names_a_signal_with_control_characters(
    db_url: str, procs: Processes, runtime: wp.Runtime
) -> None:
    """``runs show`` prints a wait's signal name with its terminal controls as escapes; the
    command it prints for pasting ANSI-C quotes them, so bash reads back the same name (a
    plain quoted escape named another signal, and the paste was refused)."""
    name = "go\x1b[2J\u202e'\\"
    runtime.register(named_wait_wf)
    run_id = runtime.client().start(named_wait_wf, name).execution_id
    runtime.drive(run_id)
    shown = wf(procs, db_url, "runs", "show", run_id).stdout
    assert not any(c in shown for c in ("\x1b", "\u202e"))
    (command,) = [
        line.strip() for line in shown.splitlines() if line.strip().startswith("wf-persist ")
    ]
    shell = f'wf-persist() {{ "{sys.executable}" -m wf_persist.cli "$@"; }}; {command}'
    done = procs.run(
        ["bash", "-c", shell], check=False, env={"WF_PERSIST_DATABASE_URL": db_url}, name="paste"
    )
    assert (done.returncode, done.stdout) == (0, "delivered\n"), done.stderr
    assert runtime.drive(run_id)
    assert runtime.client().result(run_id, timeout=10).unwrap() == "heard"


def _catalog(db_url: str) -> list[tuple[str, int, str]]:
    with wp.Client(db_url) as client:
        return [(e.name, e.version, e.source_hash) for e in client.workflows()]


#: A release that edited ``determinism`` v1 without a new version, and adds a workflow.
CLASH_APP = """
import os
import wf_persist as wp

@wp.workflow(name='determinism', version=1)
def changed(ctx: wp.Context) -> str:
    return 'changed'

@wp.workflow(name='clash-new', version=1)
def new(ctx: wp.Context) -> int:
    return 1

runtime = wp.Runtime(os.environ['WF_PERSIST_DATABASE_URL'])
runtime.register(new, changed)
"""
#: An application that builds its runtime on a thread of its own.
THREAD_APP = """
import os
import threading
import wf_persist as wp

@wp.workflow(name='threaded-new', version=1)
def new(ctx: wp.Context) -> int:
    return 1

def make() -> wp.Runtime:
    made = []
    url = os.environ['WF_PERSIST_DATABASE_URL']
    thread = threading.Thread(target=lambda: made.append(wp.Runtime(url)))
    thread.start()
    thread.join()
    made[0].register(new)
    return made[0]
"""
#: An application whose runtime opens the database the gate is given.
GATE_APP = """
import os
import wf_persist as wp

runtime = wp.Runtime(os.environ['WF_PERSIST_DATABASE_URL'])
"""


def _gate(
    procs: Processes, where: Path, app: str, env: dict[str, str], source: str, *extra: str
) -> Finished:
    """``wf-persist replay-check --app APP`` of a module (``source``) written in ``where``."""
    (where / f"{app.partition(':')[0]}.py").write_text(source)
    return procs.cli("replay-check", "--app", app, *extra, check=False, env=env, cwd=where)


def test_replay_check_catalogs_nothing_and_still_refuses_a_changed_version(
    db_url: str, procs: Processes, runtime: wp.Runtime, tmp_path: Path
) -> None:
    """The gate loads the next release's code, which registers versions the running fleet
    does not serve: were they cataloged, every start by name after a gate that failed (or
    a release never deployed) would pin its run to a version no worker drives."""
    from .fixtures import workflows as w

    runtime.register(w.determinism_wf)
    client = runtime.client()
    client.result(client.start(w.determinism_wf).execution_id, timeout=10)
    before = _catalog(db_url)
    env = {"WF_PERSIST_DATABASE_URL": db_url}
    done = procs.cli("replay-check", "--app", "tests.fixtures.app:runtime", check=False, env=env)
    assert done.returncode == 0, done.stderr
    assert _catalog(db_url) == before == [("determinism", 1, w.determinism_wf.source_hash)]
    # A start by name still pins the version the fleet serves.
    with wp.Client(db_url) as thin:
        assert thin.start("determinism").version == 1

    # The same version with another body is still refused, and nothing is written.
    clash = _gate(procs, tmp_path, "clash_app:runtime", env, CLASH_APP)
    one_error_line(clash, "WorkflowVersionConflictError", "determinism")
    # Also where the app's runtime has a database of its own and --url names the fleet's.
    own = {"WF_PERSIST_DATABASE_URL": f"sqlite:///{tmp_path / 'own.sqlite3'}"}
    elsewhere = _gate(procs, tmp_path, "clash_app:runtime", own, CLASH_APP, "--url", db_url)
    one_error_line(elsewhere, "determinism@v1 is already cataloged with different source")
    assert _catalog(db_url) == before

    # An application that builds its runtime on a thread of its own.
    threaded = _gate(procs, tmp_path, "thread_app:make", env, THREAD_APP)
    assert threaded.returncode == 0, threaded.stderr
    assert _catalog(db_url) == before


def test_a_runtime_built_without_cataloging_checks_and_catalogs_at_its_first_start(
    db_url: str, runtime: wp.Runtime
) -> None:
    from .fixtures import workflows as w

    runtime.register(w.echo_wf)
    with without_cataloging():
        gate = wp.Runtime(db_url)
    try:
        gate.register(w.determinism_wf, w.echo_wf)
        assert [n for n, _, _ in _catalog(db_url)] == ["echo"]
        assert gate.registered_workflows() == [("determinism", 1), ("echo", 1)]
        # Driven only once the catalog holds that very source (another release may catalog
        # other code under a version this runtime did not write).
        assert gate.runnable_workflows() == [("echo", 1)]
        # Registered outside the block, it still catalogs nothing: the runtime was built
        # for a gate.
        gate.register(w.explode_wf)
        assert [n for n, _, _ in _catalog(db_url)] == ["echo"]
        # A start is a write the caller asked for: its version is cataloged first.
        outcome = gate.client().execute(w.determinism_wf)
        assert isinstance(outcome, wp.Completed)
        assert [n for n, _, _ in _catalog(db_url)] == ["determinism", "echo"]
        assert gate.runnable_workflows() == [("determinism", 1), ("echo", 1)]
    finally:
        gate.close()


@pytest.mark.needs("embedded")
def test_replay_check_never_upgrades_the_fleets_database(
    db_url: str, procs: Processes, tmp_path: Path
) -> None:
    """An embedded database behind head (the fleet's release is older) stays as it is: an
    upgrade would lock that release out of its own database; a database not made yet is
    made (it holds no run to lose)."""
    older = "wf_0010"
    migrate.downgrade(db_url, older)
    done = _gate(procs, tmp_path, "gate_app:runtime", {"WF_PERSIST_DATABASE_URL": db_url}, GATE_APP)
    one_error_line(done, "SchemaVersionError", "at revision wf_0010")
    assert migrate.current(db_url) == older
    # Nor does a client opened for a gate in Python (reading the fleet's runs).
    with without_cataloging(), pytest.raises(wp.SchemaVersionError):
        wp.Client(db_url)
    assert migrate.current(db_url) == older
    fresh = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    made = _gate(procs, tmp_path, "gate_app:runtime", {"WF_PERSIST_DATABASE_URL": fresh}, GATE_APP)
    assert made.returncode == 0, made.stderr
    assert migrate.current(fresh) == migrate.SCHEMA_HEAD


@pytest.mark.needs("embedded")
def test_an_error_while_waiting_says_the_run_was_started(
    runtime: wp.Runtime, db_url: str, procs: Processes
) -> None:
    """``runs start --wait`` whose wait failed (the database unusable meanwhile) exited 1,
    which the exit status table read as "nothing written": a script would start the run
    again. The error now says the run was started, and how to wait for it again."""
    from .fixtures import workflows as w

    runtime.register(w.napper_wf)
    start = ["runs", "start", "napper", "--input", "3600", "--wait"]
    waiting = procs.spawn(
        [sys.executable, "-m", "wf_persist.cli", *start], env={"WF_PERSIST_DATABASE_URL": db_url}
    )
    waiting.wait_for_stderr("started napper v1 run")
    run = waiting.stderr().split()[-1]
    with runtime.engine.begin() as conn:  # the table gone from under the wait
        conn.exec_driver_sql("ALTER TABLE wf_executions RENAME TO wf_executions_gone")
    assert waiting.popen.wait(timeout=60) == 1
    said = " ".join(waiting.stderr().split())
    assert f"run {run} was started and goes on" in said, said
    assert f"wf-persist runs result {run}" in said
    assert said.count("error:") == 1
