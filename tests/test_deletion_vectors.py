"""Deletion vectors on the embedded Sail engine: on by default for keyed and REPLICA IDENTITY FULL
tables, off for keyless append-only ones and for tables opted out; a drain on a table with them
rewrites no data file; maintenance purges them; a lake written without them keeps draining.

Real PostgreSQL (the newest: deletion vectors are Delta's, and every drain test on 15 and 18 writes
them), the real engine, real Delta tables; every test ends with the oracle (Delta equals PostgreSQL
value for value, read with delta-rs's DataFusion, which applies deletion vectors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import deltalake
import pyarrow as pa
from dagster import MetadataValue
from pyspark.sql import SparkSession

from pgcdc_assets.incremental_assets import drain_metadata
from resources.config import parse_config, PgcdcConfig
from resources.delta.lake_storage import LakeStorage
from resources.delta.layout import BUCKET_COLUMN, bucket_values, HASH, TableLayout, TEXT_CAST_HASH
from resources.delta.maintenance import maintain_table
from resources.delta.markers import LAYOUT_PROPERTY, pgcdc_marker
from resources.delta.snapshot_writes import DELETION_VECTORS_PROPERTY, write_snapshot
from resources.delta.spark_destination import lake_destination
from resources.delta.state_table import state_path
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.deletion_vectors import has_deletion_vectors
from tests.support.delta_log import commit_bytes, commits_after
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

ROWS = 3000
DDL = f"""
    CREATE TABLE acct (id bigint PRIMARY KEY, balance numeric(12,2), note text);
    INSERT INTO acct SELECT g, g, 'n' || g FROM generate_series(0, {ROWS} - 1) g;
    CREATE TABLE feed (at bigint, what text);
    INSERT INTO feed SELECT g, 'e' || g FROM generate_series(1, 100) g;
    CREATE TABLE doc (x int, y text);
    ALTER TABLE doc REPLICA IDENTITY FULL;
    INSERT INTO doc SELECT g % 50, 'd' FROM generate_series(1, 200) g;
    CREATE PUBLICATION pub FOR TABLE acct, doc;
    CREATE PUBLICATION pub_feed FOR TABLE feed WITH (publish = 'insert, truncate');
