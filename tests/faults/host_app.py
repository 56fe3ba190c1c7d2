"""A host application's worker: ``--app tests.faults.host_app:runtime``.

The runtime is handed a plain SQLAlchemy engine, used as it is: for SQLite that is pysqlite's
own transaction handling, no WAL, its default busy timeout. The schema is migrated beforehand.
"""

from __future__ import annotations

import faulthandler
import os
import signal

import sqlalchemy

import wf_persist as wp

from .workflows import ALL, URL_ENV

# SIGUSR1 prints every thread's stack to stderr: the harness asks for it when a worker
# seems stuck, so the report shows where it waits.
faulthandler.register(signal.SIGUSR1, all_threads=True)

engine = sqlalchemy.create_engine(os.environ[URL_ENV])
runtime = wp.Runtime(
    engine,
    lease_ttl=float(os.environ.get("WF_FAULTS_LEASE_TTL", "1.5")),
    poll_interval=float(os.environ.get("WF_FAULTS_POLL_INTERVAL", "0.1")),
)
runtime.register(*ALL)
