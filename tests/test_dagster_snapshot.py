"""The Dagster snapshot side against real PostgreSQL, the real Sail engine and Delta read by delta-rs.

Dagster's wiring does not depend on the server's version, so the tests with a server run on the newest
(``NEWEST_POSTGRES_ONLY``); snapshots themselves run on PostgreSQL 15 and 18 in tests/test_snapshot.py and
around, the lost slot's re-snapshot in tests/test_faults.py.

Definitions are built from a real configuration file, as ``dagster dev`` builds them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import deltalake
import pytest
import yaml
from dagster import (
    AssetKey,
    AssetSpec,
    DagsterInstance,
    Definitions,
    ExecuteInProcessResult,
    TableColumn,
    TableSchema,
)
from pyspark.sql import SparkSession

import resources.runs.snapshot as snapshot_module
from pgcdc_assets.builder import build_definitions
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.translator import PgcdcSlotProps, PgcdcTableProps, PgcdcTranslator
from resources.config import parse_config
from resources.delta.table_log import read_table_log
from resources.engines.lazy_session import engine_start_seconds
from resources.errors import ConnectionFailure, SnapshotError
from resources.lsn import LSN
from resources.runs.key_range_copy import copy_key_range, RangeCopy
from tests.support.dagster_runs import (
    create_shop,
    delta_rows,
    invalidate_slot,
    materializations,
    NOTES_KEY,
    ORDERS_KEY,
    pg_notes,
    pg_orders,
    run_cli,
    write_config,
)
from tests.support.engine_fixtures import assert_delta_jars
from tests.support.marker_reads import read_snapshot_lsn
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # Dagster runs (each starts its engine); tiers: docs/testing.md


# --------------------------------------------------------------------------- helpers shared with the incremental tests


@pytest.fixture
def shop(pg: PgDatabase) -> PgDatabase:
    create_shop(pg)
    return pg


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as instance:
        yield instance


# --------------------------------------------------------------------------- resources


@NEWEST_POSTGRES_ONLY
def test_postgres_resource_never_shows_the_password(pg: PgDatabase, tmp_path: Path) -> None:
    config = write_config(tmp_path, pg, postgres={"dsn": pg.server.dsn(pg.name, password="s3cret")})
    resource = PostgresResource(config_file=str(config))
    assert "s3cret" not in repr(resource)
    assert "s3cret" not in str(resource)
    assert repr(resource) == f"PostgresResource(config_file={str(config)!r}, dsn={resource.masked_dsn!r})"
    assert resource.masked_dsn.endswith(f"/{pg.name}")


def test_spark_resource_modes() -> None:
    classic = SparkDeltaResource(mode="classic", spark_config={"spark.sql.shuffle.partitions": "4"})
    classic_config = classic.session_config()
    assert classic_config["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert_delta_jars(classic_config)
    assert classic_config["spark.sql.shuffle.partitions"] == "4"
    embedded = SparkDeltaResource(spark_config={"spark.sql.shuffle.partitions": "4"})
    assert embedded.session_config() == {"spark.sql.shuffle.partitions": "4"}
    settings = {"postgres": {"dsn": "host=x"}, "publication": "p"}
    assert SparkDeltaResource.from_pgcdc_config(parse_config(settings)).mode == "embedded"
    managed = SparkDeltaResource.from_pgcdc_config(parse_config({**settings, "spark": {"engine": "spark"}}))
    assert managed.mode == "spark" and managed.keep_alive_s == 600
    per_run = parse_config({**settings, "spark": {"engine": "spark", "keep_alive_s": 0}})
    assert SparkDeltaResource.from_pgcdc_config(per_run).keep_alive_s == 0
    remote = parse_config({**settings, "spark": {"engine": "spark", "remote": "sc://h:15002"}})
    assert SparkDeltaResource.from_pgcdc_config(remote).mode == "remote"  # a named server wins


def test_embedded_spark_resource_starts_and_stops_sail() -> None:
    """The resource a pipeline's configuration makes starts Sail on first use, with ``spark.config``
    (docs/configuration.md) in the session the engine runs: the session time zone it names is the one
    Sail's SQL reads, and a timestamp renders in it."""
    settings = {"postgres": {"dsn": "host=x"}, "publication": "p"}
    zone = {"spark.sql.session.timeZone": "Asia/Tokyo", "spark.sql.shuffle.partitions": "3"}
    resource = SparkDeltaResource.from_pgcdc_config(parse_config({**settings, "spark": {"config": zone}}))
    with resource.yield_for_execution(_init_context()) as ready:
        assert ready._engine is None  # nothing starts until a session is asked for
        session = ready.spark_session
        assert ready.spark_session is session
        assert session.range(5).count() == 5
        assert session.conf.get("spark.sql.shuffle.partitions") == "3"
        (row,) = session.sql(
            "SELECT current_timezone() AS zone, CAST(TIMESTAMP '2024-01-01 00:00:00 UTC' AS STRING) AS local"
        ).collect()
        assert (row["zone"], row["local"]) == ("Asia/Tokyo", "2024-01-01 09:00:00")
    assert ready._engine is None
    with pytest.raises(Exception):
        session.range(1).count()


