"""Fencing tokens, drive-failure counts, and step attempts that survive a crash.

Why: a lease named by its owner let a paused worker that came back under the same name
record steps another worker had already recorded. ``claim_epoch`` is bumped by every claim
and every write of a driver is conditional on it (a fencing token). ``drive_failures`` counts
consecutive drives that stopped on an error, so a run that fails the same way every time is
failed after a bound instead of being re-driven forever.

The views are recreated: ``wf_step_attempts`` now pairs a ``step.started`` with the outcome of
the same attempt (a long step's start is recorded before it finishes, so the two need not be
adjacent) and reports attempts cut short by a crash as ``abandoned``; both views take names
from the events instead of splitting activity names (a name may contain ``#``).

Downgrade restores the previous views and drops the two columns; no other data is touched.

Revision ID: wf_0003
Revises: wf_0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from wf_persist import migration_ops as ops

revision: str = "wf_0003"
down_revision: str | Sequence[str] | None = "wf_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Per backend: a text field and an integer field of the event JSON, and the milliseconds
# between two timestamps.
_FUNCS = {
    "postgresql": (
        "({e}->>'{k}')",
        "CAST(({e}->>'{k}') AS INTEGER)",
        "EXTRACT(EPOCH FROM ({t1} - {t0})) * 1000",
    ),
    "sqlite": (
        "json_extract({e}, '$.{k}')",
        "CAST(json_extract({e}, '$.{k}') AS INTEGER)",
        "(julianday({t1}) - julianday({t0})) * 86400000.0",
    ),
    "mysql": (
        "JSON_UNQUOTE(JSON_EXTRACT({e}, '$.{k}'))",
        "CAST(JSON_UNQUOTE(JSON_EXTRACT({e}, '$.{k}')) AS SIGNED)",
        "TIMESTAMPDIFF(MICROSECOND, {t0}, {t1}) / 1000.0",
    ),
}


def _funcs() -> tuple[str, str, str]:
    name = op.get_bind().dialect.name
    return _FUNCS["mysql" if name in ("mysql", "mariadb") else name]


def _create_views() -> None:
    text, integer, millis = _funcs()
    s_attempt = integer.format(e="s.event", k="attempt")
    ops.create_view(
        "wf_step_attempts",
        f"""
        SELECT s.execution_id AS execution_id,
               e.workflow_name AS workflow_name,
               e.workflow_version AS workflow_version,
               {text.format(e="s.event", k="stepName")} AS step_name,
               s.activity_name AS activity_name,
               {s_attempt} AS attempt,
               s.created_at AS started_at,
               f.created_at AS finished_at,
               CASE WHEN f.type = 'step.completed' THEN 'completed'
                    WHEN f.type = 'step.failed' THEN 'failed'
                    WHEN e.status IN ('completed', 'failed') THEN 'abandoned'
                    WHEN EXISTS (
                        SELECT 1 FROM wf_history n
                        WHERE n.execution_id = s.execution_id
                          AND n.activity_name = s.activity_name
                          AND n.type = 'step.started'
                          AND n.sequence > s.sequence) THEN 'abandoned'
                    ELSE 'running' END AS outcome,
               {millis.format(t0="s.created_at", t1="f.created_at")} AS duration_ms
        FROM wf_history s
        JOIN wf_executions e ON e.id = s.execution_id
        LEFT JOIN wf_history f
          ON f.execution_id = s.execution_id
         AND f.activity_name = s.activity_name
         AND f.type IN ('step.completed', 'step.failed')
         AND f.sequence > s.sequence
         AND {integer.format(e="f.event", k="attempt")} = {s_attempt}
        WHERE s.type = 'step.started'
        """,
    )
    ops.create_view(
        "wf_execution_waits",
        f"""
        SELECT e.id AS execution_id,
               e.workflow_name AS workflow_name,
               e.status AS status,
               CASE WHEN w.activity_name IS NOT NULL THEN 'signal'
                    WHEN e.status = 'suspended' THEN 'timer'
                    ELSE NULL END AS waiting_kind,
               {text.format(e="w.event", k="name")} AS signal_name,
               w.activity_name AS waiting_for,
               w.created_at AS waiting_since,
               e.wake_at AS wake_at
        FROM wf_executions e
        LEFT JOIN wf_history w
          ON w.execution_id = e.id
         AND w.type = 'signal.waiting'
         AND NOT EXISTS (
             SELECT 1 FROM wf_history r
             WHERE r.execution_id = w.execution_id
               AND r.activity_name = w.activity_name
               AND r.type IN ('signal.received', 'signal.timeout', 'signal.delivered'))
        WHERE e.status NOT IN ('completed', 'failed')
        """,
    )


def _drop_views() -> None:
    ops.drop_view("wf_execution_waits")
    ops.drop_view("wf_step_attempts")


def upgrade() -> None:
    _drop_views()
    ops.add_column(
        "wf_executions",
        sa.Column("claim_epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    ops.add_column(
        "wf_executions",
        sa.Column("drive_failures", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    _create_views()


def downgrade() -> None:
    _drop_views()
    # Plain ALTER TABLE ... DROP COLUMN everywhere (SQLite >= 3.35 has it): a batch copy of
    # wf_executions would cascade-delete its history under foreign_keys=ON.
    ops.drop_column("wf_executions", "drive_failures")
    ops.drop_column("wf_executions", "claim_epoch")
    import importlib.util
    from pathlib import Path

    # The previous revision's views, exactly as it created them.
    path = next(Path(__file__).parent.glob("*_wf_0002_sql_views.py"))
    spec = importlib.util.spec_from_file_location("_wf_0002_views", path)
    assert spec is not None and spec.loader is not None
    previous = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(previous)
    previous.upgrade()
