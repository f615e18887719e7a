"""PostgreSQL's own subscriber as the oracle: a second cluster subscribes to pgcdc's publication.

Where the expected Delta state is subtle (row filters, column lists, partition roots, duplicate
rows under REPLICA IDENTITY FULL, TRUNCATE), comparing Delta with the publisher's table is not
enough: the publisher holds rows and columns the publication never sends. PostgreSQL's logical
replication subscriber applies exactly what the publication publishes, so after each drain its
tables are what pgcdc's Delta tables must hold, value for value and with multiplicity.

* ``subscriber_server``: a second server of the publisher's major version, one per version per
  session (``tests/conftest.py``'s ``pg_server`` gives the publisher); destroyed at the end.
* ``subscribe``: a factory; ``subscribe("pub")`` copies the publisher database's schema onto a
  fresh database of the subscriber server (``pg_dump --schema-only``, then the columns a column
  list leaves out are dropped: the subscriber fills unpublished columns with defaults, which a
  NOT NULL constraint would refuse), creates the subscription on its own slot (never pgcdc's), waits
  for the initial copy and returns a :class:`Subscriber`. The subscription is dropped at teardown,
  also when the test fails, which drops its slot on the publisher.
* :meth:`Subscriber.wait_for`: until the subscriber has applied everything the publisher wrote up
  to an LSN (a drain's ``end_lsn``), by the position its apply worker reports (``replay_lsn``), as
  PostgreSQL's own TAP tests wait; bounded, and an apply error fails at once with the server's log.
* :meth:`Subscriber.assert_matches_delta`: every published relation's Delta table equals the
  subscriber's table (``resources/testing/verify.py``'s comparison, ``_pgcdc_*`` columns ignored).

The subscriber's tables equal the publisher's state at the LSN only if nothing is written between
the LSN and the comparison: tests pause their workload while they drain and compare.

PYTEST_DONT_REWRITE: failures here are raised explicitly, and test modules import this one
before ``pytest_plugins`` names it, too late for pytest to rewrite it.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from resources.config import PgcdcConfig
from resources.lsn import LSN
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.connections import libpq_options
from resources.sql import quote_ident
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import compare_table
from tests.support.postgres import PgDatabase

__all__ = ["Subscriber", "SubscriberError", "subscribe", "subscriber_server"]

#: Bound on the initial copy and on catching up after a drain: seconds, not minutes, here.
WAIT_SECONDS = 60.0
#: How often the catalogs are polled while waiting for a position.
POLL_SECONDS = 0.02
#: Server log lines shown when the subscriber fails.
LOG_LINES = 30
#: Quoted values of more than 80 characters in a diff are shortened (TOASTed values run to kilobytes).
_LONG_TEXT = re.compile(r"('[^'\n]{40})[^'\n]{40,}'")


class SubscriberError(AssertionError):
    """The subscriber failed or did not reach a position in time: the oracle has no answer."""


#: PostgreSQL 15's launcher starts apply workers at most once per wal_retrieve_retry_interval
#: (5 s) server-wide, which would hold every subscription after the first for 5 s.
SUBSCRIBER_SETTINGS = {"wal_retrieve_retry_interval": "100ms"}


@pytest.fixture(scope="session")
def subscriber_server(pg_server: LocalPostgres) -> Iterator[LocalPostgres]:
    """A second server of the publisher's major version, for the whole session."""
    server = start_local_postgres(pg_server.major, SUBSCRIBER_SETTINGS)
    try:
        yield server
    finally:
        server.destroy()


