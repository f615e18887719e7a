"""REPLICA IDENTITY FULL tables with identical rows, against real PostgreSQL 15 and 18 and Sail.

PostgreSQL lets a table without a key hold the same row several times, and its subscriber
changes exactly one matching row per change. pgcdc applies row occurrences the same way
(``resources/row_multiset.py``): every test compares Delta with PostgreSQL with multiplicity
(``resources/verify.py``).
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from tests.conftest import PgDatabase
from tests.test_incremental import drain, same, setup

pytest_plugins = ["tests.spark_fixtures"]


def rows(pg: PgDatabase, table: str, column: str = "x") -> list:
    return sorted(value for (value,) in pg.execute(f"SELECT {column} FROM {table}"))


def delta_values(config: PgcdcConfig, table: str, column: str = "x") -> list:
    import deltalake

    return sorted(deltalake.DeltaTable(config.table_path("public", table)).to_pyarrow_table().column(column).to_pylist())


def test_issue_repro_duplicates_are_separate_rows(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """The repro of issue 10, a drain after each statement."""
    config = setup(pg, tmp_path, spark, """
        CREATE TABLE t (x text); ALTER TABLE t REPLICA IDENTITY FULL;
        INSERT INTO t VALUES ('a'), ('b'), ('b'); CREATE PUBLICATION pub FOR TABLE t;
    """)
    assert delta_values(config, "t") == ["a", "b", "b"]
    steps = [
        ("UPDATE t SET x = 'bb' WHERE x = 'b'", ["a", "bb", "bb"]),
        ("INSERT INTO t VALUES ('a')", ["a", "a", "bb", "bb"]),
        ("DELETE FROM t WHERE ctid = (SELECT min(ctid) FROM t WHERE x = 'a')", ["a", "bb", "bb"]),
    ]
    for statement, expected in steps:
        pg.execute(statement)
        drain(config, spark)
        assert rows(pg, "t") == expected
        assert delta_values(config, "t") == expected
        same(pg, config, "public.t", key=())
