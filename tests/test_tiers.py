"""Every collected test has exactly one tier, and the tiers keep their promises (docs/testing.md, "Tiers")."""

from __future__ import annotations

import pytest

from tests.support.tiers import COLLECTED_TIERS, FIXTURE_TIERS, in_jvm_group, TIERS


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    collected = request.config.stash[COLLECTED_TIERS]
    assert request.node.nodeid in collected
    wrong = {nodeid: tiers for nodeid, tiers in collected.items() if len(tiers) != 1 or tiers[0] not in TIERS}
    assert wrong == {}


def test_this_test_is_in_the_unit_tier(request: pytest.FixtureRequest) -> None:
    assert request.config.stash[COLLECTED_TIERS][request.node.nodeid] == ["unit"]


def test_the_tiers_are_registered_markers(pytestconfig: pytest.Config) -> None:
    """``--strict-markers`` (pyproject.toml) turns a misspelt tier into a collection error."""
    registered = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    assert set(TIERS) <= registered
    assert set(FIXTURE_TIERS.values()) <= set(TIERS)


def test_a_fixture_that_starts_postgres_puts_its_tests_in_the_pg_tier(
    pg_server: object, request: pytest.FixtureRequest
) -> None:
    assert request.config.stash[COLLECTED_TIERS][request.node.nodeid] == ["pg"]


def test_the_jvm_worker_takes_the_jvm_modules_but_the_engines_without_a_jvm() -> None:
    assert in_jvm_group("tests/test_engines.py::test_lifecycle_kill_and_crash_match_postgres[spark-cluster-pg18]")
    assert in_jvm_group("tests/test_engines.py::test_classic_in_process_session_snapshots_drains_and_maintains[pg18]")
    assert in_jvm_group("tests/test_spark_kept_jvm.py::test_runs_share_a_kept_jvm_that_stops_when_idle[pg18]")
    assert not in_jvm_group("tests/test_engines.py::test_lifecycle_kill_and_crash_match_postgres[sail-server-pg18]")
    assert not in_jvm_group("tests/test_faults.py::test_embedded_sail_killed[pg15]")
