"""Test tiers: each test gets exactly one of ``unit``, ``pg``, ``sail``, ``slow``, ``spark``, from its fixtures.

The tier of a test is the most expensive thing its fixtures start, found in the closure of the
fixtures it uses (``item.fixturenames``), so a new test is classified without a thought:

* a fixture named in :data:`FIXTURE_TIERS` (the suite's shared servers and engines), or
* any fixture, or the test function itself, whose own source starts a server (:data:`SERVER_CALLS`:
  a fixture of one module that starts a PostgreSQL of its own, a test that runs a classic Spark
  session in a child, say);
* neither: ``unit``.

A test may name its tier itself (``pytestmark = pytest.mark.slow`` or a decorator) when its fixtures
do not tell (it starts servers in a child process, as the demo does) or when it is too long for
``make test-fast``; a named tier cheaper than the fixtures' is an error at collection. A ``unit`` test
that starts PostgreSQL or the embedded engine anyway fails at once (``refuse_servers``).
"""

from __future__ import annotations

import inspect
from functools import cache

import pytest

#: Every collected test's tier markers (nodeid -> names), stashed at collection, before ``-m`` deselects.
COLLECTED_TIERS = pytest.StashKey[dict[str, list[str]]]()

#: Cheapest first. ``make test-unit`` runs ``unit``; ``make test-fast`` ``unit``, ``pg`` and ``sail``.
TIERS = ("unit", "pg", "sail", "slow", "spark")

FIXTURE_TIERS = {
    "pg_server": "pg",  # tests/conftest.py: one PostgreSQL per version for the session
    "s3_server": "pg",  # tests/support/s3_fixtures.py: a local S3 server (moto)
    "spark_engine": "sail",  # tests/support/spark_fixtures.py: the embedded Sail engine
    "s3_spark_engine": "sail",  # the same, with object storage settings
    "engine": "spark",  # tests/support/engine_fixtures.py: the JVM engines and Sail's standalone server
}

#: Calls in a fixture's or a test's source that start a server (its tier).
SERVER_CALLS = {
    "start_local_postgres(": "pg",
    "LocalPostgres(": "pg",
    "SparkEngine.embedded(": "sail",
    "resources.engines.sail_server": "sail",
    "start_jvm(": "spark",
    "tests.support.classic_child": "spark",  # a classic Spark session: a JVM in the child
}


def rank(tier: str) -> int:
    return TIERS.index(tier)


@cache
def _source_tier(function: object) -> str:
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return "unit"
    found = [tier for call, tier in SERVER_CALLS.items() if call in source]
    return max(found, key=rank, default="unit")


def fixture_tier(item: pytest.Item) -> str:
    """The most expensive tier among the fixtures ``item`` uses (directly or through other fixtures) and its own body."""
    tiers = ["unit"]
    definitions = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if name in FIXTURE_TIERS:
            tiers.append(FIXTURE_TIERS[name])
        for definition in definitions.name2fixturedefs.get(name, ()) if definitions is not None else ():
            tiers.append(_source_tier(definition.func))
    if isinstance(item, pytest.Function):
        tiers.append(_source_tier(item.function))
    return max(tiers, key=rank)


def named_tiers(item: pytest.Item) -> list[str]:
    return [marker.name for marker in item.iter_markers() if marker.name in TIERS]


def assign_tier(item: pytest.Item) -> None:
    """Add the tier marker (or check the one the test names), so that ``-m <tier>`` selects it."""
    derived = fixture_tier(item)
    named = named_tiers(item)
    if len(set(named)) > 1:
        raise pytest.UsageError(f"{item.nodeid} names tiers {sorted(set(named))}: a test has exactly one")
    if named:
        if rank(named[0]) < rank(derived):
            raise pytest.UsageError(
                f"{item.nodeid} is marked {named[0]} but its fixtures start what the {derived} tier has: mark it {derived}"
            )
    else:
        item.add_marker(derived)
    if (named or [derived])[0] == "spark" and item.nodeid.split("::", 1)[0] not in JVM_MODULES:
        raise pytest.UsageError(
            f"{item.nodeid} starts a JVM but its module is not in JVM_MODULES (tests/support/tiers.py): add it"
            " there, so that make test runs it on the JVM worker, or move the test into one of them"
        )


def refuse_servers(nodeid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting PostgreSQL or the embedded engine fail in a ``unit`` test (this process only)."""
    from resources.engines.engine import SparkEngine
    from resources.testing.local_postgres import LocalPostgres

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{nodeid} is in the unit tier (no server) but starts one: use the pg/spark fixtures, "
            "or mark it with its tier (tests/support/tiers.py)"
        )

    monkeypatch.setattr(LocalPostgres, "start", refuse)
    monkeypatch.setattr(LocalPostgres, "init", refuse)
    monkeypatch.setattr(SparkEngine, "embedded", refuse)


#: The modules that hold the ``spark`` tier (checked at collection). ``make test`` runs on two pytest-xdist
#: workers; its scheduler (:func:`jvm_scheduler`) sends these modules' tests to one worker, one after another,
#: so at most one JVM runs at a time (the engines are session fixtures, one at a time) while the other worker
#: takes the tests without a JVM. By module, not by an ``xdist_group`` mark: with pytest 9.2, xdist 3.8's
#: ``--dist loadgroup`` no longer sees the marks (it rewrites a node id pytest no longer reads).
JVM_MODULES = (
    "tests/test_engines.py",
    "tests/test_spark_kept_jvm.py",
    "tests/test_spark_crashes.py",
    "tests/test_spark_catalog.py",
)
JVM_GROUP = "jvm"
#: Engines of ``tests/support/engine_fixtures.py`` that start no JVM (Sail's standalone server): their tests
#: leave the JVM worker, the suite's long pole, for the other one (which starts its own instance of the engine).
NO_JVM_ENGINES = ("sail-server",)


#: Modules whose tests share a module fixture that costs a child interpreter's imports: one worker runs them.
ONE_WORKER_MODULES = ("tests/test_layout.py",)


def in_jvm_group(nodeid: str) -> bool:
    """Whether the test runs on the JVM worker: a test of :data:`JVM_MODULES` not on an engine without a JVM."""
    if nodeid.split("::", 1)[0] not in JVM_MODULES:
        return False
    parameters = nodeid.partition("[")[2]
    return not any(parameters.startswith(f"{engine}-") for engine in NO_JVM_ENGINES)


def jvm_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's ``loadgroup`` scheduler, with every test :func:`in_jvm_group` in one group (the largest, so
    it starts first), each module of :data:`ONE_WORKER_MODULES` in one group; every other test is a unit of its own."""
    from xdist.scheduler import LoadGroupScheduling

    class JvmGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if in_jvm_group(nodeid):
                return JVM_GROUP
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else super()._split_scope(nodeid)

    return JvmGroupScheduling(config, log)
