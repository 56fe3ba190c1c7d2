"""Durable concurrency slots: ``wf_slots``.

Why: a step's ``Limit`` slot was a session lock (a PostgreSQL advisory lock, a MySQL named
lock), which a database restart, a failover or a killed session freed while the step ran
on: a waiting run took it, and ``Limit(1)`` had two holders. A slot is now a row that the
holding process keeps ahead of the database's clock (``expires_at``) and deletes when the
step ends; one whose holder died or froze lapses with its lease. The table also makes the
limit hold across processes on SQLite, and shows in SQL what holds a limit now.

Nothing to carry over: slots held by session locks end with the processes that held them.
Upgrade while the workers of the previous release are stopped (they would hold their slots
as session locks, unseen by the new ones). Downgrade drops the table.

Revision ID: wf_0012
Revises: wf_0011
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from alembic import op
from wf_persist import migration_ops as ops

revision: str = "wf_0012"
down_revision: str | Sequence[str] | None = "wf_0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _ts() -> sa.types.TypeEngine[object]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    ops.create_table(
        "wf_slots",
        sa.Column("slot_key", sa.String(64), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(32), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("execution_id", sa.String(36), nullable=False),
        sa.Column("step_name", sa.String(255), nullable=False),
        sa.Column("taken_at", _ts(), nullable=False),
        sa.Column("expires_at", _ts(), nullable=False),
        sa.CheckConstraint("slot >= 0", name=op.f("ck_wf_slots__slot_non_negative")),
        sa.PrimaryKeyConstraint("slot_key", "slot", name=op.f("pk_wf_slots")),
        **_MYSQL,
    )
    ops.create_index(op.f("ix_wf_slots__holder"), "wf_slots", ["holder"], unique=True)


def downgrade() -> None:
    ops.drop_table("wf_slots")
