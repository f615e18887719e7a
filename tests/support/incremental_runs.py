"""Incremental runs on a real PostgreSQL and engine: the set-up with its snapshot, one drain,
Delta compared with PostgreSQL, the slot's confirmed position, a run in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pyspark.sql import SparkSession

from resources.cdc.schema import SchemaChangeError
from resources.config import parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

SLOT = "pgcdc_slot"


def settings(pg: PgDatabase, lake: Path, tables: list[str] | None = None) -> dict:
    return {
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": SLOT,
        "tables": tables or [],
        # acct (the crash tests' table) in range buckets of 5 keys: replays cross buckets
        "delta": {"root": str(lake), "buckets": {"tables": {"public.acct": {"width": 5}}}},
    }


def setup(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, ddl: str, snapshot: list[str] | None = None
) -> PgcdcConfig:
    """Create the tables and publication, then snapshot (``snapshot``: which tables; default all)."""
    pg.execute(ddl)
    config = parse_config(settings(pg, tmp_path / "lake"))
    snapshot_tables(
        config, lake_destination(spark, config), None if snapshot is None else [TableName.parse(t) for t in snapshot]
    )
    return config


def drain(config: PgcdcConfig, spark: SparkSession, **kwargs: object) -> IncrementalResult:
    return run_incremental(config, lake_destination(spark, config), log=print, **kwargs)  # type: ignore[arg-type]


def path_of(config: PgcdcConfig, table: str) -> str:
    schema, _, name = table.partition(".")
    return config.table_path(schema, name)


def same(pg: PgDatabase, config: PgcdcConfig, table: str, key: tuple[str, ...] = ("id",), **kwargs: object) -> int:
    """Delta equals PostgreSQL, and every row is in its key's bucket (or the table is unbucketed)."""
    rows = assert_delta_equals_postgres(pg.dsn, table, path_of(config, table), key=key, **kwargs)  # type: ignore[arg-type]
    assert_buckets_right(path_of(config, table))
    return rows


def slot_confirmed(pg: PgDatabase) -> LSN:
    ((value,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    return LSN.parse(value)


def assert_refused_with_the_resnapshot_fix(
    pg: PgDatabase, config: PgcdcConfig, spark: SparkSession, statements: list[str], expected: str
) -> None:
    """After ``statements``, the drain sets the one table aside (quarantine: docs/guarantees.md) in one line
    naming ``expected`` and the re-snapshot job; with ``on_table_error: stop`` the same line fails the
    drain, and nothing past the change it could not apply is confirmed."""
    start = slot_confirmed(pg)
    with pg.connect() as conn:
        for statement in statements:
            conn.execute(statement)
    stop = config.model_copy(update={"on_table_error": "stop"})
    with pytest.raises(SchemaChangeError) as failure:
        drain(stop, spark)
    assert slot_confirmed(pg) == start
    result = drain(config, spark)
    (table,) = result.newly_quarantined
    message = result.quarantined[table].describe()
    assert str(failure.value) in message
    assert expected in message
    assert "pgcdc_resnapshot" in message and "\n" not in message


def run_child(
    config: PgcdcConfig, tmp_path: Path, fault: str | None, chunk: int, replace_values: int | None = None
) -> subprocess.CompletedProcess[str]:
    config_file = tmp_path / "pgcdc.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()))
    env = {key: value for key, value in os.environ.items() if key != FAULT_POINT_ENV}
    if fault is not None:
        env[FAULT_POINT_ENV] = fault
    extra = [] if replace_values is None else [str(replace_values)]
    return subprocess.run(
        [sys.executable, "-m", "tests.support.incremental_child", str(config_file), str(chunk), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
