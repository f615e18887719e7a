"""pgcdc's tables registered by name on Delta on Spark (``catalog:``), read by name from another JVM.

The managed engine (``spark.engine: spark``, a JVM per run) with Spark's session catalog backed by a
persistent Hive metastore: embedded Derby in a directory the test owns (``spark.config``, as a user sets
it). One walk, as the lifecycle walks of tests/test_engines.py: a snapshot (a table whose name the
metastore refuses, another whose name a Parquet table holds: each refused in one line, both written
all the same), a re-snapshot beside a table new to the publication, a drain that creates the changelog
and the SCD type 2 table and adds a column. Then a session of its own on that JVM, as a reader's on the kept
JVM (embedded Derby admits one JVM at a time: docs/deployment.md), counts every registered table by name:
equal to PostgreSQL's. It shares nothing with the writing session but the metastore (its temporary views
and its cache of relations are its own), so what it finds by name is what the metastore holds; a fresh
JVM on the same metastore would find the same and cost a JVM start. The in-memory runs of
tests/test_catalog_names.py cover a lost registration repaired by the next drain, and drains after the first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.engines.spark_connect import connect_session, engine_address
from resources.names import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres, delta_rows
from tests.support.engine_fixtures import SUITE_SPARK_CONFIG
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytestmark = pytest.mark.spark  # Spark JVMs; tiers: docs/testing.md

DDL = """
CREATE SCHEMA shop;
CREATE TABLE shop.orders (id int PRIMARY KEY, v text);
CREATE TABLE shop.items (id int PRIMARY KEY, n int);
CREATE TABLE shop.plain (k int, note text);
CREATE TABLE shop."Odd Name" (id int PRIMARY KEY);
CREATE TABLE shop.clash (k int);
INSERT INTO shop.orders SELECT g, 'o' || g FROM generate_series(1, 50) g;
INSERT INTO shop.items SELECT g, g FROM generate_series(1, 20) g;
INSERT INTO shop.plain VALUES (1, 'a'), (1, 'a'), (2, NULL);
INSERT INTO shop."Odd Name" VALUES (1), (2);
INSERT INTO shop.clash VALUES (1);
CREATE PUBLICATION pub FOR TABLE shop.orders, shop.items, shop.plain, shop."Odd Name", shop.clash;
"""

CHANGES = """
UPDATE shop.orders SET v = 'x' WHERE id <= 5;
DELETE FROM shop.orders WHERE id > 45;
INSERT INTO shop.items SELECT g, g FROM generate_series(21, 25) g;
DELETE FROM shop.items WHERE id = 1;
INSERT INTO shop.plain VALUES (3, 'c');
"""


def hive_config(pg: PgDatabase, tmp_path: Path) -> PgcdcConfig:
    """A user's configuration: the managed engine, its session catalog in a Hive metastore on embedded Derby."""
    metastore = tmp_path / "metastore"
    return parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": "pgcdc_catalog_slot",
        "delta": {"root": str(tmp_path / "lake")},
        "spark": {"engine": "spark", "keep_alive_s": 0, "config": {
            **SUITE_SPARK_CONFIG,
            "spark.sql.catalogImplementation": "hive",
            "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={metastore}/metastore_db;create=true",
            "spark.sql.warehouse.dir": str(tmp_path / "warehouse"),
            "spark.driver.extraJavaOptions": f"-XX:TieredStopAtLevel=1 -Dderby.system.home={metastore}",
        }},
        "history": {"tables": {"shop.orders": "scd2", "shop.items": "changelog"}},
        "catalog": {"schema": "pg_{schema}"},
    })  # fmt: skip


