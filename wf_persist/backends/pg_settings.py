"""What a PostgreSQL session is set to, read once when an engine is opened (one query).

Every name in it is qualified with ``pg_catalog``: it must read the session as it is even
where a host's ``search_path`` finds functions of its own before PostgreSQL's, which it
looks for (:data:`SHADOWING`).
"""

from __future__ import annotations

from typing import Final

#: PostgreSQL's own functions, operators and types that wf_persist's statements name
#: unqualified (types other than those SQL spells as keywords, like VARCHAR or BIGINT).
_FUNCTIONS: Final = (
    *("statement_timestamp", "clock_timestamp", "now", "make_interval", "current_setting"),
    *("current_schema", "current_schemas", "pg_is_in_recovery", "array_position", "unnest"),
    *("json_agg", "json_build_array", "jsonb_build_object", "count", "min", "max", "lower"),
    *("upper", "length", "octet_length", "set_config", "pg_notify", "hashtextextended"),
    *("pg_advisory_lock", "pg_try_advisory_lock", "pg_try_advisory_xact_lock"),
    *("pg_advisory_unlock", "pg_advisory_xact_lock"),
)
_OPERATORS: Final = ("=", "<>", "<", "<=", ">", ">=", "+", "-", "||", "->", "->>", "~~")
_TYPES: Final = ("jsonb", "json", "text")
_PATH: Final = "pg_catalog.current_schemas(true)"
_CATALOG_AT: Final = f"pg_catalog.array_position({_PATH}, 'pg_catalog')"
_EQ: Final = "OPERATOR(pg_catalog.=)"


def _names(names: tuple[str, ...]) -> str:
    return "'{" + ",".join(f'"{n}"' for n in names) + "}'::pg_catalog.name[]"


#: The first of those that a schema searched before ``pg_catalog`` (a ``search_path``
#: naming it after another) has one of the same name (and, for a function or operator,
#: the same argument types) of: the host's would be used in its place. PostgreSQL looks for
#: functions and operators in every such schema but a session's temporary one, for types
#: there too. Looked for only where ``pg_catalog`` is not searched first; every name here
#: is qualified, so none is shadowed.
SHADOWING: Final = f"""CASE WHEN {_CATALOG_AT} OPERATOR(pg_catalog.>) 1 THEN (
 SELECT n.nspname OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) o.name
 FROM (SELECT p.pronamespace AS ns, p.proname AS name, false AS typ FROM pg_catalog.pg_proc p
       WHERE p.proname {_EQ} ANY ({_names(_FUNCTIONS)}) AND EXISTS (
         SELECT FROM pg_catalog.pg_proc q WHERE q.pronamespace {_EQ} 11
         AND q.proname {_EQ} p.proname AND q.proargtypes {_EQ} p.proargtypes)
       UNION ALL
       SELECT o.oprnamespace, o.oprname, false FROM pg_catalog.pg_operator o
       WHERE o.oprname {_EQ} ANY ({_names(_OPERATORS)}) AND EXISTS (
         SELECT FROM pg_catalog.pg_operator q WHERE q.oprnamespace {_EQ} 11
         AND q.oprname {_EQ} o.oprname AND q.oprleft {_EQ} o.oprleft
         AND q.oprright {_EQ} o.oprright)
       UNION ALL
       SELECT t.typnamespace, t.typname, true FROM pg_catalog.pg_type t
       WHERE t.typname {_EQ} ANY ({_names(_TYPES)})) AS o
 JOIN pg_catalog.pg_namespace AS n ON n.oid {_EQ} o.ns
 WHERE o.ns OPERATOR(pg_catalog.<>) 11
 AND n.nspname {_EQ} ANY (({_PATH})[1:{_CATALOG_AT} OPERATOR(pg_catalog.-) 1])
 AND (o.typ OR n.oid OPERATOR(pg_catalog.<>) pg_catalog.pg_my_temp_schema())
 ORDER BY pg_catalog.array_position({_PATH}, n.nspname), o.name
 LIMIT 1) END"""
#: The settings, in the order :class:`~wf_persist.backends.postgresql.PostgreSQLBackend`
#: reads them: default isolation, DateStyle, client and server encodings, current schema,
#: search path, read-only (a setting or a standby), what is shadowed.
SETTINGS: Final = (
    "SELECT pg_catalog.current_setting('default_transaction_isolation'),"
    " pg_catalog.current_setting('DateStyle'),"
    " pg_catalog.current_setting('client_encoding'),"
    " pg_catalog.current_setting('server_encoding'), pg_catalog.current_schema(),"
    " pg_catalog.current_setting('search_path'),"
    " pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=)"
    " 'on' OR pg_catalog.pg_is_in_recovery(),"
    f" {SHADOWING}"
)
