"""A workflow's source printed back from its syntax tree the same way on every Python.

:func:`ast.unparse` prints f-strings differently from Python 3.12 on: it may reuse the outer
quote inside a replacement field (``f'{d['k']}'``, where 3.11 printed ``f"{d['k']}"``) and
escape what 3.11 avoided. The source hash is taken over this print, so the same code would
hash differently on workers of two Python versions, and the catalog would refuse the newer
one's registration as a changed body (``WorkflowVersionConflictError``) in the middle of an
upgrade of the interpreter. :func:`printed` therefore prints f-strings as Python 3.11 does
on every version; on 3.11 it is :func:`ast.unparse` itself, so hashes cataloged before stay
valid. Code 3.11 cannot print (an f-string whose replacement field needs a backslash, which
only parses from 3.12 on, or an invisible character there) is written out as its syntax
tree instead (:func:`shape`), the same on every version.

Only the printer's f-string methods differ between the versions supported (3.11 to 3.13):
the rest of :mod:`ast`'s printer is used as it is.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

#: Whether this interpreter's :func:`ast.unparse` is 3.11's.
NATIVE = sys.version_info < (3, 12)

# The printer's module-level helpers (private to ast, stable from 3.9 to 3.13).
_ALL_QUOTES: tuple[str, ...] = getattr(ast, "_ALL_QUOTES", ("'", '"', '"""', "'''"))
_PRECEDENCE: Any = getattr(ast, "_Precedence", None)
_INFSTR: str = getattr(ast, "_INFSTR", "1e309")


class Printer311(ast._Unparser):  # type: ignore[name-defined,misc]
    """:mod:`ast`'s printer with Python 3.11's f-string rendering: a replacement field's
    expression is printed without backslashes, in quotes the enclosing f-string does not
    use, and the f-string takes the first quote its parts leave free."""

    def __init__(self, *, _avoid_backslashes: bool = False) -> None:
        super().__init__()
        self._avoid_backslashes = _avoid_backslashes

    def _write_constant(self, value: Any) -> None:
        if isinstance(value, str) and self._avoid_backslashes:
            self._write_str_avoiding_backslashes(value)
        else:
            super()._write_constant(value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self.write("f")
        if self._avoid_backslashes:
            with self.buffered() as buffer:
                self._write_fstring_inner(node)
            self._write_str_avoiding_backslashes("".join(buffer))
            return
        # Each part's text, and whether it is literal text: only there are escapes of
        # whitespace (a "\n") allowed, as 3.11 chose.
        parts: list[tuple[str, bool]] = []
        for value in node.values:
            with self.buffered() as buffer:
                self._write_fstring_inner(value)
            parts.append(("".join(buffer), isinstance(value, ast.Constant)))
        written: list[str] = []
        quotes = list(_ALL_QUOTES)
        for text, literal in parts:
            text, left = self._str_literal_helper(
                text, quote_types=quotes, escape_special_whitespace=literal
            )
            written.append(text)
            if set(left).isdisjoint(quotes):
                # No one quote suits every part: each part's repr, in triple single quotes.
                quotes = ["'''"]
                written = [repr('"' + text)[2:-1] for text, _ in parts]
                break
            quotes = left
        self.write(f"{quotes[0]}{''.join(written)}{quotes[0]}")

    def _write_fstring_inner(self, node: ast.AST) -> None:
        if isinstance(node, ast.JoinedStr):  # the f-string itself, or a format spec
            for value in node.values:
                self._write_fstring_inner(value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.write(node.value.replace("{", "{{").replace("}", "}}"))
        elif isinstance(node, ast.FormattedValue):
            self.visit_FormattedValue(node)
        else:
            raise ValueError(f"unexpected node inside an f-string: {node!r}")

    def visit_FormattedValue(self, node: ast.FormattedValue) -> None:
        inner = type(self)(_avoid_backslashes=True)
        inner.set_precedence(_PRECEDENCE.TEST.next(), node.value)
        expr = str(inner.visit(node.value))
        if "\\" in expr:
            raise ValueError("an f-string's expression needs a backslash")
        with self.delimit("{", "}"):
            if expr.startswith("{"):
                self.write(" ")  # "{ {" keeps a set or dict display from reading as "{{"
            self.write(expr)
            if node.conversion != -1:
                self.write(f"!{chr(node.conversion)}")
            if node.format_spec:
                self.write(":")
                self._write_fstring_inner(node.format_spec)


def printed(node: ast.AST) -> str:
    """``node`` printed as Python 3.11's :func:`ast.unparse` prints it, or where 3.11 cannot
    print it (an f-string expression that needs a backslash), its :func:`shape`."""
    try:
        return ast.unparse(node) if NATIVE else str(Printer311().visit(node))
    except ValueError:
        return shape(node)


def shape(value: Any) -> str:
    """A syntax tree written out field by field, the same on every version: fields a newer
    Python added are empty for older syntax and left out (``type_params=[]``), as are the
    empty text pieces Python 3.12.1 puts in f-strings' format specs."""
    if isinstance(value, ast.AST):
        fields = []
        for name in value._fields:
            field: Any = getattr(value, name, None)
            if isinstance(value, ast.JoinedStr) and name == "values":
                field = [v for v in field if not (isinstance(v, ast.Constant) and v.value == "")]
            if field is not None and field != []:
                fields.append(f"{name}={shape(field)}")
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, list):
        return f"[{', '.join(shape(v) for v in value)}]"
    return repr(value)
