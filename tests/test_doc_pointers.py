"""The docs' code pointers still point at what they name (no server).

A pointer is written as two code spans, `` `path:line` `name` ``: ``name`` is a function, class or
module-level name defined in ``path``, qualified as far as the doc likes (``_drain`` or
``ReplicationStream._drain``), and ``line`` is the line its definition starts on (``def``/``class``).
Code moves; this test names every pointer that no longer holds and the line to write instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

POINTER = re.compile(r"`([\w./-]+\.py):(\d+)` `([\w.]+)`")

DOCUMENTS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])


def definitions(path: Path) -> dict[str, list[int]]:
    """Qualified name -> the lines its definitions start on (functions and classes at any depth,
    module-level assignments)."""
    found: dict[str, list[int]] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.setdefault(prefix + node.name, []).append(node.lineno)
                walk(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.Assign | ast.AnnAssign) and not prefix:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        found.setdefault(target.id, []).append(node.lineno)

    walk(ast.parse(path.read_text(encoding="utf-8")).body, "")
    return found


def broken_pointers(document: Path) -> list[str]:
    """One line per pointer of ``document`` that does not hold, saying what to write instead."""
    broken = []
    for number, text in enumerate(document.read_text(encoding="utf-8").splitlines(), start=1):
        for match in POINTER.finditer(text):
            relative, line, name = match.group(1), int(match.group(2)), match.group(3)
            where = f"{document.relative_to(ROOT)}:{number}: `{relative}:{line}` `{name}`"
            source = ROOT / relative
            if not source.is_file():
                broken.append(f"{where}: {relative} does not exist (moved or split?)")
                continue
            lines = sorted(
                start
                for qualified, starts in definitions(source).items()
                if qualified == name or qualified.endswith("." + name)
                for start in starts
            )
            if line in lines:
                continue
            if not lines:
                broken.append(f"{where}: {relative} defines no {name} any more (renamed or moved?)")
                continue
            source_lines = source.read_text(encoding="utf-8").splitlines()
            held = repr(source_lines[line - 1].strip()) if 0 < line <= len(source_lines) else "nothing (past the end)"
            fix = " or ".join(f"`{relative}:{start}`" for start in lines)
            broken.append(f"{where}: line {line} holds {held}; {name} is defined there at {fix}: write that")
    return broken


def test_the_documents_have_pointers() -> None:
    """docs/drain.md follows a transaction through the code by its pointers: the pattern must find them."""
    assert len(POINTER.findall((ROOT / "docs" / "drain.md").read_text(encoding="utf-8"))) >= 30


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_pointer_names_the_line_its_symbol_is_defined_on(document: Path) -> None:
    broken = broken_pointers(document)
    assert not broken, "stale code pointers (fix each as said):\n" + "\n".join(broken)
