"""Drains SIGKILLed on Delta on Spark (the managed engine on ``local[2]``) at the windows that are Spark's own,
each replayed exactly: Delta equals PostgreSQL with multiplicity, changelogs hold each change once.

Embedded Sail runs every drain crash point at arrivals 1-3 and more (tests/test_crash_matrix.py, test_incremental.py);
on Spark a table's commits go through a Spark Connect server, side by side from several threads, and
a killed client's queries run on in the server. The windows killed here:

* between two tables' commits of one chunk, written side by side (``write_concurrency``);
* after piece k of a transaction five times larger than a chunk, in a keyless, a FULL and a keyed table;
* after a changelog or SCD type 2 commit, before its table's commit;
* inside a schema change: after the widening, before the fill of a column added with a default.

The crash matrix's walk (tests/test_crash_matrix.py: every drain point at arrivals 1-3) runs on embedded Sail
only: one of its steps took seven minutes here (a table's commit costs 2-15 s on two busy cores and a step
writes about forty), the 21 steps would take hours.

The drain is a child process connected to the session's managed engine (``engine``, ``spark-local``:
tests/support/engine_fixtures.py, the JVM tests/test_engines.py's walks run on), as ``spark.remote`` finds a
server in production: the JVM outlives the killed client, so a kill costs a child, not a JVM start, and the
module none (the fixture's teardown fails if a process of the JVM's group is left).
"""

from __future__ import annotations

from pathlib import Path

import deltalake
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support import fault_runs
from tests.support.busy_drain import settle

pytest.register_assert_rewrite(
    "tests.support.engine_fixtures", "tests.support.s3_fixtures"
)  # imported here before pytest loads them as plugins
from tests.support.engine_fixtures import EngineUnderTest
from tests.support.fault_runs import confirmed, SLOT, write_config
from tests.support.history_oracle import assert_as_of_equals, assert_changes_once
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.engine_fixtures", "tests.support.s3_fixtures"]
#: The session's managed engine: the same parameter (and index) as tests/test_engines.py's, so pytest runs
#: these tests beside that module's on one engine instance (a session fixture's instance is kept while the
#: next test asks for the same parameter).
pytestmark = [
    pytest.mark.spark,  # tiers: docs/testing.md
    pytest.mark.parametrize("engine", ["spark-local"], indirect=True, scope="session"),
    NEWEST_POSTGRES_ONLY,
]


@pytest.fixture
def spark_url(engine: EngineUnderTest) -> tuple[SparkSession, str]:
    """The session engine's own session and its address, which the drains in child processes connect to."""
    assert engine.spark is not None
    return engine.spark, engine.url


def spark_config(
    pg: PgDatabase, tmp_path: Path, url: str, writes: int = 1, history: dict[str, str] | None = None
) -> PgcdcConfig:
    """pgcdc on the session's engine; ``writes``: tables written side by side (1: the drain's order is fixed,
    so ``after_table_commit:n`` names one write)."""
    return parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")},
        "spark": {"remote": url, "write_concurrency": writes}, "history": {"tables": history or {}},
    })  # fmt: skip


def killed_at(config: PgcdcConfig, tmp_path: Path, fault: str, chunk: int) -> str:
    """A drain in a child process, which must be SIGKILLed at ``fault``; its standard output (the drain's log
    lines)."""
    return fault_runs.killed_at(write_config(config, tmp_path), fault, chunk)


def rerun(pg: PgDatabase, config: PgcdcConfig, spark: SparkSession, chunk: int, racing: bool = False) -> None:
    """A drain in this process; the slot ends where it says. ``racing``: a write the killed client had sent may
    still be running in the server, and the rerun's commit of that table then fails on Delta's conflict check
    (a failed run, never a wrong table): it is retried, as the next scheduled run would be."""
    for attempt in range(3):
        try:
            result = run_incremental(config, lake_destination(spark, config), max_chunk_changes=chunk)
            break
        except Exception as error:
            if not racing or "ConcurrentAppendException" not in str(error) or attempt == 2:
                raise
            settle(config, {table: () for table in EACH_WAY})
    assert confirmed(pg) == result.confirmed_flush_lsn >= result.end_lsn


