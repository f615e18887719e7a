"""Bucketed tables against real PostgreSQL (the newest: buckets are Delta's; every keyed drain on 15 and
18 writes into them) and the embedded engine: one scenario walks a
table written the way earlier pgcdc versions wrote it (no bucket column, no layout in its marker)
through a re-snapshot that adopts range buckets, then row moves between buckets (with and without
unchanged TOAST), deletes, new buckets, a widening and an added column (both rewrite the table), a
REPLICA IDENTITY FULL table with a primary key in hash buckets, TRUNCATE, and a re-snapshot with
another configured layout (a table keeps the layout it was created with). Midway, Delta's log cleanup
removes the commit of the snapshot that adopted the buckets (the table property says "created
unbucketed"): the drains go on with the layout the pgcdc state recorded for the table's Delta id; with
the state gone too, the drain and a re-snapshot refuse in one line until the directory is removed.
After every drain Delta equals PostgreSQL value for value and every row sits in its key's bucket.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import deltalake
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import SparkSession

from pgcdc_assets.checks import table_log_reader
from resources.config import parse_config, PgcdcConfig
from resources.delta.layout import BUCKET_COLUMN, HASH, RANGE, TableLayout
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.delta.state_table import state_path
from resources.engines.engine import SparkEngine
from resources.errors import ConfigurationError
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.delta_log import clean_log
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, v int, body text);
    ALTER TABLE acct ALTER COLUMN body SET STORAGE EXTERNAL;
    INSERT INTO acct SELECT g, g, CASE WHEN g % 10 = 3 THEN repeat(md5(g::text), 200) ELSE 'b' || g END
        FROM generate_series(0, 59) g;
    CREATE TABLE fullpk (code text PRIMARY KEY, n int, body text);
    ALTER TABLE fullpk REPLICA IDENTITY FULL;
    INSERT INTO fullpk SELECT 'c' || g, g, 'f' || g FROM generate_series(0, 19) g;
    CREATE PUBLICATION pub FOR TABLE acct, fullpk;
"""


def config_with(pg: PgDatabase, lake: Path, tables: dict[str, dict]) -> PgcdcConfig:
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": f"layout_{pg.name}",
            "delta": {"root": str(lake), "buckets": {"tables": tables}},
        }
    )


def drain_and_compare(
    pg: PgDatabase, config: PgcdcConfig, spark: SparkSession, known: dict[str, TableLayout] | None = None
) -> dict[str, TableLayout | None]:
    """Drain, then compare both tables with PostgreSQL; ``known``: layouts the tables' logs no longer name."""
    run_incremental(
        config, lake_destination(spark, config), max_chunk_changes=7
    )  # several chunks, so moves span MERGEs
    layouts = {}
    for table in ("acct", "fullpk"):
        path = config.table_path("public", table)
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", path, key=("id",) if table == "acct" else ("code",))
        layouts[table] = assert_buckets_right(path, known=(known or {}).get(table))
    return layouts


def newest_merge_predicate(path: str) -> str:
    """The ON clause Delta recorded for the table's newest MERGE."""
    for commit in deltalake.DeltaTable(path).history():
        if commit["operation"] == "MERGE":
            return str(commit["operationParameters"]["mergePredicate"])
    raise AssertionError(f"no MERGE in {path}")