@NEWEST_POSTGRES_ONLY
def test_a_snapshot_on_the_embedded_engine_never_starts_it(shop: PgDatabase, tmp_path: Path) -> None:
    """Its writes, log reads and state go through delta-rs: the session a snapshot step gets starts the
    engine only when something asks it for work, and then once."""
    config = parse_config(yaml.safe_load(write_config(tmp_path, shop).read_text(encoding="utf-8")))
    with SparkDeltaResource().yield_for_execution(_init_context()) as ready:
        destination = ready.snapshot_destination()
        session = destination.spark
        results = snapshot_module.snapshot_tables(config, destination)
        assert sorted(result.rows for result in results) == [3, 500]
        assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)
        assert delta_rows(tmp_path / "lake", "notes") == pg_notes(shop)
        assert ready._engine is None and engine_start_seconds(session) is None
        assert session.range(5).count() == 5  # the first use starts it
        assert ready._engine is not None and ready.spark_session.range(3).count() == 3
        assert (engine_start_seconds(session) or 0) > 0
        assert ready.snapshot_destination().spark is ready.spark_session  # started: the session itself
    assert ready._engine is None


def _init_context():  # noqa: ANN202 - dagster's InitResourceContext
    from dagster import build_init_resource_context

    return build_init_resource_context()


# --------------------------------------------------------------------------- definitions


@NEWEST_POSTGRES_ONLY
def test_unreachable_postgres_fails_the_load_with_one_line(tmp_path: Path, pg: PgDatabase) -> None:
    config = write_config(tmp_path, pg, postgres={"dsn": "host=127.0.0.1 port=1 dbname=x user=u password=s3cret"})
    with pytest.raises(ConnectionFailure) as failure:
        build_definitions(config)
    message = str(failure.value)
    assert "\n" not in message
    assert "s3cret" not in message
    assert message.startswith("cannot reach PostgreSQL at u@127.0.0.1:1/x (")


@NEWEST_POSTGRES_ONLY
def test_assets_jobs_and_specs_from_the_publication(shop: PgDatabase, tmp_path: Path) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    graph = defs.resolve_asset_graph()
    assert set(graph.get_all_asset_keys()) == {
        ORDERS_KEY,
        NOTES_KEY,
        AssetKey(["pgcdc", "public", "orders"]),
        AssetKey(["pgcdc", "public", "notes"]),
        AssetKey(["pgcdc", "slot"]),
    }
    slot = graph.get(AssetKey(["pgcdc", "slot"]))
    assert (slot.group_name, set(slot.kinds), slot.metadata["pgcdc/slot"]) == ("pgcdc", {"postgres"}, "pgcdc_slot")
    table = graph.get(AssetKey(["pgcdc", "public", "orders"]))
    assert table.parent_keys == {ORDERS_KEY}
    assert table.group_name == "pgcdc"
    assert set(table.kinds) == {"postgres", "delta", "spark"}
    assert table.metadata["pgcdc/delta_path"].value == str(tmp_path / "lake" / "public" / "orders")
    assert graph.get(ORDERS_KEY).group_name == "pgcdc_snapshot"
    assert defs.resolve_assets_def(AssetKey(["pgcdc", "public", "orders"])).node_def.pool == "pgcdc_slot_pgcdc_slot"
    for name in ("pgcdc_snapshot", "pgcdc_resnapshot", "pgcdc_incremental"):
        assert defs.resolve_job_def(name).name == name
    schedule = defs.resolve_schedule_def("pgcdc_incremental_schedule")
    assert schedule.cron_schedule == "*/5 * * * *"
    for name in ("pgcdc_slot_lag_sensor", "pgcdc_new_tables_sensor", "pgcdc_slot_health_sensor"):
        assert defs.resolve_sensor_def(name).name == name


