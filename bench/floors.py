"""The floors: the cheapest durable writes raw SQLAlchemy Core can do on the same database.

* ``committed``: INSERT + COMMIT per write on one connection (on SQLite through an engine with
  wf_persist's settings: WAL, ``synchronous=FULL``, ``BEGIN IMMEDIATE``);
* ``autocommit`` (PostgreSQL): the INSERT alone in autocommit, one round trip per write;
* ``threaded``: the autocommit INSERT (SQLite: INSERT + COMMIT) from 8 threads, each on a
  connection of its own: the floor of the concurrent workload.

Ids keep counting across repetitions so every write is a fresh row, as a step is.
"""

from __future__ import annotations

import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Column, Connection, Engine, Integer, MetaData, Table, Text, insert

import wf_persist as wp
from bench.measure import Rate, ServerCpu, timed

_metadata = MetaData()
floor_table = Table(
    "bench_floor",
    _metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("doc", Text, nullable=False),
)


class Floor:
    def __init__(self, url: str, server: ServerCpu | None = None, threads: int = 8) -> None:
        # wf_persist's engine settings (SQLite: WAL, synchronous=FULL, BEGIN IMMEDIATE);
        # on PostgreSQL the same as a plain engine.
        self.engine: Engine = wp.create_engine(url, pool_size=threads + 2, max_overflow=0)
        self.sqlite = self.engine.dialect.name == "sqlite"
        self.server = server
        self.threads = threads
        self._ids = itertools.count()
        self._lock = threading.Lock()
        _metadata.create_all(self.engine)
        self.committed(1)  # warm-up: pool, connect-time pragmas, statement cache

    def close(self) -> None:
        self.engine.dispose()

    def _next_ids(self, count: int) -> list[int]:
        with self._lock:
            return [next(self._ids) for _ in range(count)]

    @staticmethod
    def _write(conn: Connection, ids: list[int], commit: bool) -> None:
        stmt = insert(floor_table)
        for i in ids:
            doc = json.dumps({"i": i, "ok": True, "msg": "hello"})
            conn.execute(stmt, {"id": i, "doc": doc})
            if commit:
                conn.commit()

    def committed(self, count: int) -> Rate:
        """INSERT + COMMIT per write, one connection."""
        ids = self._next_ids(count)
        with self.engine.connect() as conn:
            return timed(count, lambda: self._write(conn, ids, True), self.server)

    def autocommit(self, count: int) -> Rate:
        """The INSERT alone in autocommit, one round trip per write (PostgreSQL)."""
        ids = self._next_ids(count)
        with self.engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            return timed(count, lambda: self._write(auto, ids, False), self.server)

    def threaded(self, count: int) -> Rate:
        """``count`` writes spread over the threads, each with its own connection
        (autocommit on PostgreSQL, INSERT + COMMIT on SQLite)."""
        per = [self._next_ids(count // self.threads) for _ in range(self.threads)]
        total = sum(len(ids) for ids in per)
        conns = [self.engine.connect() for _ in range(self.threads)]
        try:
            ready = [
                c if self.sqlite else c.execution_options(isolation_level="AUTOCOMMIT")
                for c in conns
            ]

            def work() -> None:
                with ThreadPoolExecutor(self.threads) as pool:
                    futures = [
                        pool.submit(self._write, c, ids, self.sqlite)
                        for c, ids in zip(ready, per, strict=True)
                    ]
                    for fut in futures:
                        fut.result()

            return timed(total, work, self.server)
        finally:
            for conn in conns:
                conn.close()
