"""The input and output JSON Schema of each cataloged workflow version, and runs listed
across workflows.

Why: a process without a workflow's code (an operations script, the ``wf-persist runs``
commands, a web handler) starts runs by name and must validate the input before anything is
written, as a process with the code does. Both columns are nullable: versions cataloged
before this revision get their schemas the next time a runtime registers them. Operators
list every run newest or oldest first whatever its workflow: an index on
``(created_at, id)`` keeps each keyset page a range scan.

Downgrade drops the index and the two columns; no other data is touched.

Revision ID: wf_0004
Revises: wf_0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from wf_persist import migration_ops as ops

revision: str = "wf_0004"
down_revision: str | Sequence[str] | None = "wf_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    ops.add_column("wf_workflows", sa.Column("input_schema", _JSON, nullable=True))
    ops.add_column("wf_workflows", sa.Column("output_schema", _JSON, nullable=True))
    ops.create_index("ix_wf_executions__created_at_id", "wf_executions", ["created_at", "id"])


def downgrade() -> None:
    ops.drop_index("ix_wf_executions__created_at_id", "wf_executions")
    # Plain ALTER TABLE ... DROP COLUMN everywhere (SQLite >= 3.35 has it): a batch copy of
    # wf_workflows would cascade to the runs that reference it under foreign_keys=ON.
    ops.drop_column("wf_workflows", "output_schema")
    ops.drop_column("wf_workflows", "input_schema")