@NEWEST_POSTGRES_ONLY
def test_unbucketed_table_then_resnapshot_into_buckets_with_moves_schema_changes_and_truncate(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    lake = tmp_path / "lake"
    # as earlier pgcdc versions wrote it: no bucket column, no layout in the marker
    old = config_with(pg, lake, {"public.acct": {"bucketed": False}, "public.fullpk": {"bucketed": False}})
    snapshot_tables(old, lake_destination(spark, old))
    pg.execute(
        "UPDATE acct SET id = id + 100, v = -v WHERE id IN (1, 2); DELETE FROM acct WHERE id = 4;"
        " UPDATE fullpk SET n = -n WHERE code = 'c1'"
    )
    assert drain_and_compare(pg, old, spark) == {"acct": None, "fullpk": None}

    # the same tables, re-snapshotted: range buckets of 10 keys, hash buckets for the text key
    new = config_with(pg, lake, {"public.acct": {"width": 10}, "public.fullpk": {"count": 3}})
    snapshot_tables(new, lake_destination(spark, new))
    assert drain_and_compare(pg, new, spark) == {
        "acct": TableLayout(RANGE, ("id",), 10),
        "fullpk": TableLayout(HASH, ("code",), 3),
    }
    with pg.connect() as conn:
        with conn.transaction():
            conn.execute("UPDATE acct SET id = 75 WHERE id = 5")  # bucket 0 -> 7, every value sent
            conn.execute("UPDATE acct SET id = 1013 WHERE id = 13")  # a TOASTed body kept, moved to a new bucket
            conn.execute("UPDATE acct SET v = 0 WHERE id = 23")  # TOASTed body kept, same bucket
            conn.execute("DELETE FROM acct WHERE id IN (31, 44)")
            conn.execute("INSERT INTO acct VALUES (500, 5, 'new bucket'), (31, 31, 'back again')")
        with conn.transaction():
            conn.execute("UPDATE acct SET id = 13 WHERE id = 1013")  # and back, in the next transaction
            conn.execute("DELETE FROM acct WHERE id = 6")
            conn.execute("UPDATE acct SET id = 6, v = 6 WHERE id = 33")  # onto the key just deleted
            conn.execute("UPDATE fullpk SET code = 'moved' || code, n = n + 1 WHERE n < 8")  # hash buckets
            conn.execute("DELETE FROM fullpk WHERE n = 15")
    drain_and_compare(pg, new, spark)
    path = new.table_path("public", "acct")
    predicate = newest_merge_predicate(path)
    assert f"{BUCKET_COLUMN}IN(" in predicate.replace(" ", "").replace("`", ""), predicate  # the partition predicate

    # log cleanup removes the adopting snapshot's commit; acct's property says "created unbucketed"
    acct_layout = TableLayout(RANGE, ("id",), 10)
    clean_log(path)
    pg.execute(
        "UPDATE acct SET id = 301 WHERE id = 7; UPDATE acct SET v = 1 WHERE id = 43; DELETE FROM acct WHERE id = 8"
    )
    drain_and_compare(pg, new, spark, {"acct": acct_layout})
    # the schema check expects the bucket column from the same record (pgcdc_assets/checks.py)
    assert table_log_reader(new, lake_destination(spark, new))(TableName("public", "acct")).layout == acct_layout

    # schema changes rewrite the table: the partitioning and the buckets must survive them
    pg.execute(
        "ALTER TABLE acct ALTER COLUMN v TYPE bigint; ALTER TABLE acct ADD COLUMN w int DEFAULT 7;"
        " UPDATE acct SET v = v * 1000000000, id = id + 1000 WHERE id IN (10, 20)"
    )
    drain_and_compare(pg, new, spark, {"acct": acct_layout})
    assert deltalake.DeltaTable(path).metadata().partition_columns == [BUCKET_COLUMN]

    pg.execute("TRUNCATE acct; INSERT INTO acct VALUES (3, 3, 'after truncate', 1), (95, 95, 'x', 2)")
    drain_and_compare(pg, new, spark, {"acct": acct_layout})

    # with the state gone as well, nothing names acct's layout: the drain goes on without a bucket
    # predicate (a changed row moves to the NULL bucket) and says so; a re-snapshot refuses in one line
    shutil.rmtree(state_path(str(lake), new.slot))
    pg.execute("UPDATE acct SET v = 2 WHERE id = 3; INSERT INTO acct VALUES (96, 96, 'unbucketed', 3)")
    result = run_incremental(new, lake_destination(spark, new))
    unpruned = result.tables["public.acct"].unpruned
    assert unpruned is not None and "no record of its layout is left" in unpruned and "\n" not in unpruned
    assert BUCKET_COLUMN not in newest_merge_predicate(path)
    assert_delta_equals_postgres(pg.dsn, "public.acct", path)
    assert set(delta_rs_rows(path, [BUCKET_COLUMN], where='"id" IN (3, 96)').column(BUCKET_COLUMN).to_pylist()) == {
        None
    }
    with pytest.raises(ConfigurationError, match="bucketed .* but no record of its layout is left"):
        snapshot_tables(new, lake_destination(spark, new), [TableName("public", "acct")])
    shutil.rmtree(path)
    # A new engine, as the next run gets one: Sail 0.7.2 keeps a table's metadata by path and version
    # for the life of its server, and a MERGE writing deletion vectors into a table created again at
    # the same path then reads the old table's schema (docs/engine-notes.md, "Deletion vectors").
    with SparkEngine.embedded() as engine:
        snapshot_tables(new, lake_destination(engine.spark, new), [TableName("public", "acct")])
        pg.execute("UPDATE acct SET id = 4 WHERE id = 3")
        drain_and_compare(pg, new, engine.spark)

    # a table keeps the layout it was created with (its table property, which outlives the marker)
    created = config_with(pg, tmp_path / "created", {"public.acct": {"width": 10}, "public.fullpk": {"count": 3}})
    snapshot_tables(created, lake_destination(spark, created))
    changed = config_with(
        pg, tmp_path / "created", {"public.acct": {"width": 20}, "public.fullpk": {"bucketed": False}}
    )
    snapshot_tables(changed, lake_destination(spark, changed))
    pg.execute("UPDATE acct SET id = 42 WHERE id = 3")
    assert drain_and_compare(pg, changed, spark) == {
        "acct": TableLayout(RANGE, ("id",), 10),
        "fullpk": TableLayout(HASH, ("code",), 3),
    }


@NEWEST_POSTGRES_ONLY
def test_a_width_for_a_key_that_is_not_one_integer_is_refused_before_writing(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    config = config_with(pg, tmp_path / "lake", {"public.fullpk": {"width": 10}})
    with pytest.raises(
        ConfigurationError, match=r"delta\.buckets\.tables\.public\.fullpk: a bucket width needs a single integer key"
    ):
        snapshot_tables(config, lake_destination(spark, config))
    assert not (tmp_path / "lake" / "public" / "fullpk" / "_delta_log").exists()


@NEWEST_POSTGRES_ONLY  # the check reads Delta only
def test_the_bucket_check_refuses_a_null_bucket_of_a_key_that_has_one(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """``assert_buckets_right`` (resources/testing/verify.py): a row of a bucketed table in the NULL bucket
    although its key has a bucket is a row lost to pruning, refused unless the caller says it wrote such rows."""
    pg.execute(DDL)
    config = config_with(pg, tmp_path / "lake", {"public.acct": {"width": 10}})
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "acct")])
    path = config.table_path("public", "acct")
    assert assert_buckets_right(path) == TableLayout(RANGE, ("id",), 10)
    table = deltalake.DeltaTable(path)
    moved = delta_rs_rows(path).filter(pc.equal(pc.field("id"), 15))
    table.delete("id = 15")
    nulled = moved.set_column(
        moved.schema.get_field_index(BUCKET_COLUMN), BUCKET_COLUMN, pa.nulls(1, moved.schema.field(BUCKET_COLUMN).type)
    )
    deltalake.write_deltalake(
        path, nulled.cast(pa.schema(table.schema().to_arrow())), mode="append"
    )  # the same row, NULL bucket
    with pytest.raises(
        AssertionError, match=r"1 row\(s\) outside their key's bucket .*\[{'id': 15, '_pgcdc_bucket': None"
    ):
        assert_buckets_right(path)
    assert assert_buckets_right(path, unbucketed_rows=True) == TableLayout(RANGE, ("id",), 10)


