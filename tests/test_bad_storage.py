"""A lake or spill directory that cannot be written, and a corrupt Delta log, on real volumes: tmpfs mounts
of a megabyte the test makes and removes, a lake pgcdc runs as an unprivileged OS user against, real
corrupt bytes in a real ``_delta_log``; real PostgreSQL 15 and 18 and the embedded Sail engine.

Every case ends the run with one line naming the cause and the fix (a
:class:`~resources.errors.StorageFault` or :class:`~resources.errors.DeltaLogError`), confirms nothing to
the slot past what Delta holds, leaves no table a later run cannot take over, and after the fix the
next run is exact. None of these is one table's own fault (docs/guarantees.md): the whole run fails.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.delta.table_log import read_table_log
from resources.engines.capabilities import engine_capabilities, EngineCapabilities, set_engine_capabilities
from resources.errors import DeltaLogError, StorageFault
from resources.names import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.bad_storage import (
    assert_exact,
    assert_nothing_confirmed_past_delta,
    BLOB_DDL,
    BLOB_ROWS,
    child_line,
    confirmed,
    DDL,
    fill,
    grow,
    NOBODY,
    one_line,
    PENDING,
    run_as_user,
    settings,
    small_volume,
)
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

ALL = ("orders", "notes", "tally", "blob")


def pipeline(pg: PgDatabase, root: Path, blob_rows: int = 0) -> PgcdcConfig:
    pg.execute(DDL + BLOB_DDL)
    if blob_rows:
        pg.execute(BLOB_ROWS, (1, blob_rows))
    pg.execute("CREATE PUBLICATION pub FOR TABLE orders, notes, tally, blob")
    return parse_config(settings(pg.dsn, root))


@pytest.fixture(params=["delta-rs", "engine"])
def snapshot_writer(request: pytest.FixtureRequest, spark: SparkSession) -> Iterator[str]:
    """Each snapshot writer in turn: delta-rs in pgcdc's process, or the engine's write of files staged
    under the table (``_pgcdc_staging``); the session's own choice is restored after."""
    detected = engine_capabilities(spark)
    set_engine_capabilities(spark, EngineCapabilities(detected.delta_commands, request.param == "delta-rs"))
    try:
        yield request.param
    finally:
        set_engine_capabilities(spark, detected)


def test_full_lake_mid_snapshot_fails_in_one_line_and_the_next_snapshot_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, snapshot_writer: str
) -> None:
    """3 MB of rows for a 1 MiB volume: the write fails part-way (delta-rs's files, or the staged files
    under the table); the small tables copy, ``blob`` is left with no snapshot, and after the volume
    grows the next snapshot takes it over and the drains are exact."""
    with small_volume(tmp_path / "lake") as lake:
        config = pipeline(pg, lake, blob_rows=3000)
        with pytest.raises(StorageFault) as failure:
            snapshot_tables(config, lake_destination(spark, config))
        # blob, and a small table whose create the full volume reached first when the copies ran side by side
        # (left with no commit: not a table yet); the line names the first table that found the volume full
        uncopied = [
            TableName("public", name)
            for name in ALL
            if read_table_log(config.table_path("public", name)).snapshot_lsn is None
        ]
        assert TableName("public", "blob") in uncopied  # no partial snapshot
        named = [table for table in uncopied if str(failure.value).startswith(f"{table}: ")]
        assert named, (str(failure.value), uncopied)
        one_line(failure.value, f"{named[0]}: no space left for the Delta table", "free space", "delta.root")
        assert not list(lake.rglob("_pgcdc_staging/*/*")), "staged files left behind"
        grow(lake)
        # the snapshot job again, for every table without a snapshot
        snapshot_tables(config, lake_destination(spark, config), uncopied)
        pg.execute(PENDING + "UPDATE blob SET body = 'short' WHERE id <= 10")
        run_incremental(config, lake_destination(spark, config))
        assert_exact(pg, config, ALL)


