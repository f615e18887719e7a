"""The slot guard (resources/runs/slot_guard.py) where an engine matters: a drain killed between the
record's write and the confirm (real Delta tables replay the chunk), and the Dagster drain job
refusing a moved slot with its one line; real PostgreSQL 15 and 18, embedded Sail."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from dagster import instance_for_test
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import parse_config
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.spark_destination import lake_destination
from resources.runs.slot_guard import SlotGuard, SlotRecord
from resources.runs.snapshot import snapshot_tables
from tests.support.dagster_runs import (
    create_shop,
    delta_rows,
    pg_notes,
    pg_orders,
    run_job,
    slot_position,
    write_config as write_dagster_config,
)
from tests.support.fault_runs import (
    backlog,
    Child,
    confirmed,
    FAULT_DDL,
    rerun_converges,
    SLOT,
    slot_active_pid,
    write_config,
)
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # a drain killed in a child process, Dagster runs; tiers: docs/testing.md

DDL = FAULT_DDL


def test_a_kill_between_the_record_and_the_confirm_replays_exactly_and_is_not_refused(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    config = parse_config(
        {"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")}}
    )
    snapshot_tables(config, lake_destination(spark, config), None)
    guard = SlotGuard(config.delta.root, SLOT, None)
    start = confirmed(pg)
    assert guard.read() == SlotRecord(start)  # recorded when the snapshot created the slot
    backlog(pg, transactions=60)

    child = Child(write_config(config, tmp_path), env={FAULT_POINT_ENV: "after_slot_record"})
    try:
        assert child.wait() == -signal.SIGKILL, child.output()
    finally:
        child.kill()
    deadline = time.monotonic() + 30
    while slot_active_pid(pg) is not None:  # the walsender notices the killed client
        assert time.monotonic() < deadline, "the walsender still holds the slot"
        time.sleep(0.05)
    record = guard.read()
    assert record is not None and record.gap is None
    assert confirmed(pg) == start < record.allowed  # recorded, never confirmed: the slot is behind the record

    result = rerun_converges(pg, config, spark)  # replays the chunk, exactly; the slot behind the record is fine
    assert result.start_lsn == start
    assert guard.read() == SlotRecord(result.confirmed_flush_lsn)


def test_the_drain_job_fails_with_the_one_line_until_every_table_is_re_snapshotted(
    pg: PgDatabase, tmp_path: Path
) -> None:
    create_shop(pg)
    defs = build_definitions(write_dagster_config(tmp_path, pg))
    lake = tmp_path / "lake"
    with instance_for_test() as instance:
        run_job(defs, instance, "pgcdc_snapshot")
        pg.execute("INSERT INTO notes VALUES ('drained')")
        run_job(defs, instance, "pgcdc_incremental")
        recorded = slot_position(pg)
        pg.execute("INSERT INTO notes VALUES ('skipped'); UPDATE orders SET amount = 0 WHERE id = 1")
        pg.execute("SELECT pg_replication_slot_advance('pgcdc_slot', pg_current_wal_flush_lsn())")
        moved = slot_position(pg)
        before = (delta_rows(lake, "orders"), delta_rows(lake, "notes"))

        result = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance, raise_on_error=False)
        assert not result.success
        kinds = [event.event_type_value for event in result.all_events]
        assert "STEP_UP_FOR_RETRY" not in kinds and "ASSET_MATERIALIZATION" not in kinds
        (failure,) = [event for event in result.all_events if event.event_type_value == "STEP_FAILURE"]
        assert failure.step_failure_data.error.message.strip().endswith(
            f'replication slot "pgcdc_slot" moved from {recorded}, the position pgcdc recorded in its lake, to'
            f" {moved} without pgcdc: the changes in between never reached Delta (another consumer of the slot such"
            " as pg_recvlogical --start, pgcdc changes --advance, pg_replication_slot_advance(), or a second"
            " pipeline configured with the same slot name); nothing was applied or confirmed: re-snapshot every"
            " table: run the pgcdc_resnapshot job with no table list (every table missed those changes; 2 of 2"
            f" still hold a copy from before {moved}: public.notes, public.orders); give any other consumer a slot"
            " of its own"
        )
        assert slot_position(pg) == moved
        assert (delta_rows(lake, "orders"), delta_rows(lake, "notes")) == before

        run_job(defs, instance, "pgcdc_resnapshot")
        pg.execute("INSERT INTO notes VALUES ('after')")
        run_job(defs, instance, "pgcdc_incremental")
        assert delta_rows(lake, "orders") == pg_orders(pg)
        assert delta_rows(lake, "notes") == pg_notes(pg)
