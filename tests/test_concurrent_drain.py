"""Tables of one chunk committed side by side (``spark.write_concurrency``, ``resources/cdc/writer.py``) on
embedded Sail, against real PostgreSQL: exact, exact again after a kill between two tables' commits, and a
write one table's Delta table refuses sets that table aside while the others commit.

The managed Spark engine runs the same workload in tests/test_engines.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.lsn import LSN
from tests.support.busy_drain import (
    assert_busy_exact,
    BUSY_DDL,
    BUSY_TABLES,
    busy_workload,
    refuse_nulls_in,
    with_write_concurrency,
)
from tests.support.incremental_runs import drain, run_child, setup, slot_confirmed
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

WRITES = 4
CHUNK = 30
"""Changes per chunk: three of the workload's transactions, so a chunk commits each of the six tables."""


def test_a_busy_drain_with_tables_committed_side_by_side_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = with_write_concurrency(setup(pg, tmp_path, spark, BUSY_DDL), WRITES)
    busy_workload(pg, 12)
    result = drain(config, spark, max_chunk_changes=CHUNK)
    assert slot_confirmed(pg) == result.confirmed_flush_lsn >= result.end_lsn
    assert {table for table, stats in result.tables.items() if stats.applied_lsn} == set(BUSY_TABLES)
    assert_busy_exact(pg, config)


@NEWEST_POSTGRES_ONLY  # the windows are pgcdc's own; both versions' streams run the test above
@pytest.mark.parametrize("arrival", [3, 11])
@pytest.mark.slow  # a child SIGKILLed between two of its Delta writes
def test_a_kill_between_two_tables_committed_side_by_side_replays_exactly(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, arrival: int
) -> None:
    """Killed after the ``arrival``-th Delta write, while other tables' writes of the chunk are in flight
    (some tables hold the chunk, others not): the re-run, concurrent again, is exact, keyless and FULL
    rows exactly once."""
    config = with_write_concurrency(setup(pg, tmp_path, spark, BUSY_DDL), WRITES)
    start = slot_confirmed(pg)
    busy_workload(pg, 12)
    killed = run_child(config, tmp_path, f"after_table_commit:{arrival}", chunk=CHUNK)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    if arrival <= 7:  # the engine's preparation, then the first chunk's six tables: nothing confirmed yet
        assert slot_confirmed(pg) == start
    drain(config, spark, max_chunk_changes=CHUNK)  # in this process: only the kill needs one of its own
    assert_busy_exact(pg, config)


def test_a_write_one_table_refuses_sets_it_aside_while_the_others_commit(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The refusal surfaces in the write, on a writer thread, with the other tables' writes in flight:
    that table is quarantined, its later writes never run, the others and the slot move on."""
    config = with_write_concurrency(setup(pg, tmp_path, spark, BUSY_DDL), WRITES)
    refuse_nulls_in(config, "public.k2")
    refused_log = Path(config.table_path("public", "k2")) / "_delta_log"
    commits = sorted(refused_log.glob("*.json"))
    start = slot_confirmed(pg)
    busy_workload(pg, 1)
    ((first_done,),) = pg.execute("SELECT pg_current_wal_lsn()::text")
    busy_workload(pg, 11, offset=1)
    result = drain(config, spark, max_chunk_changes=CHUNK)
    assert result.newly_quarantined == ["public.k2"]
    quarantine = result.quarantined["public.k2"]
    assert "NOT NULL" in quarantine.cause
    assert start < quarantine.lsn <= LSN.parse(first_done)  # from its first change the failed write left unapplied
    assert slot_confirmed(pg) == result.confirmed_flush_lsn >= result.end_lsn
    assert sorted(refused_log.glob("*.json")) == commits  # none of its writes landed, later chunks' neither
    assert_busy_exact(pg, config, {table: key for table, key in BUSY_TABLES.items() if table != "public.k2"})