class WarehouseTranslator(PgcdcTranslator):
    """A deployment's own keys, group, owners and metadata (pgcdc_assets/translator.py's subclass hook)."""

    def get_snapshot_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey(["warehouse", "copy", props.table.schema, props.table.name])

    def get_table_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey(["warehouse", props.table.schema, props.table.name])

    def get_slot_asset_key(self, props: PgcdcSlotProps) -> AssetKey:
        return AssetKey(["warehouse", "slot"])

    def get_group_name(self, props: PgcdcTableProps | PgcdcSlotProps) -> str:
        return "warehouse"

    def get_table_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        spec = super().get_table_asset_spec(props)
        return spec.merge_attributes(metadata={"team": "billing"}, owners=["team:billing"])


@NEWEST_POSTGRES_ONLY  # Dagster's wiring does not depend on the server's version
def test_a_translator_subclass_names_the_assets_of_definitions_and_runs(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    """The keys, group, owners and metadata a translator subclass gives reach the Definitions (deps, jobs,
    checks) and what a snapshot and a drain materialize; the tables are exact."""
    defs = build_definitions(write_config(tmp_path, shop), translator=WarehouseTranslator())
    graph = defs.resolve_asset_graph()
    orders, copy, slot = (
        AssetKey(["warehouse", "public", "orders"]),
        AssetKey(["warehouse", "copy", "public", "orders"]),
        AssetKey(["warehouse", "slot"]),
    )
    assert not any(key.path[0] == "pgcdc" for key in graph.get_all_asset_keys())
    table = graph.get(orders)
    assert table.parent_keys == {copy} and table.group_name == "warehouse" and table.owners == ["team:billing"]
    assert table.metadata["team"] == "billing" and table.metadata["pgcdc/slot"] == "pgcdc_slot"
    assert graph.get(slot).group_name == "warehouse"
    assert graph.get(copy).group_name == "pgcdc_snapshot"  # get_snapshot_group_name, not overridden
    snapshot = defs.resolve_job_def("pgcdc_snapshot").execute_in_process(instance=instance)
    assert snapshot.success
    assert set(materializations(snapshot)) == {copy, AssetKey(["warehouse", "copy", "public", "notes"])}
    shop.execute("UPDATE orders SET customer = 'translated' WHERE id = 1")
    drained = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance)
    assert drained.success
    assert set(materializations(drained)) == {slot, orders}
    assert {(e.asset_key, e.check_name) for e in drained.get_asset_check_evaluations()} >= {
        (slot, "slot_lag_within_bound"),
        (orders, "schema_matches_postgres"),
    }
    assert instance.get_latest_materialization_event(orders) is not None
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)


# --------------------------------------------------------------------------- snapshot


def run_snapshot(
    defs: Definitions, instance: DagsterInstance, job: str = "pgcdc_snapshot", **kwargs: object
) -> ExecuteInProcessResult:
    result = defs.resolve_job_def(job).execute_in_process(instance=instance, **kwargs)
    assert result.success
    return result


