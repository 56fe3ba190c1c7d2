"""MySQL/MariaDB compare names and keys with a NO PAD binary collation.

Why: ``utf8mb4_bin`` is a PAD SPACE collation: trailing spaces are ignored in comparisons
and unique keys, so ``'order-1' = 'order-1 '`` held there. A start with idempotency key
``'order-1 '`` returned the run of ``'order-1'`` (its input silently dropped), workflow
``'pay '`` conflicted with ``'pay'`` in the catalog and ``list(actor='kim ')`` returned the
runs of ``'kim'``, where SQLite and PostgreSQL keep such values apart. Every name and key
column (``wf_workflows.name``; ``wf_executions.workflow_name``, ``idempotency_key``,
``actor``; ``wf_history.type``, ``activity_name``, ``dedupe_key``) moves to the NO PAD
binary collation: ``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL (which
has it from 8.0.17; older MySQL is refused before anything changes). SQLite and PostgreSQL
already compare byte for byte: nothing changes there.

Existing data cannot conflict (PAD SPACE allowed fewer distinct values, never more). The
catalog's primary key and the runs' foreign key to it must share a collation, so the foreign
key is dropped first and re-created in the same statement that changes the runs' columns.
Each of the three tables is copied once (MySQL and MariaDB rebuild a table whose indexed
columns change collation), holding writes to it meanwhile (about 8 s for 40,000 runs with
1,000,000 history events on MariaDB 10.11 here): run it in a deploy window on a large
database. An interrupted upgrade can be run again. ``--sql`` renders MariaDB's collation
for a ``mariadb://`` URL, and for a ``mysql://`` one both, each in an executable comment
only its server runs.

Downgrade returns to ``utf8mb4_bin``. It refuses, before changing anything, while values
that differ only by trailing spaces share a unique key there (two runs of a workflow with
keys ``'k'`` and ``'k '``, say): rename or purge them first.

Revision ID: wf_0010
Revises: wf_0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import context, op
from wf_persist.errors import UnsupportedDatabaseError

revision: str = "wf_0010"
down_revision: str | Sequence[str] | None = "wf_0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PAD = "utf8mb4_bin"
_MARIADB_NOPAD = "utf8mb4_nopad_bin"
_MYSQL_NOPAD = "utf8mb4_0900_bin"
_MYSQL_NOPAD_SINCE = (8, 0, 17)

_FK = "fk_wf_executions__workflow_name_workflow_version__wf_workflows"
# (table, ((column, width, nullable), ...)): every name and key column at wf_0009.
_KEYS = (
    ("wf_workflows", (("name", 200, False),)),
    (
        "wf_executions",
        (("workflow_name", 200, False), ("idempotency_key", 255, True), ("actor", 255, True)),
    ),
    (
        "wf_history",
        (("type", 64, False), ("activity_name", 255, True), ("dedupe_key", 255, True)),
    ),
)
# The unique keys over those columns under PAD SPACE: (table, GROUP BY columns, filter).
_UNIQUE = (
    ("wf_workflows", ("name", "version"), "TRUE"),
    ("wf_executions", ("workflow_name", "idempotency_key"), "idempotency_key IS NOT NULL"),
    ("wf_history", ("execution_id", "dedupe_key"), "dedupe_key IS NOT NULL"),
)


def _mysql() -> bool:
    return op.get_bind().dialect.name in ("mysql", "mariadb")


def _online() -> bool:
    return not context.is_offline_mode()


def _nopad() -> str:
    dialect = op.get_bind().dialect
    if getattr(dialect, "is_mariadb", False):
        return _MARIADB_NOPAD
    if not _online():
        # A mysql:// URL may be either server: each reads its own collation from an
        # executable comment (MariaDB runs /*M! ones and skips /*!8xxxx ones; MySQL the
        # opposite, and MySQL before 8.0.17 fails the statement, as online it is refused).
        return f"/*M!100200 {_MARIADB_NOPAD} */ /*!80017 {_MYSQL_NOPAD} */"
    version = dialect.server_version_info if _online() else None
    if version is not None and tuple(version) < _MYSQL_NOPAD_SINCE:
        found = ".".join(str(p) for p in version)
        raise UnsupportedDatabaseError(
            f"wf_0010 needs MySQL >= 8.0.17 for the {_MYSQL_NOPAD} collation (names and keys "
            f"that differ by trailing spaces are distinct); found {found}. Nothing was changed."
        )
    return _MYSQL_NOPAD


def _modify(table: str, collation: str) -> list[str]:
    columns = dict(_KEYS)[table]
    return [
        f"MODIFY {name} VARCHAR({width}) CHARACTER SET utf8mb4 COLLATE {collation} "
        + ("NULL" if nullable else "NOT NULL")
        for name, width, nullable in columns
    ]


def _has_fk(bind: sa.Connection) -> bool:
    """Whether the runs' foreign key exists, read from ``information_schema`` rather than by
    reflection: SQLAlchemy parses ``SHOW CREATE TABLE``, which a host's ``sql_mode`` (``ANSI``,
    ``ANSI_QUOTES``, ``ORACLE``) set after the dialect looked prints in another quoting."""
    found = bind.execute(
        sa.text(
            "SELECT COUNT(*) FROM information_schema.REFERENTIAL_CONSTRAINTS"
            " WHERE CONSTRAINT_SCHEMA = DATABASE() AND TABLE_NAME = 'wf_executions'"
            " AND CONSTRAINT_NAME = :name"
        ),
        {"name": _FK},
    ).scalar_one()
    return bool(found)


def _recollate(collation: str) -> None:
    """Every name and key column to ``collation``: one copy of each table. The foreign key
    is dropped while its two sides differ and re-created with the runs' new columns."""
    bind = op.get_bind()
    if not _online() or _has_fk(bind):
        op.execute(f"ALTER TABLE wf_executions DROP FOREIGN KEY {_FK}")
    op.execute("ALTER TABLE wf_workflows " + ", ".join(_modify("wf_workflows", collation)))
    add_fk = (
        f"ADD CONSTRAINT {_FK} FOREIGN KEY (workflow_name, workflow_version) "
        "REFERENCES wf_workflows (name, version)"
    )
    op.execute(
        "ALTER TABLE wf_executions " + ", ".join([*_modify("wf_executions", collation), add_fk])
    )
    op.execute("ALTER TABLE wf_history " + ", ".join(_modify("wf_history", collation)))


def _padded_conflict() -> str | None:
    """The first unique key that values differing only by trailing spaces would break
    under ``utf8mb4_bin`` (``None`` when there is none, or offline where nobody can look)."""
    if not _online():
        return None
    bind = op.get_bind()
    for table, columns, where in _UNIQUE:
        keys = ", ".join(f"{c} COLLATE {_PAD}" if c in _key_columns(table) else c for c in columns)
        found = bind.execute(
            sa.text(
                f"SELECT 1 FROM {table} WHERE {where} GROUP BY {keys} HAVING COUNT(*) > 1 LIMIT 1"
            )
        ).first()
        if found is not None:
            return f"{table} ({', '.join(columns)})"
    return None


def _key_columns(table: str) -> set[str]:
    return {name for name, _, _ in dict(_KEYS)[table]}


def upgrade() -> None:
    if _mysql():
        _recollate(_nopad())


def downgrade() -> None:
    if not _mysql():
        return
    conflict = _padded_conflict()
    if conflict is not None:
        raise UnsupportedDatabaseError(
            f"cannot downgrade wf_0010: {conflict} holds values that differ only by trailing "
            f"spaces, one key under {_PAD}; rename or purge them first. Nothing was changed."
        )
    _recollate(_PAD)
