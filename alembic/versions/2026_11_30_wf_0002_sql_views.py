"""Views for SQL users: step attempts and current waits.

Why: the common questions about history ("which steps fail, how long do they take", "which
runs wait for what") should be one-line SELECTs, without JSON operators. Views add no
write cost. They are plain SQL per backend (JSON extraction, string slicing and time
arithmetic differ); each backend gets the same columns.

Downgrade drops the views; no data is touched.

Revision ID: wf_0002
Revises: wf_0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from wf_persist import migration_ops as ops

revision: str = "wf_0002"
down_revision: str | Sequence[str] | None = "wf_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Per backend: step name from an activity name, attempt number from the event JSON, and
# milliseconds between two timestamps.
_FUNCS = {
    "postgresql": (
        "split_part({a}, '#', 1)",
        "CAST(({e}->>'attempt') AS INTEGER)",
        "EXTRACT(EPOCH FROM ({t1} - {t0})) * 1000",
    ),
    "sqlite": (
        "substr({a}, 1, instr({a}, '#') - 1)",
        "CAST(json_extract({e}, '$.attempt') AS INTEGER)",
        "(julianday({t1}) - julianday({t0})) * 86400000.0",
    ),
    "mysql": (
        "SUBSTRING_INDEX({a}, '#', 1)",
        "CAST(JSON_UNQUOTE(JSON_EXTRACT({e}, '$.attempt')) AS SIGNED)",
        "TIMESTAMPDIFF(MICROSECOND, {t0}, {t1}) / 1000.0",
    ),
}


def _funcs() -> tuple[str, str, str]:
    name = op.get_bind().dialect.name
    return _FUNCS["mysql" if name in ("mysql", "mariadb") else name]


def upgrade() -> None:
    step_name, attempt, millis = _funcs()
    ops.create_view(
        "wf_step_attempts",
        f"""
        SELECT s.execution_id AS execution_id,
               e.workflow_name AS workflow_name,
               e.workflow_version AS workflow_version,
               {step_name.format(a="s.activity_name")} AS step_name,
               s.activity_name AS activity_name,
               {attempt.format(e="s.event")} AS attempt,
               s.created_at AS started_at,
               f.created_at AS finished_at,
               CASE f.type WHEN 'step.completed' THEN 'completed'
                           WHEN 'step.failed' THEN 'failed'
                           ELSE 'running' END AS outcome,
               {millis.format(t0="s.created_at", t1="f.created_at")} AS duration_ms
        FROM wf_history s
        JOIN wf_executions e ON e.id = s.execution_id
        LEFT JOIN wf_history f
          ON f.execution_id = s.execution_id
         AND f.sequence = s.sequence + 1
         AND f.activity_name = s.activity_name
         AND f.type IN ('step.completed', 'step.failed')
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
               {step_name.format(a="w.activity_name")} AS signal_name,
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


def downgrade() -> None:
    ops.drop_view("wf_execution_waits")
    ops.drop_view("wf_step_attempts")
