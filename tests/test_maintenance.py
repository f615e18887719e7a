"""Table maintenance (``pgcdc_maintenance``) against real PostgreSQL 15 and 18, embedded Sail and delta-rs.

One scenario per version walks what a long-running pipeline meets: many small drains, the
Dagster maintenance job (the retention properties, compaction, vacuum after the retention, log
clean-up after the retention), time travel inside the retention, more drains, and a drain that
crashes after its Delta commit and is replayed; Delta equals PostgreSQL value for value after
every step.

The retention is a week, so its passing is simulated the one way a Delta table records it:
the commits a drain made "long ago" get their removal timestamps (and the removed files their
modification times) moved back, and expired log files their modification times. The tables
are real, written by Sail; only the clock they were written under is moved.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import deltalake
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, DefaultScheduleStatus, instance_for_test
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.lake_storage import open_lake
from resources.delta.maintenance import maintain_table, properties_to_set, RETENTION_PROPERTIES
from resources.delta.markers import EXPIRED_SNAPSHOT_LSN
from resources.delta.reads import delta_rs_rows
from resources.delta.snapshot_writes import ROW_GROUP_BYTES, ROW_GROUP_ROWS
from resources.delta.spark_destination import lake_destination
from resources.delta.table_files import delta_tables_under
from resources.delta.table_log import read_table_log
from resources.history.as_of import read_as_of
from resources.names import INCREMENTAL_JOB, MAINTENANCE_JOB, MAINTENANCE_SCHEDULE, slot_pool
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import arrow_rows, assert_delta_equals_postgres, compare_rows
from tests.support.fault_runs import Child, confirmed, SLOT, write_config
from tests.support.marker_reads import read_snapshot_lsn
from tests.support.postgres import PgDatabase, POSTGRES_VERSIONS
from tests.support.s3_fixtures import S3Server

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.s3_fixtures"]

DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, balance numeric(12, 2), note text, seen timestamptz, tags int[]);
    CREATE TABLE dup (k int, v text, at timestamptz, tags text[]);
    ALTER TABLE dup REPLICA IDENTITY FULL;
    CREATE TABLE journal (entry int, note text);
    INSERT INTO acct SELECT g, g / 4.0, 'start', '2026-01-01 00:00+00', ARRAY[g] FROM generate_series(1, 300) g;
    INSERT INTO dup VALUES (1, 'a', '2026-01-01 00:00+00', '{x}'), (1, 'a', '2026-01-01 00:00+00', '{x}'), (2, NULL, NULL, NULL);
    INSERT INTO journal VALUES (-1, 'seed');
    CREATE PUBLICATION pub FOR TABLE acct, dup, journal;
"""
TABLES = {"acct": ("id",), "dup": (), "journal": ()}
RETENTION_HOURS = 168
RETENTION = {name: "interval 168 hours" for name in RETENTION_PROPERTIES}
DAY_MS = 24 * 3600 * 1000


def drain_work(pg: PgDatabase, i: int) -> None:
    """One small transaction per drain: new keys, an update of the previous drain's keys, a FULL
    table change on identical rows, a keyless append. Each drain adds files and replaces some."""
    pg.execute(
        f"INSERT INTO acct SELECT g, g, 'new', now(), ARRAY[g, {i}] FROM generate_series({1000 + 10 * i}, {1004 + 10 * i}) g;"
        f" UPDATE acct SET balance = balance + 1, note = 'upd {i}' WHERE id = {1000 + 10 * (i - 1) if i else 1};"
        f" INSERT INTO dup VALUES ({i % 3}, 'c{i}', now(), ARRAY['t{i}']), (1, 'a', '2026-01-01 00:00+00', '{{x}}');"
        f" DELETE FROM dup WHERE ctid = (SELECT min(ctid) FROM dup WHERE k = 1 AND v = 'a');"
        f" INSERT INTO journal VALUES ({i}, 'drain'), ({i}, 'drain')"
    )


def assert_exact(pg: PgDatabase, config: PgcdcConfig) -> None:
    for table, key in TABLES.items():
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table), key=key or None)


def table_files(path: str) -> set[str]:
    return set(deltalake.DeltaTable(path).get_add_actions(flatten=True).column("path").to_pylist())


