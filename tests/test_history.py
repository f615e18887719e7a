"""Changelogs against real PostgreSQL 15 and 18 and Delta on embedded Sail: an oracle of the past.

A seeded random workload (key moves keeping unchanged TOAST values, updates that leave a TOASTed
column alone, REPLICA IDENTITY FULL duplicates, TRUNCATE, ADD COLUMN with and without a default,
keyless appends) runs with
drains in between. At quiet moments the test records the WAL insert position and copies each
table inside PostgreSQL (``CREATE TABLE past_k_<t> AS ...``, an unpublished table). After the
last drain, the as-of read at each recorded position equals that copy exactly (a multiset, value
for value), and the changelog folded whole equals the table. Drains killed right after a changelog
commit (before the table's), before a chunk's writes, after a table's commit and before the run's
state is written converge on a re-run with no changelog row twice or missing.

Each test runs twice: with a changelog for every table, and with ``orders`` keeping SCD type 2
versions instead (the other two have no key to keep versions of). With versions, a re-snapshot of
``orders`` midway must close what vanished and open what appeared, and every captured moment must
still read back exactly.
"""

from __future__ import annotations

import json
import random
import signal
from collections import Counter
from datetime import datetime
from pathlib import Path

import deltalake
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.lake_storage import open_lake
from resources.delta.layout import HASH, RANGE, TableLayout
from resources.delta.maintenance import maintain_table
from resources.delta.markers import layout_from_property
from resources.delta.reads import read_rows
from resources.delta.spark_destination import lake_destination
from resources.delta.table_log import read_table_metadata
from resources.history import scd2_merge as delta_versions
from resources.history.as_of import read_as_of
from resources.history.scd2_merge import finer_layout
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.cli import main as cli_main
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import arrow_rows, assert_delta_equals_postgres, compare_rows
from tests.support.fault_runs import Child, confirmed, write_config
from tests.support.history_oracle import assert_as_of_equals, capture
from tests.support.postgres import NEWEST_POSTGRES_ONLY, one_version_each, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # crash points in child processes around changelog commits; tiers: docs/testing.md

TABLES = ("public.orders", "public.dups", "public.events")
SEED = ("reset", "snapshot")
DDL = """
    CREATE SEQUENCE ids START 100;
    CREATE TABLE orders (id int PRIMARY KEY, status text, body text);
    ALTER TABLE orders ALTER COLUMN body SET STORAGE EXTERNAL;
    CREATE TABLE dups (a int, b text);
    ALTER TABLE dups REPLICA IDENTITY FULL;
    CREATE TABLE events (n int, note text);
    INSERT INTO orders SELECT g, 'new', repeat(md5(g::text), 100) FROM generate_series(1, 30) g;
    INSERT INTO dups SELECT g % 5, 'd' FROM generate_series(1, 20) g;
    CREATE PUBLICATION pub FOR TABLE orders, dups, events;
"""


MODES = ("changelog", "scd2")
"""The history of ``orders`` in each run of the tests (the others keep changelogs)."""


def history_config(
    pg: PgDatabase, tmp_path: Path, name: str = "lake", slot: str = "pgcdc_slot", orders: str = "changelog"
) -> PgcdcConfig:
    return parse_config({
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": slot,
        # orders' keys span several partitions of its SCD type 2 table (finer_layout: 100 keys each)
        "delta": {"root": str(tmp_path / name), "buckets": {"tables": {"public.orders": {"width": 5000}}}},
        "history": {"default": "changelog", "tables": {"public.events": "changelog", "public.orders": orders}},
    })  # fmt: skip