@NEWEST_POSTGRES_ONLY
@pytest.mark.timeout(1200)  # a JVM start, Derby, Delta on Spark: minutes on two busy cores
def test_every_table_is_registered_and_another_session_counts_them_by_name(pg: PgDatabase, tmp_path: Path) -> None:
    pg.execute(DDL)
    config = hive_config(pg, tmp_path)
    with SparkEngine.from_config(config.spark) as engine:
        spark = engine.spark
        spark.sql("CREATE SCHEMA spark_catalog.pg_shop").collect()
        spark.sql("CREATE TABLE spark_catalog.pg_shop.clash (k int) USING parquet").collect()
        destination = lake_destination(spark, config)
        results = {str(result.table): result for result in snapshot_tables(config, destination)}
        assert {table: result.catalog_name for table, result in results.items()} == {
            "shop.orders": "spark_catalog.pg_shop.orders", "shop.items": "spark_catalog.pg_shop.items",
            "shop.plain": "spark_catalog.pg_shop.plain", "shop.Odd Name": None, "shop.clash": None,
        }  # fmt: skip
        odd, clash = results["shop.Odd Name"].catalog_refusal, results["shop.clash"].catalog_refusal
        assert odd is not None and clash is not None
        assert odd.startswith(
            "shop.Odd Name cannot be registered in catalog spark_catalog as spark_catalog.pg_shop.`Odd Name`"
            " ([INVALID_SCHEMA_OR_RELATION_NAME] `odd name` is not a valid name for tables/schemas."
        ) and odd.endswith(
            f"rename the table in PostgreSQL; it is written at {config.table_path('shop', 'Odd Name')} meanwhile"
        )
        assert clash == (
            "shop.clash cannot be registered in catalog spark_catalog as spark_catalog.pg_shop.clash: the name holds a"
            f" parquet table at file:{tmp_path}/warehouse/pg_shop.db/clash: drop or rename that table (DROP TABLE"
            " `spark_catalog`.`pg_shop`.`clash` drops only the catalog entry of an external table), or set another"
            f" catalog.schema; the next drain registers the table at {config.table_path('shop', 'clash')}"
        )
        assert "\n" not in odd + clash and results["shop.Odd Name"].rows == 2 and results["shop.clash"].rows == 1

        pg.execute(CHANGES)
        pg.execute("""
            CREATE TABLE shop.fresh (id int PRIMARY KEY); INSERT INTO shop.fresh VALUES (1), (2);
            ALTER PUBLICATION pub ADD TABLE shop.fresh;
        """)  # fmt: skip
        again = snapshot_tables(config, destination, [TableName("shop", "orders"), TableName("shop", "fresh")])
        assert [result.catalog_name for result in again] == [
            "spark_catalog.pg_shop.orders",
            "spark_catalog.pg_shop.fresh",
        ]
        pg.execute("""
            INSERT INTO shop.fresh VALUES (3); UPDATE shop.orders SET v = 'y' WHERE id = 7;
            ALTER TABLE shop.orders ADD COLUMN note text; UPDATE shop.orders SET note = 'n' WHERE id <= 2;
        """)  # fmt: skip
        drained = run_incremental(config, destination)  # creates the changelog and the SCD2 table: registered now
        assert drained.unregistered == {"shop.Odd Name": odd, "shop.clash": clash}
        for table in ("orders", "items", "plain", "fresh"):
            assert_delta_equals_postgres(pg.dsn, f"shop.{table}", config.table_path("shop", table))
        reader = connect_session(engine_address(spark))
        try:
            assert reader.session_id != spark.session_id
            assert_counted_by_name(reader, pg, config)
        finally:
            reader.stop()


def assert_counted_by_name(reader: SparkSession, pg: PgDatabase, config: PgcdcConfig) -> None:
    """``reader``, a session that shares only the Hive metastore with the writer, lists every registered table
    and counts each by name: equal to PostgreSQL's, the history tables to their Delta tables'."""
    assert reader.conf.get("spark.sql.catalogImplementation") == "hive"  # the catalog is the metastore, not memory
    listed = {row.tableName for row in reader.sql("SHOW TABLES IN spark_catalog.pg_shop").collect()}
    assert listed == {"orders", "orders__history", "items", "items__changes", "plain", "fresh", "clash"}

    def count(query: str) -> int:
        return int(reader.sql(query).collect()[0][0])

    for table in ("orders", "items", "plain", "fresh"):
        postgres = pg.execute(f"SELECT count(*) FROM shop.{table}")[0][0]
        assert count(f"SELECT count(*) FROM spark_catalog.pg_shop.{table}") == postgres, table
    current = "SELECT count(*) FROM pg_shop.orders__history WHERE _pgcdc_is_current"
    assert count(current) == pg.execute("SELECT count(*) FROM shop.orders")[0][0]
    assert count("SELECT count(note) FROM spark_catalog.pg_shop.orders") == 2  # a column added after the registration
    for history in ("orders__history", "items__changes"):
        at = config.delta.root + "/shop/" + history
        assert count(f"SELECT count(*) FROM spark_catalog.pg_shop.{history}") == len(delta_rows(at)[1]), history
