"""Secret references: only ``secret:<name>`` is ever stored; the value exists inside a step.

Put ``secret("stripe-key")`` in a workflow's input or a step's arguments. History, inputs and
results keep the reference. Right before a step runs, the runtime's resolver replaces every
reference in its arguments (recursively, in dicts and lists) and the arguments are validated
again. The resolver of the process that runs the step is used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from .errors import WfPersistError

PREFIX: Final = "secret:"

#: Resolves a secret name to its value.
SecretResolver = Callable[[str], str]


class SecretError(WfPersistError):
    """A secret could not be resolved (the step fails as a transient error)."""

    def __init__(self, name: str, message: str) -> None:
        self.secret_name = name
        super().__init__(message)


def secret(name: str) -> str:
    """The reference to store instead of the secret's value."""
    if not name or not isinstance(name, str):
        raise WfPersistError("a secret needs a non-empty name")
    return f"{PREFIX}{name}"


def contains_reference(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith(PREFIX)
    if isinstance(value, dict):
        return any(contains_reference(v) for v in value.values())
    if isinstance(value, list):
        return any(contains_reference(v) for v in value)
    return False


def resolve_references(
    value: Any, resolver: SecretResolver | None, redactor: Redactor | None = None
) -> Any:
    """``value`` (a JSON document) with every ``secret:<name>`` replaced by its value.

    Each resolved value is remembered by ``redactor``, so that no error recorded afterwards
    can carry it to the database.
    """
    if isinstance(value, str) and value.startswith(PREFIX):
        name = value[len(PREFIX) :]
        if resolver is None:
            raise SecretError(name, f"No secret resolver configured for {name}")
        resolved = resolver(name)
        if redactor is not None:
            redactor.add(value, resolved)
        return resolved
    if isinstance(value, dict):
        return {k: resolve_references(v, resolver, redactor) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_references(v, resolver, redactor) for v in value]
    return value


class Redactor:
    """Replaces resolved secret values with their references in whatever gets stored.

    A step that raises with its API key in the message must not put the key in history or
    in ``wf_executions.error``: every error document a drive records passes through
    :meth:`scrub` (messages, args, fields, nested documents). Values shorter than
    :attr:`MIN_LENGTH` are not scrubbed (they would garble every message and hide nothing).
    """

    MIN_LENGTH: Final = 4

    def __init__(self) -> None:
        self._values: dict[str, str] = {}

    def add(self, reference: str, value: Any) -> None:
        if isinstance(value, str) and len(value) >= self.MIN_LENGTH:
            self._values[value] = reference

    def __bool__(self) -> bool:
        return bool(self._values)

    def scrub(self, value: Any) -> Any:
        """``value`` with every known secret value replaced by its reference."""
        if not self._values:
            return value
        if isinstance(value, str):
            # Longest first: a secret containing another is replaced whole.
            for secret_value in sorted(self._values, key=len, reverse=True):
                if secret_value in value:
                    value = value.replace(secret_value, self._values[secret_value])
            return value
        if isinstance(value, dict):
            return {self.scrub(k): self.scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub(v) for v in value]
        return value


def env_variable_name(name: str) -> str:
    """``x-bearer-token`` -> ``X_BEARER_TOKEN``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper()


def env_secret_resolver(
    mapping: Mapping[str, str] | None = None, fallback: str | None = None
) -> SecretResolver:
    """A resolver reading environment variables.

    Args:
        mapping: secret name -> variable name, for names that do not follow the rule.
        fallback: the value of an unset variable (may be ``""``); without it an unset
            variable is an error naming the variable to set.
    """
    explicit = dict(mapping or {})

    def resolve(name: str) -> str:
        variable = explicit.get(name) or env_variable_name(name)
        value = os.environ.get(variable)
        if value is not None:
            return value
        if fallback is not None:
            return fallback
        raise SecretError(name, f'Secret "{name}" not found: set env var {variable}')

    return resolve
