"""Argument checks shared by the clients, and signal payload validation: every argument is
checked (and a payload validated) before anything is written."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError
from sqlalchemy import Connection
from sqlalchemy.orm import Session, scoped_session

from .authoring import Workflow, adapter_for
from .error_documents import shown
from .errors import InvalidArgumentError, SignalPayloadError
from .models import KEY_WIDTH, WORKFLOW_NAME_WIDTH
from .timeouts import plain_number
from .values import (
    json_form,
    non_finite,
    parsed,
    resolve_type_reference,
    schema_errors,
    unstorable,
)


def validate_signal(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    """The payload's stored JSON form, validated by the wait's type or recorded schema."""
    if non_finite(payload):
        problem: str | None = "it contains NaN or an infinity, which JSON cannot hold"
    else:
        try:
            stored = signal_document(execution_id, name, wait, payload)
        except SignalPayloadError:
            raise
        except Exception as exc:  # a validator of the caller's own raising what it likes
            raise SignalPayloadError(execution_id, name, [raised(exc)]) from exc
        problem = unstorable(stored)
    if problem is not None:
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}])
    return stored


def raised(exc: Exception) -> dict[str, Any]:
    """The error entry for a payload whose validation raised ``exc`` (a validator's own
    ``KeyError``, say: pydantic passes on what is not a ValueError or AssertionError)."""
    return {"loc": (), "msg": f"validating it raised {shown(exc)}"}


def signal_document(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    tp = resolve_type_reference(wait.get("payloadType"))
    # A bool is an int to isinstance, but not to the wait (JSON ``true`` is not a number).
    if tp is not None and isinstance(payload, tp) and not _bool_for_other(payload, tp):
        adapter = adapter_for(tp)
        try:
            dumped, problem = json_form(adapter, payload)
        # bytes not UTF-8; ValueError: pydantic's "Maximum serialization depth exceeded"
        except (PydanticSerializationError, UnicodeDecodeError, ValueError) as exc:
            raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": str(exc)}]) from exc
        if problem is not None:
            raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}])
        # Read back as the wait will read it: an instance made without validation
        # (``model_construct``) was "delivered" and then failed the run.
        return _readable(execution_id, name, adapter, dumped)
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        # Said as for any value (an integer of more digits than Python prints, say).
        problem = unstorable(payload) or str(exc)
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}]) from exc
    doc, lost = parsed(text)
    if lost is not None:
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": lost}])
    if tp is not None:
        # Strict JSON validation: the payload must already have the declared shape ("yes" is
        # not a boolean), as the recorded JSON Schema would judge it.
        adapter = adapter_for(tp)
        try:
            doc = adapter.dump_python(adapter.validate_json(text, strict=True), mode="json")
        except ValidationError as exc:
            errors = [dict(e) for e in exc.errors(include_url=False)]
            raise SignalPayloadError(execution_id, name, errors) from exc
        # A type whose dump it cannot read back (an alias it does not populate by name, an
        # excluded field) would be delivered and then fail the run.
        return _readable(execution_id, name, adapter, doc)
    schema = wait.get("payloadSchema")
    if schema:
        errors = schema_errors(schema, doc)
        if errors:
            raise SignalPayloadError(execution_id, name, errors)
    return doc


def _readable(execution_id: str, name: str, adapter: TypeAdapter[Any], doc: Any) -> Any:
    """``doc`` if the wait can read it (as ``values.from_json`` will), else refused."""
    try:
        adapter.validate_python(doc)
    except ValidationError as exc:
        errors = [dict(e) for e in exc.errors(include_url=False)]
        raise SignalPayloadError(execution_id, name, errors) from exc
    return doc


def _bool_for_other(payload: Any, tp: type) -> bool:
    return isinstance(payload, bool) and not issubclass(tp, bool)


def utc(value: object, what: str) -> dt.datetime:
    """An aware datetime as UTC (the form it is stored and compared in)."""
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise InvalidArgumentError(f"{what} must be an aware datetime, got {shown(value)}")
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidArgumentError(f"{what} is out of range in UTC: {shown(value)}") from None


def plain_text(value: object) -> str | None:
    """A ``str`` argument as a plain ``str`` (``None`` for anything else): a subclass's own
    length, hash or equality may raise or lie."""
    # type(), not isinstance(): an object's __class__ may claim str.
    return str.__str__(value) if issubclass(type(value), str) else None


def check_text(what: str, value: object, width: int = KEY_WIDTH) -> str | None:
    """A key or name (``None`` passes) as a plain ``str``, at most ``width`` characters."""
    return None if value is None else required_text(what, value, width)


def required_text(what: str, value: object, width: int = KEY_WIDTH) -> str:
    """A key or name as a plain ``str``, at most ``width`` characters."""
    text = plain_text(value)
    if not text or len(text) > width or unstorable(text):
        raise InvalidArgumentError(
            f"{what} must be a non-empty string of at most {width} characters without "
            f"NUL or invalid UTF-8, got {shown(value)}"
        )
    return text


def check_id(execution_id: object) -> str:
    text = plain_text(execution_id)
    if not text or len(text) > 36 or unstorable(text):
        raise InvalidArgumentError(
            "an execution id is a string of 36 characters without NUL or invalid UTF-8, "
            f"got {shown(execution_id)}"
        )
    return text  # a plain str: a subclass's own hash or equality is not used


def workflow_name(workflow: object) -> str:
    if isinstance(workflow, Workflow):
        return workflow.name
    name = plain_text(workflow)
    if not name or len(name) > WORKFLOW_NAME_WIDTH or unstorable(name):
        raise InvalidArgumentError(
            f"expected a workflow or its name (a non-empty string of at most "
            f"{WORKFLOW_NAME_WIDTH} characters without NUL or invalid UTF-8), got {shown(workflow)}"
        )
    return name


def check_version(version: object) -> int | None:
    """A version (``None`` passes) as a plain ``int``."""
    if version is None:
        return None
    number = plain_number(version)
    if not isinstance(number, int) or not 1 <= number < 2**31:
        raise InvalidArgumentError(f"version must be a positive integer, got {shown(version)}")
    return number


def check_timeout(timeout: object) -> float | None:
    """A timeout is ``None`` or a non-negative number of seconds (not NaN), returned as a
    plain ``float``."""
    if timeout is None:
        return None
    number = plain_number(timeout)
    if number is None or not number >= 0:
        raise InvalidArgumentError(f"timeout must be a number of seconds, got {shown(timeout)}")
    try:
        return float(number)  # deadlines are monotonic floats: 10**400 seconds is not one
    except OverflowError:
        raise InvalidArgumentError(f"timeout is out of range: {shown(timeout)}") from None


def check_session(session: object) -> None:
    """A host's ``session=``: a synchronous ``Session`` (or a ``scoped_session``, as
    Flask-SQLAlchemy's ``db.session``) or ``Connection``, or ``None`` (an
    engine, an async session or a URL failed deep inside, an async one leaking its
    coroutine)."""
    if session is not None and not isinstance(session, Session | Connection | scoped_session):
        raise InvalidArgumentError(
            f"session must be a SQLAlchemy Session or Connection (in the transaction to "
            f"write in), got {shown(session)}"
        )