def workload_step(conn: psycopg.Connection, rng: random.Random, step: int) -> None:
    """A few transactions of random changes."""
    for _ in range(rng.randint(2, 5)):
        with conn.transaction():
            for _ in range(rng.randint(1, 6)):
                choice = rng.random()
                if choice < 0.2:
                    conn.execute("INSERT INTO orders SELECT nextval('ids'), 'new', repeat(md5(random()::text), 100)")
                elif choice < 0.4:  # body is TOASTed and unchanged: sent as 'u'
                    conn.execute("UPDATE orders SET status = %s WHERE id = (SELECT id FROM orders ORDER BY random() LIMIT 1)",
                                 (f"s{rng.randint(0, 99)}",))  # fmt: skip
                elif choice < 0.5:  # a key move keeping the TOASTed body
                    conn.execute(
                        "UPDATE orders SET id = nextval('ids') WHERE id = (SELECT id FROM orders ORDER BY random() LIMIT 1)"
                    )
                elif choice < 0.55:
                    conn.execute("DELETE FROM orders WHERE id = (SELECT id FROM orders ORDER BY random() LIMIT 1)")
                elif choice < 0.7:
                    conn.execute("INSERT INTO dups VALUES (%s, 'd')", (rng.randint(0, 4),))
                elif choice < 0.8:  # one copy of a duplicated row
                    conn.execute("UPDATE dups SET b = b || 'x' WHERE ctid = (SELECT ctid FROM dups WHERE a = %s LIMIT 1)",
                                 (rng.randint(0, 4),))  # fmt: skip
                elif choice < 0.85:
                    conn.execute(
                        "DELETE FROM dups WHERE ctid = (SELECT ctid FROM dups WHERE a = %s LIMIT 1)",
                        (rng.randint(0, 4),),
                    )
                else:
                    conn.execute("INSERT INTO events VALUES (%s, 'e')", (rng.randint(0, 9),))
    if step == 2:
        conn.execute("ALTER TABLE orders ADD COLUMN extra int")
        conn.execute("UPDATE orders SET extra = id WHERE id % 3 = 0")
    # Existing rows get a column's default without a row change in the WAL; the stream tells of the
    # column with the table's next change, which is where the changelog records the fill.
    if step == 1:
        conn.execute("ALTER TABLE dups ADD COLUMN c int DEFAULT 1")
        conn.execute("INSERT INTO dups VALUES (1, 'd', 2)")
    if step == 3:
        conn.execute("ALTER TABLE orders ADD COLUMN flag int DEFAULT 5")
        conn.execute("UPDATE orders SET status = 'flagged' WHERE id = (SELECT min(id) FROM orders)")
    if step == 4:
        conn.execute("TRUNCATE dups")
        conn.execute("INSERT INTO dups VALUES (7, 'after'), (7, 'after')")


def changelog(config: PgcdcConfig, table: str, spark: SparkSession) -> pa.Table:
    schema, name = table.split(".")
    return read_rows(spark, config.history_path(schema, name), None)


def keeps_versions(config: PgcdcConfig, table: str) -> bool:
    return config.history.mode(TableName.parse(table)) == "scd2"


def change_rows(config: PgcdcConfig, table: str, spark: SparkSession) -> Counter:
    """The changelog's rows after its seed (or every version), as a multiset."""
    rows = changelog(config, table, spark).to_pylist()
    if keeps_versions(config, table):  # the snapshot's versions open at its own LSN, the changes' at theirs
        seed = {"_pgcdc_valid_from_lsn": "snapshot"}
        return Counter(
            json.dumps(row | seed if row["_pgcdc_seq"] == -1 else row, sort_keys=True, default=str)
            for row in rows
            if row["_pgcdc_marker"] is None
        )
    return Counter(json.dumps(row, sort_keys=True, default=str) for row in rows if row["_pgcdc_op"] not in SEED)


def assert_versions_once(config: PgcdcConfig, table: str, spark: SparkSession) -> None:
    """Each version once; per key, in order, each closed where the next opens unless its key was deleted,
    only the last current."""
    rows = changelog(config, table, spark).to_pylist()
    markers = [row for row in rows if row["_pgcdc_marker"] is not None]
    assert len(markers) == 1 and all(value is None for name, value in markers[0].items() if name != "_pgcdc_marker")
    rows = [row for row in rows if row["_pgcdc_marker"] is None]
    key = TABLE_KEYS[table]
    opened = Counter((row[key], row["_pgcdc_valid_from_lsn"], row["_pgcdc_seq"]) for row in rows)
    repeated = {version: n for version, n in opened.items() if n > 1}
    assert not repeated, f"{table}: versions twice: {repeated}"
    by_key: dict[object, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row[key], []).append(row)
    for versions in by_key.values():
        versions.sort(key=lambda v: (v["_pgcdc_valid_from_lsn"], v["_pgcdc_seq"]))
        for version, following in zip(versions, versions[1:]):
            assert not version["_pgcdc_is_current"], versions
            if not version["_pgcdc_is_deleted"]:
                assert version["_pgcdc_valid_to_lsn"] == following["_pgcdc_valid_from_lsn"], versions
        assert versions[-1]["_pgcdc_is_current"] == (versions[-1]["_pgcdc_valid_to_lsn"] is None), versions


