"""Child runs: ``wf_executions.parent_id`` and the ``wf_run_tree`` view.

Why: a workflow may start child workflows (``ctx.start_child``). A child is a run like any
other (claimed and driven by any worker); its parent is stored with it so the tree of runs is
plain SQL: ``parent_id`` (indexed, for a parent's children) and ``wf_run_tree``, one row per
parent/child link with both workflows' names and the child's status and times. The parent's
history records which child each call started (``child.started``) and the child's outcome
(``child.finished``, written in the same transaction as the child's own outcome).

There is no foreign key: purging a finished parent keeps its children's rows (and theirs).

Downgrade drops the view, the index and the column; the runs stay (their links are lost).

Revision ID: wf_0007
Revises: wf_0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from wf_persist import migration_ops as ops

revision: str = "wf_0007"
down_revision: str | Sequence[str] | None = "wf_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_wf_executions__parent_id"


def upgrade() -> None:
    ops.add_column("wf_executions", sa.Column("parent_id", sa.String(36), nullable=True))
    ops.create_index(_INDEX, "wf_executions", ["parent_id"])
    ops.create_view(
        "wf_run_tree",
        """
        SELECT c.parent_id AS parent_id,
               p.workflow_name AS parent_workflow,
               c.id AS execution_id,
               c.workflow_name AS workflow_name,
               c.workflow_version AS workflow_version,
               c.status AS status,
               c.created_at AS created_at,
               c.finished_at AS finished_at
        FROM wf_executions c
        LEFT JOIN wf_executions p ON p.id = c.parent_id
        WHERE c.parent_id IS NOT NULL
        """,
    )


def downgrade() -> None:
    ops.drop_view("wf_run_tree")
    ops.drop_index(_INDEX, "wf_executions")
    # Plain ALTER TABLE ... DROP COLUMN everywhere (SQLite >= 3.35 has it): a batch copy of
    # wf_executions would cascade-delete its history under foreign_keys=ON.
    ops.drop_column("wf_executions", "parent_id")
