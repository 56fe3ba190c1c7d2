"""The source hash is the same on every Python the package supports.

Python 3.12's :func:`ast.unparse` prints f-strings differently (``f'{d['k']}'`` where 3.11
printed ``f"{d['k']}"``): unchanged code hashed differently on a newer interpreter and its
registration was refused as a changed body. The hash now prints f-strings as 3.11 does
everywhere (``wf_persist.source_print``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from wf_persist import source_print
from wf_persist.source_print import NATIVE, Printer311, printed, shape
from wf_persist.sources import normalized_source, source_hash

from .fixtures import fstrings

ROOT = Path(__file__).resolve().parents[1]
#: Where the printer's checks read functions: this project's (about 90 of them print
#: differently with Python 3.12's own ast.unparse).
CORPUS = [ROOT / "wf_persist", ROOT / "tests", ROOT / "bench", ROOT / "examples"]

#: The hashes Python 3.11 gives the fixture's workflows; every later Python must agree.
PINNED = {
    "keyed": "250d69391b3f5bb1",
    "nested": "6e278cff8038a9da",
    # Python 3.11 cannot print it (it raised a bare ValueError): its syntax tree's shape.
    "invisible": "f735dcebf82303af",
}


def _files() -> Iterator[Path]:
    for place in CORPUS:
        yield from sorted(place.rglob("*.py"))


def _native(node: ast.AST) -> str:
    """This interpreter's own print; where it cannot print (ValueError), the shape."""
    try:
        return ast.unparse(node)
    except ValueError:
        return shape(node)


def _functions() -> Iterator[tuple[str, ast.AST]]:
    """Every function of the corpus that parses here, with its ``path:line``."""
    for path in _files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{path}:{node.lineno}", node


def _digests(print_: str) -> dict[str, str]:
    """``path:line`` → sha256 of each function's print."""
    found: dict[str, str] = {}
    for where, node in _functions():
        text = _native(node) if print_ == "native" else printed(node)
        found[where] = hashlib.sha256(text.encode()).hexdigest()
    return found


def test_fstrings_hash_as_python_3_11_printed_them() -> None:
    for name, pinned in PINNED.items():
        assert source_hash(name, 1, getattr(fstrings, name))[:16] == pinned, name


@pytest.mark.skipif(not NATIVE, reason="compares with this interpreter's own ast.unparse")
def test_the_printer_prints_as_python_3_11_does() -> None:
    """On 3.11 the printer (the f-string methods ported) gives what ast.unparse gives, for
    every function of the corpus."""
    count = 0
    for where, node in _functions():
        try:
            expected = ast.unparse(node)
        except ValueError:  # nor can the printer: printed() then gives the shape
            with pytest.raises(ValueError):
                Printer311().visit(node)
            continue
        assert Printer311().visit(node) == expected, where
        count += 1
    assert count > 1_000


def _other_pythons() -> list[Path]:
    """Interpreters of later minor versions this machine has through pyenv, if any."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return []
    run = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True)
    found = []
    for version in run.stdout.split():
        parts = version.split(".")
        if len(parts) == 3 and parts[0] == "3" and parts[1].isdigit() and int(parts[1]) >= 12:
            prefix = subprocess.run([pyenv, "prefix", version], capture_output=True, text=True)
            python = Path(prefix.stdout.strip()) / "bin" / "python"
            if prefix.returncode == 0 and python.exists():
                found.append(python)
    return found


_SCRIPT = """
import ast, hashlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("printer", sys.argv[1])
printer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(printer)
found = {}
for path in json.loads(sys.stdin.read()):
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            text = printer.printed(node)
            found[f"{path}:{node.lineno}"] = hashlib.sha256(text.encode()).hexdigest()
print(json.dumps(found))
"""


@pytest.mark.skipif(not NATIVE, reason="the reference print is Python 3.11's")
def test_later_pythons_print_what_python_3_11_printed() -> None:
    """Run on each later interpreter at hand (the printer needs nothing but the standard
    library): every function of the corpus prints as here. (A string literal holding a
    character a later Unicode database made printable would not: its repr changes.)"""
    here = _digests("printed")
    assert here == _digests("native")
    for python in _other_pythons():
        run = subprocess.run(
            [str(python), "-X", "utf8", "-c", _SCRIPT, source_print.__file__],
            input=json.dumps([str(p) for p in _files()]),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        there = json.loads(run.stdout)
        differ = sorted(k for k in here.keys() & there.keys() if here[k] != there[k])
        assert differ == [], (python, differ[:5])
        assert here.keys() <= there.keys()


def test_fstrings_print_with_the_other_quote_inside() -> None:
    """3.11's print: a replacement field's strings take a quote the f-string does not."""
    text = normalized_source(fstrings.keyed)
    assert "f\"{d['k']}\"" in text and "f'{d['k']}'" not in text