TABLE_KEYS = {"public.orders": "id"}


def assert_each_change_once(config: PgcdcConfig, spark: SparkSession) -> None:
    for table in TABLES:
        if keeps_versions(config, table):
            assert_versions_once(config, table, spark)
            continue
        rows = changelog(config, table, spark)
        ops = rows.column("_pgcdc_op").to_pylist()
        positions = Counter(  # a fill shares the position of the change it comes right before
            (*position, op == "fill")
            for position, op in zip(
                zip(rows.column("_pgcdc_lsn").to_pylist(), rows.column("_pgcdc_seq").to_pylist()), ops
            )
            if op not in SEED
        )
        seeds = Counter(ops)["reset"]
        assert seeds == 1, f"{table}: {seeds} seeds"
        repeated = {position: n for position, n in positions.items() if n > 1}
        assert not repeated, f"{table}: changelog rows twice: {repeated}"


@one_version_each("orders_history", MODES)  # with the test below, each mode on each version
def test_as_of_reads_equal_postgres_at_every_captured_moment(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, orders_history: str
) -> None:
    pg.execute(DDL)
    config = history_config(pg, tmp_path, orders=orders_history)
    snapshot_tables(config, lake_destination(spark, config), None)
    rng = random.Random(pg.major * 1000 + 24)
    moments: list[tuple[LSN, datetime]] = []
    with pg.connect() as conn:
        for step in range(6):
            workload_step(conn, rng, step)
            moments.append(capture(conn, step, TABLES))
            if step in (1, 3):
                run_incremental(
                    config, lake_destination(spark, config), max_chunk_changes=7
                )  # small chunks: many history commits
            if step == 4 and orders_history == "scd2":
                # Changes only a re-snapshot sees: the versions of the rows it no longer holds as they were
                # close at its LSN, and the rows it holds anew open there.
                run_incremental(config, lake_destination(spark, config), max_chunk_changes=7)
                conn.execute(
                    "UPDATE orders SET status = 'resnapshotted' WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 3)"
                )
                conn.execute("DELETE FROM orders WHERE id = (SELECT max(id) FROM orders)")
                snapshot_tables(config, lake_destination(spark, config), [TableName("public", "orders")])
    run_incremental(config, lake_destination(spark, config), max_chunk_changes=7)
    for table in TABLES:
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(*table.split(".")))
        for k, (lsn, time) in enumerate(moments):
            assert_as_of_equals(pg, spark, config, table, lsn, f"public.past_{k}_{table.split('.')[1]}")
            if not (k == 4 and keeps_versions(config, table)):  # a re-snapshot follows: it has no commit time
                assert_as_of_equals(pg, spark, config, table, None, f"public.past_{k}_{table.split('.')[1]}", time)
        assert_as_of_equals(pg, spark, config, table, None, table)
    assert_each_change_once(config, spark)
    if orders_history == "scd2":
        assert_versions_of_orders(config, spark, moments)
    else:
        assert_orders_changelog(config, spark)
    # Maintenance compacts the history tables and cleans their logs; drains go on from their newest marker.
    lake = open_lake(config.delta.root)
    for table in TABLES:
        maintain_table(config.history_path(*table.split(".")), lake, retention_hours=1, target_file_bytes=1 << 20)
    with pg.connect() as conn:
        workload_step(conn, rng, 6)
        moments.append(capture(conn, 6, TABLES))
    run_incremental(config, lake_destination(spark, config), max_chunk_changes=7)
    for table in TABLES:
        for k, (lsn, _) in enumerate(moments):
            assert_as_of_equals(pg, spark, config, table, lsn, f"public.past_{k}_{table.split('.')[1]}")
        assert_as_of_equals(pg, spark, config, table, None, table)
    assert_each_change_once(config, spark)


