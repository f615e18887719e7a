"""A snapshot SIGKILLed at each of its phases, under writes, recovers on the next run with no manual step.

Each kill runs ``tests.support.fault_child`` (``snapshot_tables``) with ``PGCDC_FAULT_POINT`` set, on either
snapshot writer (delta-rs streaming in pgcdc's process, the embedded engine's default; the engine's
overwrite of staged Parquet, Delta on Spark's, forced on Sail through the capability seam) while a
writer thread keeps changing the tables. It checks what the kill left (the phase really was
reached), then the next snapshot must succeed and, after the next drain, Delta must equal
PostgreSQL value for value, every row in its bucket: for a new table, a re-snapshot and a walk in
key ranges, and through Dagster's CLI. What pgcdc did not create is refused and left as it is
(docs/contracts.md, "Snapshot crash points"). Delta on Spark itself: tests/test_engines.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import deltalake
import pyarrow as pa
import pytest
import yaml
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter
from pyspark.sql import SparkSession

from resources.config import CONFIG_ENV_VAR, load_config, parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.lake_storage import open_lake
from resources.delta.layout import BUCKET_COLUMN, TableLayout
from resources.delta.markers import LAYOUT_PROPERTY, layout_property, snapshot_marker
from resources.delta.snapshot_writes import write_snapshot
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.delta.staging import STAGING_DIRECTORY
from resources.delta.state_table import read_state, state_path
from resources.delta.table_log import read_table_log, table_exists, unfinished_create
from resources.engines.capabilities import engine_capabilities, set_engine_capabilities
from resources.errors import ConfigurationError
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

pytest.register_assert_rewrite(
    "tests.support.s3_fixtures"
)  # imported below (through the Dagster tests) before pytest loads it as a plugin
from tests.support.dagster_runs import create_shop, DAGSTER, delta_rows, pg_notes, pg_orders, REPO, write_config
from tests.support.fault_child import SNAPSHOT_WRITER_ENV, use_snapshot_writer
from tests.support.fault_runs import Child
from tests.support.key_range_writer import DDL, ROWS, Writer

if TYPE_CHECKING:
    from tests.support.s3_fixtures import S3Server

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.s3_fixtures"]
pytestmark = pytest.mark.slow  # snapshots SIGKILLed at each phase, in child processes; tiers: docs/testing.md

WRITERS = ("delta-rs", "engine")

#: Every phase of a one-snapshot run each writer passes through, in order.
POINTS = {
    "delta-rs": (
        "after_snapshot_slot",
        "before_snapshot_create",
        "after_snapshot_create",
        "during_snapshot_write",
        "after_snapshot_commit",
        "before_snapshot_state_write",
    ),
    "engine": (
        "after_snapshot_slot",
        "during_snapshot_write",
        "after_snapshot_staged",
        "after_snapshot_commit",
        "before_snapshot_state_write",
    ),
}


@contextmanager
def snapshot_writer(spark: SparkSession, writer: str) -> Iterator[None]:
    """Snapshots in this process written by ``writer`` meanwhile."""
    detected = engine_capabilities(spark)
    use_snapshot_writer(spark, writer)
    try:
        yield
    finally:
        set_engine_capabilities(spark, detected)


def kill_config(pg: PgDatabase, root: Path, slot: str, width: int = 1000, **snapshot: object) -> PgcdcConfig:
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": slot,
            # big in range buckets of ``width`` keys (its writer's inserts open new ones); flat is keyless
            "delta": {"root": str(root), "buckets": {"tables": {"public.big": {"width": width}}}},
            # one table at a time: big first, so each kill lands in big's snapshot
            "snapshot": {"parallel_tables": 1, **snapshot},
        }
    )


def killed_child(config: PgcdcConfig, config_file: Path, point: str, writer: str, what: str = "snapshot") -> None:
    """Run ``what`` in a child process that SIGKILLs itself at ``point``."""
    config_file.write_text(yaml.safe_dump(config.model_dump()), encoding="utf-8")
    child = Child(config_file, what, env={FAULT_POINT_ENV: point, SNAPSHOT_WRITER_ENV: writer})
    assert child.wait() == -9, (point, child.output())


def state_left(path: str) -> str:
    """What a killed snapshot left at the table ``path``, in words the assertions name."""
    if table_exists(path):
        if unfinished_create(path):
            return "unfinished create"
        return "snapshot" if read_table_log(path).snapshot_lsn is not None else "table without snapshot"
    directory = Path(path)
    if (directory / STAGING_DIRECTORY).is_dir() and any((directory / STAGING_DIRECTORY).rglob("*.parquet")):
        return "staged files"
    return "directory" if directory.is_dir() else "nothing"


#: What each kill leaves at public.big (public.flat: a snapshot only once big's state write is next).
LEFT = {
    ("delta-rs", "after_snapshot_slot"): "nothing",
    ("delta-rs", "before_snapshot_create"): "directory",
    ("delta-rs", "after_snapshot_create"): "unfinished create",
    ("delta-rs", "during_snapshot_write"): "unfinished create",
    ("delta-rs", "after_snapshot_commit"): "snapshot",
    ("delta-rs", "before_snapshot_state_write"): "snapshot",
    ("engine", "after_snapshot_slot"): "nothing",
    ("engine", "during_snapshot_write"): "directory",  # staging begun (its first file may not be written yet)
    ("engine", "after_snapshot_staged"): "staged files",
    ("engine", "after_snapshot_commit"): "snapshot",
    ("engine", "before_snapshot_state_write"): "snapshot",
}


def assert_exact(pg: PgDatabase, config: PgcdcConfig) -> None:
    big, flat = (config.table_path("public", name) for name in ("big", "flat"))
    assert assert_delta_equals_postgres(pg.dsn, "public.big", big, key=("id",)) > ROWS // 2
    assert assert_buckets_right(big) is not None
    assert_delta_equals_postgres(pg.dsn, "public.flat", flat)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_snapshot_killed_at_each_phase_recovers_on_the_next_run(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path, writer: str
) -> None:
    """Per phase, on a lake and slot of its own: a new snapshot killed there, then a re-snapshot killed
    there once the table has its snapshot; each followed by a snapshot that succeeds and a drain
    after which Delta equals PostgreSQL."""
    pg.execute(DDL)
    for number, point in enumerate(POINTS[writer]):
        config = kill_config(pg, tmp_path / point, f"kill_{number}")
        big, flat = config.table_path("public", "big"), config.table_path("public", "flat")
        with Writer(pg, seed=pg.major * 100 + number) as traffic:
            killed_child(config, tmp_path / f"{point}.yaml", point, writer)
            assert state_left(big) == LEFT[writer, point], point
            assert state_left(flat) == ("snapshot" if point == "before_snapshot_state_write" else "nothing"), point
            assert read_state(state_path(config.delta.root, config.slot)) == {}, point
            # Configured otherwise by now: a table the kill left without a snapshot gets the layout
            # configured now (its created table's layout property included), one with a snapshot keeps its own.
            with snapshot_writer(spark, writer):
                snapshot_tables(
                    kill_config(pg, tmp_path / point, f"kill_{number}", width=700), SparkDeltaDestination(spark, None)
                )
        assert traffic.transactions > 0
        run_incremental(config, lake_destination(spark, config))
        assert_exact(pg, config)
        layout = assert_buckets_right(big)
        assert layout is not None and layout.size == (1000 if LEFT[writer, point] == "snapshot" else 700), point
        rows = read_state(state_path(config.delta.root, config.slot))
        assert {table: row.log.version for table, row in rows.items()} == {
            "public.big": read_table_log(big).version,
            "public.flat": read_table_log(flat).version,
        }, point

        # The same phase again, now that the tables have their snapshots (a re-snapshot): the table keeps
        # a snapshot (the old one, or the new one), a drain meanwhile goes on, and the next snapshot succeeds.
        if point not in ("before_snapshot_create", "after_snapshot_create"):  # only a new table is created
            with Writer(pg, seed=pg.major * 100 + number + 50):
                killed_child(config, tmp_path / f"{point}-again.yaml", point, writer)
                assert state_left(big) == "snapshot", point
                run_incremental(config, lake_destination(spark, config))
                with snapshot_writer(spark, writer):
                    snapshot_tables(config, lake_destination(spark, config))
            run_incremental(config, lake_destination(spark, config))
            assert_exact(pg, config)
        pg.execute(f"SELECT pg_drop_replication_slot('kill_{number}')")


def ranges_left(path: str) -> str:
    """:func:`state_left`, with the key ranges done once the walk committed one."""
    chunks = read_table_log(path).chunks if table_exists(path) else None
    return state_left(path) if chunks is None else f"{chunks.done} range{'s' * (chunks.done != 1)} done"


#: One walk of a new table in key ranges, killed again and again, each run resuming (or starting
#: over, while no range is committed) where the previous one died: (writer, point, what is left).
RANGE_KILLS = {
    "delta-rs": (  # the first range is written by delta-rs (a new table), the others by the engine
        ("delta-rs", "after_range_slot", "nothing"),
        ("delta-rs", "before_snapshot_create", "directory"),
        ("delta-rs", "after_snapshot_create", "unfinished create"),
        ("delta-rs", "during_snapshot_write", "unfinished create"),
        ("delta-rs", "after_snapshot_commit", "1 range done"),
        ("delta-rs", "after_range_commit", "2 ranges done"),
        ("delta-rs", "during_snapshot_write", "2 ranges done"),
        ("delta-rs", "after_snapshot_staged", "2 ranges done"),
        ("delta-rs", "before_merge", "3 ranges done"),
    ),
    "engine": (  # begun by delta-rs, whose created table the engine's writer takes over
        ("delta-rs", "after_snapshot_create", "unfinished create"),
        ("engine", "after_range_slot", "unfinished create"),
        ("engine", "during_snapshot_write", "directory"),  # the created table taken away, staging begun
        ("engine", "after_snapshot_staged", "staged files"),
        ("engine", "after_snapshot_commit", "1 range done"),
        ("engine", "after_range_commit", "2 ranges done"),
    ),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_snapshot_in_key_ranges_killed_at_each_phase_resumes(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path, writer: str
) -> None:
    """A new table's snapshot in key ranges under writes, SIGKILLed at every phase of its first
    ranges in turn: each run goes on from what the previous one left, the last one completes, and
    after the next drain Delta equals PostgreSQL."""
    pg.execute(DDL)
    (heap,) = pg.execute("SELECT pg_catalog.pg_relation_size('big')")[0]
    config = kill_config(pg, tmp_path / "lake", "pgcdc_slot", chunked_above_mb=0, key_chunk_mb=heap / 2**20 / 4.5)
    big = config.table_path("public", "big")
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "flat")])
    left = []
    with Writer(pg, seed=pg.major + (writer == "engine")) as traffic:
        for number, (child_writer, point, _) in enumerate(RANGE_KILLS[writer]):
            killed_child(config, tmp_path / f"{number}.yaml", point, child_writer, "snapshot:public.big")
            left.append(ranges_left(big))
            if number == 0:  # a drain meanwhile: the table counts as not snapshotted, skipped and left as it is
                run_incremental(config, lake_destination(spark, config))
                assert ranges_left(big) == left[0]
        with snapshot_writer(spark, writer):
            (result,) = snapshot_tables(config, lake_destination(spark, config), [TableName("public", "big")])
    assert left == [expected for _, _, expected in RANGE_KILLS[writer]]
    assert traffic.transactions > 0 and result.key_ranges and result.chunks >= 4
    run_incremental(config, lake_destination(spark, config))
    assert_exact(pg, config)


def files_under(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


def foreign_tables(path: Path) -> Iterator[str]:
    """Tables at ``path`` that pgcdc did not create, each partitioned by the bucket column and without
    any record of a layout; yields what each one is, leaving it in place meanwhile."""
    bucketed = pa.table({"id": pa.array([1, 2], pa.int32()), BUCKET_COLUMN: pa.array([0, 0], pa.int64())})
    deltalake.write_deltalake(str(path), bucketed, partition_by=[BUCKET_COLUMN])
    yield "another writer's table with rows"
    shutil.rmtree(path / "_delta_log")
    deltalake.DeltaTable.create(str(path), bucketed.schema, partition_by=[BUCKET_COLUMN])
    yield "another writer's empty table"
    shutil.rmtree(path / "_delta_log")
    # pgcdc's layout property, but a commit after the create: something was committed to it
    deltalake.DeltaTable.create(
        str(path),
        bucketed.schema,
        partition_by=[BUCKET_COLUMN],
        configuration={LAYOUT_PROPERTY: "none"},
        raise_if_key_not_exists=False,
    )
    deltalake.write_deltalake(str(path), bucketed, mode="append")
    yield "a created table with a commit after its creation"


def test_a_table_pgcdc_did_not_create_is_refused_and_left_as_it_is(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    """A bucketed Delta table without a record of its layout that is not pgcdc's unfinished create:
    the snapshot still refuses it (one line naming the fix) and deletes nothing of it, on either writer."""
    pg.execute(DDL)
    config = kill_config(pg, tmp_path / "lake", "pgcdc_slot")
    path = Path(config.table_path("public", "big"))
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("not pgcdc's")
    for what in foreign_tables(path):
        assert not unfinished_create(str(path)), what
        before = files_under(path)
        for writer in WRITERS:
            with snapshot_writer(spark, writer), pytest.raises(ConfigurationError) as refused:
                snapshot_tables(config, lake_destination(spark, config), [TableName("public", "big")])
            assert "no record of its layout is left" in str(refused.value), what
            assert "remove the table's Delta directory" in str(refused.value), what
            assert files_under(path) == before, (what, writer)


def test_a_failed_write_takes_away_only_what_it_created(spark: SparkSession, tmp_path: Path) -> None:
    """A delta-rs snapshot write that fails after creating the table: a directory it made goes whole;
    in a directory that was there before, only the created table's log goes, never other files."""
    schema = pa.schema([("id", pa.int64())])

    def failing() -> Iterator[pa.RecordBatch]:
        yield pa.record_batch([pa.array([1, 2], pa.int64())], schema=schema)
        raise RuntimeError("the source failed")

    with snapshot_writer(spark, "delta-rs"):
        made = tmp_path / "lake" / "made"
        with pytest.raises(RuntimeError, match="the source failed"):
            write_snapshot(spark, failing(), schema, str(made), json.dumps({"pgcdc": {"kind": "snapshot"}}))
        assert not made.exists() and made.parent.is_dir()

        there = tmp_path / "there"
        there.mkdir()
        (there / "notes.txt").write_text("not pgcdc's")
        with pytest.raises(RuntimeError, match="the source failed"):
            write_snapshot(spark, failing(), schema, str(there), json.dumps({"pgcdc": {"kind": "snapshot"}}))
        assert (there / "notes.txt").read_text() == "not pgcdc's"
        assert not table_exists(str(there)) and not (there / "_delta_log").exists()


