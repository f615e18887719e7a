"""RENAME COLUMN of the last published column against DROP COLUMN and ADD COLUMN, on PostgreSQL 15 and 18.

The pgoutput stream shows both the same way (a column gone, a new one last); the catalog numbers the
snapshot recorded tell them apart (``resources/cdc/renames.py``). A rename fails the drain with the
re-snapshot fix and confirms nothing; DROP and ADD drain exactly; a re-snapshot after a rename is exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.delta.reads import delta_rs_rows
from resources.postgres.catalog import TableName
from resources.snapshot import snapshot_tables
from tests.conftest import PgDatabase
from tests.test_incremental import assert_refused_with_the_resnapshot_fix, drain, path_of, same, setup

pytest_plugins = ["tests.spark_fixtures"]


def test_drop_and_add_of_the_last_column_drain_exactly(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """DROP + ADD of the last snapshot column, then of a column added since the snapshot: the new
    columns are NULL in the rows that existed before them, as in PostgreSQL; the dropped ones stay."""
    config = setup(pg, tmp_path, spark, """
        CREATE TABLE d (id int PRIMARY KEY, v int, note text);
        INSERT INTO d VALUES (1, 10, 'a'), (2, 20, 'b');
        CREATE PUBLICATION pub FOR TABLE d;
    """)
    with pg.connect() as conn:
        conn.execute("ALTER TABLE d DROP COLUMN note")
        conn.execute("ALTER TABLE d ADD COLUMN memo text")
        conn.execute("INSERT INTO d VALUES (3, 30, 'm3')")
        conn.execute("UPDATE d SET memo = 'm1' WHERE id = 1")
    drain(config, spark)
    assert same(pg, config, "public.d", extra_delta_columns=["note"]) == 3
    table = delta_rs_rows(path_of(config, "public.d")).sort_by("id")
    assert table.column("memo").to_pylist() == ["m1", None, "m3"]
    assert table.column("note").to_pylist() == [None, "b", None]
    with pg.connect() as conn:
        conn.execute("ALTER TABLE d DROP COLUMN memo, ADD COLUMN z int")
        conn.execute("INSERT INTO d VALUES (4, 40, 4)")
    drain(config, spark)
    assert same(pg, config, "public.d", extra_delta_columns=["note", "memo"]) == 4
    table = delta_rs_rows(path_of(config, "public.d")).sort_by("id")
    assert table.column("z").to_pylist() == [None, None, None, 4]


def test_a_rename_of_the_last_column_fails_with_the_resnapshot_fix_and_a_resnapshot_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """RENAME of the last snapshot column: refused, nothing confirmed; after a re-snapshot the renamed
    column holds its values in Delta. Then a column added since that snapshot, renamed while last: refused."""
    config = setup(pg, tmp_path, spark, """
        CREATE TABLE r (id int PRIMARY KEY, v int, note text);
        INSERT INTO r VALUES (1, 10, 'a'), (2, 20, 'b');
        CREATE PUBLICATION pub FOR TABLE r;
    """)
    assert_refused_with_the_resnapshot_fix(
        pg, config, spark, ["ALTER TABLE r RENAME COLUMN note TO memo", "INSERT INTO r VALUES (3, 30, 'c')"],
        "public.r: column 'memo' existed when the table was snapshotted (a RENAME COLUMN",
    )
    snapshot_tables(config, spark, [TableName.parse("public.r")])
    with pg.connect() as conn:
        conn.execute("UPDATE r SET v = 11 WHERE id = 1")
        conn.execute("ALTER TABLE r ADD COLUMN z int")
        conn.execute("INSERT INTO r VALUES (4, 40, 'd', 4)")
    drain(config, spark)
    assert same(pg, config, "public.r") == 4
    table = delta_rs_rows(path_of(config, "public.r")).sort_by("id")
    assert table.column("memo").to_pylist() == ["a", "b", "c", "d"]
    assert_refused_with_the_resnapshot_fix(
        pg, config, spark, ["ALTER TABLE r RENAME COLUMN z TO zz", "INSERT INTO r VALUES (5, 50, 'e', 5)"],
        "public.r: column(s) zz appeared as z disappeared, and PostgreSQL holds 0 column(s) dropped before them",
    )
