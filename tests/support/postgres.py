"""Test databases on the suite's PostgreSQL servers: the versions, their settings, a fresh database each."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pytest

from resources.testing.local_postgres import LocalPostgres

#: Versions every protocol test runs against; PGCDC_TEST_VERSIONS narrows it for local iteration.
POSTGRES_VERSIONS = [int(v) for v in os.environ.get("PGCDC_TEST_VERSIONS", "15,18").split(",")]

#: For a module's ``pytestmark``: its tests run on the newest server only. Dagster's wiring and YAML do
#: not depend on the server's version, and each version costs such a test its whole run again. (A
#: ``parametrize`` mark takes precedence over the ``pg_server`` fixture's own versions.)
NEWEST_POSTGRES_ONLY = pytest.mark.parametrize(
    "pg_server", POSTGRES_VERSIONS[-1:], indirect=True, scope="session", ids=[f"pg{POSTGRES_VERSIONS[-1]}"]
)


def one_version_each(argname: str, values: Sequence[str], first: int = 0) -> pytest.MarkDecorator:
    """For a test whose parameter ``argname`` does not depend on the server's version (a writer, a history
    mode): each value runs on one PostgreSQL version, the versions taken in turn from ``POSTGRES_VERSIONS[first]``,
    rather than every value on every version. Two tests over the same values with ``first`` 0 and 1 run
    every value on every version between them."""
    versions = [POSTGRES_VERSIONS[(first + i) % len(POSTGRES_VERSIONS)] for i in range(len(values))]
    return pytest.mark.parametrize(
        ("pg_server", argname), list(zip(versions, values)), indirect=["pg_server"], scope="session",
        ids=[f"pg{version}-{value}" for version, value in zip(versions, values)],
    )  # fmt: skip


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


@contextmanager
def fresh_database(pg_server: LocalPostgres, encoding: str | None = None) -> Iterator[PgDatabase]:
    """A new database on ``pg_server``, dropped afterwards with its slots and prepared transactions.

    ``encoding`` (e.g. ``LATIN1``) creates it in that encoding, with the C locale, from template0."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    created_as = "" if encoding is None else f" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"{created_as}')
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
