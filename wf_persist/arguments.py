"""Argument checks shared by the clients, and signal payload validation: every argument is
checked (and a payload validated) before anything is written."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from .authoring import Workflow, adapter_for
from .error_documents import shown
from .errors import InvalidArgumentError, SignalPayloadError
from .models import KEY_WIDTH, WORKFLOW_NAME_WIDTH
from .values import non_finite, resolve_type_reference, schema_errors, unstorable


def validate_signal(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    """The payload's stored JSON form, validated by the wait's type or recorded schema."""
    if non_finite(payload):
        problem: str | None = "it contains NaN or an infinity, which JSON cannot hold"
    else:
        stored = signal_document(execution_id, name, wait, payload)
        problem = unstorable(stored)
    if problem is not None:
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}])
    return stored


def signal_document(execution_id: str, name: str, wait: Mapping[str, Any], payload: Any) -> Any:
    tp = resolve_type_reference(wait.get("payloadType"))
    if tp is not None and isinstance(payload, tp):
        try:
            return adapter_for(tp).dump_python(payload, mode="json")
        # bytes not UTF-8; ValueError: pydantic's "Maximum serialization depth exceeded"
        except (PydanticSerializationError, UnicodeDecodeError, ValueError) as exc:
            raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": str(exc)}]) from exc
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        # Said as for any value (an integer of more digits than Python prints, say).
        problem = unstorable(payload) or str(exc)
        raise SignalPayloadError(execution_id, name, [{"loc": (), "msg": problem}]) from exc
    if tp is not None:
        # Strict JSON validation: the payload must already have the declared shape ("yes" is
        # not a boolean), as the recorded JSON Schema would judge it.
        adapter = adapter_for(tp)
        try:
            return adapter.dump_python(adapter.validate_json(text, strict=True), mode="json")
        except ValidationError as exc:
            errors = [dict(e) for e in exc.errors(include_url=False)]
            raise SignalPayloadError(execution_id, name, errors) from exc
    doc = json.loads(text)
    schema = wait.get("payloadSchema")
    if schema:
        errors = schema_errors(schema, doc)
        if errors:
            raise SignalPayloadError(execution_id, name, errors)
    return doc


def utc(value: object, what: str) -> dt.datetime:
    """An aware datetime as UTC (the form it is stored and compared in)."""
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise InvalidArgumentError(f"{what} must be an aware datetime, got {shown(value)}")
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise InvalidArgumentError(f"{what} is out of range in UTC: {shown(value)}") from None


def check_text(what: str, value: str | None) -> None:
    """A key or name: the length is ``str``'s own (a subclass may say otherwise)."""
    if value is not None and (
        not isinstance(value, str)
        or not value
        or str.__len__(value) > KEY_WIDTH
        or unstorable(value)
    ):
        raise InvalidArgumentError(
            f"{what} must be a non-empty string of at most {KEY_WIDTH} characters without "
            f"NUL or invalid UTF-8, got {shown(value)}"
        )


def check_id(execution_id: object) -> str:
    if (
        not isinstance(execution_id, str)
        or not execution_id
        or str.__len__(execution_id) > 36
        or unstorable(execution_id)
    ):
        raise InvalidArgumentError(
            "an execution id is a string of 36 characters without NUL or invalid UTF-8, "
            f"got {shown(execution_id)}"
        )
    return str.__str__(execution_id)  # a plain str: a subclass's own hash or equality is not used


def workflow_name(workflow: object) -> str:
    if isinstance(workflow, Workflow):
        return workflow.name
    if (
        not isinstance(workflow, str)
        or not workflow
        or str.__len__(workflow) > WORKFLOW_NAME_WIDTH
        or unstorable(workflow)
    ):
        raise InvalidArgumentError(
            f"expected a workflow or its name (a non-empty string of at most "
            f"{WORKFLOW_NAME_WIDTH} characters without NUL or invalid UTF-8), got {shown(workflow)}"
        )
    return workflow


def check_version(version: object) -> None:
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**31
    ):
        raise InvalidArgumentError(f"version must be a positive integer, got {shown(version)}")


def check_timeout(timeout: object) -> None:
    """A timeout is ``None`` or a non-negative number of seconds (not NaN)."""
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or timeout != timeout
        or timeout < 0
    ):
        raise InvalidArgumentError(f"timeout must be a number of seconds, got {shown(timeout)}")
    if isinstance(timeout, int):
        try:
            float(timeout)  # deadlines are monotonic floats: 10**400 seconds is not one
        except OverflowError:
            raise InvalidArgumentError(f"timeout is out of range: {shown(timeout)}") from None
