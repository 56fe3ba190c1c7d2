"""JSON read from PostgreSQL with ``json.loads``, whatever loaders a host set.

psycopg decodes JSON and JSONB itself, with the loaders of the connection (or of the whole
process) a cursor copies: an engine made with ``json_deserializer=`` installs its function
on every connection of the pool wf_persist shares, and an application may call psycopg's
``set_json_loads`` for a connection or globally. A loader that reads numbers as ``Decimal``
or floats would hand a replay another value than the run saw when it recorded it, so each
cursor and transformer of ours that would inherit such a loader gets ``json.loads`` back.
The host's own cursors keep theirs.
"""

from __future__ import annotations

import json
from typing import Any


def plain(adapters: Any) -> bool:
    """Whether ``adapters`` (a psycopg ``AdaptersMap``) load JSON with psycopg's own
    loaders, reading with ``json.loads``: a loader class of the host's, also one derived
    from psycopg's with its own ``load``, or a function set globally, is not plain."""
    from psycopg.types import json as pg

    # set_json_loads(fn) with no context sets the base class's function (psycopg's own
    # name for it: where a release has no such class, nothing is taken as plain).
    base = getattr(pg, "_JsonLoader", None)
    if getattr(base, "_loads", None) is not json.loads:
        return False
    return (
        adapters.get_loader(114, 0) is pg.JsonLoader
        and adapters.get_loader(114, 1) is pg.JsonBinaryLoader
        and adapters.get_loader(3802, 0) is pg.JsonbLoader
        and adapters.get_loader(3802, 1) is pg.JsonbBinaryLoader
    )


def _set_loads(context: Any) -> None:
    # psycopg is imported here: the PostgreSQL driver is an extra.
    from psycopg.types.json import set_json_loads

    set_json_loads(json.loads, context)


def own_loads(context: Any) -> None:
    """Make ``context`` (a psycopg cursor, or :class:`Context`) load JSON with
    ``json.loads`` if the adapters it copied do not."""
    if not plain(context.adapters):
        _set_loads(context)


class Context:
    """An adaptation context of a connection with a copy of its adapters and our JSON
    loaders, for a transformer made outside a cursor (:mod:`.pg_wire`): loaders the host
    sets on the connection later do not reach it either."""

    __slots__ = ("adapters", "connection")

    def __init__(self, connection: Any) -> None:
        from psycopg.adapt import AdaptersMap

        self.connection = connection
        self.adapters = AdaptersMap(connection.adapters)
        _set_loads(self)


def cursor_loads(
    _conn: Any, cursor: Any, _statement: Any, _parameters: Any, _context: Any, _many: Any
) -> None:
    """A ``before_cursor_execute`` listener of wf_persist's engine: :func:`own_loads` on
    the psycopg cursor (wrapped by SQLAlchemy's adapter on an asyncio engine)."""
    target = cursor if hasattr(cursor, "adapters") else getattr(cursor, "_cursor", None)
    if target is not None and hasattr(target, "adapters"):
        own_loads(target)
