"""Randomized workloads ("Prove it"): thousands of seeded random operations on PostgreSQL 15 and 18,
interleaved with incremental runs; after every run each snapshotted table must equal PostgreSQL exactly.

The workload (``tests/support/workload.py``) covers inserts, updates (key changes, unchanged TOAST),
changes to one copy among identical rows of a REPLICA IDENTITY FULL table (NULLs, TOAST),
deletes, TRUNCATE, rolled-back transactions, savepoints rolled back inside committed ones,
streamed transactions (committed, aborted, left open across a run), two-phase commit and
rollback (also a prepared transaction pending across a run), ADD/DROP COLUMN and a widening
mid-stream (also inside transactions that roll back), a table added to the publication
mid-stream and snapshotted later, and re-snapshots in the middle; runs use random small
``max_chunk_changes``.

Modes:

* default (CI): ``DEFAULT_SEEDS`` with ``DEFAULT_OPS`` operations each, each seed on one PostgreSQL version
  (the versions taken in turn): the workload does not depend on the version, so two seeds on two versions
  cover both seeds and both servers (and their pgoutput protocol versions) in two runs rather than four;
* long: ``PGCDC_LONG=1`` or ``pytest --pgcdc-long``: ``PGCDC_LONG_SEEDS`` (default 10) fresh
  random seeds with ``LONG_OPS`` operations each;
* replay: ``PGCDC_SEED=<seed>[,<seed>...]`` (and ``PGCDC_OPS=<n>``, as printed on failure).

Every case prints its seed first; a failure names the seed, the step and the SQL that led there,
and writes the whole workload to ``workload-<seed>.sql`` in the test's tmp_path.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import PgDatabase, POSTGRES_VERSIONS
from tests.support.randomized_replay import Replay
from tests.support.workload import generate

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # long seeded workloads; tiers: docs/testing.md

DEFAULT_SEEDS = [20240601, 7]
DEFAULT_OPS = 350
LONG_OPS = 3000


def _long(config: pytest.Config) -> bool:
    option = config.getoption("--pgcdc-long", default=False)
    return bool(option) or os.environ.get("PGCDC_LONG", "") not in ("", "0")


def _cases(config: pytest.Config) -> list[tuple[int, int]]:
    long = _long(config)
    ops = int(os.environ.get("PGCDC_OPS", LONG_OPS if long else DEFAULT_OPS))
    if os.environ.get("PGCDC_SEED"):
        return [(int(seed), ops) for seed in os.environ["PGCDC_SEED"].split(",")]
    if long:
        count = int(os.environ.get("PGCDC_LONG_SEEDS", "10"))
        return [(random.SystemRandom().randrange(10**9), ops) for _ in range(count)]
    return [(seed, ops) for seed in DEFAULT_SEEDS]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every seed on every version in the long and replay modes; in the default mode, each seed on one version:
    a ``parametrize`` mark over ``pg_server`` too (added before pytest reads the marks), which takes
    precedence over the fixture's own versions (``one_version_each`` in tests/support/postgres.py)."""
    if "case" not in metafunc.fixturenames:
        return
    cases = _cases(metafunc.config)
    ids = [f"seed{seed}-ops{ops}" for seed, ops in cases]
    if _long(metafunc.config) or os.environ.get("PGCDC_SEED"):
        metafunc.parametrize("case", cases, ids=ids)
        return
    versions = [POSTGRES_VERSIONS[i % len(POSTGRES_VERSIONS)] for i in range(len(cases))]
    metafunc.definition.add_marker(
        pytest.mark.parametrize(
            ("pg_server", "case"), list(zip(versions, cases)), indirect=["pg_server"], scope="session",
            ids=[f"pg{version}-{case_id}" for version, case_id in zip(versions, ids)],
        )
    )  # fmt: skip


def test_randomized_workload_matches_postgres_after_every_run(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, case: tuple[int, int]
) -> None:
    seed, ops = case
    print(f"randomized workload: seed {seed}, {ops} ops, PostgreSQL {pg.major}")
    started = time.monotonic()
    steps = generate(seed, ops)
    replay = Replay(pg, tmp_path, spark, seed, ops)
    print(f"replay with: {replay.replay_hint()}")
    replay.execute(steps)
    ((streamed,),) = pg.execute(
        "SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (replay.slot,)
    )
    if any(step.note.startswith("large") for step in steps):
        assert streamed > 0, "no transaction was streamed: the workload no longer exercises streaming"
    print(f"seed {seed}: {streamed} streamed transactions, up to {replay.most_duplicates} duplicate rows in dup_t")
    assert replay.most_duplicates > 0, "dup_t never held identical rows: the workload no longer exercises them"
    print(
        f"seed {seed}: {len(steps)} steps, {replay.runs} runs, {replay.oracle_checks} table comparisons, "
        f"{time.monotonic() - started:.1f}s; runs {' '.join(replay.run_times)}"
    )


# --------------------------------------------------------------------------- findings (regression tests)


def _single_table(pg: PgDatabase, tmp_path: Path, spark: SparkSession, ddl: str) -> PgcdcConfig:
    pg.execute(ddl)
    config = parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": f"rand_{pg.name}",
            "tables": [],
            "delta": {"root": str(tmp_path / "lake")},
        }
    )
    snapshot_tables(config, lake_destination(spark, config))
    return config


def test_walsender_keeps_the_connection_while_one_transaction_is_applied_in_many_chunks(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Regression (seed 7, 450 ops, PostgreSQL 15 and 18, chunk 3): the walsender dropped the
    connection ("server closed the connection unexpectedly") while one transaction was applied
    in many chunks, since nothing answered it while the run waited for Delta commits. The waits
    now send status updates (same durable position) at a quarter of wal_sender_timeout. Here:
    wal_sender_timeout 1 s, a 40-row transaction, max_chunk_changes=1 (about 2 s of Delta commits).
    """
    config = _single_table(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE w (id int PRIMARY KEY, v text);
        INSERT INTO w VALUES (0, 'seed');
        CREATE PUBLICATION pub FOR TABLE w;
    """,
    )
    pg.execute(f"ALTER DATABASE \"{pg.name}\" SET wal_sender_timeout = '1s'")  # the walsender of this database
    pg.execute("INSERT INTO w SELECT g, 'v' || g FROM generate_series(1, 40) g")
    run_incremental(config, lake_destination(spark, config), max_chunk_changes=1)
    assert assert_delta_equals_postgres(pg.dsn, "public.w", config.table_path("public", "w"), key=("id",)) == 41


def test_added_column_with_default_reaches_existing_rows_in_delta(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Regression: ``ALTER TABLE ... ADD COLUMN c ... DEFAULT x`` gives every existing row ``x`` in
    PostgreSQL without any row change in the WAL (a non-volatile default is stored once in
    pg_attribute.attmissingval). Delta had NULL there for every untouched row; now the rows
    already in Delta get the missing value when the column first appears in a Relation message.
    """
    config = _single_table(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE d (id int PRIMARY KEY, v text);
        INSERT INTO d SELECT g, 'v' FROM generate_series(1, 3) g;
        CREATE PUBLICATION pub FOR TABLE d;
    """,
    )
    pg.execute("ALTER TABLE d ADD COLUMN status text NOT NULL DEFAULT 'new'")
    pg.execute("UPDATE d SET v = 'changed' WHERE id = 1")  # the Relation message announcing status
    run_incremental(config, lake_destination(spark, config))
    assert assert_delta_equals_postgres(pg.dsn, "public.d", config.table_path("public", "d"), key=("id",)) == 3
