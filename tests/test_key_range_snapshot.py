"""Snapshots in primary-key ranges against real PostgreSQL 15 and 18 and the embedded Sail engine.

One scenario per server walks what docs/contracts.md argues ("Chunked snapshots in primary-key
ranges"): a table above ``snapshot.chunked_above_mb`` is copied one key range per short
transaction while a second connection keeps inserting, updating, deleting and moving keys across
ranges; between two ranges a key-moving update carries a TOASTed (> 2 kB, stored out of line) body
unchanged from a range not copied yet into one already copied (the hole the drain answers by
copying that range again); a keyless table of the same size keeps the ctid mode. Then the same
table is snapshotted again, in place (every range keeps its rows and is drained as before until
copied again), by child processes SIGKILLed at three points of the walk (after a range's temporary
slot, after a range's Delta commit, inside the drain of a step), each run resuming where the
previous one died, under the same traffic. After each part, a drain, then Delta
equals PostgreSQL value for value and with multiplicity.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.delta.table_log import read_table_log
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables, SnapshotProgress
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.fault_runs import Child
from tests.support.key_range_writer import DDL, ROWS, Writer
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


@pytest.mark.slow  # children SIGKILLed at three points
def test_a_snapshot_in_key_ranges_under_writes_crashes_and_a_toast_move_is_exact(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pg.execute(DDL)
    config = parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": "pgcdc_slot",
            # big in range buckets of 1,000 keys: every range commit and drain writes a bucketed table
            "delta": {"root": str(tmp_path / "lake"), "buckets": {"tables": {"public.big": {"width": 1000}}}},
            "snapshot": {"chunked_above_mb": 0.05, "key_chunk_mb": 0.04},
        }
    )
    path = str(tmp_path / "lake" / "public" / "big")
    moved: list[str] = []

    def move_toast_into_a_copied_range(progress: SnapshotProgress) -> None:
        """After the first range: move a TOASTed row of the last range (not copied yet) into the
        first one (copied), its body unchanged: the drain must not write it from the stream."""
        if str(progress.table) == "public.big" and progress.chunks_done == 1 and not moved:
            pg.execute("UPDATE big SET id = -7 WHERE id = %s", (ROWS,))  # ROWS % 50 == 0: a TOASTed body
            moved.append("done")

    with caplog.at_level(logging.INFO), Writer(pg, seed=pg.major) as writer:
        results = {
            str(r.table): r
            for r in snapshot_tables(
                config, lake_destination(spark, config), on_progress=move_toast_into_a_copied_range
            )
        }
    assert writer.transactions > 20 and moved
    assert results["public.big"].key_ranges and results["public.big"].chunks >= 4
    assert not results["public.flat"].key_ranges
    lines = caplog.text
    assert "snapshot public.big: " in lines and "ranges of primary key id, one short transaction each" in lines
    assert "snapshot public.flat: " in lines and "key ranges need a one-column primary key" in lines
    assert "public.big: copying key range 1 of" in lines  # the TOAST move was answered by a new copy of range 1
    run_incremental(config, lake_destination(spark, config))
    root = Path(config.delta.root)
    assert assert_delta_equals_postgres(pg.dsn, "public.big", path, key=("id",)) > ROWS // 2
    assert pg.execute("SELECT length(body) FROM big WHERE id = -7") == [(3200,)]
    assert assert_buckets_right(path) is not None
    assert_delta_equals_postgres(pg.dsn, "public.flat", str(root / "public" / "flat"))

    # The same table again (a re-snapshot in place), by processes killed part-way, each resuming where
    # the previous one died.
    config_file = tmp_path / "pgcdc.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()), encoding="utf-8")
    with Writer(pg, seed=pg.major + 1):
        progress = []
        for point in ("after_range_commit", "after_range_slot", "before_merge"):
            child = Child(config_file, "snapshot:public.big", env={FAULT_POINT_ENV: point})
            assert child.wait() == -9, (point, child.output())
            log = read_table_log(path)
            # a re-snapshot in place: part-way, yet every range has a point and Delta the whole table
            assert log.chunks is not None and log.chunks.next_range() is not None and log.snapshot_lsn is not None, (
                point
            )
            assert delta_rs_rows(path, ["id"]).num_rows > ROWS // 2, point
            progress.append(log.chunks.done)
        child = Child(config_file, "snapshot:public.big")
        assert child.wait() == 0, child.output()
    # killed after range 1's commit; before range 2's commit; in the drain after range 2's commit
    assert progress == [1, 1, 2], progress
    final = read_table_log(path)
    assert final.chunks is not None and final.chunks.next_range() is None and final.snapshot_lsn is not None
    run_incremental(config, lake_destination(spark, config))
    assert assert_delta_equals_postgres(pg.dsn, "public.big", path, key=("id",)) > ROWS // 2
    assert assert_buckets_right(path) is not None
    assert_delta_equals_postgres(pg.dsn, "public.flat", str(root / "public" / "flat"))