"""


def config_for(pg: PgDatabase, lake: Path, **delta: object) -> PgcdcConfig:
    # acct (keys 0-2999) in range buckets of 1,000 keys: three buckets, so random keys touch all
    return parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": "pgcdc_slot",
        "delta": {"root": str(lake), "buckets": {"tables": {"public.acct": {"width": 1000}}}, **delta},
    })  # fmt: skip


def exact(pg: PgDatabase, config: PgcdcConfig, table: str, key: tuple[str, ...] = ("id",)) -> int:
    path = config.table_path("public", table)
    rows = assert_delta_equals_postgres(pg.dsn, f"public.{table}", path, key=key)
    assert_buckets_right(path)
    return rows


def random_changes(pg: PgDatabase, seed: int) -> None:
    """Updates of keys spread over every bucket, a few deletes, a few inserts."""
    pg.execute(f"UPDATE acct SET balance = balance + 1, note = 'u{seed}' WHERE id % 97 = {seed}")
    pg.execute(f"DELETE FROM acct WHERE id % 389 = {seed}")
    pg.execute(f"INSERT INTO acct SELECT {ROWS} * 10 + {seed} * 100 + g, g, 'new' FROM generate_series(1, 5) g")


@NEWEST_POSTGRES_ONLY
def test_keyed_and_full_tables_get_deletion_vectors_and_a_drain_rewrites_no_data_file(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    snapshot_tables(config, lake_destination(spark, config))
    acct, doc = config.table_path("public", "acct"), config.table_path("public", "doc")
    assert has_deletion_vectors(acct) and has_deletion_vectors(doc)
    assert deltalake.DeltaTable(acct).metadata().configuration[DELETION_VECTORS_PROPERTY] == "true"
    snapshotted = deltalake.DeltaTable(acct).version()
    data_bytes = sum(deltalake.DeltaTable(acct).get_add_actions(flatten=True).column("size_bytes").to_pylist())

    random_changes(pg, 3)
    pg.execute("UPDATE doc SET y = 'changed' WHERE x = 7")  # duplicates: every copy changes
    pg.execute("DELETE FROM doc WHERE x = 8")
    run_incremental(config, lake_destination(spark, config))
    assert exact(pg, config, "acct") == ROWS - len(range(3, ROWS, 389)) + 5
    assert exact(pg, config, "doc", key=()) == 196

    commits = commits_after(acct, snapshotted)
    removed = [action["remove"] for commit in commits for action in commit if "remove" in action]
    added = [action["add"] for commit in commits for action in commit if "add" in action]
    assert removed, "the drain changed rows of the snapshot's files"
    # every file the drain took out of the table is back, the same file with a deletion vector:
    # no data file was rewritten, and the new files hold only the new row images
    with_vectors = {add["path"]: add for add in added if add.get("deletionVector")}
    assert {remove["path"] for remove in removed} == set(with_vectors)
    assert all(with_vectors[remove["path"]]["size"] == remove["size"] for remove in removed)
    new_bytes = sum(add["size"] for add in added if add["path"] not in with_vectors)
    assert new_bytes < data_bytes / 4, (new_bytes, data_bytes)

    # and it stays exact over more drains on the same files
    for seed in (5, 11):
        random_changes(pg, seed)
        run_incremental(config, lake_destination(spark, config))
    assert exact(pg, config, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]


@NEWEST_POSTGRES_ONLY
def test_keyless_tables_and_opted_out_tables_are_copy_on_write(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    # opted out per table while the global default is on
    config = config_for(pg, tmp_path / "lake", deletion_vectors_tables={"public.acct": False})
    snapshot_tables(config, lake_destination(spark, config))
    acct, doc = config.table_path("public", "acct"), config.table_path("public", "doc")
    assert not has_deletion_vectors(acct) and has_deletion_vectors(doc)
    keyless = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub_feed", "slot": "pgcdc_feed", "delta": {"root": str(tmp_path / "lake")},
    })  # fmt: skip
    snapshot_tables(keyless, lake_destination(spark, keyless))
    assert not has_deletion_vectors(keyless.table_path("public", "feed"))  # only ever appended to

    snapshotted = deltalake.DeltaTable(acct).version()
    random_changes(pg, 3)
    pg.execute("INSERT INTO feed VALUES (101, 'late')")
    run_incremental(config, lake_destination(spark, config))
    run_incremental(keyless, lake_destination(spark, keyless))
    commits = commits_after(acct, snapshotted)
    assert not any(action["add"].get("deletionVector") for commit in commits for action in commit if "add" in action)
    assert exact(pg, config, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]
    assert exact(pg, keyless, "feed", key=()) == 101

    # off globally: no table gets them
    off = config_for(pg, tmp_path / "off", deletion_vectors=False)
    pg.execute("SELECT pg_drop_replication_slot('pgcdc_slot')")
    snapshot_tables(off, lake_destination(spark, off))
    assert not has_deletion_vectors(off.table_path("public", "acct")) and not has_deletion_vectors(
        off.table_path("public", "doc")
    )
    random_changes(pg, 7)
    run_incremental(off, lake_destination(spark, off))
    assert exact(pg, off, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]
    assert exact(pg, off, "doc", key=()) == 200


@NEWEST_POSTGRES_ONLY
def test_a_lake_written_without_deletion_vectors_keeps_draining_with_them_on(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A lake of the previous version (tables created without deletion vectors) under the new default:
    its tables keep their protocol, copy-on-write, and stay exact; so does a re-snapshot in place."""
    pg.execute(DDL)
    before = config_for(pg, tmp_path / "lake", deletion_vectors=False)
    snapshot_tables(before, lake_destination(spark, before))
    random_changes(pg, 2)
    run_incremental(before, lake_destination(spark, before))
    now = config_for(pg, tmp_path / "lake")
    acct = now.table_path("public", "acct")
    protocol = deltalake.DeltaTable(acct).protocol()
    for seed in (3, 4):
        random_changes(pg, seed)
        run_incremental(now, lake_destination(spark, now))
    assert deltalake.DeltaTable(acct).protocol() == protocol and not has_deletion_vectors(acct)
    assert exact(pg, now, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]
    assert exact(pg, now, "doc", key=()) == 200
    snapshot_tables(now, lake_destination(spark, now))  # a re-snapshot into the existing table keeps its protocol too
    assert not has_deletion_vectors(acct)
    random_changes(pg, 6)
    run_incremental(now, lake_destination(spark, now))
    assert exact(pg, now, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]


