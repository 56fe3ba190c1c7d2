"""Initial schema: workflow catalog, executions, history.

Why: the foundation every later revision builds on. The root revision carries the branch
label ``wf_persist`` so a host can merge our versions into its own Alembic chain
(``version_locations`` + ``upgrade heads``). Types here are frozen copies of what the models
declared at this revision; never import live models into a revision.

Downgrade drops all three tables and every row in them.

Revision ID: wf_0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from alembic import op
from wf_persist import migration_ops as ops

revision: str = "wf_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("wf_persist",)
depends_on: str | Sequence[str] | None = None


# MySQL/MariaDB: InnoDB; names and keys get a binary collation (compared byte for byte as
# elsewhere), ids keep the database default so host tables can reference them as they are.
_MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _key(length: int) -> sa.types.TypeEngine[object]:
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _ts() -> sa.types.TypeEngine[object]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    ops.create_table(
        "wf_workflows",
        sa.Column("name", _key(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source_hash", sa.String(64), nullable=False),
        sa.Column("registered_at", _ts(), nullable=False),
        sa.CheckConstraint("version >= 1", name=op.f("ck_wf_workflows__version_positive")),
        sa.PrimaryKeyConstraint("name", "version", name=op.f("pk_wf_workflows")),
        **_MYSQL,
    )
    ops.create_table(
        "wf_executions",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("workflow_name", _key(200), nullable=False),
        sa.Column("workflow_version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("input", _json(), nullable=True),
        sa.Column("result", _json(), nullable=True),
        sa.Column("error", _json(), nullable=True),
        sa.Column("idempotency_key", _key(255), nullable=True),
        sa.Column("actor", _key(255), nullable=True),
        sa.Column("next_seq", sa.BigInteger(), nullable=False),
        sa.Column("wake_at", _ts(), nullable=True),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", _ts(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("started_at", _ts(), nullable=True),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.CheckConstraint(
            "status IN ('running', 'suspended', 'compensating', 'completed', 'failed')",
            name=op.f("ck_wf_executions__status"),
        ),
        sa.ForeignKeyConstraint(
            ["workflow_name", "workflow_version"],
            ["wf_workflows.name", "wf_workflows.version"],
            name=op.f("fk_wf_executions__workflow_name_workflow_version__wf_workflows"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_wf_executions")),
        sa.UniqueConstraint(
            "workflow_name",
            "idempotency_key",
            name=op.f("uq_wf_executions__workflow_name_idempotency_key"),
        ),
        **_MYSQL,
    )
    ops.create_index(
        op.f("ix_wf_executions__workflow_name_created_at_id"),
        "wf_executions",
        ["workflow_name", "created_at", "id"],
    )
    ops.create_index(
        op.f("ix_wf_executions__workflow_name_workflow_version_created_at_id"),
        "wf_executions",
        ["workflow_name", "workflow_version", "created_at", "id"],
    )
    ops.create_index(
        op.f("ix_wf_executions__workflow_name_status_created_at_id"),
        "wf_executions",
        ["workflow_name", "status", "created_at", "id"],
    )
    ops.create_index(
        op.f("ix_wf_executions__status_wake_at"), "wf_executions", ["status", "wake_at"]
    )
    ops.create_table(
        "wf_history",
        sa.Column("execution_id", sa.String(36), nullable=False),
        sa.Column("sequence", sa.BigInteger(), nullable=False),
        sa.Column("type", _key(64), nullable=False),
        sa.Column("activity_name", _key(255), nullable=True),
        sa.Column("dedupe_key", _key(255), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("event", _json(), nullable=False),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["wf_executions.id"],
            name=op.f("fk_wf_history__execution_id__wf_executions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("execution_id", "sequence", name=op.f("pk_wf_history")),
        **_MYSQL,
    )
    ops.create_index(
        op.f("uq_wf_history__execution_id_dedupe_key"),
        "wf_history",
        ["execution_id", "dedupe_key"],
        unique=True,
        postgresql_where=sa.text("dedupe_key IS NOT NULL"),
        sqlite_where=sa.text("dedupe_key IS NOT NULL"),
    )
    ops.create_index(op.f("ix_wf_history__type_created_at"), "wf_history", ["type", "created_at"])


def downgrade() -> None:
    # Dropping a table drops its indexes; MySQL refuses to drop an index a foreign key needs
    # while the key exists, so drop whole tables, children first.
    ops.drop_table("wf_history")
    ops.drop_table("wf_executions")
    ops.drop_table("wf_workflows")