@NEWEST_POSTGRES_ONLY
def test_snapshot_job_copies_every_table_with_metadata(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance, spark: SparkSession
) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    result = run_snapshot(defs, instance)

    lake = tmp_path / "lake"
    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert delta_rows(lake, "notes") == pg_notes(shop)

    logged = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(line.startswith("snapshot public.orders: 500 rows, ") and line.endswith(" rows/s)") for line in logged)
    assert any(line.startswith("snapshot public.orders: 500 rows at LSN ") and " copied at " in line for line in logged)

    meta = materializations(result)
    assert set(meta) == {ORDERS_KEY, NOTES_KEY}
    orders = meta[ORDERS_KEY]
    path = str(lake / "public" / "orders")
    assert orders["dagster/row_count"] == 500
    assert meta[NOTES_KEY]["dagster/row_count"] == 3
    assert orders["pgcdc/delta_path"] == path
    assert orders["pgcdc/delta_version"] == deltalake.DeltaTable(path).version()
    assert LSN.parse(orders["pgcdc/snapshot_lsn"]) == read_snapshot_lsn(spark, path)
    assert orders["pgcdc/duration_s"] > 0
    assert orders["pgcdc/copy_rows_per_second"] >= orders["pgcdc/rows_per_second"] > 0  # the copy's phases lie inside
    assert (orders["pgcdc/chunks"], orders["pgcdc/workers"]) == (1, 1)  # a small table is one COPY
    assert orders["dagster/column_schema"] == TableSchema(
        columns=[
            TableColumn("id", "bigint", description="PostgreSQL bigint", tags={"pgcdc/postgres_type": "bigint"}),
            TableColumn("customer", "string", description="PostgreSQL text", tags={"pgcdc/postgres_type": "text"}),
            TableColumn(
                "amount", "decimal(10,2)", description="PostgreSQL numeric(10,2)",
                tags={"pgcdc/postgres_type": "numeric(10,2)"},
            ),
            TableColumn("tags", "array<int>", description="PostgreSQL integer[]", tags={"pgcdc/postgres_type": "integer[]"}),
            TableColumn(
                "placed", "timestamp_ntz", description="PostgreSQL timestamp without time zone",
                tags={"pgcdc/postgres_type": "timestamp without time zone"},
            ),
            TableColumn("_pgcdc_lsn", "bigint", description="commit LSN that last wrote the row (snapshot LSN here)"),
            TableColumn("_pgcdc_bucket", "bigint", description="partition column: range buckets of 1,000,000 keys of id"),
        ]
    )  # fmt: skip
    assert orders["pgcdc/layout"] == "range buckets of 1,000,000 keys of id"
    # where the step's time went: its own phases before the copies, then the table's (resources/runs/phases.py)
    phases = {
        key.removeprefix("pgcdc/phase_seconds/"): value
        for key, value in orders.items()
        if key.startswith("pgcdc/phase_seconds/")
    }
    assert set(phases) == {
        "configuration", "slot_check", "publication", "engine_start", "recopy_check", "slot", "state_read",
        "log_read", "slot_and_catalog", "writer_start", "first_rows", "copy", "commit", "metadata_read",
    }  # fmt: skip
    assert all(seconds >= 0 for seconds in phases.values())
    assert any(line.startswith("snapshot step phases: configuration ") and "state write" in line for line in logged)
    slot = shop.execute("SELECT slot_type, plugin FROM pg_replication_slots WHERE slot_name = 'pgcdc_slot'")
    assert slot == [("logical", "pgoutput")]
    assert (1, "c1", Decimal("1.25"), [1, None], datetime(2024, 1, 1, 0, 0, 1)) in delta_rows(lake, "orders")


@NEWEST_POSTGRES_ONLY
def test_subset_snapshots_only_the_selected_table(shop: PgDatabase, tmp_path: Path, instance: DagsterInstance) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    result = run_snapshot(defs, instance, asset_selection=[NOTES_KEY])
    assert set(materializations(result)) == {NOTES_KEY}
    assert sorted(p.name for p in (tmp_path / "lake" / "public").iterdir()) == ["notes"]


@NEWEST_POSTGRES_ONLY
def test_resnapshot_copies_the_listed_tables_again(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance, spark: SparkSession
) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    first = materializations(run_snapshot(defs, instance))
    shop.execute("INSERT INTO orders VALUES (501, 'late', 1.00, NULL, NULL)")
    shop.execute("INSERT INTO notes VALUES ('late')")

    second = run_snapshot(
        defs, instance, "pgcdc_resnapshot",
        run_config={"ops": {"snapshot_tables": {"config": {"tables": ["public.orders"]}}}},
    )  # fmt: skip
    meta = materializations(second)
    assert set(meta) == {ORDERS_KEY}
    assert meta[ORDERS_KEY]["dagster/row_count"] == 501
    assert LSN.parse(meta[ORDERS_KEY]["pgcdc/snapshot_lsn"]) > LSN.parse(first[ORDERS_KEY]["pgcdc/snapshot_lsn"])
    lake = tmp_path / "lake"
    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert len(delta_rows(lake, "notes")) == 3  # not listed: untouched