def storage_files(path: str) -> set[str]:
    """The data files on disk, as the log names them (bucketed tables keep theirs under ``_pgcdc_bucket=N/``)."""
    return {
        file.relative_to(path).as_posix() for file in Path(path).rglob("*.parquet") if "_delta_log" not in file.parts
    }


def rows_at(path: str, version: int) -> list[dict]:
    table = delta_rs_rows(path, version=version)
    return sorted(table.to_pylist(), key=repr)


def protocol_of(path: str) -> tuple[int, int, frozenset[str], frozenset[str]]:
    """The table's protocol: versions and feature sets (delta-rs lists the features in no set order)."""
    protocol = deltalake.DeltaTable(path).protocol()
    return (
        protocol.min_reader_version, protocol.min_writer_version,
        frozenset(protocol.reader_features or ()), frozenset(protocol.writer_features or ()),
    )  # fmt: skip


def age_commits(path: str, versions: range, days: float) -> set[str]:
    """Move the clock of these commits back by ``days``: their commit and removal timestamps,
    and the modification time of the files they removed (Delta's VACUUM compares both with its
    cutoff). Returns the files they removed for good: not those a commit since added again (a
    file given a deletion vector is removed and added back in one commit). Only commits after the
    newest checkpoint hold their own removals, so there must be none yet."""
    log = Path(path) / "_delta_log"
    assert not list(log.glob("*.checkpoint.parquet")), "a checkpoint would hold these removals too"
    shift = int(days * DAY_MS)
    removed: dict[str, int] = {}  # path -> the version that removed it
    for version in versions:
        commit = log / f"{version:020d}.json"
        actions = [json.loads(line) for line in commit.read_text().splitlines() if line.strip()]
        for action in actions:
            if "remove" in action:
                action["remove"]["deletionTimestamp"] -= shift
                removed[action["remove"]["path"]] = version
                then = time.time() - shift / 1000
                os.utime(Path(path) / action["remove"]["path"], (then, then))
            if "commitInfo" in action:
                action["commitInfo"]["timestamp"] -= shift
        commit.write_text("".join(json.dumps(action) + "\n" for action in actions))
    last_added: dict[str, int] = {}
    for commit in sorted(log.glob("*.json")):
        for line in commit.read_text().splitlines():
            if line.startswith('{"add"'):
                last_added[json.loads(line)["add"]["path"]] = int(commit.name[:20])
    return {path for path, version in removed.items() if last_added.get(path, -1) < version}


def age_log(path: str, days: float) -> None:
    """Every log file so far ``days`` older (what Delta's log clean-up compares with its cutoff)."""
    then = time.time() - days * 24 * 3600
    for entry in (Path(path) / "_delta_log").iterdir():
        os.utime(entry, (then, then))


def observations(result: object, key: AssetKey) -> list[dict[str, object]]:
    return [
        {name: value.value for name, value in event.asset_observation_data.asset_observation.metadata.items()}
        for event in result.all_events  # type: ignore[attr-defined]
        if event.event_type_value == "ASSET_OBSERVATION"
        and event.asset_observation_data.asset_observation.asset_key == key
    ]


def retention_properties(path: str) -> dict[str, str]:
    configuration = deltalake.DeltaTable(path).metadata().configuration
    return {name: configuration[name] for name in RETENTION_PROPERTIES if name in configuration}


def assert_changelog_is_the_table(pg: PgDatabase, spark: SparkSession, config: PgcdcConfig) -> None:
    with pg.connect() as conn:
        compare_rows(conn, "public.acct", *arrow_rows(read_as_of(spark, config, TableName("public", "acct"))))