def assert_versions_of_orders(config: PgcdcConfig, spark: SparkSession, moments: list[tuple[LSN, datetime]]) -> None:
    """Unchanged TOAST values resolved in every version, several versions per key, and docs/history.md's
    queries of a key's versions (Spark SQL) give what the versions hold."""
    versions = changelog(config, "public.orders", spark)
    versions = versions.filter(pc.is_null(versions.column("_pgcdc_marker")))
    # Partitioned 100 times finer than the table (buckets of 5,000 keys), every version where its key puts it.
    path = config.history_path("public", "orders")
    assert path is not None
    metadata = read_table_metadata(path)
    assert metadata is not None and layout_from_property(metadata.layout_property) == TableLayout("range", ("id",), 100)
    placed = spark.sql(f"SELECT id, _pgcdc_bucket FROM delta.`{path}` WHERE _pgcdc_marker IS NULL").collect()
    assert len(placed) == versions.num_rows and all(row["_pgcdc_bucket"] == row["id"] // 100 for row in placed)
    assert len({row["_pgcdc_bucket"] for row in placed}) > 1
    assert all(body is not None and len(body) == 3200 for body in versions.column("body").to_pylist())
    assert Counter(versions.column("id").to_pylist()).most_common(1)[0][1] > 2
    deleted = versions.column("_pgcdc_is_deleted").to_pylist()
    assert any(deleted) and not all(deleted)
    current = spark.sql(f"SELECT id, status FROM delta.`{path}` WHERE _pgcdc_is_current").collect()
    assert sorted((row["id"], row["status"]) for row in current) == sorted(
        (row["id"], row["status"]) for row in read_rows(spark, config.table_path("public", "orders"), None).to_pylist()
    )
    lsn = int(moments[2][0])
    at = spark.sql(
        f"SELECT id, status FROM delta.`{path}` WHERE _pgcdc_valid_from_lsn <= {lsn} "
        f"AND (_pgcdc_valid_to_lsn IS NULL OR _pgcdc_valid_to_lsn > {lsn})"
    ).collect()
    expected = read_as_of(spark, config, TableName("public", "orders"), LSN(lsn))
    assert sorted((row["id"], row["status"]) for row in at) == sorted(
        zip(expected.column("id").to_pylist(), expected.column("status").to_pylist())
    )


def assert_orders_changelog(config: PgcdcConfig, spark: SparkSession) -> None:
    orders = changelog(config, "public.orders", spark).sort_by(
        [("_pgcdc_lsn", "ascending"), ("_pgcdc_seq", "ascending")]
    )
    ops = orders.column("_pgcdc_op").to_pylist()
    bodies = [
        body for op, body in zip(ops, orders.column("body").to_pylist()) if op in ("snapshot", "insert", "update")
    ]
    assert all(body is not None and len(body) == 3200 for body in bodies), "an unchanged TOAST value was not resolved"
    assert set(ops) >= {"reset", "snapshot", "insert", "update", "delete"}
    times = [
        t for op, t in zip(ops, orders.column("_pgcdc_commit_time").to_pylist()) if op != "snapshot" and op != "reset"
    ]
    assert all(t is not None for t in times) and times == sorted(times)
    # docs/history.md's query of every status an order went through
    path = config.history_path("public", "orders")
    statuses = spark.sql(
        f"SELECT _pgcdc_commit_time, _pgcdc_op, status FROM delta.`{path}` "
        "WHERE _pgcdc_op IN ('snapshot', 'insert', 'update') AND id = 1 ORDER BY _pgcdc_lsn, _pgcdc_seq"
    ).collect()
    expected = [(op, status) for op, i, status in zip(ops, orders.column("id").to_pylist(), orders.column("status").to_pylist())
                if op in ("snapshot", "insert", "update") and i == 1]  # fmt: skip
    assert [(row["_pgcdc_op"], row["status"]) for row in statuses] == expected and expected


@one_version_each("orders_history", MODES, first=1)
def test_a_drain_killed_between_the_changelog_and_the_table_commit_converges(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, capsys: pytest.CaptureFixture[str], orders_history: str
) -> None:
    pg.execute(DDL)
    config = history_config(pg, tmp_path, orders=orders_history)
    snapshot_tables(config, lake_destination(spark, config), None)
    reference = history_config(pg, tmp_path, "reference", "reference_slot", orders_history)  # drained without faults
    snapshot_tables(reference, lake_destination(spark, reference), None)
    rng = random.Random(pg.major)
    moments: list[tuple[LSN, datetime]] = []
    with pg.connect() as conn:
        for step in range(3):
            workload_step(conn, rng, step)
            moments.append(capture(conn, step, TABLES))
    config_file = write_config(config, tmp_path)
    start = confirmed(pg)
    # The first three kills follow each table's seed, the fourth a commit of changes; then before any
    # write of a chunk, and after a table's commit whose changelog commit came first.
    for point in ["after_history_commit"] * 4 + ["before_merge", "after_delta_commit"]:
        child = Child(config_file, chunk=5, env={FAULT_POINT_ENV: point})
        assert child.wait() == -signal.SIGKILL, child.output()
    assert confirmed(pg) == start  # nothing of the backlog was confirmed: it is replayed whole
    # Every chunk durable and all but the last confirmed, the run's state not written.
    child = Child(config_file, chunk=5, env={FAULT_POINT_ENV: "before_state_write"})
    assert child.wait() == -signal.SIGKILL, child.output()
    run_incremental(config, lake_destination(spark, config), max_chunk_changes=5)
    for table in TABLES:
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(*table.split(".")))
        for k, (lsn, _) in enumerate(moments):
            assert_as_of_equals(pg, spark, config, table, lsn, f"public.past_{k}_{table.split('.')[1]}")
        assert_as_of_equals(pg, spark, config, table, None, table)
    assert_each_change_once(config, spark)
    run_incremental(reference, lake_destination(spark, reference), max_chunk_changes=50)
    for table in TABLES:  # the same change rows as a drain that was never interrupted, no more, no fewer
        assert change_rows(config, table, spark) == change_rows(reference, table, spark), table
    # The command line prints the same rows as the Python read.
    assert (
        cli_main(["as-of", "--table", "public.orders", "--lsn", str(moments[1][0]), "--config", str(config_file)]) == 0
    )
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = read_as_of(spark, config, TableName.parse("public.orders"), moments[1][0]).to_pylist()
    assert Counter(json.dumps(row, sort_keys=True) for row in printed) == Counter(
        json.dumps(row, sort_keys=True) for row in expected
    )
    assert cli_main(["as-of", "--table", "public.dups", "--lsn", str(moments[0][0]), "--config", str(config_file)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = read_as_of(spark, config, TableName.parse("public.dups"), moments[0][0]).to_pylist()
    assert Counter(json.dumps(row, sort_keys=True) for row in printed) == Counter(
        json.dumps(row, sort_keys=True) for row in expected
    )
    assert deltalake.DeltaTable(config.history_path("public", "orders")).version() > 0


def test_scd2_tables_are_partitioned_a_hundred_times_finer_than_their_tables() -> None:
    assert finer_layout(TableLayout(RANGE, ("id",), 1_000_000)) == TableLayout(RANGE, ("id",), 10_000)
    assert finer_layout(TableLayout(RANGE, ("id",), 5_000)) == TableLayout(RANGE, ("id",), 100)
    assert finer_layout(TableLayout(RANGE, ("id",), 50)) == TableLayout(RANGE, ("id",), 50)  # not a partition per key
    assert finer_layout(TableLayout(HASH, ("a", "b"), 12)) == TableLayout(HASH, ("a", "b"), 1_200)


@NEWEST_POSTGRES_ONLY  # a Delta table's recorded layout: nothing of the server's version
def test_an_scd2_table_created_before_the_finer_layout_keeps_its_tables_layout(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SCD type 2 table records its layout when created; drains go on by the recorded layout, here the
    table's own (as every one was created before the finer layout), and stay exact."""
    pg.execute(
        "CREATE TABLE item (id int PRIMARY KEY, v text);"
        " INSERT INTO item SELECT g, 'start' FROM generate_series(1, 300) g;"
        " CREATE PUBLICATION pub FOR TABLE item"
    )
    config = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": "pgcdc_slot",
        "delta": {"root": str(tmp_path / "lake"), "buckets": {"tables": {"public.item": {"width": 5000}}}},
        "history": {"default": "scd2"},
    })  # fmt: skip
    path = config.history_path("public", "item")
    assert path is not None
    snapshot_tables(config, lake_destination(spark, config))
    with monkeypatch.context() as patched:
        patched.setattr(delta_versions, "finer_layout", lambda layout: layout)  # as created before it
        pg.execute("UPDATE item SET v = 'one' WHERE id % 7 = 0")
        run_incremental(config, lake_destination(spark, config))  # seeds the SCD type 2 table, then its changes
    metadata = read_table_metadata(path)
    assert metadata is not None and layout_from_property(metadata.layout_property) == TableLayout(RANGE, ("id",), 5000)
    pg.execute("UPDATE item SET v = 'two' WHERE id % 5 = 0; DELETE FROM item WHERE id > 290")
    run_incremental(config, lake_destination(spark, config))
    with pg.connect() as conn:
        compare_rows(conn, "public.item", *arrow_rows(read_as_of(spark, config, TableName("public", "item"))))
    placed = spark.sql(f"SELECT _pgcdc_bucket, count_if(_pgcdc_is_current) FROM delta.`{path}` GROUP BY 1").collect()
    assert sorted((row[0], row[1]) for row in placed if row[0] is not None) == [(0, 290)]  # every key in bucket 0


def assert_as_of_without_dropped(
    pg: PgDatabase, spark: SparkSession, config: PgcdcConfig, table: str, lsn: LSN, copy: str, dropped: str
) -> None:
    """The as-of read at ``lsn`` equals ``copy`` in every column ``copy`` has; ``dropped``, gone from
    PostgreSQL by then, is a column the history keeps (its older values stay), so it is not compared."""
    rows = read_as_of(spark, config, TableName.parse(table), lsn)
    assert dropped in rows.column_names
    with pg.connect() as conn:
        compare_rows(conn, copy, *arrow_rows(rows.drop_columns([dropped])))


@NEWEST_POSTGRES_ONLY
def test_drop_column_and_truncate_in_a_changelog_and_in_scd2_versions(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """docs/history.md: a dropped column keeps its values in the older versions and changelog rows and is
    NULL from the drop on; a TRUNCATE closes every current version of an SCD type 2 table (deleted) at
    its LSN. The as-of reads before the drop, between the drop and the TRUNCATE, and after it equal
    PostgreSQL's copies (``orders`` keeps versions, ``dups`` a changelog)."""
    pg.execute(DDL)
    config = history_config(pg, tmp_path, orders="scd2")
    snapshot_tables(config, lake_destination(spark, config), None)
    with pg.connect() as conn:
        conn.execute("UPDATE orders SET status = 'paid' WHERE id <= 5")
        conn.execute("INSERT INTO dups VALUES (9, 'kept')")
        before = capture(conn, 0, TABLES)
        run_incremental(config, lake_destination(spark, config))
        conn.execute("ALTER TABLE orders DROP COLUMN status")
        conn.execute("ALTER TABLE dups DROP COLUMN b")
        conn.execute("UPDATE orders SET body = 'short' WHERE id IN (1, 6)")
        conn.execute("INSERT INTO orders VALUES (40, 'new')")
        conn.execute("INSERT INTO dups VALUES (10)")
        dropped = capture(conn, 1, TABLES)
        conn.execute("TRUNCATE orders")
        conn.execute("INSERT INTO orders VALUES (50, 'after')")
        truncated = capture(conn, 2, TABLES)
    run_incremental(config, lake_destination(spark, config))
    for table in ("public.orders", "public.dups"):
        name = table.split(".")[1]
        column = "status" if name == "orders" else "b"
        assert_as_of_equals(pg, spark, config, table, before[0], f"public.past_0_{name}")
        assert_as_of_without_dropped(pg, spark, config, table, dropped[0], f"public.past_1_{name}", column)
        assert_as_of_without_dropped(pg, spark, config, table, truncated[0], f"public.past_2_{name}", column)
        assert_delta_equals_postgres(pg.dsn, table, config.table_path("public", name), extra_delta_columns=[column])
    assert_versions_once(config, "public.orders", spark)
    versions = changelog(config, "public.orders", spark).to_pylist()
    versions = [row for row in versions if row["_pgcdc_marker"] is None]
    after_drop = [row for row in versions if row["_pgcdc_valid_from_lsn"] > before[0]]
    # versions opened after the drop: id 1 and 6 updated, 40 and 50 inserted; status NULL in each
    assert sorted(row["id"] for row in after_drop) == [1, 6, 40, 50]
    assert all(row["status"] is None for row in after_drop)
    paid = [row for row in versions if row["status"] == "paid"]  # opened before the drop, values kept
    assert sorted(row["id"] for row in paid) == [1, 2, 3, 4, 5]
    # the TRUNCATE closed every version current before it, deleted, at one LSN between the two moments
    closed = {row["_pgcdc_valid_to_lsn"] for row in versions if row["id"] != 50 and row["_pgcdc_is_deleted"]}
    assert len(closed) == 1 and dropped[0] < closed.pop() <= truncated[0]
    current = [row for row in versions if row["_pgcdc_is_current"]]
    assert [(row["id"], row["body"]) for row in current] == [(50, "after")]
    log = changelog(config, "public.dups", spark).to_pylist()
    assert [row["b"] for row in log if row["a"] == 10] == [None] and [row["b"] for row in log if row["a"] == 9] == [
        "kept"
    ]
