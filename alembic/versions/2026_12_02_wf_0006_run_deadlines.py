"""Runs may have a deadline: ``wf_executions.deadline_at``.

Why: a workflow's ``timeout`` (``@workflow(timeout=...)`` or ``start(..., timeout=...)``)
must hold even when no process is alive when it passes, so the deadline lives with the run:
a run parked past it is woken at it (its ``wake_at`` is capped by the deadline), and
whichever worker drives it next cancels it with compensation and fails it with
``WorkflowTimeoutError``. NULL for runs without one, and for every run started before this
revision; nothing is indexed (the claim's index already schedules the wake-up).

Downgrade drops the column (deadlines of unfinished runs are lost with it).

Revision ID: wf_0006
Revises: wf_0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from wf_persist import migration_ops as ops

revision: str = "wf_0006"
down_revision: str | Sequence[str] | None = "wf_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts() -> sa.types.TypeEngine[object]:
    """The timestamp type of wf_0001, declared here (never the live models)."""
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    ops.add_column("wf_executions", sa.Column("deadline_at", _ts(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN everywhere (SQLite >= 3.35 has it): a batch copy of
    # wf_executions would cascade-delete its history under foreign_keys=ON.
    ops.drop_column("wf_executions", "deadline_at")
