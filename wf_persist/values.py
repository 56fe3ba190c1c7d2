"""Recorded values: validation into JSON documents, and the checks that keep a value storable.

Every value that reaches the database (inputs, step arguments and results, signal payloads,
outcomes) is validated by its declared type and dumped to its JSON form here, so a value a
database would reject becomes a typed error where it was produced, never a write that fails
on every retry.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import weakref
from collections.abc import Iterator
from dataclasses import is_dataclass
from decimal import Decimal
from typing import Any, Final, Literal

import pydantic_core
from jsonschema import Draft202012Validator, validators
from jsonschema import ValidationError as SchemaViolation
from jsonschema.exceptions import SchemaError, UnknownType
from pydantic import BaseModel, PydanticUserError, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, core_schema
from referencing.exceptions import Unresolvable

from .error_documents import shown
from .errors import InvalidPayloadError, NotSerializableError

#: JSON numbers every backend keeps exactly (MySQL's JSON and SQLite's json functions turn
#: larger integers into doubles, silently losing digits).
INT_RANGE: Final = range(-(2**63), 2**63)
#: Lists and objects nested in one value: MariaDB keeps JSON documents up to 31 levels deep
#: and a stored event wraps a value in up to two more (``{"input": {"param": value}}``).
MAX_DEPTH: Final = 29


def unstorable(value: Any, depth: int = 0) -> str | None:
    """Why a JSON document cannot be stored exactly everywhere, or ``None``: text with NUL
    characters or lone surrogates (invalid UTF-8), an integer beyond 64 bits, NaN or an
    infinity, or lists and objects nested more than :data:`MAX_DEPTH` levels deep."""
    return _scan(value, depth, None)


def _scan(value: Any, depth: int, nulls: list[bool] | None) -> str | None:
    """:func:`unstorable`, also noting in ``nulls`` whether the document holds a null."""
    if value is None:
        if nulls is not None and not nulls:
            nulls.append(True)
        return None
    if isinstance(value, str):
        if "\x00" in value:
            return "it contains a NUL character, which databases reject"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "it contains invalid UTF-8 text (a lone surrogate), which databases reject"
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        # Compared, not ``in INT_RANGE``: for an int subclass (an IntEnum) that walks the range.
        if not INT_RANGE.start <= value < INT_RANGE.stop:
            return f"the integer {shown(value)} does not fit 64 bits; store it as a string"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else _NON_FINITE
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        return f"it is nested more than {MAX_DEPTH} levels deep, which MariaDB rejects"
    if isinstance(value, dict):
        for k, v in value.items():
            if nulls is not None and not nulls and _FLOAT_KEY.search(k):
                nulls.append(True)  # a key pydantic wrote from numbers: maybe NaN or inf
            found = _scan(k, depth, nulls) or _scan(v, depth + 1, nulls)
            if found:
                return found
        return None
    if isinstance(value, list):
        for v in value:
            found = _scan(v, depth + 1, nulls)
            if found:
                return found
    return None


_NON_FINITE: Final = "it contains NaN or an infinity, which JSON cannot hold"
#: What pydantic writes for a NaN or infinite float (or ``Decimal``) key, alone or in a
#: tuple key's text (``"None"`` where the key's type is ``Any``): two such keys would
#: collapse into one.
_FLOAT_KEY: Final = re.compile(r"None|nan|NaN|inf|Inf")


def non_finite(value: Any, depth: int = 0) -> bool:
    """Whether a value holds NaN or an infinity (JSON has neither; pydantic would store
    ``null`` in their place, silently)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > 64 or isinstance(value, str | bytes | int):
        return False
    if isinstance(value, dict):
        return any(
            _non_finite_key(k, depth + 1) or non_finite(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple | set | frozenset):
        return any(non_finite(v, depth + 1) for v in value)
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and (is_dataclass(value) or isinstance(value, BaseModel)):
        return any(non_finite(v, depth + 1) for v in fields.values())
    return False


def _non_finite_key(key: Any, depth: int) -> bool:
    """:func:`non_finite` for a dict key, which may also be a ``Decimal`` or a tuple of
    keys: pydantic writes a NaN ``Decimal`` key as ``"NaN"`` too."""
    if isinstance(key, Decimal):
        return not key.is_finite()
    if isinstance(key, tuple) and depth <= 64:
        return any(_non_finite_key(k, depth + 1) for k in key)
    return non_finite(key, depth)


#: Values with no keys inside: :func:`_plain` passes them without a call.
_LEAVES: Final = frozenset({str, int, float, bool, type(None), bytes})


def json_form(adapter: TypeAdapter[Any], validated: Any) -> tuple[Any, str | None]:
    """``validated``'s JSON form, and why it would lose a dict entry (or ``None``): JSON keys
    are text, so ``{1: "a", "1": "b"}`` (or ``True`` and ``"true"``, ``(1, 2)`` and
    ``"1,2"``) becomes one entry, silently.

    pydantic's JSON text keeps both (``{"1":"a","1":"b"}``): it is read back watching for a
    key twice. One dump, so an iterator in the value is read once. Plain JSON data (text
    keys, lists) whose type has no serializer of its own cannot lose a key and is dumped
    to Python directly (the common case, and faster); so is a value whose JSON text cannot
    be made, for the reason that dump gives."""
    if not _serializes(adapter) and _plain(validated, 0):
        return adapter.dump_python(validated, mode="json"), None
    try:
        text = adapter.dump_json(validated)
    except Exception:
        return adapter.dump_python(validated, mode="json"), None
    return parsed(text)


def parsed(text: str | bytes) -> tuple[Any, str | None]:
    """``json.loads(text)``, and why an entry of it would be lost: JSON text written from
    a dict whose keys became one text has that key twice (``json.dumps`` and pydantic write
    both), and reading it keeps one entry, silently."""
    lost: list[str] = []

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc = dict(pairs)
        if len(doc) < len(pairs) and not lost:
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    lost.append(
                        f"two of its keys are both written as the JSON key {shown(key)}, so "
                        "one entry would be lost"
                    )
                    break
                seen.add(key)
        return doc

    return json.loads(text, object_pairs_hook=unique), (lost[0] if lost else None)


_SERIALIZES: weakref.WeakKeyDictionary[TypeAdapter[Any], bool] = weakref.WeakKeyDictionary()


def _serializes(adapter: TypeAdapter[Any]) -> bool:
    """Whether ``adapter``'s type has a serializer of its own anywhere (one may write two
    text keys as one: ``"A"`` and ``"a"`` in lower case), found once per adapter."""
    found = _SERIALIZES.get(adapter)
    if found is None:
        found = _SERIALIZES[adapter] = _has_serializer(adapter.core_schema, set())
    return found


def _has_serializer(schema: Any, seen: set[int]) -> bool:
    if id(schema) in seen:
        return False
    seen.add(id(schema))
    if isinstance(schema, dict):
        return "serialization" in schema or any(_has_serializer(v, seen) for v in schema.values())
    if isinstance(schema, list | tuple):
        return any(_has_serializer(v, seen) for v in schema)
    return False


def _plain(value: Any, depth: int) -> bool:
    """Whether ``value`` is JSON already (dicts of text keys, lists, text, numbers): the
    common case, where no key can be lost. Looked at no deeper than a storable document
    goes, so a cycle ends it (the dump then refuses the value)."""
    kind = type(value)
    if kind is dict:
        return depth <= MAX_DEPTH and all(
            type(k) is str and (type(v) in _LEAVES or _plain(v, depth + 1))
            for k, v in value.items()
        )
    if kind is list:
        return depth <= MAX_DEPTH and all(type(v) in _LEAVES or _plain(v, depth + 1) for v in value)
    return kind in _LEAVES


def to_json(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """Validate ``value`` and return its JSON form (what gets stored).

    Text a database rejects (NUL, lone surrogates) is refused here, as a typed error of the
    step or workflow; a write the database rejected would otherwise be retried forever.
    """
    try:
        validated = adapter.validate_python(value)
        doc, lost = json_form(adapter, validated)
    except ValidationError as exc:
        raise InvalidPayloadError(what, [dict(e) for e in exc.errors(include_url=False)]) from exc
    except (PydanticSerializationError, UnicodeDecodeError, TypeError) as exc:
        # TypeError: a key pydantic cannot write (a frozenset's), say
        raise NotSerializableError(what, str(exc)) from exc
    except ValueError as exc:  # pydantic's own limit: "Maximum serialization depth exceeded"
        deep = "depth" in str(exc)
        detail = f"it is nested more than {MAX_DEPTH} levels deep" if deep else str(exc)
        raise NotSerializableError(what, detail) from exc
    nulls: list[bool] = []
    problem = _scan(doc, 0, nulls)
    # pydantic writes NaN and infinities as null (as keys, as text): only a document with a
    # null or such a key (or already refused) needs the walk over the Python value that
    # tells them apart.
    if (nulls or problem) and non_finite(validated):
        raise NotSerializableError(what, _NON_FINITE)
    problem = problem or lost
    if problem is not None:
        raise NotSerializableError(what, problem)
    return doc


def fresh(doc: Any) -> Any:
    """A copy of a JSON document's containers: a step given an untyped (``Any``) argument
    gets its own, so changing it in place cannot rewrite what is recorded for the call or
    handed to its compensation."""
    if isinstance(doc, dict):
        return {k: fresh(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [fresh(v) for v in doc]
    return doc


def from_json(adapter: TypeAdapter[Any], value: Any, what: str) -> Any:
    """Decode a recorded value; a value that no longer fits its type is a typed error."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise InvalidPayloadError(what, [dict(e) for e in exc.errors(include_url=False)]) from exc


def type_reference(tp: Any) -> str | None:
    """``module:qualname`` of a class defined at module level, else ``None`` (also for
    ``typing.Any``, a class since Python 3.11 that ``isinstance`` refuses, and ``object``:
    every value is one, and pydantic would write what JSON cannot hold, a set as a list, so
    a signal sent to such a wait would be taken where the same one buffered is refused)."""
    module, qualname = getattr(tp, "__module__", None), getattr(tp, "__qualname__", None)
    if (
        not isinstance(tp, type)
        or tp is Any
        or tp is object
        or not module
        or not qualname
        or "<locals>" in qualname
    ):
        return None
    return f"{module}:{qualname}"


def resolve_type_reference(ref: str | None) -> Any:
    """The class a :func:`type_reference` names, if its module is already imported."""
    if not ref:
        return None
    module_name, _, qualname = ref.partition(":")
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target if isinstance(target, type) and target not in (Any, object) else None


def json_schema_of(
    adapter: TypeAdapter[Any], mode: Literal["validation", "serialization"]
) -> dict[str, Any] | None:
    """The type's JSON Schema as the catalog stores it, or ``None`` when the type has none
    (an arbitrary class) or the schema itself is not a storable document."""
    try:
        schema = adapter.json_schema(mode=mode)
        json.dumps(schema, allow_nan=False)
    except (PydanticUserError, TypeError, ValueError):
        return None
    return None if unstorable(schema) is not None else schema


@functools.lru_cache(maxsize=256)
def _pattern_matcher(pattern: str) -> pydantic_core.SchemaValidator:
    """A matcher for ``pattern`` with pydantic's linear-time engine (Python's ``re`` only
    for what that engine lacks, as pydantic itself would need)."""
    try:
        return pydantic_core.SchemaValidator(core_schema.str_schema(pattern=pattern))
    except pydantic_core.SchemaError:
        return pydantic_core.SchemaValidator(
            core_schema.str_schema(pattern=pattern, regex_engine="python-re")
        )


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[SchemaViolation]:
    """The ``pattern`` keyword matched as pydantic matches it: jsonschema's ``re.search``
    takes exponential time on patterns such as ``^(a+)+$``, which a hostile value exploits."""
    if validator.is_type(instance, "string") and not _pattern_matcher(pattern).isinstance_python(
        instance
    ):
        yield SchemaViolation(f"{instance!r} does not match {pattern!r}")


_Validator: Any = validators.extend(Draft202012Validator, {"pattern": _pattern})  # type: ignore[no-untyped-call]


_SCHEMA_PROBLEMS: Final = (
    SchemaError,
    UnknownType,
    Unresolvable,
    TypeError,
    ValueError,
    RecursionError,
)


@functools.lru_cache(maxsize=256)
def _checked_validator(schema_text: str) -> Any:
    """The validator of a schema (by its JSON text), or None for one that is not valid JSON
    Schema: checking a schema against the meta-schema costs more than validating most
    documents with it, and a start checks its workflow's schema every time."""
    schema = json.loads(schema_text)
    try:
        _Validator.check_schema(schema)
        return _Validator(schema)
    except _SCHEMA_PROBLEMS:
        return None


def schema_errors(schema: Any, doc: Any) -> list[dict[str, Any]]:
    """Where a JSON document breaks a JSON Schema (2020-12: an object, ``true`` or
    ``false``), in pydantic's error shape; a schema that is not valid JSON Schema (or
    references itself forever) checks nothing."""
    try:
        validator = _checked_validator(json.dumps(schema, sort_keys=True))
        if validator is None:
            return []
        found = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    except _SCHEMA_PROBLEMS:
        return []
    return [{"loc": tuple(e.absolute_path), "msg": e.message} for e in found]


def cataloged_document(what: str, payload: Any, schema: Any) -> Any:
    """The payload's stored JSON form, checked against a cataloged JSON Schema (strictly: a
    value must already have the declared shape; ``"5"`` is not an integer). The catalog
    column holds any JSON: ``true`` and ``false`` are schemas too."""
    problem = unstorable(payload)
    if problem is None:
        try:
            doc, lost = parsed(json.dumps(payload, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as exc:
            raise NotSerializableError(what, f"it is not JSON: {exc}") from None
        # Checked again as JSON: a tuple (which the first look passes over) became a list.
        problem = lost or unstorable(doc)
    if problem is not None:
        raise NotSerializableError(what, problem)
    if schema is not None:
        errors = schema_errors(schema, doc)
        if errors:
            raise InvalidPayloadError(what, errors)
    return doc
