"""Incremental runs against real PostgreSQL 15 and 18 and the embedded Sail engine.

Every test snapshots its tables with ``resources.snapshot``, changes them in PostgreSQL,
drains the slot with ``run_incremental`` and ends with the oracle: the Delta table, read
with delta-rs, equals the PostgreSQL table value for value.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import deltalake
import psycopg
import pytest
import yaml
from pyspark.sql import SparkSession

from resources.change_batches import SchemaChangeError
from resources.config import PgcdcConfig, parse_config
from resources.errors import ConfigurationError, SlotError
from resources.faults import FAULT_POINT_ENV
from resources.incremental import IncrementalResult, run_incremental
from resources.lsn import LSN
from resources.replication import PgOutputOptions, ReplicationConnection, ReplicationStream
from resources.snapshot import snapshot_tables
from tests.conftest import PgDatabase
from tests.oracle import assert_delta_equals_postgres

pytest_plugins = ["tests.spark_fixtures"]

SLOT = "pgcdc_slot"


def settings(pg: PgDatabase, lake: Path, tables: list[str] | None = None) -> dict:
    return {
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": SLOT,
        "tables": tables or [],
        "delta": {"root": str(lake)},
    }


def setup(pg: PgDatabase, tmp_path: Path, spark: SparkSession, ddl: str, snapshot: list[str] | None = None) -> PgcdcConfig:
    """Create the tables and publication, then snapshot (``snapshot``: which tables; default all)."""
    pg.execute(ddl)
    config = parse_config(settings(pg, tmp_path / "lake"))
    from resources.catalog import TableName

    snapshot_tables(config, spark, None if snapshot is None else [TableName.parse(t) for t in snapshot])
    return config


def drain(config: PgcdcConfig, spark: SparkSession, **kwargs: object) -> IncrementalResult:
    return run_incremental(config, spark, log=print, **kwargs)  # type: ignore[arg-type]


def path_of(config: PgcdcConfig, table: str) -> str:
    schema, _, name = table.partition(".")
    return config.table_path(schema, name)


def same(pg: PgDatabase, config: PgcdcConfig, table: str, key: tuple[str, ...] = ("id",), **kwargs: object) -> int:
    return assert_delta_equals_postgres(pg.dsn, table, path_of(config, table), key=key, **kwargs)  # type: ignore[arg-type]


def slot_confirmed(pg: PgDatabase) -> LSN:
    (value,), = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    return LSN.parse(value)


def delta_version(config: PgcdcConfig, table: str) -> int:
    return deltalake.DeltaTable(path_of(config, table)).version()


# --------------------------------------------------------------------------- DML


def test_inserts_updates_deletes_of_many_types(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(pg, tmp_path, spark, """
        CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(10,2), big bigint, at timestamptz,
                            day date, ok boolean, doc jsonb, tags int[], raw numeric, blob bytea);
        INSERT INTO items SELECT g, 'n' || g, g * 1.25, g * 10000000000, '2024-01-01'::timestamptz + g * interval '1 hour',
                                 '2024-01-01'::date + g, g % 2 = 0, jsonb_build_object('g', g), ARRAY[g, NULL], g / 7.0, '\\x00ff'
                          FROM generate_series(1, 50) g;
        CREATE PUBLICATION pub FOR TABLE items;
    """)
    pg.execute("""
        INSERT INTO items SELECT g, 'new' || g, NULL, NULL, 'infinity', NULL, NULL, '[1, "x"]', '{}', 'NaN', NULL
          FROM generate_series(51, 60) g;
        UPDATE items SET name = 'upd', price = 99.99, tags = ARRAY[7] WHERE id % 5 = 0;
        DELETE FROM items WHERE id % 7 = 0;
    """)
    result = drain(config, spark)
    assert same(pg, config, "public.items") == 60 - 8
    stats = result.tables["public.items"]
    assert (stats.inserted, stats.updated, stats.deleted, stats.truncates) == (10, 12, 8, 0)
    assert result.confirmed_flush_lsn == slot_confirmed(pg) >= result.end_lsn
    assert result.lag_bytes_before > 0 and result.transactions == 1