@NEWEST_POSTGRES_ONLY
def test_resnapshot_refuses_a_table_without_asset(shop: PgDatabase, tmp_path: Path, instance: DagsterInstance) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    result = defs.resolve_job_def("pgcdc_resnapshot").execute_in_process(
        instance=instance,
        run_config={"ops": {"snapshot_tables": {"config": {"tables": ["public.nope"]}}}},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.error.message.strip().endswith(
        "no snapshot asset for public.nope: name tables of the publication as schema.table, double-quoting"
        ' a name as SQL would (public."Order Items"; reload the code location after adding tables)'
    )


@NEWEST_POSTGRES_ONLY
def test_lost_slot_is_recreated_and_every_table_resnapshotted(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    run_snapshot(defs, instance)
    invalidate_slot(shop, "pgcdc_slot")
    shop.execute("INSERT INTO orders VALUES (501, 'lost', 1.00, NULL, NULL)")

    narrow = defs.resolve_job_def("pgcdc_resnapshot").execute_in_process(
        instance=instance,
        run_config={"ops": {"snapshot_tables": {"config": {"tables": ["public.notes"]}}}},
        raise_on_error=False,
    )
    assert not narrow.success

    result = run_snapshot(defs, instance, "pgcdc_resnapshot")
    assert set(materializations(result)) == {ORDERS_KEY, NOTES_KEY}
    (status,) = shop.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'pgcdc_slot'")
    assert status[0] in ("reserved", "extended")
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)


# --------------------------------------------------------------------------- command line


@NEWEST_POSTGRES_ONLY
def test_a_stopped_snapshot_in_key_ranges_resumes_in_the_next_run(
    shop: PgDatabase,
    tmp_path: Path,
    instance: DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run of the snapshot job stopped at a range boundary (its step fails right after the second
    range's commit, where a run terminated there leaves the table), changes meanwhile, and the next
    run, which goes on at the third range: Delta equals PostgreSQL, the materialization records the mode."""
    (heap,) = shop.execute("SELECT pg_catalog.pg_relation_size('orders')")[0]
    chunked = {"parallel_tables": 2, "chunked_above_mb": 0, "key_chunk_mb": heap / 2**20 / 3.5}  # four ranges
    defs = build_definitions(write_config(tmp_path, shop, snapshot=chunked))
    copied: list[int] = []

    def stopped_after_two_ranges(*args: Any, **kwargs: Any) -> RangeCopy:
        done = copy_key_range(*args, **kwargs)
        copied.append(done.range)
        if len(copied) == 2:
            raise SnapshotError("the run was stopped", "run the snapshot again")
        return done

    with monkeypatch.context() as patched:
        patched.setattr(snapshot_module, "copy_key_range", stopped_after_two_ranges)
        stopped = defs.resolve_job_def("pgcdc_snapshot").execute_in_process(instance=instance, raise_on_error=False)
    assert not stopped.success and copied == [0, 1]
    path = str(tmp_path / "lake" / "public" / "orders")
    part_way = read_table_log(path).chunks
    assert part_way is not None and (part_way.done, part_way.count) == (2, 4)
    shop.execute("UPDATE orders SET customer = 'later' WHERE id % 100 = 0")
    shop.execute("DELETE FROM orders WHERE id = 7")
    shop.execute("INSERT INTO orders VALUES (900, 'new', 1.00, NULL, NULL)")

    with caplog.at_level(logging.INFO, logger="resources.runs.snapshot"):
        resumed = run_snapshot(defs, instance)
    assert "resuming its snapshot in key ranges of id: 2 of 4 done" in caplog.text
    assert materializations(resumed)[ORDERS_KEY]["pgcdc/mode"] == "4 primary-key ranges, one short transaction each"
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)
    assert delta_rows(tmp_path / "lake", "notes") == pg_notes(shop)


@NEWEST_POSTGRES_ONLY
def test_dagster_cli_runs_the_snapshot_job(shop: PgDatabase, tmp_path: Path) -> None:
    config = write_config(tmp_path, shop)
    done = run_cli(tmp_path, config, "job", "execute", "-m", "pgcdc_assets.definitions", "-j", "pgcdc_snapshot")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_SUCCESS" in done.stderr + done.stdout
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)


@NEWEST_POSTGRES_ONLY
def test_definitions_validate(shop: PgDatabase, tmp_path: Path) -> None:
    config = write_config(tmp_path, shop)
    done = run_cli(tmp_path, config, "definitions", "validate", "-m", "pgcdc_assets.definitions")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Validation successful" in done.stdout + done.stderr
