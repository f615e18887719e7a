"""Dagster's private APIs are used in one module only, and each is still where that module imports it from.

An upgrade of Dagster that moves one fails here with the name, its old module and the version,
instead of as an ImportError somewhere in a code location's start.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import dagster

ROOT = Path(__file__).resolve().parents[1]
PRIVATE_MODULE = ROOT / "pgcdc_assets" / "dagster_private.py"


def private_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from dagster._... import name`` and ``import dagster._...`` in ``path``."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dagster._"):
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names if alias.name.startswith("dagster._"))
    return found


def test_only_dagster_private_imports_private_dagster() -> None:
    elsewhere = [
        f"{path.relative_to(ROOT)} imports {module}"
        for package in ("resources", "pgcdc_assets", "sensors")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != PRIVATE_MODULE
        for module, _ in private_imports(path)
    ]
    assert elsewhere == [], "import Dagster's private APIs through pgcdc_assets/dagster_private.py only"


def test_every_private_dagster_api_is_still_there() -> None:
    imports = private_imports(PRIVATE_MODULE)
    assert imports, "pgcdc_assets/dagster_private.py imports nothing private: delete it and this test"
    moved = []
    for module_name, name in imports:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            moved.append(f"module {module_name} is gone")
            continue
        if name and not hasattr(module, name):
            moved.append(f"{name} is no longer in {module_name}")
    assert moved == [], (
        f"Dagster {dagster.__version__} moved private APIs pgcdc uses: {'; '.join(moved)}. "
        "Find their new home (or a public replacement) and update pgcdc_assets/dagster_private.py"
    )
