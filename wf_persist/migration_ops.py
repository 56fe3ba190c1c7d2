"""Schema operations of wf_persist's revisions that an interrupted upgrade can do again.

MySQL and MariaDB commit each DDL statement on its own: a revision killed midway (a deploy
job's timeout, a SIGKILL) has done its first statements and is still recorded as not done,
so the next upgrade runs it again from the start and met "table already exists" or
"duplicate column" for ever. On those servers each operation here first asks
``information_schema`` whether it is done (never SQLAlchemy's reflection, which parses
``SHOW CREATE TABLE`` in whatever quoting a host's ``sql_mode`` gives it) and views are
created with ``OR REPLACE``. Elsewhere DDL is transactional (an interrupted revision left
nothing) and these are Alembic's operations as they are; offline SQL is written as is.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from alembic import context, op


def _redone() -> bool:
    """Whether this revision may find some of its statements already done."""
    return not context.is_offline_mode() and op.get_bind().dialect.name in ("mysql", "mariadb")


def _exists(view: str, table: str, **names: str) -> bool:
    """Whether ``information_schema.<view>`` has a row of ``table`` in this database with
    these column values (``COLUMN_NAME``, ``INDEX_NAME``)."""
    where = "".join(f" AND {column} = :{column}" for column in names)
    sql = (
        f"SELECT COUNT(*) FROM information_schema.{view}"
        f" WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :table{where}"
    )
    return bool(op.get_bind().execute(sa.text(sql), {"table": table, **names}).scalar_one())


def _has_table(name: str) -> bool:
    return _exists("TABLES", name)


def _has_column(table: str, name: str) -> bool:
    return _exists("COLUMNS", table, COLUMN_NAME=name)


def _has_index(table: str, name: str) -> bool:
    return _exists("STATISTICS", table, INDEX_NAME=name)


def create_table(name: str, *parts: Any, **kw: Any) -> None:
    if _redone() and _has_table(name):
        return
    op.create_table(name, *parts, **kw)


def drop_table(name: str) -> None:
    if _redone() and not _has_table(name):
        return
    op.drop_table(name)


def add_column(table: str, column: sa.Column[Any]) -> None:
    if _redone() and _has_column(table, column.name):
        return
    op.add_column(table, column)


def drop_column(table: str, name: str) -> None:
    """``ALTER TABLE ... DROP COLUMN`` everywhere (SQLite >= 3.35 has it): a batch copy of
    a table would cascade-delete the history of its runs under ``foreign_keys=ON``."""
    if _redone() and not _has_column(table, name):
        return
    op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")


def create_index(name: str, table: str, columns: list[str], **kw: Any) -> None:
    if _redone() and _has_index(table, name):
        return
    op.create_index(name, table, columns, **kw)


def drop_index(name: str, table: str) -> None:
    if _redone() and not _has_index(table, name):
        return
    op.drop_index(name, table_name=table)


def create_view(name: str, select: str) -> None:
    replace = "OR REPLACE " if _redone() else ""
    op.execute(f"CREATE {replace}VIEW {name} AS {select}")


def drop_view(name: str) -> None:
    op.execute(f"DROP VIEW IF EXISTS {name}" if _redone() else f"DROP VIEW {name}")