@NEWEST_POSTGRES_ONLY
def test_maintenance_purges_deletion_vectors_above_the_ratio_and_stays_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    snapshot_tables(config, lake_destination(spark, config))
    acct = config.table_path("public", "acct")
    # deletes only: each bucket keeps its one file, with a deletion vector deleting 10% of its rows
    # (compaction bins leave a file alone in its bucket as it is)
    pg.execute("DELETE FROM acct WHERE id % 10 = 0")
    run_incremental(config, lake_destination(spark, config))
    lake = LakeStorage(config.delta.root, config.delta.storage)
    kept = maintain_table(acct, lake, retention_hours=1, target_file_bytes=1 << 27, max_deleted_rows_ratio=0.5)
    assert kept.deleted_before == kept.deleted_after and kept.deleted_before.rows == ROWS
    assert kept.deleted_before.deleted == ROWS // 10 and round(kept.deleted_before.fraction, 3) == 0.1
    assert kept.files_compacted == 0
    done = maintain_table(acct, lake, retention_hours=1, target_file_bytes=1 << 27, max_deleted_rows_ratio=0.05)
    assert done.deleted_before.fraction > 0.05 and done.deleted_after.deleted == 0, done
    assert done.deleted_after.rows == ROWS - ROWS // 10 and done.files_compacted == 3
    assert pa.table(deltalake.DeltaTable(acct).deletion_vectors()).num_rows == 0
    assert exact(pg, config, "acct") == ROWS - ROWS // 10

    # updates after the purge, then maintenance again: bins of several files are compacted, their
    # deletion vectors go with them; drains on the compacted files stay exact
    for seed in (1, 2):
        random_changes(pg, seed)
        run_incremental(config, lake_destination(spark, config))
    again = maintain_table(acct, lake, retention_hours=1, target_file_bytes=1 << 27)
    assert again.deleted_before.deleted > 0 and again.deleted_after.deleted == 0, again
    random_changes(pg, 9)
    run_incremental(config, lake_destination(spark, config))
    assert exact(pg, config, "acct") == pg.execute("SELECT count(*) FROM acct")[0][0]
    assert exact(pg, config, "doc", key=()) == 200


