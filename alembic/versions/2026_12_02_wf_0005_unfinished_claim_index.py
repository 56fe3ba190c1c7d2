"""The claim index holds only unfinished runs where the backend has partial indexes.

Why: finished runs pile up (a million is ordinary) and never need a driver again, yet
every entry of ``(status, wake_at)`` was one a claim's plan could weigh or read, and a
planner that found a workflow's finished runs by another index took time growing with
them (an idle worker spent half a core looking for nothing). On PostgreSQL and SQLite the
index becomes partial (``WHERE status IN ('compensating', 'running', 'suspended')``, the
statuses spelled as the claim spells them): a claim is a range over unfinished runs' entries
only, and finishing a run removes its entry. MySQL and MariaDB have no partial indexes; there
the full ``(status, wake_at)`` index stays as it is, its leading ``status`` making the
claim's ``status IN (...) AND wake_at <= now`` a range over unfinished runs' entries too.

PostgreSQL is analyzed afterwards so the new index has statistics at once (autovacuum would
get there later), but only a table that has rows: an empty table analyzed is taken for a
small one from then on (a never-analyzed one is assumed to be at least 10 pages), so the
plans prepared on a new database while it is tiny would scan the whole table, and with
autovacuum off keep doing so as it grows. SQLite is not analyzed: its planner takes a partial
index whose predicate the query repeats without statistics.

Downgrade recreates the full index on PostgreSQL and SQLite; no data is touched.

Revision ID: wf_0005
Revises: wf_0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import context, op

revision: str = "wf_0005"
down_revision: str | Sequence[str] | None = "wf_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_wf_executions__status_wake_at"
_UNFINISHED = sa.text("status IN ('compensating', 'running', 'suspended')")


def _partial() -> bool:
    return op.get_bind().dialect.name in ("postgresql", "sqlite")


def upgrade() -> None:
    if not _partial():
        return
    op.drop_index(_INDEX, table_name="wf_executions")
    op.create_index(
        _INDEX,
        "wf_executions",
        ["status", "wake_at"],
        postgresql_where=_UNFINISHED,
        sqlite_where=_UNFINISHED,
    )
    if op.get_bind().dialect.name != "postgresql":
        return
    if context.is_offline_mode():  # the script decides when it runs (needs PL/pgSQL)
        op.execute(
            "DO $$ BEGIN IF EXISTS (SELECT 1 FROM wf_executions) THEN ANALYZE wf_executions; "
            "END IF; END $$"
        )
    elif op.get_bind().execute(sa.text("SELECT EXISTS (SELECT 1 FROM wf_executions)")).scalar():
        op.execute("ANALYZE wf_executions")


def downgrade() -> None:
    if not _partial():
        return
    op.drop_index(_INDEX, table_name="wf_executions")
    op.create_index(_INDEX, "wf_executions", ["status", "wake_at"])
