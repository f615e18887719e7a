"""A snapshot SIGKILLed at each of its phases, under writes, recovers on the next run with no manual step.

Each case runs ``tests.fault_child`` (``snapshot_tables``) with ``PGCDC_FAULT_POINT`` set, on either
snapshot writer (delta-rs streaming in pgcdc's process, the embedded engine's default; the engine's
overwrite of staged Parquet, Delta on Spark's, forced on Sail through the capability seam) while a
writer thread keeps changing the tables. It checks what the kill left (the phase really was
reached), then the next snapshot (in this process, same writer) must succeed and, after the next
drain, Delta must equal PostgreSQL value for value, every row in its bucket. What pgcdc did not
create is refused and left as it is (docs/contracts.md, "Snapshot crash points").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import deltalake
import pyarrow as pa
import pytest
import yaml
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.capabilities import engine_capabilities, set_engine_capabilities
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LAYOUT_PROPERTY
from resources.delta.snapshot_writes import STAGING_DIRECTORY, write_snapshot
from resources.delta.state_table import read_state, state_path
from resources.delta.table_log import read_table_log, table_exists, unfinished_create
from resources.errors import ConfigurationError
from resources.incremental import run_incremental
from resources.snapshot import snapshot_tables
from resources.testing.faults import FAULT_POINT_ENV
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.conftest import PgDatabase
from tests.fault_child import SNAPSHOT_WRITER_ENV, use_snapshot_writer
from tests.test_faults import Child
from tests.test_key_range_snapshot import DDL, ROWS, Writer

pytest_plugins = ["tests.spark_fixtures"]

WRITERS = ("delta-rs", "engine")

#: Every phase of a one-snapshot run each writer passes through, in order.
POINTS = {
    "delta-rs": (
        "after_snapshot_slot", "before_snapshot_create", "after_snapshot_create", "during_snapshot_write",
        "after_snapshot_commit", "before_snapshot_state_write",
    ),
    "engine": (
        "after_snapshot_slot", "during_snapshot_write", "after_snapshot_staged", "after_snapshot_commit",
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
    return parse_config({
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": slot,
        # big in range buckets of ``width`` keys (its writer's inserts open new ones); flat is keyless
        "delta": {"root": str(root), "buckets": {"tables": {"public.big": {"width": width}}}},
        # one table at a time: big first, so each kill lands in big's snapshot
        "snapshot": {"parallel_tables": 1, **snapshot},
    })


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
            assert read_state(spark, state_path(config.delta.root, config.slot)) == {}, point
            # Configured otherwise by now: a table the kill left without a snapshot gets the layout
            # configured now (its created table's layout property included), one with a snapshot keeps its own.
            with snapshot_writer(spark, writer):
                snapshot_tables(kill_config(pg, tmp_path / point, f"kill_{number}", width=700), spark)
        assert traffic.transactions > 0
        run_incremental(config, spark)
        assert_exact(pg, config)
        layout = assert_buckets_right(big)
        assert layout is not None and layout.size == (1000 if LEFT[writer, point] == "snapshot" else 700), point
        rows = read_state(spark, state_path(config.delta.root, config.slot))
        assert {table: row.log.version for table, row in rows.items()} == {
            "public.big": read_table_log(big).version, "public.flat": read_table_log(flat).version,
        }, point

        # The same phase again, now that the tables have their snapshots (a re-snapshot): the table is
        # as it was, or has its new snapshot, and a drain keeps it exact meanwhile.
        if point not in ("before_snapshot_create", "after_snapshot_create"):  # only a new table is created
            with Writer(pg, seed=pg.major * 100 + number + 50):
                killed_child(config, tmp_path / f"{point}-again.yaml", point, writer)
                assert state_left(big) == "snapshot", point
                run_incremental(config, spark)
                with snapshot_writer(spark, writer):
                    snapshot_tables(config, spark)
            run_incremental(config, spark)
            assert_exact(pg, config)
        pg.execute(f"SELECT pg_drop_replication_slot('kill_{number}')")