@dataclass
class Subscriber:
    """One subscription on the subscriber server, to one publication of a test's database."""

    publisher: PgDatabase
    server: LocalPostgres
    database: str
    publication: str
    subscription: str

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.database)

    def connect(self) -> psycopg.Connection:
        """A session on the subscriber's database that reads values as pgcdc's sessions do."""
        return psycopg.connect(self.dsn, autocommit=True, options=libpq_options(SESSION_SETTINGS))

    # ---------------------------------------------------------------- set-up and teardown

    def create(self) -> None:
        """Database, schema and subscription; returns once every table's initial copy is done."""
        if self.server.major < 15:
            raise SubscriberError(
                f"the subscriber oracle needs PostgreSQL 15+ (disable_on_error, column lists), not {self.server.major}:"
                " use resources/testing/verify.py against the publisher"
            )
        with psycopg.connect(self.server.dsn(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {quote_ident(self.database)}")
        self._copy_schema()
        with self.connect() as conn:
            # A utility statement takes no parameters: the values are quoted as literals client-side.
            conn.execute(
                sql.SQL(
                    "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}"
                    " WITH (copy_data = true, create_slot = true, slot_name = {}, disable_on_error = true)"
                ).format(
                    sql.Identifier(self.subscription),
                    sql.Literal(self.publisher.dsn),
                    sql.Identifier(self.publication),
                    sql.Literal(self.subscription),
                )
            )
        self._wait_for_initial_copy()

    def _copy_schema(self) -> None:
        """The publisher database's schema, less the columns each publication's column list leaves out."""
        dump = subprocess.run(
            [
                str(self.server.binary("pg_dump")),
                "--schema-only",
                "--no-owner",
                "--no-privileges",
                "--no-publications",
                "--no-subscriptions",
                "--dbname",
                self.publisher.dsn,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        restore = subprocess.run(
            [
                str(self.server.binary("psql")),
                "--no-psqlrc",
                "--quiet",
                "--set",
                "ON_ERROR_STOP=1",
                "--dbname",
                self.dsn,
            ],
            input=dump.stdout,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if restore.returncode != 0:
            raise SubscriberError(f"the publisher's schema did not load on the subscriber: {restore.stderr.strip()}")
        with self.connect() as conn:
            for schema, table, columns in self._published():
                relation = f"{quote_ident(schema)}.{quote_ident(table)}"
                for (column,) in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
                    " AND NOT attisdropped AND NOT attname = ANY(%s)",
                    (relation, columns),
                ).fetchall():
                    conn.execute(f"ALTER TABLE {relation} DROP COLUMN {quote_ident(column)} CASCADE")

    def _published(self) -> list[tuple[str, str, list[str]]]:
        """(schema, table, published columns) of every relation the publication publishes."""
        return [
            (schema, table, list(columns))
            for schema, table, columns in self.publisher.execute(
                "SELECT schemaname::text, tablename::text, attnames::text[] FROM pg_publication_tables"
                " WHERE pubname = %s ORDER BY 1, 2",
                (self.publication,),
            )
        ]

    def _wait_for_initial_copy(self) -> None:
        """Every relation synchronized ('s') or ready ('r'): from here the apply worker owns them all."""
        expected = len(self._published())
        with self.connect() as conn:
            self._poll(
                lambda: _true(
                    conn,
                    "SELECT count(*) FILTER (WHERE r.srsubstate IN ('r', 's')) = %s FROM pg_subscription_rel r"
                    " JOIN pg_subscription s ON s.oid = r.srsubid WHERE s.subname = %s",
                    (expected, self.subscription),
                ),
                conn,
                f"the initial copy of {expected} relation(s)",
            )

    def drop(self) -> None:
        """Drop the subscription (and so its slot on the publisher), then the database.

        A subscription that cannot reach its slot any more is detached from it first; the slot,
        if still there, goes with the publisher's database (``pg``'s teardown drops its slots).
        """
        with psycopg.connect(self.server.dsn(), autocommit=True) as admin:
            if not _true(admin, "SELECT count(*) > 0 FROM pg_database WHERE datname = %s", (self.database,)):
                return  # create() failed before there was anything to drop
        with self.connect() as conn:
            name = quote_ident(self.subscription)
            try:
                conn.execute(f"DROP SUBSCRIPTION IF EXISTS {name}")
            except psycopg.Error:
                conn.execute(f"ALTER SUBSCRIPTION {name} DISABLE")
                conn.execute(f"ALTER SUBSCRIPTION {name} SET (slot_name = NONE)")
                conn.execute(f"DROP SUBSCRIPTION {name}")
        with psycopg.connect(self.server.dsn(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {quote_ident(self.database)} WITH (FORCE)")

    # ---------------------------------------------------------------- waiting

    def wait_for(self, lsn: LSN, timeout: float = WAIT_SECONDS) -> None:
        """Return once the subscriber has applied every transaction the publisher committed before ``lsn``.

        The apply worker reports as its apply position (``replay_lsn`` in the publisher's
        pg_stat_replication) the end of what it has received and applied, and the walsender
        sends keepalives carrying its position when idle, so the position passes ``lsn`` soon
        after the last transaction before it has been committed on the subscriber.
        """
        with self.publisher.connect() as publisher, self.connect() as subscriber:
            self._poll(
                lambda: _true(
                    publisher,
                    "SELECT coalesce(bool_or(replay_lsn >= %s::pg_lsn), false) FROM pg_stat_replication"
                    " WHERE application_name = %s AND state = 'streaming'",
                    (str(lsn), self.subscription),
                ),
                subscriber,
                f"publisher position {lsn}",
                timeout,
            )

    def _poll(
        self, reached: Callable[[], bool], subscriber: psycopg.Connection, what: str, timeout: float = WAIT_SECONDS
    ) -> None:
        """Poll ``reached`` until true; an error (disable_on_error disabled the subscription) or the
        deadline fails at once, with the subscriber's log, rather than leaving the test to hang."""
        deadline = time.monotonic() + timeout
        while not reached():
            enabled = _true(
                subscriber, "SELECT subenabled FROM pg_subscription WHERE subname = %s", (self.subscription,)
            )
            if not enabled:  # disable_on_error: an apply or copy error stopped the subscription
                raise SubscriberError(f"subscription {self.subscription} failed before {what}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise SubscriberError(
                    f"subscription {self.subscription} did not reach {what} within {timeout:.0f} s:\n{self._log_tail()}"
                )
            time.sleep(POLL_SECONDS)

    def _log_tail(self) -> str:
        lines = self.server.log_file.read_text(errors="replace").splitlines() if self.server.log_file.exists() else []
        return "\n".join(f"  {line}" for line in lines[-LOG_LINES:]) or "  (the subscriber's server log is empty)"

    # ---------------------------------------------------------------- the comparison

    def assert_matches_delta(self, config: PgcdcConfig) -> dict[str, int]:
        """Every relation the publication publishes: its Delta table equals the subscriber's table.

        Returns the row count per ``schema.table``; fails with compare_table's diff.
        """
        counts: dict[str, int] = {}
        with self.connect() as conn:
            for schema, table, _ in self._published():
                name = f"{schema}.{table}"
                key = [
                    column
                    for (column,) in conn.execute(
                        "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
                        " ON a.attrelid = i.indrelid AND a.attnum = ANY((i.indkey::int2[])[0:i.indnkeyatts - 1])"
                        " WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY a.attnum",
                        (f"{quote_ident(schema)}.{quote_ident(table)}",),
                    ).fetchall()
                ]
                try:
                    counts[name] = compare_table(conn, name, config.table_path(schema, table), key=key)
                except AssertionError as error:
                    raise AssertionError(
                        f"Delta differs from the subscriber ({self.subscription}, shown as PostgreSQL):\n"
                        + _LONG_TEXT.sub(lambda long: f"{long[1]}...({len(long[0])} chars)'", str(error))
                    ) from None
        return counts


def _true(conn: psycopg.Connection, query: str, params: tuple[object, ...]) -> bool:
    """The boolean a one-row query returns."""
    ((value,),) = conn.execute(query, params).fetchall()
    return bool(value)


@pytest.fixture
def subscribe(pg: PgDatabase, subscriber_server: LocalPostgres) -> Iterator[Callable[[str], Subscriber]]:
    """``subscribe(publication)``: a subscriber of ``pg``'s publication, dropped after the test."""
    created: list[Subscriber] = []

    def start(publication: str) -> Subscriber:
        name = f"oracle_{uuid.uuid4().hex[:12]}"
        subscriber = Subscriber(pg, subscriber_server, name, publication, name)
        created.append(subscriber)
        subscriber.create()
        return subscriber

    try:
        yield start
    finally:
        for subscriber in created:
            subscriber.drop()
