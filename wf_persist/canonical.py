"""A canonical text of a Python syntax tree, the same on every supported interpreter.

:func:`ast.unparse` is not: Python 3.12 prints ``f"{d['k']}"`` as ``f'{d['k']}'``, so a
source hash over it changed for unchanged code when a deploy moved to 3.12, and every run
parked on that version could no longer be driven by the new workers. The tree itself is the
same; what newer interpreters add to it are fields left empty for code older ones accept
(``type_params=[]`` in 3.12). This text names each node and its fields, leaving out the
empty ones, with constants as their ``repr``. It imports nothing but the standard library,
so any interpreter can load this file alone and check it.
"""

from __future__ import annotations

import ast


def canonical(node: object) -> str:
    """The canonical text of ``node`` (an :class:`ast.AST`, a list of them, or a field's
    constant value)."""
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={canonical(value)}"
            for name in node._fields
            if (value := getattr(node, name, None)) is not None and value != []
        ]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(canonical(item) for item in node)}]"
    return f"{type(node).__name__}:{node!r}"
