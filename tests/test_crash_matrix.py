"""The crash matrix on embedded Sail: a drain SIGKILLed at every drain crash point at its arrivals 1, 2 and 3, each
over a fresh slice of one workload (tests/support/crash_matrix.py says what each slice holds and where the kills
land), then exact: no change applied twice, none lost, each change once in its history.

One walk on one set of tables keeps it cheap: every step costs a killed child (with its own embedded engine, which
dies with it) and a drain in the test's process that finishes the backlog, not a new database and snapshot. On
Delta on Spark one step took seven minutes, so Spark's kills are at its own windows (tests/test_spark_crashes.py).
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import deltalake
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.crash_matrix import (
    ARRIVALS,
    assert_matrix_exact,
    assert_step_exact,
    BIG_CHANGES,
    KILL_CHUNK,
    MATRIX_DDL,
    MATRIX_HISTORY,
    MATRIX_POINTS,
    write_slice,
)
from tests.support.fault_runs import confirmed, killed_at, SLOT, write_config
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


def matrix_config(pg: PgDatabase, tmp_path: Path, writes: int | None = None) -> PgcdcConfig:
    """The matrix's tables and histories; ``writes``: tables written side by side (default: the engine's)."""
    return parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")},
        "history": {"tables": MATRIX_HISTORY}, "spark": {"write_concurrency": writes},
    })  # fmt: skip


#: With one table written at a time the first drain's order of writes is fixed: the engine's preparation, the
#: changelog's seed, the SCD type 2 table's seed and first versions, ``acct``'s piece, then the keyless table's.
FIRST_LEDGER_PIECE = 6


@NEWEST_POSTGRES_ONLY  # the windows are pgcdc's own; both versions' streams run test_incremental's crash points
@pytest.mark.slow  # 21 drain children SIGKILLed
def test_a_drain_killed_at_every_point_and_arrival_replays_exactly(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(MATRIX_DDL)
    config = matrix_config(pg, tmp_path)
    config_file = write_config(config, tmp_path)
    snapshot_tables(config, lake_destination(spark, config))
    for step, (point, n) in enumerate(product(MATRIX_POINTS, ARRIVALS)):
        marks = write_slice(pg, step)
        before = confirmed(pg)
        killed_at(config_file, f"{point}:{n}", KILL_CHUNK, marks if point == "before_state_write" else ())
        if point in ("before_merge", "after_history_commit", "after_table_commit"):
            assert confirmed(pg) == before, f"{point}:{n}: the slot was confirmed inside the large transaction"
        result = run_incremental(config, lake_destination(spark, config))
        assert confirmed(pg) == result.confirmed_flush_lsn >= result.end_lsn
        assert_step_exact(pg, config, f"{point}:{n}")
    assert_matrix_exact(pg, config, spark)


@NEWEST_POSTGRES_ONLY  # the window is pgcdc's own
def test_a_drain_killed_between_two_pieces_of_a_streamed_transaction_replays_exactly(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The matrix's representative in the fast tier: one slice, a drain killed after the keyless table's commit of
    the large transaction's first piece (part of the transaction in Delta, the slot not moved); the next drain
    skips what the piece's marker covers and applies every change once."""
    pg.execute(MATRIX_DDL)
    config = matrix_config(pg, tmp_path, writes=1)
    snapshot_tables(config, lake_destination(spark, config))
    write_slice(pg, 0)
    before = confirmed(pg)
    killed_at(write_config(config, tmp_path), f"after_table_commit:{FIRST_LEDGER_PIECE}", KILL_CHUNK)
    assert 1 < deltalake.DeltaTable(config.table_path("public", "ledger")).count() < 1 + BIG_CHANGES // 3
    assert confirmed(pg) == before
    run_incremental(config, lake_destination(spark, config))
    assert_matrix_exact(pg, config, spark)
