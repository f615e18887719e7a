"""Drains as scheduled runs see them on the managed Spark engine with its JVM kept (``bench.cdc --drains N``).

Each round writes the same mix of changes as ``bench.cdc``'s backlog (new keys, updates, deletes),
drains it on embedded Sail, writes it again and drains it on the managed Spark engine, each drain in
a fresh engine session as a Dagster run opens one: on Spark that is a lease on the kept JVM
(``spark.keep_alive_s``, ``resources/engines/kept_spark.py``), started by the first round and reused
by the others. It prints each Spark drain, the engine's start or attach before it, and both against
the Sail drain of the same round. The kept JVM's state lives in the benchmark's own directory and
the JVM is stopped at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pyarrow.compute as pc

from resources.config import PgcdcConfig
from resources.delta.lake_storage import open_lake
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.engines.kept_spark import SERVERS_DIR_ENV, stop_all
from resources.engines.s3a import s3a_settings
from resources.locations import StorageSettings
from resources.runs.incremental import run_incremental

KEEP_ALIVE_S = 600


def _drain(engine: SparkEngine, config: PgcdcConfig, chunk: int, merge_rows: int) -> float:
    with engine:
        result = run_incremental(
            config, lake_destination(engine.spark, config), max_chunk_changes=chunk, max_merge_rows=merge_rows
        )
    return result.duration_s


def kept_jvm_rounds(
    config: PgcdcConfig,
    write_round: Callable[[int], object],
    drains: int,
    chunk: int,
    merge_rows: int,
    work: Path,
) -> None:
    """``drains`` rounds (see the module's docstring); ``write_round(n)`` writes round n's changes (1, 2, ...:
    after ``bench.cdc``'s own backlog, which is round 0)."""
    os.environ[SERVERS_DIR_ENV] = str(work / "spark-servers")
    lake = open_lake(config.delta.root, StorageSettings(**config.delta.storage.model_dump()))
    dsn = config.postgres.dsn
    round_ = 0
    try:
        for drain in range(1, drains + 1):
            round_ += 1
            write_round(round_)
            started = time.perf_counter()
            sail_engine = SparkEngine.embedded(storage_environment=lake.engine_environment())
            sail_start = time.perf_counter() - started
            sail = _drain(sail_engine, config, chunk, merge_rows)
            round_ += 1
            write_round(round_)
            started = time.perf_counter()
            engine = SparkEngine.managed_spark(
                s3a_settings(lake), storage_environment=lake.engine_environment(), keep_alive_s=KEEP_ALIVE_S
            )
            start = time.perf_counter() - started
            note = engine.start_note
            spark = _drain(engine, config, chunk, merge_rows)
            print(
                f"kept JVM drain {drain}: {spark:.2f} s ({spark / sail:.2f}x Sail's {sail:.2f} s); with the engine's "
                f"start: {start + spark:.2f} s ({(start + spark) / (sail_start + sail):.2f}x Sail's "
                f"{sail_start + sail:.2f} s); {note}",
                flush=True,
            )
    finally:
        stop_all()
    table = delta_rs_rows(
        config.table_path("public", "orders"), ["id", "amount"], storage_options=lake.object_store_options() or None
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((count, amount),) = conn.execute("SELECT count(*), sum(amount) FROM orders").fetchall()
    delta = (table.num_rows, pc.sum(table.column("amount")).as_py())
    assert delta == (count, amount), (delta, count, amount)
    print(f"check after the rounds: Delta and PostgreSQL both hold {count:,} rows, amount total {amount}")
