"""The oracle of the past for history tables (docs/history.md): PostgreSQL's state captured at quiet
moments with the LSN it holds at, and the as-of read at that LSN compared with it value for value.

Used by tests/test_history.py (embedded Sail), tests/test_engines.py and tests/test_spark_crashes.py (Delta on Spark)
and the crash matrix (tests/support/crash_matrix.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime

import psycopg
from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from resources.delta.reads import read_rows
from resources.history.as_of import read_as_of
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.testing.verify import arrow_rows, compare_rows
from tests.support.postgres import PgDatabase


def capture(conn: psycopg.Connection, k: int, tables: Sequence[str]) -> tuple[LSN, datetime]:
    """At a quiet moment: the WAL insert position (past every commit so far, before any later one), the
    server's clock (after every commit time so far, before any later one) and a copy of each table
    (``past_<k>_<name>``, unpublished)."""
    ((lsn, now),) = conn.execute("SELECT pg_current_wal_insert_lsn()::text, clock_timestamp()").fetchall()
    for table in tables:
        name = table.split(".")[1]
        conn.execute(f"CREATE TABLE past_{k}_{name} AS SELECT * FROM {table}")
    return LSN.parse(lsn), now


def assert_as_of_equals(
    pg: PgDatabase,
    spark: SparkSession,
    config: PgcdcConfig,
    table: str,
    lsn: LSN | None,
    copy: str,
    time: datetime | None = None,
) -> None:
    """The as-of read of ``table`` at ``lsn`` (or ``time``; neither: now) equals the PostgreSQL table ``copy``."""
    rows = read_as_of(spark, config, TableName.parse(table), lsn, time)
    with pg.connect() as conn:
        pg_columns = [name for (name,) in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped", (copy,)
        ).fetchall()]  # fmt: skip
        later = [name for name in rows.column_names if name not in pg_columns]
        for name in later:  # columns added after that moment are NULL in it
            assert rows.column(name).null_count == rows.num_rows, f"{table} as of {lsn}: {name} before it existed"
        schema, values = arrow_rows(rows)
        compare_rows(conn, copy, schema, values, extra_delta_columns=later)


def assert_changes_once(spark: SparkSession, config: PgcdcConfig, table: str) -> None:
    """A changelog (or SCD type 2 table, keyed by ``id``) holds each change (version) once and its seed once."""
    rows = read_rows(spark, config.history_path(*table.split(".")), None).to_pylist()
    if config.history.mode(TableName.parse(table)) == "scd2":
        versions = Counter(
            (r["id"], r["_pgcdc_valid_from_lsn"], r["_pgcdc_seq"]) for r in rows if not r["_pgcdc_marker"]
        )
        assert sum(1 for r in rows if r["_pgcdc_marker"]) == 1, table
    else:
        versions = Counter(
            (r["_pgcdc_lsn"], r["_pgcdc_seq"], r["_pgcdc_op"] == "fill")
            for r in rows
            if r["_pgcdc_op"] not in ("reset", "snapshot")
        )
        assert Counter(r["_pgcdc_op"] for r in rows)["reset"] == 1, table
    assert not {v: n for v, n in versions.items() if n > 1}, f"{table}: written twice"
