"""What makes a JSON document unstorable, told the same for the JSON types and for their
subclasses (a ``str`` or ``int`` enum, an ``OrderedDict``): an ``int`` subclass once made
the range check walk 2**64 numbers."""

from __future__ import annotations

import collections
import enum
import json
from collections.abc import Callable
from typing import Any

import pytest

import wf_persist as wp
from wf_persist.error_documents import shown, text_of
from wf_persist.timeouts import plain_number, positive
from wf_persist.values import MAX_DEPTH, unstorable


class Text(str):
    pass


class Number(int):
    pass


class Color(enum.StrEnum):
    RED = "red"
    NUL = "a\x00b"


def _nested(depth: int, kind: type[Any] = list) -> Any:
    doc: Any = 1
    for _ in range(depth):
        doc = kind([doc]) if kind is not dict else {"k": doc}
    return doc


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("plain", None),
        ("caf\u00e9 \U0001f600", None),
        ("a\x00b", "NUL"),
        ("\ud800", "surrogate"),
        (Text("a\x00b"), "NUL"),
        (Text("\udfff"), "surrogate"),
        (Color.RED, None),
        (Color.NUL, "NUL"),
        (2**63 - 1, None),
        (-(2**63), None),
        (2**63, "64 bits"),
        (-(2**63) - 1, "64 bits"),
        (Number(2**63), "64 bits"),
        (Number(5), None),
        (True, None),
        (None, None),
        (1.5, None),
        (float("nan"), "NaN"),
        (float("-inf"), "NaN"),
        ({"a\x00": 1}, "NUL"),
        ({Text("k\x00"): 1}, "NUL"),
        ({"k": [1, {"x": "\ud800"}]}, "surrogate"),
        (collections.OrderedDict(k="a\x00"), "NUL"),
        (collections.OrderedDict(k=2**64), "64 bits"),
        (_nested(MAX_DEPTH), None),
        (_nested(MAX_DEPTH + 1), "levels deep"),
        (_nested(MAX_DEPTH + 1, dict), "levels deep"),
        ([collections.OrderedDict(k=_nested(MAX_DEPTH))], "levels deep"),
        ((1, "a\x00"), None),  # not a JSON type: nothing to say of it here
    ],
)
def test_unstorable_says_why_for_json_types_and_their_subclasses(
    value: Any, problem: str | None
) -> None:
    found = unstorable(value)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


class _ClassRaises:
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("no class")


class _BitsRaise(int):
    def bit_length(self) -> int:
        raise RuntimeError("no bits")


class _NameRaises(type):
    @property
    def __name__(cls) -> str:  # type: ignore[override]
        raise RuntimeError("no name")


class _Opaque(metaclass=_NameRaises):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __str__(self) -> str:
        raise RuntimeError("no str")


class _Loud(str):
    def strip(self, *args: Any) -> str:
        raise RuntimeError("no strip")


class _SaysLoud:
    def __str__(self) -> str:
        return _Loud("said")


@pytest.mark.parametrize(
    "make",
    [_ClassRaises, lambda: _BitsRaise(5), lambda: _BitsRaise(10**5000), _Opaque, _SaysLoud],
    ids=["class-raises", "bits-raise", "bits-raise-huge", "opaque", "says-str-subclass"],
)
def test_shown_and_text_of_never_raise_and_give_plain_text(make: Callable[[], Any]) -> None:
    value = make()  # made here: pytest itself asks a parameter for its class
    for show in (shown, text_of):
        found = show(value)
        assert type(found) is str


def test_settings_given_hostile_numbers_get_typed_errors_or_plain_values() -> None:
    assert plain_number(_BitsRaise(5)) == 5 and type(plain_number(_BitsRaise(5))) is int
    assert plain_number(True) is None and plain_number(_ClassRaises()) is None
    with pytest.raises(wp.InvalidArgumentError):
        positive(_ClassRaises(), "poll_interval")
    positive(_BitsRaise(5), "lease_ttl")


@pytest.mark.parametrize("char", ["\x7f", "\x01", "é", "€", "\U0001f600", '"', "'", "\\"])
@pytest.mark.parametrize("shape", ["text", "list", "keys"])
def test_the_size_check_refuses_what_json_dumps_makes_too_large(
    runtime: wp.Runtime, char: str, shape: str
) -> None:
    """The size check first bounds a value by its compact JSON: that bound must hold for
    characters ``json.dumps`` escapes and compact JSON does not (DEL: 1 byte becomes 6),
    so a value whose text is over the limit is refused however it is made up."""
    backend = runtime.backend
    backend.max_value_bytes = 10_000

    def make(count: int) -> object:
        if shape == "text":
            return char * count
        if shape == "list":
            return [char] * count
        return {f"{char}{i}": 0 for i in range(count)}

    count = 1
    while backend.value_size(json.dumps(make(count))) <= backend.max_value_bytes:
        count *= 2  # at most twice the limit as sent
    value = make(count)
    with pytest.raises(wp.ValueTooLargeError):
        backend.check_size("result of step s", value)
    backend.check_size("result of step s", make(10))
