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
import threading
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
    ``input_value='sk_live_...yqP'``) keeps its two ends. An integer field whose digits
    are a value is replaced too. Values shorter than :attr:`MIN_LENGTH` are not scrubbed
    (they would garble every message and hide nothing). One per drive, shared by its
    ``ctx.all`` branches' threads.
    """

    MIN_LENGTH: Final = 4
    #: The shortest piece of a value that is scrubbed on its own.
    FRAGMENT: Final = 12

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Each value's printed forms -> its reference (replaced whole first), longest first.
        self._values: dict[str, str] = {}
        #: The printed forms at least FRAGMENT long -> their references, and their pieces.
        self._long: dict[str, str] = {}
        self._pieces: frozenset[str] = frozenset()

    def add(self, reference: str, value: Any) -> None:
        if not isinstance(value, str) or len(value) < self.MIN_LENGTH:
            return
        forms = _printed_forms(value)
        with self._lock:  # scrubs read a copy: never one changing under them
            values = dict(self._values)
            long = dict(self._long)
            pieces = set(self._pieces)
            for form in forms:
                values[form] = reference
                if len(form) >= self.FRAGMENT:
                    long[form] = reference
                    pieces.update(_pieces_of(form, self.FRAGMENT))
            # Longest first: a secret containing another is replaced whole.
            values = dict(sorted(values.items(), key=lambda item: len(item[0]), reverse=True))
            self._values, self._long, self._pieces = values, long, frozenset(pieces)

    def __bool__(self) -> bool:
        return bool(self._values)

    def scrub(self, value: Any) -> Any:
        """``value`` with every known secret value replaced by its reference."""
        with self._lock:
            values, long, pieces = self._values, self._long, self._pieces
        if not values:
            return value
        return _Scrub(values, long, pieces, self.FRAGMENT).of(value)


def _pieces_of(form: str, size: int) -> set[str]:
    return {form[i : i + size] for i in range(len(form) - size + 1)}


class _Scrub:
    """One scrub, over a fixed set of values (see :class:`Redactor`)."""

    def __init__(
        self, values: dict[str, str], long: dict[str, str], pieces: frozenset[str], size: int
    ) -> None:
        self.values, self.long, self.pieces, self.size = values, long, pieces, size

    def of(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret_value in self.values:  # longest first (see Redactor.add)
                if secret_value in value:
                    value = value.replace(secret_value, self.values[secret_value])
            return self._pieces_in(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return self.values.get(str(value), value)
        if isinstance(value, dict):
            return {self.of(k): self.of(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.of(v) for v in value]
        return value

    def _pieces_in(self, text: str) -> str:
        """``text`` with each run of a long form's characters (a piece of ``size`` or more,
        as far as it goes on matching the form) replaced by the form's reference."""
        if not self.pieces:
            return text
        size, out, kept, at = self.size, [], 0, 0
        while at + size <= len(text):
            piece = text[at : at + size]
            if piece not in self.pieces:
                at += 1
                continue
            reference, end = "", at + size
            for form, ref in self.long.items():
                where = form.find(piece)
                while where >= 0:  # every place the piece has in the form, extended
                    stop, k = at + size, where + size
                    while k < len(form) and stop < len(text) and text[stop] == form[k]:
                        stop, k = stop + 1, k + 1
                    if not reference or stop > end:
                        reference, end = ref, max(end, stop)
                    where = form.find(piece, where + 1)
            out.append(text[kept:at])
            out.append(reference)
            kept = at = end
        out.append(text[kept:])
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