def test_full_lake_mid_drain_confirms_nothing_and_the_next_drain_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    with small_volume(tmp_path / "lake") as lake:
        config = pipeline(pg, lake, blob_rows=100)
        snapshot_tables(config, lake_destination(spark, config))
        pg.execute(PENDING)
        pg.execute(BLOB_ROWS, (101, 2000))  # more than the volume has left
        before = confirmed(pg)
        filler = fill(lake)
        with pytest.raises(StorageFault) as failure:
            run_incremental(config, lake_destination(spark, config))
        one_line(failure.value, f"no space left for the lake at {lake}", "delta.root", "run the drain again")
        assert_nothing_confirmed_past_delta(pg, config, before)
        filler.unlink()
        grow(lake)
        run_incremental(config, lake_destination(spark, config))
        assert_exact(pg, config, ALL)


def test_full_spill_directory_mid_drain_names_tmpdir_and_confirms_nothing(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A transaction larger than logical_decoding_work_mem is streamed, and its blocks spill to the
    drain's spill directory (``TMPDIR``), here a 64 KiB volume."""
    config = pipeline(pg, tmp_path / "lake")
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute(PENDING)
    pg.execute("INSERT INTO notes SELECT repeat('s', 200) FROM generate_series(1, 3000)")
    before = confirmed(pg)
    with small_volume(tmp_path / "spill", "64k") as spill:
        with pytest.raises(StorageFault) as failure:
            run_incremental(config, lake_destination(spark, config), spill_dir=str(spill))
        one_line(failure.value, f"no space left for the drain's spill files in {spill}", "TMPDIR")
        assert_nothing_confirmed_past_delta(pg, config, before)
        assert not list(spill.iterdir()), "spill files left behind"
        grow(spill, "16m")
        run_incremental(config, lake_destination(spark, config), spill_dir=str(spill))
    assert_exact(pg, config)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="pgcdc-as-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow  # pgcdc in child processes, each with its engine
@NEWEST_POSTGRES_ONLY  # file permissions do not depend on PostgreSQL's version
def test_lake_the_os_user_cannot_write_fails_in_one_line_naming_the_user(
    pg: PgDatabase, shared_dir: Path, spark: SparkSession
) -> None:
    """pgcdc runs as ``nobody`` (a real unprivileged user, its engine too) against a lake owned by root:
    the snapshot and, once the lake is the user's and one table's directory is root's again (a restore
    made as root), the drain fail in one line naming the user; ``chown`` is the fix."""
    lake = shared_dir / "lake"
    lake.mkdir()
    config = pipeline(pg, lake)
    line = child_line(run_as_user(config, shared_dir, "snapshot"))
    one_line(line, "StorageFault", f"cannot write the Delta table {lake}/public/", "as user nobody (uid 65534)")
    assert not any(lake.iterdir())
    shutil.chown(lake, NOBODY, NOBODY)
    assert run_as_user(config, shared_dir, "snapshot").returncode == 0
    pg.execute(PENDING)
    before = confirmed(pg)
    subprocess.run(["chown", "-R", "root:root", str(lake / "public" / "orders")], check=True)
    line = child_line(run_as_user(config, shared_dir, "1000"))
    one_line(line, "StorageFault", "cannot write", "as user nobody (uid 65534)", "delta.root writable")
    assert_nothing_confirmed_past_delta(pg, config, before)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(lake)], check=True)
    done = run_as_user(config, shared_dir, "1000")
    assert done.returncode == 0, done.stderr
    assert_exact(pg, config)


@pytest.mark.parametrize("damage", ["truncated", "other bytes"])
def test_corrupt_commit_file_fails_the_drain_naming_the_file(
    damage: str, pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The newest commit of ``orders`` cut in half, or overwritten: the drain that meets a change of
    ``orders`` fails naming the file, every table's changes wait; moving the table aside and
    re-snapshotting it is the fix, and the next drain is exact."""
    config = pipeline(pg, tmp_path / "lake")
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute(PENDING)
    run_incremental(config, lake_destination(spark, config))
    pg.execute(PENDING.replace("51", "52"))
    orders = Path(config.table_path("public", "orders"))
    newest = sorted((orders / "_delta_log").glob("*.json"))[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00\xff{not json at all\n")
    before = confirmed(pg)
    with pytest.raises(DeltaLogError) as failure:
        run_incremental(config, lake_destination(spark, config))
    one_line(failure.value, f"the Delta log of {orders} is corrupt: {newest}", "restore that file", "re-snapshot")
    assert_nothing_confirmed_past_delta(pg, config, before)
    orders.rename(tmp_path / "orders.corrupt")
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "orders")])
    run_incremental(config, lake_destination(spark, config))
    assert_exact(pg, config)
