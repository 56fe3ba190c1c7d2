"""The worker application of the fault suite: ``--app tests.faults.app:runtime``.

The runtime opens ``$WF_PERSIST_DATABASE_URL`` itself (its own engine), with the lease and
poll interval the harness chose (``WF_FAULTS_LEASE_TTL``, ``WF_FAULTS_POLL_INTERVAL``).
"""

from __future__ import annotations

import faulthandler
import os
import signal

import wf_persist as wp

from .workflows import ALL, URL_ENV

# SIGUSR1 prints every thread's stack to stderr: the harness asks for it when a worker
# seems stuck, so the report shows where it waits.
faulthandler.register(signal.SIGUSR1, all_threads=True)

runtime = wp.Runtime(
    os.environ[URL_ENV],
    lease_ttl=float(os.environ.get("WF_FAULTS_LEASE_TTL", "1.5")),
    poll_interval=float(os.environ.get("WF_FAULTS_POLL_INTERVAL", "0.1")),
)
runtime.register(*ALL)
