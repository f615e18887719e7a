"""Slots are never lost unnoticed: PostgreSQL 18's idle_replication_slot_timeout, for real.

A slot no one reads for longer than ``idle_replication_slot_timeout`` is invalidated at the
next checkpoint. Before that happens, a drain warns and the slot-health sensor fails when the
schedule's gaps can outlast the timeout; after it, the drain, the snapshot's slot check and
the sensor each fail with one line naming the cause (``idle_timeout``) and the fix, and the
re-snapshot job the fix names restores an exact lake.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance, SkipReason
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import load_config
from resources.delta.spark_destination import lake_destination
from resources.errors import SlotError
from resources.postgres.preflight import ensure_slot
from resources.runs.incremental import run_incremental
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.dagster_runs import create_shop, evaluate, run_job, write_config
from tests.support.postgres import PgDatabase, TEST_SERVER_SETTINGS

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # Dagster runs against a lost slot; tiers: docs/testing.md

SLOT = "pgcdc_slot"


@pytest.fixture
def server() -> Iterator[LocalPostgres]:
    """A PostgreSQL 18 server of its own: the timeout is server-wide."""
    postgres = start_local_postgres(18, TEST_SERVER_SETTINGS)
    try:
        yield postgres
    finally:
        postgres.destroy()


def set_idle_timeout(pg: PgDatabase, setting: str) -> None:
    with psycopg.connect(pg.server.dsn(), autocommit=True) as admin:
        admin.execute(f"ALTER SYSTEM SET idle_replication_slot_timeout = '{setting}'")
        admin.execute("SELECT pg_reload_conf()")


def idle_out(pg: PgDatabase) -> None:
    """Let the slot idle past a 1 s timeout, and CHECKPOINT until PostgreSQL invalidates it."""
    set_idle_timeout(pg, "1s")
    for _ in range(30):
        time.sleep(1.5)
        pg.execute("CHECKPOINT")
        rows = pg.execute("SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
        if rows == [("idle_timeout",)]:
            return
    raise AssertionError(f"slot not invalidated by idle_replication_slot_timeout: {rows}")


def test_idle_timeout_is_warned_before_and_named_with_its_fix_after(
    server: LocalPostgres, tmp_path: Path, spark: SparkSession
) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute('CREATE DATABASE "idle"')
    pg = PgDatabase(server, "idle")
    create_shop(pg)
    config_file = write_config(tmp_path, pg, schedule={"cron": "*/5 * * * *"})
    config = load_config(config_file)
    defs = build_definitions(config_file)
    with DagsterInstance.ephemeral() as instance:
        run_job(defs, instance, "pgcdc_snapshot")
        healthy = evaluate(defs, "pgcdc_slot_health_sensor", instance, config_file)
        assert isinstance(healthy, SkipReason), healthy

        # Before: a timeout the schedule's 300 s gaps can outlast is a warning and a failed tick.
        set_idle_timeout(pg, "7min")
        warnings: list[str] = []
        run_incremental(
            config, lake_destination(spark, config), warn=warnings.append, schedule_gap=timedelta(minutes=5)
        )
        risk = (
            "idle_replication_slot_timeout is 420 s, less than 2 x the schedule's longest gap between drains (300 s):"
            f' PostgreSQL can invalidate slot "{SLOT}" while it waits for a drain, and every table must then be'
            " re-snapshotted: raise it to at least 600 s (ALTER SYSTEM SET idle_replication_slot_timeout = '600s';"
            " SELECT pg_reload_conf()), or set it to 0"
        )
        assert warnings == [risk]
        with pytest.raises(SlotError) as at_risk:
            evaluate(defs, "pgcdc_slot_health_sensor", instance, config_file)
        assert str(at_risk.value) == risk
        set_idle_timeout(pg, "10min")
        warnings.clear()
        run_incremental(
            config, lake_destination(spark, config), warn=warnings.append, schedule_gap=timedelta(minutes=5)
        )
        assert warnings == []

        # After: the slot idled out. Every reader names the cause and the fix, in one line.
        pg.execute("INSERT INTO notes VALUES ('lost with the slot')")
        idle_out(pg)
        set_idle_timeout(pg, "0")
        cause = (
            f'replication slot "{SLOT}" is invalidated (wal_status lost, idle_timeout) because no one read it for'
            " longer than idle_replication_slot_timeout; the changes it held are gone"
        )
        prevention = "; then raise idle_replication_slot_timeout above the longest gap between drains"
        with pytest.raises(SlotError) as drain:
            run_incremental(config, lake_destination(spark, config))
        assert str(drain.value) == (
            f"{cause}: run the pgcdc_resnapshot job (it recreates the slot and copies every table afresh),"
            f" or drop and recreate the slot and re-snapshot every table{prevention}"
        )
        with pytest.raises(SlotError) as snapshot:
            ensure_slot(pg.dsn, SLOT)
        assert str(snapshot.value) == (
            f"{cause}: drop it (SELECT pg_drop_replication_slot('{SLOT}')) and run the snapshot again,"
            f" which recreates it and copies every table afresh{prevention}"
        )
        with pytest.raises(SlotError) as sensed:
            evaluate(defs, "pgcdc_slot_health_sensor", instance, config_file)
        assert str(sensed.value) == (
            f"{cause}: run the pgcdc_resnapshot job with no table list: it recreates the slot and re-snapshots"
            f" every table{prevention}"
        )

        # The fix named restores an exact lake, and drains go on.
        run_job(defs, instance, "pgcdc_resnapshot")
        pg.execute("INSERT INTO notes VALUES ('after the re-snapshot')")
        pg.execute("UPDATE orders SET amount = amount + 1 WHERE id <= 10")
        run_job(defs, instance, "pgcdc_incremental")
    root = tmp_path / "lake"
    assert assert_delta_equals_postgres(pg.dsn, "public.orders", str(root / "public" / "orders"), key=("id",)) == 500
    assert_delta_equals_postgres(pg.dsn, "public.notes", str(root / "public" / "notes"))


def test_an_unreserved_slot_fails_the_health_sensor_before_it_is_lost(server: LocalPostgres, tmp_path: Path) -> None:
    """Past max_slot_wal_keep_size the slot is 'unreserved': still valid, but the next checkpoint can invalidate it."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute('CREATE DATABASE "unreserved"')
        admin.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        admin.execute("ALTER SYSTEM SET wal_keep_size = 0")
        admin.execute("SELECT pg_reload_conf()")
    pg = PgDatabase(server, "unreserved")
    create_shop(pg)
    config_file = write_config(tmp_path, pg)
    ensure_slot(pg.dsn, SLOT)
    pg.execute("CREATE TABLE filler (x text)")  # unpublished: only makes WAL
    for _ in range(10):  # no CHECKPOINT: the WAL stays, the slot's reservation is exceeded
        pg.execute("INSERT INTO filler SELECT repeat('x', 100) FROM generate_series(1, 5000)")
        pg.execute("SELECT pg_switch_wal()")
        if pg.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)) == [("unreserved",)]:
            break
    ((status, safe),) = pg.execute(
        "SELECT wal_status, safe_wal_size FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
    )
    assert status == "unreserved" and safe <= 0, (status, safe)
    with DagsterInstance.ephemeral() as instance, pytest.raises(SlotError) as at_risk:
        evaluate(build_definitions(config_file), "pgcdc_slot_health_sensor", instance, config_file)
    message = str(at_risk.value)
    told = re.fullmatch(
        f'replication slot "{SLOT}" is unreserved \\(safe_wal_size (-?[0-9]+) bytes\\): the next checkpoint can'
        " invalidate it: run the pgcdc_incremental job now, then raise max_slot_wal_keep_size or drain more often",
        message,
    )
    assert told is not None and int(told.group(1)) <= 0, message
