"""A workflow version's source hash, which the catalog keeps to tell a changed body.

sha256 over ``name NUL version NUL body`` where *body* is the workflow function's source
parsed with :mod:`ast`, stripped of its decorators and docstring, and written as
:func:`~.canonical.canonical` text. Comments, blank lines, quoting style, formatting and the
interpreter's version therefore never change the hash; any change to what the code does (or
to its annotations) does. Step definitions and helper functions are not part of it: they are
recorded results, not replayed code. A catalog entry made before (the body printed back with
:func:`ast.unparse`) is still the same code's: :func:`source_hashes` gives both.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from .canonical import canonical
from .error_documents import shown
from .errors import WorkflowDefinitionError


def _definition(fn: Callable[..., Any]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function's definition without decorators or docstring."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise WorkflowDefinitionError(
            f"cannot read the source of {shown(fn)}; workflows must be defined in a module file"
        ) from exc
    try:  # a lambda's source is its whole line, which may not parse on its own
        node: ast.stmt | None = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        node = None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise WorkflowDefinitionError(f"{shown(fn)} is not a plain function definition")
    node.decorator_list = []
    body = node.body
    first = body[0] if body else None
    is_docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    if is_docstring:
        node.body = body[1:] or [ast.Pass()]
    return node


def source_hashes(name: str, version: int, fn: Callable[..., Any]) -> tuple[str, str]:
    """The source hash, and the one the catalog recorded before (over ``ast.unparse``,
    which one interpreter version may print differently from another)."""
    node = _definition(fn)
    return _hash(name, version, canonical(node)), _hash(name, version, ast.unparse(node))


def source_hash(name: str, version: int, fn: Callable[..., Any]) -> str:
    """sha256 (hex) over name, version and the normalized workflow source."""
    return source_hashes(name, version, fn)[0]


def _hash(name: str, version: int, body: str) -> str:
    digest = hashlib.sha256()
    digest.update(name.encode())
    digest.update(b"\0")
    digest.update(str(int(version)).encode())
    digest.update(b"\0")
    digest.update(body.encode())
    return digest.hexdigest()