def test_maintenance_compacts_vacuums_and_cleans_the_log_and_drains_stay_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    config = PgcdcConfig.model_validate({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
        # acct copy-on-write (with a changelog), dup (REPLICA IDENTITY FULL) with deletion vectors
        "delta": {"root": str(tmp_path / "lake"), "deletion_vectors_tables": {"public.acct": False}},
        "maintenance": {"cron": "0 4 * * 0"},
        "history": {"tables": {"public.acct": "changelog"}},
    })  # fmt: skip
    config_file = write_config(config, tmp_path)
    defs = build_definitions(config_file)
    paths = {table: config.table_path("public", table) for table in TABLES}
    acct, journal = paths["acct"], paths["journal"]
    acct_changes = config.history_path("public", "acct")
    assert acct_changes is not None

    # The job shares the drain's pool (a pool limit of 1 keeps them apart) and its schedule is off.
    maintenance_op = defs.resolve_job_def(MAINTENANCE_JOB).graph.node_defs[0]
    drain_op = defs.resolve_job_def(INCREMENTAL_JOB).graph.node_defs[0]
    assert maintenance_op.pool == drain_op.pool == slot_pool(SLOT)
    schedule = defs.resolve_schedule_def(MAINTENANCE_SCHEDULE)
    assert schedule.default_status == DefaultScheduleStatus.STOPPED and schedule.cron_schedule == "0 4 * * 0"

    snapshot_tables(config, lake_destination(spark, config))
    drains = 6  # below Sail's checkpoint interval of 10 commits: see age_commits
    for i in range(drains):
        drain_work(pg, i)
        run_incremental(config, lake_destination(spark, config))
    assert_exact(pg, config)
    files_before = {table: table_files(path) for table, path in paths.items()}
    assert all(len(files) >= drains for table, files in files_before.items() if table != "dup")
    protocol = {table: protocol_of(path) for table, path in paths.items()}
    snapshot_lsn = read_snapshot_lsn(spark, acct)
    applied = read_table_log(journal).applied_marker
    acct_layout = read_table_log(acct).layout  # from its snapshot marker
    assert applied is not None and acct_layout is not None
    newest = deltalake.DeltaTable(acct).version()
    # The first half of the drains happened "eight days ago": beyond the week of retention.
    old = {table: age_commits(path, range(1, 1 + drains // 2), days=8) for table, path in paths.items()}
    assert old["acct"] and old["dup"] and not old["journal"]  # appends replace no file
    inside = newest - 2
    at_inside = rows_at(acct, inside)
    at_cutoff = rows_at(acct, drains // 2)  # the version current at the cutoff: still readable

    # pgcdc's own tables under <delta.root>/_pgcdc/ (its state) are maintained with the others.
    state = str(tmp_path / "lake" / "_pgcdc" / "state" / SLOT)
    rows = deltalake.DeltaTable(state).to_pyarrow_table()  # written by the snapshot and the drains
    for _ in range(4):
        deltalake.write_deltalake(state, rows, mode="append")

    changelog_files = table_files(acct_changes)
    assert len(changelog_files) >= drains

    with instance_for_test() as instance:
        first = defs.resolve_job_def(MAINTENANCE_JOB).execute_in_process(instance=instance)
        assert first.success
        assert len(table_files(state)) == 1
        assert (
            len(table_files(acct_changes)) == 1 and retention_properties(acct_changes) == RETENTION
        )  # the changelog too
        for table, path in paths.items():
            observed = observations(first, AssetKey(["pgcdc", "public", table]))
            assert len(observed) == 1
            meta = observed[0]
            after = table_files(path)
            assert meta["pgcdc/files_before"] == len(files_before[table])
            assert meta["pgcdc/files_after"] == len(after)
            assert meta["pgcdc/maintenance_method"] == "delta-rs"
            # pgcdc owns both retention properties: set to the retention, recorded.
            assert retention_properties(path) == RETENTION, table
            assert "delta.logRetentionDuration: (unset) -> interval 168 hours" in meta["pgcdc/retention_properties_set"]
            if table != "dup":
                assert len(after) < len(files_before[table]), table  # compacted
            # the rows deletion vectors delete (none in copy-on-write acct), compacted away with their files
            assert meta["pgcdc/deleted_rows_fraction_after"] == 0.0, table
            assert table != "acct" or meta["pgcdc/deleted_rows_fraction_before"] == 0.0
            # Vacuum: files removed before the cutoff are gone, later removals stay for time travel.
            on_storage = storage_files(path)
            assert not old[table] & on_storage, table
            assert (files_before[table] - old[table]) - after <= on_storage, table
            assert meta["pgcdc/files_removed"] == len(old[table])
            assert meta["pgcdc/storage_files_after"] == len(on_storage)
            # delta-rs commits keep the protocol the engine wrote, and the engine reads them.
            assert protocol_of(path) == protocol[table]
            assert spark.read.format("delta").load(path).count() == delta_rs_rows(path).num_rows
        assert retention_properties(state) == RETENTION
        assert_exact(pg, config)
        # Markers: maintenance commits are none, so the readers find the same ones.
        assert read_snapshot_lsn(spark, acct) == snapshot_lsn
        assert read_table_log(journal).applied_marker == applied
        # Time travel inside the retention reads what it read before; before the cutoff it cannot.
        assert rows_at(acct, inside) == at_inside
        assert rows_at(acct, drains // 2) == at_cutoff
        with pytest.raises(Exception, match=r"(?i)not found|no such file"):
            rows_at(acct, 1)

        # Eight days later (beyond the retention, well inside Delta's default log retention of 30
        # days): everything written so far has expired, then two drains. The log is cleaned as far
        # as the retention allows (from the newest expired checkpoint on: the first job's), by
        # maintenance or by Sail's own clean-up at its checkpoints (every ten commits: journal's
        # tenth is a drain's); both drains' versions, inside the retention, travel back exactly.
        checkpointed = {table: deltalake.DeltaTable(path).version() for table, path in paths.items()}
        at_checkpointed = {table: rows_at(path, checkpointed[table]) for table, path in paths.items()}
        for path in paths.values():
            age_log(path, days=8)
        drain_work(pg, drains)
        run_incremental(config, lake_destination(spark, config))
        recent = {table: deltalake.DeltaTable(path).version() for table, path in paths.items()}
        at_recent = {table: rows_at(path, recent[table]) for table, path in paths.items()}
        drain_work(pg, drains + 1)
        run_incremental(config, lake_destination(spark, config))
        applied = read_table_log(journal).applied_marker
        assert applied is not None
        second = defs.resolve_job_def(MAINTENANCE_JOB).execute_in_process(instance=instance)
        assert second.success
        for table, path in paths.items():
            meta = observations(second, AssetKey(["pgcdc", "public", table]))[0]
            assert meta["pgcdc/retention_properties_set"] == "none"  # they hold the retention since the first run
            log = Path(path) / "_delta_log"
            # The log starts at the first job's checkpoint, or at a later checkpoint of Sail's own
            # (which of the two depends on where Sail's every-tenth commit falls), never later than
            # the drains inside the retention.
            oldest = min(int(p.name[:20]) for p in log.glob("*.json"))
            assert checkpointed[table] <= oldest <= recent[table], table
            assert not [p for p in log.glob("*.crc") if int(p.name[:20]) < oldest], table
            assert rows_at(path, recent[table]) == at_recent[table], table
            if oldest == checkpointed[table]:
                assert rows_at(path, checkpointed[table]) == at_checkpointed[table], table
        with pytest.raises(Exception, match=r"(?i)no files in log segment"):  # older versions are gone
            rows_at(acct, checkpointed["acct"] - 1)
        assert observations(second, AssetKey(["pgcdc", "public", "acct"]))[0]["pgcdc/log_files_removed"] > 0
        assert read_snapshot_lsn(spark, acct) == EXPIRED_SNAPSHOT_LSN  # its snapshot commit expired
        assert read_table_log(journal).applied_marker == applied  # the newest append commit stays
        # The drains' log read: the layout now comes from the table property in delta-rs's checkpoint.
        expired = read_table_log(acct)
        assert (expired.snapshot_lsn, expired.layout) == (EXPIRED_SNAPSHOT_LSN, acct_layout)
        assert_exact(pg, config)
        # The changelog went on after its table's snapshot commit expired: folded whole, it is the table.
        assert_changelog_is_the_table(pg, spark, config)

    # A drain on the maintained tables; then (on one version: the crash is Delta's, not
    # PostgreSQL's, and a child process with its own engine is costly) one that crashes after
    # its Delta commit and is replayed.
    drain_work(pg, drains + 2)
    run_incremental(config, lake_destination(spark, config))
    assert_exact(pg, config)
    if pg.major != POSTGRES_VERSIONS[-1]:
        return
    for i in range(drains + 3, drains + 6):
        drain_work(pg, i)
    position = confirmed(pg)
    child = Child(config_file, chunk=100, env={FAULT_POINT_ENV: "after_delta_commit"})
    try:
        assert child.wait(timeout=120) == -9, child.output()
    finally:
        child.kill()
    assert confirmed(pg) == position  # in Delta, not confirmed: the next drain replays it
    replay = run_incremental(config, lake_destination(spark, config))
    # Exactly the replayed chunk's changes to the keyless and FULL tables (per transaction: two dup
    # inserts and a delete, two journal inserts), by their commits' markers found after maintenance;
    # acct's are merged again (idempotent), not skipped.
    assert replay.changes_skipped == 3 * (3 + 2)
    assert_exact(pg, config)
    assert_changelog_is_the_table(pg, spark, config)


def test_maintenance_compacts_scd2_tables_and_their_drains_go_on(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The job maintains SCD type 2 tables beside their tables: each drain adds a file for its new
    versions and one for its marker row, which every later drain's MERGE reads until compacted."""
    pg.execute(
        "CREATE TABLE item (id int PRIMARY KEY, v text);"
        " INSERT INTO item SELECT g, 'start' FROM generate_series(1, 40) g;"
        " CREATE PUBLICATION pub FOR TABLE item"
    )
    config = PgcdcConfig.model_validate({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
        "delta": {"root": str(tmp_path / "lake")}, "history": {"tables": {"public.item": "scd2"}},
    })  # fmt: skip
    defs = build_definitions(write_config(config, tmp_path))
    versions = config.history_path("public", "item")
    assert versions is not None and versions.endswith("__history")
    snapshot_tables(config, lake_destination(spark, config))
    for i in range(4):
        pg.execute(f"UPDATE item SET v = 'drain {i}' WHERE id % 4 = {i}")
        run_incremental(config, lake_destination(spark, config))
    before = table_files(versions)
    assert len(before) > 4
    with instance_for_test() as instance:
        assert defs.resolve_job_def(MAINTENANCE_JOB).execute_in_process(instance=instance).success
    after = table_files(versions)
    assert len(after) < len(before) and retention_properties(versions) == RETENTION
    pg.execute("UPDATE item SET v = 'after maintenance' WHERE id <= 3; DELETE FROM item WHERE id = 40")
    run_incremental(config, lake_destination(spark, config))
    with pg.connect() as conn:
        compare_rows(conn, "public.item", *arrow_rows(read_as_of(spark, config, TableName("public", "item"))))
    current = spark.sql(f"SELECT count(*) FROM delta.`{versions}` WHERE _pgcdc_is_current").collect()[0][0]
    assert current == 39


def test_maintenance_of_an_object_store_lake_through_delta_rs(s3_server: S3Server, s3_root: str) -> None:
    """An ``s3://`` lake (moto): found under ``_pgcdc/``, compacted, listed and cleaned through the
    configured store, credentials from their ${ENV} references."""
    lake = s3_server.lake(s3_root)
    path = f"{s3_root}/_pgcdc/state/{SLOT}"
    # delta-rs writes the table here as Sail would (this test needs no engine); maintenance then commits without the flag.
    writing = {**lake.object_store_options(), "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
    for i in range(4):
        deltalake.write_deltalake(
            path, pa.table({"table": [f"t{i}"], "version": [i]}), mode="append", storage_options=writing
        )
    assert delta_tables_under(lake, f"{s3_root}/_pgcdc") == [path]
    done = maintain_table(path, lake, retention_hours=RETENTION_HOURS, target_file_bytes=1 << 27)
    assert (done.method, done.table_before.files, done.table_after.files) == ("delta-rs", 4, 1)
    assert (
        done.storage_after.files == 5 and done.log_files_after == 7
    )  # 6 commits (one setting the retention) and a checkpoint
    table = deltalake.DeltaTable(path, storage_options=lake.object_store_options())
    assert sorted(table.to_pyarrow_table().column("version").to_pylist()) == [0, 1, 2, 3]
    assert {name: table.metadata().configuration.get(name) for name in RETENTION_PROPERTIES} == RETENTION


def test_vacuum_deletes_files_whose_tombstones_a_checkpoint_already_dropped(tmp_path: Path) -> None:
    """A checkpoint drops tombstones older than the table's deletedFileRetentionDuration (Sail writes
    one every ten commits); the files they named are still on storage, unreferenced. Vacuum must find
    them by listing, not by tombstones, or they stay for good. The newest version stays readable."""
    path = str(tmp_path / "t")
    rows = pa.table({"id": pa.array([1, 2, 3], pa.int64())})
    deltalake.write_deltalake(path, rows, configuration={"delta.deletedFileRetentionDuration": "interval 1 second"})
    for _ in range(4):  # each overwrite replaces the table's file: a tombstone each
        deltalake.write_deltalake(path, rows, mode="overwrite")
    time.sleep(1.5)
    deltalake.DeltaTable(path).create_checkpoint()  # drops the (now expired) tombstones
    two_hours_ago = time.time() - 7200
    for data_file in Path(path).glob("*.parquet"):
        os.utime(data_file, (two_hours_ago, two_hours_ago))
    assert len(list(Path(path).glob("*.parquet"))) == 5

    done = maintain_table(path, open_lake(path), retention_hours=1, target_file_bytes=1 << 20)

    assert done.files_vacuumed == 4, done
    assert [p.name for p in Path(path).glob("*.parquet")] == [
        Path(f).name for f in deltalake.DeltaTable(path).file_uris()
    ]
    assert deltalake.DeltaTable(path).to_pyarrow_table().sort_by("id").equals(rows)


def test_compaction_sizes_its_row_groups_by_the_stored_bytes_of_the_rows(tmp_path: Path) -> None:
    """delta-rs buffers the row group of every file it writes, on each of its tasks: compaction groups
    16 MiB of rows as stored (``ROW_GROUP_BYTES``), so 1 KB rows of incompressible text come in groups of
    about 16k rows (delta-rs's default: one group up to about 1M rows), narrow rows in groups of
    ``ROW_GROUP_ROWS``; the codec stays delta-rs's own, ZSTD."""
    wide, narrow = str(tmp_path / "wide"), str(tmp_path / "narrow")
    for part in range(8):
        wide_rows = {
            "id": range(part * 5000, (part + 1) * 5000),
            "payload": [os.urandom(500).hex() for _ in range(5000)],
        }
        deltalake.write_deltalake(wide, pa.table(wide_rows), mode="append")
        deltalake.write_deltalake(narrow, pa.table({"id": range(part * 20000, (part + 1) * 20000)}), mode="append")
    for path in (wide, narrow):
        done = maintain_table(path, open_lake(path), retention_hours=1, target_file_bytes=256 << 20)
        assert (done.files_compacted, done.files_written) == (8, 1), done

    def row_groups(path: str) -> list[int]:
        (uri,) = deltalake.DeltaTable(path).file_uris()
        metadata = pq.ParquetFile(uri).metadata
        assert {metadata.row_group(0).column(i).compression for i in range(metadata.num_columns)} == {"ZSTD"}
        return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]

    wide_groups, narrow_groups = row_groups(wide), row_groups(narrow)
    assert sum(wide_groups) == 40000 and len(wide_groups) == 3, wide_groups
    assert max(wide_groups) <= ROW_GROUP_BYTES // 1000, wide_groups
    assert narrow_groups == [ROW_GROUP_ROWS, 160000 - ROW_GROUP_ROWS]
    assert sorted(delta_rs_rows(wide, ["id"]).column("id").to_pylist()) == list(range(40000))


def test_retention_properties_follow_the_retention_whatever_was_set_by_hand(tmp_path: Path) -> None:
    """Both properties are set to the retention (whole hours in hours, a fraction in seconds);
    a hand-set other value is overwritten, an equal one written otherwise kept; a retention
    below one second is refused before anything is written."""
    assert properties_to_set({}, 168 * 3600) == RETENTION
    assert properties_to_set({name: "interval 7 days" for name in RETENTION_PROPERTIES}, 168 * 3600) == {}
    assert properties_to_set({"delta.logRetentionDuration": "interval 30 days", "delta.deletedFileRetentionDuration": "interval 1 week"}, 168 * 3600) == {
        "delta.logRetentionDuration": "interval 168 hours"
    }  # fmt: skip
    assert properties_to_set({}, 180) == {name: "interval 180 seconds" for name in RETENTION_PROPERTIES}
    path = str(tmp_path / "t")
    deltalake.write_deltalake(
        path, pa.table({"id": [1]}), configuration={"delta.logRetentionDuration": "interval 30 days"}
    )
    with pytest.raises(ValueError, match="at least one second"):
        maintain_table(path, open_lake(path), retention_hours=0.0001, target_file_bytes=1 << 20)
    assert deltalake.DeltaTable(path).version() == 0
    done = maintain_table(path, open_lake(path), retention_hours=0.05, target_file_bytes=1 << 20)
    assert retention_properties(path) == {name: "interval 180 seconds" for name in RETENTION_PROPERTIES}
    assert done.properties_set == (
        "delta.logRetentionDuration: interval 30 days -> interval 180 seconds",
        "delta.deletedFileRetentionDuration: (unset) -> interval 180 seconds",
    )
