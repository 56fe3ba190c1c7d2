"""The JSON text of every document wf_persist writes: ``json.dumps``'s, made faster, with
every float kept a float on every backend."""

from __future__ import annotations

import json
import json.encoder
import os
from typing import Any, Final


def _encoder() -> Any:
    """``json.dumps`` with its defaults, made once: ``dumps`` builds a C encoder on every
    call, which costs about as much as encoding a step's event. No circular-reference check:
    every document written is JSON pydantic dumped or wf_persist built, which has no cycle
    (one would still fail, with RecursionError)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # an interpreter without the C accelerator
        return None
    return make(
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        True,
    )


_ENCODE: Final = _encoder()


def json_text(value: Any) -> str:
    """``json.dumps(value)``, the text every write sends for a JSON column, made faster,
    with every float kept a float (see :func:`_exact_floats`)."""
    text = json.dumps(value) if _ENCODE is None else "".join(_ENCODE(value, 0))
    return _exact_floats(value) if "e+" in text else text


def _exact_floats(value: Any) -> str:
    """``value`` as JSON text where each float written with a positive exponent
    (``1e+16``, any of magnitude 1e16 or more: every such float is an integer) is written
    as its integer digits and ``.0`` instead. PostgreSQL's JSONB keeps a number as a
    decimal of the scale it was written with: ``1e+16`` came back as the integer
    10000000000000000 (past 64 bits, one no step argument may hold), so a replay saw
    another value than the run had."""
    found: list[str] = []
    # Stands in for a float while the document is encoded: NUL and a token drawn for this
    # call, which no text of the document can hold by chance or by design.
    mark = f"\x00wf{os.urandom(8).hex()}"

    def marked(v: Any) -> Any:
        if isinstance(v, float) and "e+" in repr(v):
            found.append(f"{int(v)}.0")
            return f"{mark}{len(found) - 1}\x00"
        if isinstance(v, dict):
            return {k: marked(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [marked(x) for x in v]
        return v

    text = json.dumps(marked(value))
    quoted = json.dumps(mark)[1:-1]
    for i, digits in enumerate(found):
        text = text.replace(f'"{quoted}{i}\\u0000"', digits, 1)
    return text


def as_jsonb(doc: Any) -> Any:
    """``doc`` as PostgreSQL's JSONB gives it back: each object's keys shortest first, then
    by their UTF-8 bytes, and ``-0.0`` as ``0.0`` (a decimal has no negative zero). A run
    handed the value it recorded in its own order would replay in another: a loop over a
    step's dict called the next step with another key than it had recorded."""
    if isinstance(doc, dict):
        keys = sorted(
            doc,
            key=lambda k: (
                len(k.encode("utf-8", "surrogatepass")),
                k.encode("utf-8", "surrogatepass"),
            ),
        )
        return {k: as_jsonb(doc[k]) for k in keys}
    if isinstance(doc, list):
        return [as_jsonb(v) for v in doc]
    if type(doc) is float and doc == 0.0:
        return 0.0
    return doc
