"""A workflow version's source hash, which the catalog keeps to tell a changed body.

sha256 over ``name NUL version NUL body`` where *body* is the workflow function's source
parsed with :mod:`ast`, stripped of its decorators and docstring, and printed back with
:func:`ast.unparse` (f-strings as Python 3.11 prints them, on every version: see
:mod:`.source_print`). Comments, blank lines, quoting style and formatting therefore never change
the hash; any change to what the code does (or to its annotations) does. Step definitions and
helper functions are not part of it: they are recorded results, not replayed code.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from .error_documents import shown
from .errors import WorkflowDefinitionError
from .source_print import printed


def normalized_source(fn: Callable[..., Any]) -> str:
    """The function's code without decorators, docstring, comments or formatting."""
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
    except ValueError as exc:  # the parser's own failure (CPython 3.12.1 on f"{x:{y=}}")
        raise WorkflowDefinitionError(f"cannot parse the source of {shown(fn)}: {exc}") from exc
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
    return printed(node)


def source_hash(name: str, version: int, fn: Callable[..., Any]) -> str:
    """sha256 (hex) over name, version and the normalized workflow source."""
    digest = hashlib.sha256()
    digest.update(name.encode())
    digest.update(b"\0")
    digest.update(str(version).encode())
    digest.update(b"\0")
    digest.update(normalized_source(fn).encode())
    return digest.hexdigest()