@NEWEST_POSTGRES_ONLY
def test_a_drain_reports_the_bytes_its_commits_wrote_in_proportion_to_the_rows_it_changed(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """200 random updates into a 60,000-row table in one bucket: with deletion vectors the drain writes
    the 200 new row images and a deletion vector; copy-on-write it rewrites the bucket. The figure the
    drain reports (the Dagster metadata's ``pgcdc/bytes_written``) is exactly what its commits added."""
    pg.execute("""
        CREATE TABLE wide (id bigint PRIMARY KEY, v int, note text);
        INSERT INTO wide SELECT g, g, md5(g::text) FROM generate_series(1, 60000) g;
        CREATE PUBLICATION pub_wide FOR TABLE wide;
    """)
    reported: dict[bool, int] = {}
    new_rows: dict[bool, int] = {}
    table_bytes: dict[bool, int] = {}
    for deletion_vectors in (True, False):
        slot = f"wide_{str(deletion_vectors).lower()}"
        config = parse_config({
            "postgres": {"dsn": pg.dsn}, "publication": "pub_wide", "slot": slot,
            "delta": {"root": str(tmp_path / slot), "deletion_vectors": deletion_vectors},
        })  # fmt: skip
        snapshot_tables(config, lake_destination(spark, config))
        path = config.table_path("public", "wide")
        before = deltalake.DeltaTable(path)
        table_bytes[deletion_vectors] = sum(before.get_add_actions(flatten=True).column("size_bytes").to_pylist())
        pg.execute(
            f"UPDATE wide SET v = v + 1, note = '{slot}' WHERE id % 300 = 7"
        )  # 200 rows over the whole key space
        result = run_incremental(config, lake_destination(spark, config))
        stats = result.tables["public.wide"]
        assert stats.updated == 200 and stats.bytes_written == commit_bytes(path, before.version()) > 0
        metadata = drain_metadata(result, TableName("public", "wide"))
        assert metadata["pgcdc/bytes_written"] == MetadataValue.int(stats.bytes_written)
        reported[deletion_vectors] = stats.bytes_written
        added = [
            action["add"] for commit in commits_after(path, before.version()) for action in commit if "add" in action
        ]
        new_rows[deletion_vectors] = sum(
            json.loads(add["stats"])["numRecords"] for add in added if not add.get("deletionVector")
        )
        assert exact(pg, config, "wide") == 60000
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    # with deletion vectors only the changed rows are written; copy-on-write, every row of the bucket again
    assert new_rows == {True: 200, False: 60000}
    assert reported[True] * 20 < table_bytes[True] <= reported[False], (reported, table_bytes)


def rewrite_as_the_previous_version(spark: SparkSession, path: str) -> TableLayout:
    """The table at ``path`` (hash buckets, copy-on-write) written again the way pgcdc wrote it before
    hash layouts named their hash function: bucketed by the text-cast hash, its snapshot marker and
    its layout property without a ``hash`` entry. Returns that layout (as read today: the text-cast hash)."""
    table = deltalake.DeltaTable(path)
    marker = next(
        pgcdc for commit in table.history()
        if (pgcdc := pgcdc_marker(commit.get("userMetadata"))) is not None and pgcdc["kind"] == "snapshot"
    )  # fmt: skip
    record = {name: value for name, value in marker["layout"].items() if name != "hash"}
    layout = TableLayout.from_json(record)
    assert layout.kind == HASH and layout.hash == TEXT_CAST_HASH
    rows = table.to_pyarrow_table().drop_columns([BUCKET_COLUMN])
    shutil.rmtree(path)
    write_snapshot(spark, rows, rows.schema, path, json.dumps({"pgcdc": {**marker, "layout": record}}), layout=layout)
    for commit in (Path(path) / "_delta_log").glob("*.json"):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        for action in actions:
            if "metaData" in action:
                action["metaData"]["configuration"][LAYOUT_PROPERTY] = json.dumps(record)
        commit.write_text("\n".join(json.dumps(action) for action in actions) + "\n")
    return layout


@NEWEST_POSTGRES_ONLY
def test_a_lake_of_the_previous_version_keeps_draining_exactly_on_its_old_hash_buckets(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A table the previous version wrote: copy-on-write (no deletion vector feature), hash buckets of a
    date key computed by the text-cast hash and recorded without a ``hash`` entry, and no pgcdc state.
    Drains under today's defaults keep its protocol, bucket new and changed rows by its old hash (a row
    in another bucket would be missed by the bucket-pruned MERGE and show as a duplicate), and stay exact."""
    pg.execute("""
        CREATE TABLE visit (day date PRIMARY KEY, hits int, note text);
        INSERT INTO visit SELECT DATE '2024-01-01' + g, g, 'v' || g FROM generate_series(0, 399) g;
        CREATE PUBLICATION pub_visit FOR TABLE visit;
    """)
    lake = tmp_path / "lake"
    before = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub_visit", "slot": "pgcdc_slot",
        "delta": {"root": str(lake), "deletion_vectors": False, "buckets": {"tables": {"public.visit": {"count": 4}}}},
    })  # fmt: skip
    snapshot_tables(before, lake_destination(spark, before))
    path = before.table_path("public", "visit")
    old = rewrite_as_the_previous_version(spark, path)
    shutil.rmtree(state_path(str(lake), "pgcdc_slot"))  # the previous version kept no state table
    days = deltalake.DeltaTable(path).to_pyarrow_table(columns=["day"]).column("day")
    typed = TableLayout(HASH, old.key, old.size)
    assert bucket_values(old, [days]) != bucket_values(typed, [days]), (
        "the two hashes must differ on this key for the test to mean anything"
    )
    assert assert_buckets_right(path) == old
    protocol = deltalake.DeltaTable(path).protocol()

    now = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub_visit", "slot": "pgcdc_slot",
                        "delta": {"root": str(lake)}})  # fmt: skip
    for seed in range(3):  # the first drain reads the old record from the log, the later ones from the state it wrote
        pg.execute(f"UPDATE visit SET hits = hits + 1, note = 'u{seed}' WHERE (day - DATE '2024-01-01') % 7 = {seed};"
                   f" DELETE FROM visit WHERE (day - DATE '2024-01-01') % 53 = {seed};"
                   f" INSERT INTO visit SELECT DATE '2030-01-01' + {seed} * 100 + g, g, 'new' FROM generate_series(1, 20) g")  # fmt: skip
        run_incremental(now, lake_destination(spark, now))
        assert exact(pg, now, "visit", key=("day",)) == pg.execute("SELECT count(*) FROM visit")[0][0]
    assert assert_buckets_right(path) == old
    assert deltalake.DeltaTable(path).protocol() == protocol and not has_deletion_vectors(path)