def run_dagster(
    home: Path, config_file: Path, *args: str, fault: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``dagster job execute`` in a subprocess on the instance at ``home``; ``fault``: the point where the
    process running the snapshot step (the job's in-process executor: the run's process) SIGKILLs itself."""
    env = {key: value for key, value in os.environ.items() if key != FAULT_POINT_ENV}
    env.update(
        {CONFIG_ENV_VAR: str(config_file), "DAGSTER_HOME": str(home), **({FAULT_POINT_ENV: fault} if fault else {})}
    )
    try:
        return subprocess.run(
            [DAGSTER, "job", "execute", "-m", "pgcdc_assets.definitions", *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as stuck:
        raise AssertionError(f"{args} {fault}: {stuck.stdout!s}\n{stuck.stderr!s}"[-6000:]) from None


def end_killed_runs(home: Path) -> int:
    """What Dagster does for a run whose process was killed outright, which stays STARTED and keeps its
    claim on the slot's pool: mark it failed (run monitoring, where the run launcher checks its
    workers; else Terminate, then force termination, in the UI) and free its pool slots (the daemon's
    ``run_monitoring.free_slots_after_run_end_seconds``, or the UI). Returns how many runs it ended."""
    with DagsterInstance.from_config(str(home)) as instance:
        records = instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.STARTED]))
        for record in records:
            instance.report_run_failed(record.dagster_run, "its run process was killed")
            instance.event_log_storage.free_concurrency_slots_for_run(record.dagster_run.run_id)
        return len(records)


def test_a_killed_dagster_snapshot_run_is_followed_by_a_run_that_succeeds(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    """``pgcdc_snapshot`` through Dagster's CLI, its process SIGKILLed between a table's creation and its
    snapshot commit, the dead run ended as Dagster ends it (:func:`end_killed_runs`), then a new run of
    the job (the slot's pool limited to 1, as deployed): it succeeds, as does a ``pgcdc_resnapshot`` run
    after one killed mid-write, and after a drain Delta equals PostgreSQL."""
    create_shop(pg)
    config_file = write_config(tmp_path, pg)
    config = load_config(str(config_file))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("concurrency:\n  pools:\n    default_limit: 1\n", encoding="utf-8")
    lake = tmp_path / "lake"

    killed = run_dagster(home, config_file, "-j", "pgcdc_snapshot", fault="after_snapshot_create")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert end_killed_runs(home) == 1
    assert any(unfinished_create(str(lake / "public" / table)) for table in ("orders", "notes"))
    pg.execute("UPDATE orders SET customer = 'during' WHERE id % 50 = 0")
    pg.execute("INSERT INTO notes VALUES ('during')")
    done = run_dagster(home, config_file, "-j", "pgcdc_snapshot")
    assert done.returncode == 0 and "RUN_SUCCESS" in done.stdout + done.stderr, done.stderr[-3000:]

    run_config = tmp_path / "resnapshot.yaml"
    run_config.write_text(yaml.safe_dump({"ops": {"snapshot_tables": {"config": {"tables": ["public.orders"]}}}}))
    pg.execute("DELETE FROM orders WHERE id = 7")
    killed = run_dagster(
        home, config_file, "-j", "pgcdc_resnapshot", "-c", str(run_config), fault="during_snapshot_write"
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert end_killed_runs(home) == 1
    pg.execute("INSERT INTO orders VALUES (900, 'new', 1.00, NULL, NULL)")
    done = run_dagster(home, config_file, "-j", "pgcdc_resnapshot", "-c", str(run_config))
    assert done.returncode == 0 and "RUN_SUCCESS" in done.stdout + done.stderr, done.stderr[-3000:]
    run_incremental(config, lake_destination(spark, config))
    assert delta_rows(lake, "orders") == pg_orders(pg)
    assert delta_rows(lake, "notes") == pg_notes(pg)


def test_an_unfinished_create_on_s3_is_created_again(s3_server: S3Server, s3_root: str, s3_spark: SparkSession) -> None:
    """On an object store too: the empty table delta-rs's writer creates before the snapshot commit (made
    here as that writer makes it, with an older layout in its property) is recognised, taken away and
    created again with the snapshot's layout; another writer's table next to it is left alone."""
    lake = open_lake(s3_root, s3_server.lake(s3_root).settings)
    options = lake.object_store_options()
    schema = pa.schema([("id", pa.int64())])
    path, other = f"{s3_root}/public/t", f"{s3_root}/public/other"
    deltalake.DeltaTable.create(
        path, schema.append(pa.field(BUCKET_COLUMN, pa.int64())), partition_by=[BUCKET_COLUMN],
        configuration={LAYOUT_PROPERTY: layout_property(TableLayout("range", ("id",), 1000))},
        storage_options=options, raise_if_key_not_exists=False,
    )  # fmt: skip
    deltalake.DeltaTable.create(other, schema, storage_options=options)
    assert unfinished_create(path, lake) and not unfinished_create(other, lake)
    layout = TableLayout("range", ("id",), 100)
    batches = (pa.record_batch([pa.array(range(i * 100, i * 100 + 100), pa.int64())], schema=schema) for i in range(4))
    marker = snapshot_marker(LSN(1), "s", "public.t", layout)
    with snapshot_writer(s3_spark, "delta-rs"):
        assert (
            write_snapshot(s3_spark, batches, schema, path, marker, layout=layout, lake=lake) == 1
        )  # a new create, then the commit
    table = deltalake.DeltaTable(path, storage_options=options)
    assert table.metadata().configuration[LAYOUT_PROPERTY] == layout_property(layout)
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == list(range(400))
    assert read_table_log(path, None, lake).layout == layout and not unfinished_create(path, lake)
    assert deltalake.DeltaTable(other, storage_options=options).version() == 0


@pytest.mark.parametrize("writer", WRITERS)
def test_a_log_directory_without_commits_is_no_table(spark: SparkSession, tmp_path: Path, writer: str) -> None:
    """What a kill in the middle of taking an unfinished create away leaves (its commit 0 deleted, the
    rest of ``_delta_log`` not yet): no table, and a snapshot writes one there, on either writer."""
    schema = pa.schema([("id", pa.int64())])
    path = tmp_path / "t"
    (path / "_delta_log").mkdir(parents=True)
    (path / "_delta_log" / "_commit_0123.json.tmp").write_text("{}")
    assert not table_exists(str(path)) and not unfinished_create(str(path))
    layout = TableLayout("range", ("id",), 10)
    marker = snapshot_marker(LSN(1), "s", "public.t", layout)
    with snapshot_writer(spark, writer):
        write_snapshot(
            spark, pa.table({"id": pa.array(range(30), pa.int64())}), schema, str(path), marker, layout=layout
        )
    assert read_table_log(str(path)).layout == layout
    assert sorted(deltalake.DeltaTable(str(path)).to_pyarrow_table().column("id").to_pylist()) == list(range(30))
