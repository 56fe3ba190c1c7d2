"""A racing process: ``python -m tests.faults.racer URL DIR NAME KIND TARGET...``.

For each round ``r`` (one per TARGET) it touches ``DIR/ready-r-NAME``, waits for
``DIR/go-r`` (a handshake, so every racer is really ready when the round starts), does KIND to
TARGET and prints one JSON line ``{"round": r, "outcome": ...}``. A TARGET may carry a delay
in ms after the go (``id@3``), to sweep the interleavings of a race, and a KIND of its own
(``cancel-abrupt:id@3``).

KIND:
  start            start ``race-echo`` with idempotency key TARGET
  signal           deliver ``ping`` to run TARGET, payload ``{"sender": NAME}``
  cancel           cancel run TARGET, compensating
  cancel-abrupt    cancel run TARGET without compensation
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import wf_persist as wp

from .workflows import ALL, race_echo_wf, wait_for_file


def act(client: wp.WorkflowClient, kind: str, name: str, target: str) -> dict[str, Any]:
    try:
        if kind == "start":
            handle = client.start(race_echo_wf, 1, idempotency_key=target, actor=name)
            return {"outcome": "ok", "id": handle.execution_id, "created": handle.created}
        if kind == "signal":
            client.signal(target, "ping", {"sender": name}, actor=name)
        elif kind in ("cancel", "cancel-abrupt"):
            client.cancel(target, compensate=kind == "cancel", actor=name)
        else:
            raise SystemExit(f"unknown kind {kind!r}")
    except wp.WfPersistError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc)}
    return {"outcome": "ok"}


def main(argv: list[str]) -> None:
    url, directory, name, kind, *targets = argv
    where = Path(directory)
    runtime = wp.Runtime(url, auto_migrate=False)
    runtime.register(*ALL)
    client = runtime.client()
    try:
        for r, spec in enumerate(targets):
            spec, _, delay = spec.partition("@")
            what, _, target = spec.rpartition(":")
            (where / f"ready-{r}-{name}").touch()
            wait_for_file(where / f"go-{r}")
            if delay:
                time.sleep(int(delay) / 1000)
            began = time.time()
            result = act(client, what or kind, name, target)
            line = {"round": r, "name": name, "pid": os.getpid(), "t": began, **result}
            print(json.dumps(line), flush=True)
    finally:
        runtime.close()


if __name__ == "__main__":
    main(sys.argv[1:])
