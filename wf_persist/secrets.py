"""Secret references: only ``secret:<name>`` is ever stored; the value exists inside a step.

Put ``secret("stripe-key")`` in a workflow's input or a step's arguments. History, inputs and
results keep the reference. Right before a step runs, the runtime's resolver replaces every
reference in its arguments (recursively, in dicts and lists) and the arguments are validated
again. The resolver of the process that runs the step is used.
"""

from __future__ import annotations

import json
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
    :meth:`scrub` (messages, args, fields, nested documents). A value is also found as
    ``repr``, JSON and ``bytes`` print it (escaped: a key with a quote, a backslash or a
    line break in an error's ``{key!r}``), and so is any run of :attr:`FRAGMENT` or more of
    its characters in such a form: a message that shortens what it quotes (pydantic's
    ``input_value='sk_live_...yqP'``) keeps its two ends. Values shorter than
    :attr:`MIN_LENGTH` are not scrubbed (they would garble every message and hide nothing).
    """

    MIN_LENGTH: Final = 4
    #: The shortest piece of a value that is scrubbed on its own.
    FRAGMENT: Final = 12

    def __init__(self) -> None:
        #: Each value's printed forms -> its reference.
        self._values: dict[str, str] = {}
        self._pieces: re.Pattern[str] | None = None
        #: For the pieces' pattern: each form at least FRAGMENT long -> its reference.
        self._long: dict[str, str] = {}

    def add(self, reference: str, value: Any) -> None:
        if not isinstance(value, str) or len(value) < self.MIN_LENGTH:
            return
        for form in _printed_forms(value):
            self._values[form] = reference
            if len(form) >= self.FRAGMENT:
                self._long[form] = reference
        if self._long:
            pieces = {
                form[i : i + self.FRAGMENT]
                for form in self._long
                for i in range(len(form) - self.FRAGMENT + 1)
            }
            # Longest first is moot (all one length); sorted for a stable pattern.
            self._pieces = re.compile("|".join(re.escape(p) for p in sorted(pieces)))

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
            return self._scrub_pieces(value)
        if isinstance(value, dict):
            return {self.scrub(k): self.scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub(v) for v in value]
        return value

    def _scrub_pieces(self, text: str) -> str:
        """``text`` with each run of a long value's characters (a printed form's piece of
        :attr:`FRAGMENT` or more, as long as it goes on matching) replaced."""
        if self._pieces is None:
            return text
        out: list[str] = []
        at = 0
        while (found := self._pieces.search(text, at)) is not None:
            start, end = found.span()
            reference = ""
            for form, ref in self._long.items():
                where = form.find(found.group())
                while where >= 0:  # extend along every place the piece occurs in the form
                    stop = end
                    k = where + self.FRAGMENT
                    while k < len(form) and stop < len(text) and text[stop] == form[k]:
                        stop, k = stop + 1, k + 1
                    if not reference or stop > end:
                        reference, end = ref, max(end, stop)
                    where = form.find(found.group(), where + 1)
            out.append(text[at:start])
            out.append(reference)
            at = end
        out.append(text[at:])
        return "".join(out)


def _printed_forms(value: str) -> set[str]:
    """``value`` as text, and as ``repr``, JSON and its UTF-8 ``bytes`` print it (without
    their quotes)."""
    forms = {value, repr(value)[1:-1], json.dumps(value)[1:-1]}
    forms.add(json.dumps(value, ensure_ascii=False)[1:-1])
    forms.add(repr(value.encode("utf-8", "surrogatepass"))[2:-1])
    return forms


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
