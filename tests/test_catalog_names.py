"""Tables registered by name (``catalog:``): the configuration, the names, their quoting, and whole runs
against the in-memory destination (real PostgreSQL, no engine), whose catalog refuses a name held by
another table as Spark's does. The same walk on Delta on Spark with a Hive metastore, read back by name
from a session of its own: tests/test_spark_catalog.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pgcdc_assets.translator import PgcdcTableProps, PgcdcTranslator
from resources.config import parse_config, PgcdcConfig
from resources.config.catalog import CatalogName
from resources.delta.catalog_names import same_location, spark_literal
from resources.delta.lake_records import read_records, records_location
from resources.errors import ConfigurationError
from resources.names import TableName
from resources.runs.catalog_names import CATALOG_RECORDS, catalog_targets
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from resources.testing.verify import arrow_rows
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

SLOT = "pgcdc_catalog_slot"


def settings(**catalog: object) -> dict[str, object]:
    return {
        "postgres": {"dsn": "dbname=x"}, "publication": "pub", "slot": SLOT, "spark": {"engine": "spark"},
        "catalog": catalog, "history": {"tables": {"shop.orders": "scd2", "shop.items": "changelog"}},
    }  # fmt: skip


def test_names_follow_the_schema_template_and_the_history_suffixes() -> None:
    config = parse_config(settings(schema="pg_{schema}"))
    names = {
        target.what: target.name
        for table in ("orders", "items", "plain")
        for target in catalog_targets(config, TableName("shop", table))
    }
    assert names == {
        "shop.orders": CatalogName("spark_catalog", "pg_shop", "orders"),
        "shop.orders (SCD type 2 table)": CatalogName("spark_catalog", "pg_shop", "orders__history"),
        "shop.items": CatalogName("spark_catalog", "pg_shop", "items"),
        "shop.items (changelog)": CatalogName("spark_catalog", "pg_shop", "items__changes"),
        "shop.plain": CatalogName("spark_catalog", "pg_shop", "plain"),
    }  # fmt: skip
    assert [target.path for target in catalog_targets(config, TableName("shop", "orders"))] == [
        config.table_path("shop", "orders"), config.history_path("shop", "orders"),
    ]  # fmt: skip
    assert parse_config(config.model_dump()) == config  # dumped under its keys (a child run's file reads back)
    default = parse_config(settings(name="main"))
    assert catalog_targets(default, TableName("Mixed Case", "a`b"))[0].name == CatalogName("main", "Mixed Case", "a`b")
    assert catalog_targets(parse_config({**settings(), "catalog": None}), TableName("shop", "orders")) == []


def test_dagster_names_a_table_by_its_catalog_name_when_it_has_one() -> None:
    """``dagster/table_name`` is the catalog name with ``catalog:``, the location without; ``dagster/uri`` the location."""
    translator, orders = PgcdcTranslator(), TableName("shop", "orders")
    props = PgcdcTableProps.of(parse_config(settings(schema="pg_{schema}")), orders)
    table, history = translator.get_table_asset_spec(props).metadata, translator.get_history_asset_spec(props).metadata
    assert (table["dagster/table_name"], table["dagster/uri"]) == (
        "spark_catalog.pg_shop.orders",
        f"file://{props.delta_path}",
    )
    assert (history["dagster/table_name"], history["dagster/uri"]) == (
        "spark_catalog.pg_shop.orders__history", f"file://{props.history_path}",
    )  # fmt: skip
    unnamed = PgcdcTableProps.of(parse_config({**settings(), "catalog": None}), orders)
    assert translator.get_table_asset_spec(unnamed).metadata["dagster/table_name"] == unnamed.delta_path


def test_names_are_quoted_as_spark_sql_reads_them() -> None:
    odd = CatalogName("spark_catalog", "pg_Mixed Case", "a`b.c")
    assert odd.sql == "`spark_catalog`.`pg_Mixed Case`.`a``b.c`"
    assert odd.schema_sql == "`spark_catalog`.`pg_Mixed Case`"
    assert str(odd) == "spark_catalog.`pg_Mixed Case`.`a``b.c`"
    assert str(CatalogName("main", "pg_shop", "orders__changes")) == "main.pg_shop.orders__changes"
    assert str(CatalogName("main", "shop", "2024_orders")) == "main.shop.`2024_orders`"
    assert spark_literal("/lake/it's\\here") == "'/lake/it\\'s\\\\here'"


def test_a_location_the_catalog_writes_is_the_one_pgcdc_gave() -> None:
    assert same_location("file:/lake/shop/orders", "/lake/shop/orders")
    assert same_location("file:///lake/shop/orders/", "/lake/shop/orders")
    assert same_location("s3a://bucket/lake/shop/orders", "s3://bucket/lake/shop/orders")
    assert not same_location("file:/lake/shop/orders__changes", "/lake/shop/orders")
    assert not same_location("s3://other/lake/shop/orders", "s3://bucket/lake/shop/orders")


@pytest.mark.parametrize(
    ("catalog", "spark", "says"),
    [
        ({"schema": "lake"}, {"engine": "spark"}, "'catalog.schema': Value error, got 'lake': write {schema} once"),
        ({"schema": "{schema}_{schema}"}, {"engine": "spark"}, "write {schema} once"),
        ({"schema": "pg_{schema}_{table}"}, {"engine": "spark"}, "{schema} is the only placeholder"),
        ({"name": ""}, {"engine": "spark"}, "'catalog.name'"),
        ({"tables": "x"}, {"engine": "spark"}, "unknown key 'catalog.tables'"),
        ({}, {}, "catalog: the embedded engine (spark.engine: sail) keeps a table registered for one session only"),
    ],
)
def test_a_catalog_block_pgcdc_cannot_honour_is_refused_in_one_line(
    catalog: dict[str, object], spark: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        parse_config({**settings(**catalog), "spark": spark})
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_remote_engine_may_hold_the_catalog() -> None:
    assert parse_config({**settings(), "spark": {"remote": "sc://spark:15002"}}).catalog is not None


DDL = """
CREATE SCHEMA shop;
CREATE TABLE shop.orders (id int PRIMARY KEY, v text);
CREATE TABLE shop.items (id int PRIMARY KEY, n int);
CREATE TABLE shop.clash (k int);
INSERT INTO shop.orders SELECT g, 'o' || g FROM generate_series(1, 20) g;
INSERT INTO shop.items SELECT g, g FROM generate_series(1, 5) g;
INSERT INTO shop.clash VALUES (1), (2);
CREATE PUBLICATION pub FOR TABLE shop.orders, shop.items, shop.clash;
"""


def memory_config(pg: PgDatabase, lake: Path) -> PgcdcConfig:
    return parse_config({**settings(schema="pg_{schema}"), "postgres": {"dsn": pg.dsn}, "delta": {"root": str(lake)}})


def named(destination: InMemoryDestination, name: str) -> int:
    """``SELECT count(*) FROM <name>`` of the in-memory catalog."""
    catalog, schema, table = name.split(".")
    return len(arrow_rows(destination.tables[destination.catalog[CatalogName(catalog, schema, table)]])[1])


@NEWEST_POSTGRES_ONLY
def test_runs_register_every_table_they_create_and_refuse_a_taken_name_in_one_line(
    pg: PgDatabase, tmp_path: Path
) -> None:
    """The snapshot registers each table after its commit, the drain each history table its first write
    created; a name held by another table is refused in one line naming the table, the catalog and the fix,
    while that table and the others are written exactly; a registration lost between a commit and its record
    (a crash) is done again by the next drain; a re-snapshot keeps the names."""
    pg.execute(DDL)
    config = memory_config(pg, tmp_path / "lake")
    destination = InMemoryDestination()
    destination.catalog[CatalogName("spark_catalog", "pg_shop", "clash")] = "/somewhere/else"

    results = {str(result.table): result for result in snapshot_tables(config, destination)}
    assert {table: result.catalog_name for table, result in results.items()} == {
        "shop.orders": "spark_catalog.pg_shop.orders", "shop.items": "spark_catalog.pg_shop.items", "shop.clash": None,
    }  # fmt: skip
    refusal = results["shop.clash"].catalog_refusal
    assert refusal == (
        "shop.clash cannot be registered in catalog spark_catalog as spark_catalog.pg_shop.clash: the name holds a"
        " table at /somewhere/else: drop or rename that table, or set another catalog.schema"
    )
    assert results["shop.clash"].rows == 2 and results["shop.orders"].catalog_refusal is None

    pg.execute(
        "UPDATE shop.orders SET v = 'x' WHERE id <= 3; INSERT INTO shop.items VALUES (6, 6); INSERT INTO shop.clash VALUES (3)"
    )
    warnings: list[str] = []
    drained = run_incremental(config, destination, warn=warnings.append)
    assert drained.unregistered == {"shop.clash": refusal} and warnings == [refusal]
    assert (
        named(destination, "spark_catalog.pg_shop.orders") == 20
        and named(destination, "spark_catalog.pg_shop.items") == 6
    )
    assert (
        named(destination, "spark_catalog.pg_shop.orders__history") == 20 + 3 + 1
    )  # versions, closed ones, the marker row
    assert named(destination, "spark_catalog.pg_shop.items__changes") == 1 + 5 + 1  # reset, the seed, the insert
    assert len(destination.tables[config.table_path("shop", "clash")]) == 3
    records = read_records(records_location(config.delta.root, CATALOG_RECORDS, SLOT), None)
    assert {record["name"]: record["location"] for record in records.values()} == {
        "`spark_catalog`.`pg_shop`.`items`": config.table_path("shop", "items"),
        "`spark_catalog`.`pg_shop`.`items__changes`": config.history_path("shop", "items"),
        "`spark_catalog`.`pg_shop`.`orders`": config.table_path("shop", "orders"),
        "`spark_catalog`.`pg_shop`.`orders__history`": config.history_path("shop", "orders"),
    }

    # A crash between a commit and its registration: no record, no name; the next drain registers it.
    location = records_location(config.delta.root, CATALOG_RECORDS, SLOT)
    lost = next(name for name in os.listdir(location) if "items__changes" in name)
    os.remove(os.path.join(location, lost))
    del destination.catalog[CatalogName("spark_catalog", "pg_shop", "items__changes")]
    del destination.catalog[CatalogName("spark_catalog", "pg_shop", "clash")]  # and the clash fixed by its owner
    fixed = run_incremental(config, destination, warn=warnings.append)
    assert not fixed.unregistered and len(warnings) == 1
    assert (
        named(destination, "spark_catalog.pg_shop.items__changes") == 7
        and named(destination, "spark_catalog.pg_shop.clash") == 3
    )

    again = snapshot_tables(config, destination, [TableName("shop", "orders")])
    assert again[0].catalog_name == "spark_catalog.pg_shop.orders" and len(destination.catalog) == 5


class NamingWhen(InMemoryDestination):
    """Records, at each registration, whether the table's snapshot was complete."""

    def __init__(self) -> None:
        super().__init__()
        self.named_when: list[bool] = []

    def register_table(self, name: CatalogName, path: str, what: str) -> bool:
        self.named_when.append(self.read_table_log(path, None).snapshot_lsn is not None)
        return super().register_table(name, path, what)


@NEWEST_POSTGRES_ONLY
def test_a_table_copied_in_key_ranges_is_named_when_its_walk_is_done(pg: PgDatabase, tmp_path: Path) -> None:
    """The walk's drains hold the table (``held``) and leave its name alone; the snapshot names it once every
    range is copied."""
    pg.execute("""
        CREATE SCHEMA shop; CREATE TABLE shop.big (id int PRIMARY KEY, v text);
        INSERT INTO shop.big SELECT g, 'v' FROM generate_series(1, 300) g;
        CREATE PUBLICATION pub FOR TABLE shop.big;
    """)  # fmt: skip
    config = parse_config({
        **settings(schema="pg_{schema}"), "postgres": {"dsn": pg.dsn}, "delta": {"root": str(tmp_path / "lake")},
        "snapshot": {"chunked_above_mb": 0, "key_chunk_mb": 0.004}, "history": {},
    })  # fmt: skip
    destination = NamingWhen()
    (result,) = snapshot_tables(config, destination)
    assert result.key_ranges and result.chunks > 1
    assert destination.named_when == [True]  # once, with every range copied
    assert result.catalog_name == "spark_catalog.pg_shop.big" and named(destination, "spark_catalog.pg_shop.big") == 300
