"""The Dagster incremental side, checks and sensors against real PostgreSQL, Sail and delta-rs.

Dagster's wiring does not depend on the server's version, so these run on the newest server
(``NEWEST_POSTGRES_ONLY``); the drains themselves run on PostgreSQL 15 and 18 in tests/test_incremental.py.
The health sensor's message depends on it (PostgreSQL 17 names why a slot was invalidated): both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, UTC
from pathlib import Path

import deltalake
import pytest
from dagster import (
    AssetCheckKey,
    AssetCheckSeverity,
    AssetKey,
    AssetSelection,
    build_schedule_context,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    ExecuteInProcessResult,
    FreshnessPolicy,
    instance_for_test,
    materialize,
    RunRequest,
    SensorResult,
    SkipReason,
)

from pgcdc_assets.builder import build_definitions
from pgcdc_assets.dagster_resources import PostgresResource
from resources.engines.engine import process_memory_mib
from resources.errors import SlotError
from resources.lsn import LSN
from resources.testing.dagster_instance import postgres_instance, sqlite_instance
from resources.testing.local_postgres import LocalPostgres
from tests.support.dagster_runs import (
    check_outcomes,
    create_shop,
    delta_rows,
    evaluate,
    invalidate_slot,
    materializations,
    NOTES_KEY,
    ORDERS_KEY,
    pg_notes,
    pg_orders,
    run_cli,
    run_job,
    slot_position,
    write_config,
)
from tests.support.delta_log import commit_bytes
from tests.support.postgres import fresh_database, NEWEST_POSTGRES_ONLY, PgDatabase
from tests.support.tcp_proxy import TcpProxy

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # Dagster runs (each starts its engine); tiers: docs/testing.md

ORDERS = AssetKey(["pgcdc", "public", "orders"])
NOTES = AssetKey(["pgcdc", "public", "notes"])
SLOT = AssetKey(["pgcdc", "slot"])


@pytest.fixture
def shop(pg: PgDatabase) -> PgDatabase:
    create_shop(pg)
    return pg


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        yield instance


def make_changes(pg: PgDatabase) -> None:
    """Three transactions: 3 inserts, 2 updates and 1 delete on orders; 2 inserts on notes."""
    pg.execute("INSERT INTO orders VALUES (501, 'new', 9.99, '{7}', '2025-01-01'), (502, 'n2', 0, NULL, NULL),"
               " (503, 'n3', 1, '{}', NULL)")  # fmt: skip
    pg.execute("UPDATE orders SET customer = 'changed', amount = amount + 1 WHERE id IN (1, 2)")
    pg.execute("DELETE FROM orders WHERE id = 3; INSERT INTO notes VALUES ('later'), ('again')")


def planned(instance: DagsterInstance, result: ExecuteInProcessResult) -> list[str]:
    """The assets and checks the run planned, as Dagster recorded them before running it."""
    events = [record.dagster_event for record in instance.all_logs(result.run_id) if record.dagster_event]
    return sorted(
        f"{event.asset_key.to_user_string()}" if event.event_type_value == "ASSET_MATERIALIZATION_PLANNED"
        else f"{event.asset_check_planned_data.asset_check_key.asset_key.to_user_string()}:"
        f"{event.asset_check_planned_data.asset_check_key.name}"
        for event in events
        if event.event_type_value in ("ASSET_MATERIALIZATION_PLANNED", "ASSET_CHECK_EVALUATION_PLANNED")
    )  # fmt: skip


@pytest.fixture(params=["sqlite", "postgres"])
def storage_instance(
    request: pytest.FixtureRequest, pg_server: LocalPostgres, tmp_path: Path
) -> Iterator[DagsterInstance]:
    """A Dagster instance on SQLite files, or on a database of the test server through the
    dagster.yaml docs/deployment.md shows."""
    if request.param == "sqlite":
        with sqlite_instance(tmp_path / "dagster_home") as instance:
            yield instance
        return
    with (
        fresh_database(pg_server) as database,
        postgres_instance(tmp_path / "dagster_home", pg_server, database.name) as instance,
    ):
        yield instance


@NEWEST_POSTGRES_ONLY
def test_drains_materialize_the_slot_always_and_tables_only_when_changed(
    shop: PgDatabase, tmp_path: Path, storage_instance: DagsterInstance
) -> None:
    instance = storage_instance
    defs = build_definitions(write_config(tmp_path, shop, schedule={"cron": "*/7 * * * *"}))
    assert defs.resolve_schedule_def("pgcdc_incremental_schedule").cron_schedule == "*/7 * * * *"
    assert defs.resolve_asset_graph().get(SLOT).freshness_policy == FreshnessPolicy.time_window(
        fail_window=timedelta(minutes=21), warn_window=timedelta(minutes=14)
    )
    assert defs.resolve_asset_graph().get(ORDERS).freshness_policy is None  # an idle table is never stale
    run_job(defs, instance, "pgcdc_snapshot")
    start = slot_position(shop)
    lake = tmp_path / "lake"
    snapshotted = {name: deltalake.DeltaTable(str(lake / "public" / name)).version() for name in ("orders", "notes")}
    make_changes(shop)

    first = run_job(defs, instance, "pgcdc_incremental")

    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert delta_rows(lake, "notes") == pg_notes(shop)
    assert planned(instance, first) == ["pgcdc/slot", "pgcdc/slot:slot_lag_within_bound"]
    meta = materializations(first)
    assert set(meta) == {SLOT, ORDERS, NOTES}
    slot, orders, notes = meta[SLOT], meta[ORDERS], meta[NOTES]
    confirmed = slot_position(shop)
    for drained in (slot, orders, notes):
        assert drained["pgcdc/confirmed_flush_lsn"] == str(confirmed)
        assert drained["pgcdc/start_lsn"] == str(start)
        assert drained["pgcdc/transactions_applied"] == 3
        assert drained["pgcdc/changes_applied"] == 8
    assert LSN.parse(slot["pgcdc/end_lsn"]) <= confirmed
    assert slot["pgcdc/slot_lag_bytes_before"] == LSN.parse(slot["pgcdc/end_lsn"]) - start
    assert isinstance(slot["pgcdc/slot_lag_bytes_after"], int)
    assert slot["pgcdc/duration_s"] > 0
    assert 0 < slot["pgcdc/peak_memory_mib"] <= round(process_memory_mib()[1], 1)  # the run's process is this one
    assert slot["pgcdc/tables_changed"] == 2
    assert (
        slot["pgcdc/changed_tables"]
        == "- [public.notes](/assets/pgcdc/public/notes)\n- [public.orders](/assets/pgcdc/public/orders)"
    )
    assert (orders["pgcdc/inserted"], orders["pgcdc/updated"], orders["pgcdc/deleted"]) == (3, 2, 1)
    assert (notes["pgcdc/inserted"], notes["pgcdc/updated"], notes["pgcdc/deleted"]) == (2, 0, 0)
    assert orders["pgcdc/truncates"] == 0
    assert orders["pgcdc/applied_lsn"] == orders["pgcdc/last_applied_lsn"]
    assert orders["pgcdc/delta_version"] == deltalake.DeltaTable(str(lake / "public" / "orders")).version()
    # the bytes each table's commits added, exactly as its log records them, and their sum on the slot
    written = {name: commit_bytes(str(lake / "public" / name), version) for name, version in snapshotted.items()}
    assert (orders["pgcdc/bytes_written"], notes["pgcdc/bytes_written"]) == (written["orders"], written["notes"])
    assert slot["pgcdc/bytes_written"] == written["orders"] + written["notes"] and min(written.values()) > 0
    # The first drain after a snapshot evaluates the schema check of every table; the lag check is the slot's.
    assert check_outcomes(first) == {
        (SLOT, "slot_lag_within_bound"): True, (ORDERS, "schema_matches_postgres"): True,
        (NOTES, "schema_matches_postgres"): True,
    }  # fmt: skip

    idle = run_job(defs, instance, "pgcdc_incremental")

    assert planned(instance, idle) == ["pgcdc/slot", "pgcdc/slot:slot_lag_within_bound"]
    assert set(materializations(idle)) == {SLOT}
    assert materializations(idle)[SLOT]["pgcdc/tables_changed"] == 0
    assert materializations(idle)[SLOT]["pgcdc/confirmed_flush_lsn"] == str(slot_position(shop))
    assert check_outcomes(idle) == {(SLOT, "slot_lag_within_bound"): True}

    shop.execute("INSERT INTO notes VALUES ('only notes')")
    one = run_job(defs, instance, "pgcdc_incremental")

    assert set(materializations(one)) == {SLOT, NOTES}
    assert materializations(one)[NOTES]["pgcdc/inserted"] == 1
    assert materializations(one)[SLOT]["pgcdc/changed_tables"] == "- [public.notes](/assets/pgcdc/public/notes)"
    assert delta_rows(lake, "notes") == pg_notes(shop)
    assert delta_rows(lake, "orders") == pg_orders(shop)
    latest = {key: instance.get_latest_materialization_event(key).run_id for key in (SLOT, ORDERS, NOTES)}
    assert latest == {SLOT: one.run_id, ORDERS: first.run_id, NOTES: one.run_id}
    # Every drain is one slot materialization, each with the slot's confirmed position at its end.
    slot_history = instance.fetch_materializations(SLOT, limit=10).records
    assert [record.run_id for record in slot_history] == [one.run_id, idle.run_id, first.run_id]
    assert slot_history[0].asset_materialization.metadata["pgcdc/confirmed_flush_lsn"].value == str(slot_position(shop))
    assert len(instance.fetch_materializations(ORDERS, limit=10).records) == 1


@NEWEST_POSTGRES_ONLY
def test_table_without_snapshot_is_reported_not_materialized(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    run_job(defs, instance, "pgcdc_snapshot", asset_selection=[NOTES_KEY])
    make_changes(shop)

    result = run_job(defs, instance, "pgcdc_incremental")

    assert set(materializations(result)) == {SLOT, NOTES}
    assert materializations(result)[SLOT]["pgcdc/tables_without_snapshot"] == "public.orders"
    (observation,) = [
        e.event_specific_data.asset_observation for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert observation.asset_key == ORDERS
    assert observation.metadata["pgcdc/skipped"].value == (
        "public.orders has no snapshot yet: its changes were skipped; run the pgcdc_snapshot job for it"
    )
    assert not (tmp_path / "lake" / "public" / "orders").exists()
    assert delta_rows(tmp_path / "lake", "notes") == pg_notes(shop)
    assert check_outcomes(result) == {
        (ORDERS, "schema_matches_postgres"): False, (NOTES, "schema_matches_postgres"): True,
        (SLOT, "slot_lag_within_bound"): True,
    }  # fmt: skip


@NEWEST_POSTGRES_ONLY
def test_missing_slot_fails_once_with_the_fix(shop: PgDatabase, tmp_path: Path, instance: DagsterInstance) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    result = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    kinds = [event.event_type_value for event in result.all_events]
    assert "STEP_UP_FOR_RETRY" not in kinds  # only ConnectionFailure is retried
    (failure,) = [event for event in result.all_events if event.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.error.message.strip().endswith(
        'replication slot "pgcdc_slot" does not exist: create it (run the pgcdc_snapshot job,'
        " or pgcdc changes --create-slot) or fix the slot name"
    )


@NEWEST_POSTGRES_ONLY
def test_a_connection_failure_is_retried_and_the_retry_drains_exactly(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    """PostgreSQL unreachable when the drain step connects (the proxy refuses that one connection):
    the step fails with ConnectionFailure, Dagster's retry policy runs it again, and the retry, which
    reaches PostgreSQL, applies every change exactly once."""
    with TcpProxy("127.0.0.1", shop.server.port) as proxy:
        config = write_config(tmp_path, shop, postgres={"dsn": proxy.dsn_for(shop.dsn)})
        defs = build_definitions(config)
        run_job(defs, instance, "pgcdc_snapshot")
        start = slot_position(shop)
        make_changes(shop)
        proxy.refuse_next(1)
        result = run_job(defs, instance, "pgcdc_incremental")
        assert proxy.refused == 1
    kinds = [event.event_type_value for event in result.all_events]
    assert kinds.count("STEP_UP_FOR_RETRY") == 1 and kinds.count("STEP_RESTARTED") == 1, kinds
    (retried,) = [event for event in result.all_events if event.event_type_value == "STEP_UP_FOR_RETRY"]
    assert "ConnectionFailure" in str(retried.event_specific_data.error)
    lake = tmp_path / "lake"
    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert delta_rows(lake, "notes") == pg_notes(shop)
    meta = materializations(result)
    assert meta[ORDERS]["pgcdc/start_lsn"] == str(start)
    assert meta[ORDERS]["pgcdc/changes_applied"] == 8
    assert meta[ORDERS]["pgcdc/confirmed_flush_lsn"] == str(slot_position(shop))


@NEWEST_POSTGRES_ONLY
def test_cli_drains_twice_and_the_second_changes_nothing(shop: PgDatabase, tmp_path: Path) -> None:
    config = write_config(tmp_path, shop)
    home = tmp_path / "dagster_home"
    home.mkdir()
    # A limit of 1 on the slot's pool, as production sets it: the drain step must still run.
    (home / "dagster.yaml").write_text("concurrency:\n  pools:\n    default_limit: 1\n", encoding="utf-8")
    execute = ("job", "execute", "-m", "pgcdc_assets.definitions", "-j")
    done = run_cli(tmp_path, config, *execute, "pgcdc_snapshot")
    assert done.returncode == 0, done.stderr[-3000:]
    make_changes(shop)

    first = run_cli(tmp_path, config, *execute, "pgcdc_incremental")
    assert first.returncode == 0, first.stderr[-3000:]
    lake = tmp_path / "lake"
    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert delta_rows(lake, "notes") == pg_notes(shop)
    versions = [deltalake.DeltaTable(str(lake / "public" / t)).version() for t in ("orders", "notes")]
    confirmed = slot_position(shop)

    second = run_cli(tmp_path, config, *execute, "pgcdc_incremental")
    assert second.returncode == 0, second.stderr[-3000:]
    assert [deltalake.DeltaTable(str(lake / "public" / t)).version() for t in ("orders", "notes")] == versions
    assert delta_rows(lake, "orders") == pg_orders(shop)
    assert slot_position(shop) >= confirmed


# --------------------------------------------------------------------------- sensors


@NEWEST_POSTGRES_ONLY
def test_lag_sensor_requests_a_drain_only_above_the_threshold(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    config = write_config(tmp_path, shop, sensors={"lag_bytes": 200_000}, checks={"max_lag_bytes": 200_000})
    defs = build_definitions(config)
    run_job(defs, instance, "pgcdc_snapshot")
    run_job(defs, instance, "pgcdc_incremental")

    quiet = evaluate(defs, "pgcdc_slot_lag_sensor", instance, config)
    assert isinstance(quiet, SkipReason)
    assert "at or below sensors.lag_bytes=200000" in quiet.skip_message

    shop.execute("INSERT INTO orders SELECT g, repeat('x', 100) FROM generate_series(1000, 4000) g")
    confirmed_before = slot_position(shop)
    request = evaluate(defs, "pgcdc_slot_lag_sensor", instance, config)
    assert isinstance(request, RunRequest)
    assert int(request.tags["pgcdc/slot_lag_bytes"]) > 200_000
    assert slot_position(shop) == confirmed_before  # the sensor only looks

    running = DagsterRun(job_name="pgcdc_incremental", run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED)
    instance.add_run(running)
    pending = evaluate(defs, "pgcdc_slot_lag_sensor", instance, config)
    assert isinstance(pending, SkipReason)
    assert pending.skip_message.endswith(f"a pgcdc_incremental run is already pending: {running.run_id}")

    # The slot_lag_within_bound check past checks.max_lag_bytes fails (an error), with the lag it measured;
    # evaluated alone it does not drain; the drain's own evaluation after it confirmed passes again.
    lag_check = AssetCheckKey(SLOT, "slot_lag_within_bound")
    alone = materialize([defs.resolve_assets_def(SLOT)], selection=AssetSelection.checks(lag_check), instance=instance)
    assert alone.success and materializations(alone) == {}
    (failing,) = alone.get_asset_check_evaluations()
    assert (failing.asset_key, failing.check_name, failing.passed) == (SLOT, "slot_lag_within_bound", False)
    assert failing.severity == AssetCheckSeverity.ERROR
    assert failing.metadata["slot_lag_bytes"].value > 200_000 and failing.metadata["max_lag_bytes"].value == 200_000
    assert slot_position(shop) == confirmed_before
    drained = run_job(defs, instance, "pgcdc_incremental")
    assert check_outcomes(drained)[(SLOT, "slot_lag_within_bound")] is True


def test_health_sensor_reports_a_missing_slot_with_the_fix(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    config = write_config(tmp_path, shop)
    defs = build_definitions(config)
    run_job(defs, instance, "pgcdc_snapshot")
    healthy = evaluate(defs, "pgcdc_slot_health_sensor", instance, config)
    assert isinstance(healthy, SkipReason)
    assert healthy.skip_message.startswith('slot "pgcdc_slot" is healthy: wal_status reserved, lag ')

    invalidate_slot(shop, "pgcdc_slot")
    with pytest.raises(SlotError) as lost:
        evaluate(defs, "pgcdc_slot_health_sensor", instance, config)
    # PostgreSQL 17+ names why (invalidation_reason), and so what keeps it from happening again.
    because = (
        ", wal_removed) because the WAL it needed was removed (it fell more than max_slot_wal_keep_size behind)"
        if shop.major >= 17
        else ")"
    )
    prevention = "; then drain more often or raise max_slot_wal_keep_size" if shop.major >= 17 else ""
    assert str(lost.value) == (
        f'replication slot "pgcdc_slot" is invalidated (wal_status lost{because}; the changes it held are gone:'
        f" run the pgcdc_resnapshot job with no table list: it recreates the slot and re-snapshots every table{prevention}"
    )

    shop.execute("SELECT pg_drop_replication_slot('pgcdc_slot')")
    with pytest.raises(SlotError) as failure:
        evaluate(defs, "pgcdc_slot_health_sensor", instance, config)
    masked = PostgresResource(config_file=str(config)).masked_dsn
    assert str(failure.value) == (
        f'replication slot "pgcdc_slot" does not exist on {masked}: run the pgcdc_snapshot job'
        " (it creates the slot and snapshots every table), or fix 'slot'"
    )


@NEWEST_POSTGRES_ONLY
def test_new_tables_sensor_snapshots_defined_tables_and_names_the_rest(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    config = write_config(tmp_path, shop)
    defs = build_definitions(config)
    # The sensor reads snapshot markers through the lake's storage client: a tick starts no engine.
    assert defs.resolve_sensor_def("pgcdc_new_tables_sensor").required_resource_keys == {"postgres"}
    run_job(defs, instance, "pgcdc_snapshot", asset_selection=[NOTES_KEY])
    shop.execute("CREATE TABLE extra (id int PRIMARY KEY)")
    shop.execute("ALTER PUBLICATION pgcdc_pub ADD TABLE extra")

    result = evaluate(defs, "pgcdc_new_tables_sensor", instance, config)
    assert isinstance(result, SensorResult)
    (request,) = result.run_requests
    assert request.asset_selection == [ORDERS_KEY]

    run_job(defs, instance, "pgcdc_snapshot", asset_selection=[ORDERS_KEY])
    reload = evaluate(defs, "pgcdc_new_tables_sensor", instance, config)
    assert isinstance(reload, SkipReason)
    assert reload.skip_message == (
        "1 published table(s) have no asset, reload the code location to add them: public.extra"
    )

    reloaded = build_definitions(config)
    request = evaluate(reloaded, "pgcdc_new_tables_sensor", instance, config)
    assert isinstance(request, SensorResult)
    assert request.run_requests[0].asset_selection == [AssetKey(["pgcdc", "snapshot", "public", "extra"])]


@NEWEST_POSTGRES_ONLY
def test_a_check_only_run_does_not_drain_and_a_schedule_tick_does(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    defs = build_definitions(write_config(tmp_path, shop))
    run_job(defs, instance, "pgcdc_snapshot")
    before = slot_position(shop)
    make_changes(shop)
    result = materialize(
        [defs.resolve_assets_def(ORDERS)],
        selection=AssetSelection.checks(AssetCheckKey(ORDERS, "schema_matches_postgres")),
        instance=instance,
    )
    assert result.success
    assert materializations(result) == {}
    assert check_outcomes(result) == {(ORDERS, "schema_matches_postgres"): True}  # evaluated without a drain
    assert slot_position(shop) == before

    # The schedule's tick (Dagster's own evaluation at a time its cron names) requests one run of the
    # incremental job; that run drains the changes exactly.
    schedule = defs.resolve_schedule_def("pgcdc_incremental_schedule")
    tick_time = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)  # on */5 * * * *
    with build_schedule_context(instance=instance, scheduled_execution_time=tick_time) as context:
        tick = schedule.evaluate_tick(context)
    assert tick.skip_message is None
    (request,) = tick.run_requests or []
    assert (request.job_name or schedule.job_name) == "pgcdc_incremental"
    drained = defs.resolve_job_def(schedule.job_name).execute_in_process(
        instance=instance, run_config=request.run_config, tags=request.tags
    )
    assert drained.success and drained.dagster_run.tags["dagster/schedule_name"] == "pgcdc_incremental_schedule"
    assert slot_position(shop) > before
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)
    assert delta_rows(tmp_path / "lake", "notes") == pg_notes(shop)


@NEWEST_POSTGRES_ONLY
def test_materializing_one_table_drains_the_slot_and_records_what_changed(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    """Selecting a table (the UI's Materialize) drains the whole slot: the selected table gets an output only
    when it changed; the slot asset and every changed table are recorded as runtime materializations."""
    defs = build_definitions(write_config(tmp_path, shop))
    run_job(defs, instance, "pgcdc_snapshot")
    shop.execute("UPDATE orders SET customer = 'picked' WHERE id = 9")

    result = materialize([defs.resolve_assets_def(NOTES)], selection=[NOTES], instance=instance)

    assert result.success
    assert planned(instance, result) == [
        "pgcdc/public/notes", "pgcdc/public/notes:schema_matches_postgres", "pgcdc/public/notes:table_not_quarantined"
    ]  # fmt: skip
    assert set(materializations(result)) == {SLOT, ORDERS}  # notes did not change: no output for it
    assert materializations(result)[ORDERS]["pgcdc/updated"] == 1
    assert delta_rows(tmp_path / "lake", "orders") == pg_orders(shop)


@NEWEST_POSTGRES_ONLY
def test_history_assets_are_downstream_of_their_tables_and_materialized_when_written(
    shop: PgDatabase, tmp_path: Path, instance: DagsterInstance
) -> None:
    history = {"default": "none", "tables": {"public.orders": "scd2", "public.notes": "changelog"}}
    defs = build_definitions(write_config(tmp_path, shop, history=history))
    orders_history, notes_history = (
        AssetKey(["pgcdc", "history", "public", "orders"]),
        AssetKey(["pgcdc", "history", "public", "notes"]),
    )
    graph = defs.resolve_asset_graph()
    assert graph.get(orders_history).parent_keys == {ORDERS} and graph.get(notes_history).parent_keys == {NOTES}
    run_job(defs, instance, "pgcdc_snapshot")
    make_changes(shop)

    first = run_job(defs, instance, "pgcdc_incremental")

    meta = materializations(first)
    assert set(meta) == {SLOT, ORDERS, NOTES, orders_history, notes_history}
    assert meta[orders_history]["pgcdc/history_rows"] == 6 and meta[notes_history]["pgcdc/history_rows"] == 2
    assert meta[orders_history]["pgcdc/applied_lsn"] == meta[ORDERS]["pgcdc/applied_lsn"]
    assert meta[orders_history]["pgcdc/confirmed_flush_lsn"] == str(slot_position(shop))
    assert planned(instance, first) == ["pgcdc/slot", "pgcdc/slot:slot_lag_within_bound"]

    shop.execute("INSERT INTO notes VALUES ('only notes')")
    second = run_job(defs, instance, "pgcdc_incremental")

    assert set(materializations(second)) == {SLOT, NOTES, notes_history}
    assert materializations(second)[notes_history]["pgcdc/history_rows"] == 1
    assert instance.get_latest_materialization_event(orders_history).run_id == first.run_id