def exact(pg: PgDatabase, config: PgcdcConfig, tables: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Delta equals PostgreSQL, value for value with multiplicity; each table's rows."""
    return {
        table: assert_delta_equals_postgres(pg.dsn, table, config.table_path(*table.split(".")), key=key)
        for table, key in tables.items()
    }


def delta_rows(config: PgcdcConfig, table: str) -> int:
    return deltalake.DeltaTable(config.table_path("public", table)).count()


def delta_version(config: PgcdcConfig, table: str) -> int:
    return deltalake.DeltaTable(config.table_path(*table.split("."))).version()


ONE_TABLE_EACH_WAY = """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE ledger (entry int, note text);
    CREATE TABLE tally (k int, note text);
    ALTER TABLE tally REPLICA IDENTITY FULL;
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, 60) g;
    INSERT INTO ledger VALUES (0, 'seed');
    INSERT INTO tally VALUES (0, 'same'), (0, 'same');
    CREATE PUBLICATION pub FOR TABLE acct, ledger, tally;
"""
"""A keyed, a keyless and a REPLICA IDENTITY FULL table with identical rows, never truncated: a change
applied twice would show in the keyless and the FULL one."""
EACH_WAY = {"public.acct": ("id",), "public.ledger": (), "public.tally": ()}


def test_a_kill_between_two_tables_commits_of_one_chunk_replays_exactly(
    spark_url: tuple[SparkSession, str], pg: PgDatabase, tmp_path: Path
) -> None:
    """One chunk commits three tables, two at a time: killed after the first of them (``after_table_commit:2``:
    the drain's first write prepares the engine), the chunk is in some tables and not in others (the write the
    dead client had sent lands meanwhile); the rerun is exact."""
    spark, url = spark_url
    pg.execute(ONE_TABLE_EACH_WAY)
    config = spark_config(pg, tmp_path, url, writes=2)
    snapshot_tables(config, lake_destination(spark, config))
    versions = {table: delta_version(config, table) for table in EACH_WAY}
    start = confirmed(pg)
    with pg.connect() as conn:
        for i in range(5):
            with conn.transaction():
                conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id <= 5", (f"t{i}",))
                conn.execute("INSERT INTO ledger VALUES (%s, 'same'), (%s, 'same')", (i % 2, i % 2))
                conn.execute("INSERT INTO tally VALUES (0, 'same')")
                conn.execute("DELETE FROM tally WHERE ctid = (SELECT min(ctid) FROM tally WHERE k = 0)")
    killed_at(config, tmp_path, "after_table_commit:2", chunk=1000)
    settle(config, {table: () for table in EACH_WAY})  # the dead client's writes still running in the server
    written = [table for table, version in versions.items() if delta_version(config, table) > version]
    assert 1 <= len(written) < len(EACH_WAY), written  # the chunk is in some tables, not in all
    assert confirmed(pg) == start
    rerun(pg, config, spark, 1000, racing=True)
    exact(pg, config, EACH_WAY)


def test_kills_after_pieces_of_a_transaction_five_chunks_long_replay_exactly(
    spark_url: tuple[SparkSession, str], pg: PgDatabase, tmp_path: Path
) -> None:
    """One transaction of 90 changes (30 to each table) drained in chunks of 18, so it is written in pieces,
    each commit with its (end, seq) marker: killed after the keyless table's second piece (the drain's first
    write prepares the engine), part of the transaction in Delta; on the replay, which skips what the markers
    cover, between two pieces of the FULL table; the rerun applies every change once."""
    spark, url = spark_url
    pg.execute(ONE_TABLE_EACH_WAY)
    config = spark_config(pg, tmp_path, url)
    snapshot_tables(config, lake_destination(spark, config))
    start = confirmed(pg)
    with pg.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO ledger SELECT g % 3, 'same' FROM generate_series(1, 30) g")
        conn.execute("INSERT INTO tally SELECT 0, 'same' FROM generate_series(1, 30) g")
        conn.execute("UPDATE acct SET balance = balance + 1, note = 'big' WHERE id <= 30")
    pg.execute("INSERT INTO ledger VALUES (9, 'after'); INSERT INTO tally VALUES (0, 'same')")
    killed_at(config, tmp_path, "after_table_commit:3", chunk=18)
    assert 1 < delta_rows(config, "ledger") <= 31  # part of the transaction is in Delta
    killed_at(config, tmp_path, "after_table_commit:4", chunk=18)
    assert confirmed(pg) == start  # the transaction is not whole in Delta before the second kill's point
    rerun(pg, config, spark, 18)
    assert exact(pg, config, EACH_WAY) == {"public.acct": 60, "public.ledger": 32, "public.tally": 33}


def test_kills_after_history_commits_replay_each_change_once(
    spark_url: tuple[SparkSession, str], pg: PgDatabase, tmp_path: Path
) -> None:
    """Changelogs on the keyless and the FULL table, SCD type 2 on the keyed one: killed after a history
    table's seed, then after a changelog commit of changes whose table commit has not run; the rerun leaves
    every table exact, each change once in its history, and the as-of read of now equal to PostgreSQL."""
    spark, url = spark_url
    pg.execute(ONE_TABLE_EACH_WAY)
    history = {"public.acct": "scd2", "public.ledger": "changelog", "public.tally": "changelog"}
    config = spark_config(pg, tmp_path, url, history=history)
    snapshot_tables(config, lake_destination(spark, config))
    with pg.connect() as conn:
        for i in range(6):
            with conn.transaction():
                conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id = %s", (f"t{i}", i % 3 + 1))
                conn.execute("INSERT INTO ledger VALUES (%s, 'same'), (%s, 'same')", (i % 2, i % 2))
                conn.execute("INSERT INTO tally VALUES (0, 'same')")
                if i % 2:
                    conn.execute("DELETE FROM tally WHERE ctid = (SELECT min(ctid) FROM tally WHERE k = 0)")
    killed_at(config, tmp_path, "after_history_commit:2", chunk=1000)  # after a table's seed
    killed_at(config, tmp_path, "after_history_commit:3", chunk=1000)  # past the first run's, a changelog of changes
    rerun(pg, config, spark, 1000)
    exact(pg, config, EACH_WAY)
    for table in history:
        assert_changes_once(spark, config, table)
        assert_as_of_equals(pg, spark, config, table, None, table)


def test_kills_inside_a_schema_change_replay_exactly(
    spark_url: tuple[SparkSession, str], pg: PgDatabase, tmp_path: Path
) -> None:
    """ALTERs widen ``entry`` and add ``extra`` with a default, then rows come: at the Relation message before
    them the drain widens Delta's column (one commit), then fills ``extra`` in the rows before it (another).
    Killed after the widening, then, on the replay (which finds the column wide), after the fill; the rerun
    is exact, the fill in every old row."""
    spark, url = spark_url
    pg.execute(ONE_TABLE_EACH_WAY)
    config = spark_config(pg, tmp_path, url)
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute("INSERT INTO ledger VALUES (1, 'before'), (1, 'before')")
    # two statements: a column added in the statement that rewrites the table has no default to prove
    pg.execute("ALTER TABLE ledger ALTER COLUMN entry TYPE bigint")
    pg.execute("ALTER TABLE ledger ADD COLUMN extra int DEFAULT 7")
    pg.execute("INSERT INTO ledger VALUES (5000000000, 'wide', 8), (5000000000, 'wide', 8)")
    # the drain's writes: the engine prepared, the two rows before the ALTER, the widening, the fill
    first = killed_at(config, tmp_path, "after_table_commit:3", chunk=10)
    assert "widening entry" in first.splitlines()[-1], first
    second = killed_at(config, tmp_path, "after_table_commit:2", chunk=10)
    assert "setting extra" in second.splitlines()[-1], second
    rerun(pg, config, spark, 10)
    assert exact(pg, config, EACH_WAY)["public.ledger"] == 5
