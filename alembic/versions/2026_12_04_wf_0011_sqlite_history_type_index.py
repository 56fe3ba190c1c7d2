"""SQLite's ``(type, created_at)`` history index leaves out step events too.

Why: every step attempt writes ``step.started`` and ``step.completed``, most rows of any
history, and none of wf_persist's queries looks them up by type (a run's history is read by
``execution_id``). On SQLite each such entry is one more page a step's commit writes to the
WAL and a checkpoint copies back: the step's statements, sent by a bare ``sqlite3`` loop
(WAL, ``synchronous=FULL``), took 317 µs a write with them and 277 µs without (13 %).
PostgreSQL left them out in wf_0008.

SQLite's planner uses a partial index only for a query that repeats the index's condition:
a query by type reads it when it adds ``AND type NOT IN ('step.completed',
'step.started')`` (``docs/sql.md``); without the condition it reads the table.

The new index is built inside the migration's transaction, which holds writes meanwhile (a
few seconds per million events): run it in a deploy window on a large database. Downgrade
recreates the full index; no data is touched. Nothing changes on PostgreSQL (partial since
wf_0008) or MySQL/MariaDB (no partial indexes). Each step can be re-run: a host whose own
migration environment commits each statement (merged mode) and was stopped between the
``DROP INDEX`` and the ``CREATE INDEX`` finds no index to drop, and goes on.

Revision ID: wf_0011
Revises: wf_0010
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "wf_0011"
down_revision: str | Sequence[str] | None = "wf_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_wf_history__type_created_at"
_NOT_STEP_EVENT = sa.text("type NOT IN ('step.completed', 'step.started')")


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    if not _sqlite():
        return
    op.drop_index(_INDEX, table_name="wf_history", if_exists=True)
    op.create_index(_INDEX, "wf_history", ["type", "created_at"], sqlite_where=_NOT_STEP_EVENT)


def downgrade() -> None:
    if not _sqlite():
        return
    op.drop_index(_INDEX, table_name="wf_history", if_exists=True)
    op.create_index(_INDEX, "wf_history", ["type", "created_at"])
