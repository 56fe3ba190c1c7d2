"""``wf-persist worker``: the one command that runs workflow code, imported from ``--app``."""

from __future__ import annotations

import enum
import importlib
import logging
import os
import signal
import sys
from typing import Annotated

import typer

from .. import logs, telemetry_sdk
from ..async_worker import ASYNC_CONCURRENCY
from ..errors import InvalidArgumentError
from ..runtime import Runtime
from ..worker import Worker
from .common import err


class LogFormat(enum.StrEnum):
    """How ``worker`` writes its log lines."""

    text = "text"
    json = "json"


def load_runtime(reference: str) -> Runtime:
    """Import ``module:attribute`` (a Runtime, or a callable returning one)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(
            f"--app must look like 'package.module:runtime', got {reference!r}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # the app's own code failed as it was imported: one line
        raise InvalidArgumentError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attribute.split("."):
        target = getattr(target, part, None)
    if callable(target) and not isinstance(target, Runtime):
        try:
            target = target()
        except Exception as exc:  # a factory that raised, or one that needs arguments
            raise InvalidArgumentError(
                f"calling {reference} failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(target, Runtime):
        raise InvalidArgumentError(f"{reference} is not a wf_persist Runtime")
    return target


def worker(
    app_ref: Annotated[
        str, typer.Option("--app", help="The runtime to serve, as 'package.module:runtime'.")
    ],
    concurrency: Annotated[
        int | None,
        typer.Option(help="Runs driven at once (default 4, with --async 1000)."),
    ] = None,
    event_loop: Annotated[
        bool,
        typer.Option(
            "--async",
            help="Drive the runs of async def workflows on one event loop, not a thread each "
            "(needs the async extra).",
        ),
    ] = False,
    poll_interval: Annotated[
        float | None, typer.Option(help="Seconds between looks for due work (default 0.25).")
    ] = None,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            "--log-format",
            help="Log lines on stderr: text, or json (one object per line, with execution_id, "
            "workflow, step, attempt).",
        ),
    ] = LogFormat.text,
    log_level: Annotated[
        str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")
    ] = "INFO",
) -> None:
    """Claim and drive due runs of the runtime's workflows until SIGINT/SIGTERM.

    Logs go to stderr through the 'wf_persist' loggers (runtime, steps, leases, worker).
    """
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise InvalidArgumentError(
            f"--log-level takes DEBUG, INFO, WARNING or ERROR, got {log_level!r}"
        )
    logs.configure(log_format.value, level)
    runtime = load_runtime(app_ref)
    if concurrency is None:
        concurrency = ASYNC_CONCURRENCY if event_loop else 4
    loop = Worker(
        runtime, concurrency=concurrency, poll_interval=poll_interval, event_loop=event_loop
    )

    def stop(signum: int, _frame: object) -> None:
        err.print(f"worker {runtime.owner}: stopping ({signal.Signals(signum).name})")
        # As close() does first: runs in flight stop before their next step and are handed
        # over, rather than driven to their end while the loop waits for them.
        runtime.closing = True
        loop.stop(timeout=0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    err.print(
        f"worker {runtime.owner}: serving {len(runtime.registered_workflows())} workflow "
        f"version(s), concurrency {concurrency}{' on an event loop' if event_loop else ''}"
    )
    try:
        loop.run()
    finally:
        runtime.close()
    left = runtime.drives_in_flight()
    if left:
        # A step that outlives close()'s wait would hold the process (its thread is joined
        # at exit) for as long as it runs, forever if it hangs; its lease is released, and
        # another worker takes the run (the step runs again there: at least once).
        err.print(
            f"worker {runtime.owner}: {left} run(s) still inside a step; their leases are "
            "released: exiting"
        )
        telemetry_sdk.flush()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