@NEWEST_POSTGRES_ONLY  # the layout is pgcdc's choice from the server's estimate
def test_target_rows_sizes_the_buckets_a_snapshot_chooses(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """``delta.buckets.target_rows`` (docs/configuration.md): a snapshot sizes a table's buckets to about
    that many rows at its key density: range buckets of 10 keys for 60 dense integer keys, 2 hash buckets
    for 20 text keys; the Delta tables are partitioned so, every row where its key puts it."""
    pg.execute(DDL)
    pg.execute("ANALYZE acct, fullpk")  # the estimate the layout is sized from
    config = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": f"layout_{pg.name}",
        "delta": {"root": str(tmp_path / "lake"), "buckets": {"target_rows": 10}},
    })  # fmt: skip
    snapshot_tables(config, lake_destination(spark, config))
    acct, fullpk = config.table_path("public", "acct"), config.table_path("public", "fullpk")
    assert assert_buckets_right(acct) == TableLayout(RANGE, ("id",), 10)
    assert assert_buckets_right(fullpk) == TableLayout(HASH, ("code",), 2)
    assert sorted(set(delta_rs_rows(acct).column(BUCKET_COLUMN).to_pylist())) == [0, 1, 2, 3, 4, 5]
    assert sorted(set(delta_rs_rows(fullpk).column(BUCKET_COLUMN).to_pylist())) == [0, 1]
    assert assert_delta_equals_postgres(pg.dsn, "public.acct", acct, key=("id",)) == 60
