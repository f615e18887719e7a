"""One table's fault stays in that table: the drain applies every other table, the slot moves on, the
table is quarantined with its cause and fix, later drains skip it, and a re-snapshot restores it exactly.

Real PostgreSQL (15 and 18); the in-memory destination (the same runs, no engine) except where the
engine is what refuses.
"""

from __future__ import annotations

import dataclasses
import signal
from collections import Counter
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    build_sensor_context,
    DagsterInstance,
    DefaultSensorStatus,
    Definitions,
    instance_for_test,
    SensorResult,
    SkipReason,
)
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.cdc.schema import ChangeValueError, SchemaChangeError
from resources.config import load_config, parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.names import QUARANTINE_CHECK, TableName
from resources.runs.incremental import run_incremental
from resources.runs.quarantine import read_quarantines, record_quarantine
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.dagster_runs import (
    check_outcomes,
    create_shop,
    delta_rows,
    evaluate,
    materializations,
    pg_notes,
    pg_orders,
    run_job,
    sensor_resources,
    slot_position as pgcdc_slot_position,
    write_config,
)
from tests.support.fault_runs import Child, write_config as write_config_file
from tests.support.poisons import DDL, GOOD, round_of_changes
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

SLOT = "pgcdc_quarantine_slot"
SLOT_KEY = AssetKey(["pgcdc", "slot"])
ORDERS_KEY = AssetKey(["pgcdc", "public", "orders"])


def config_for(pg: PgDatabase, lake: Path, on_table_error: str = "quarantine") -> PgcdcConfig:
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": SLOT,
            "delta": {"root": str(lake)},
            "on_table_error": on_table_error,
        }
    )


def rows(destination: InMemoryDestination, config: PgcdcConfig, table: str) -> Counter[tuple]:
    data = destination.tables[config.table_path("public", table)]
    names = [name for name in data.column_names if not name.startswith("_pgcdc_")]
    return Counter(tuple(row[name] for name in names) for row in data.select(names).to_pylist())


def assert_exact(
    pg: PgDatabase, destination: InMemoryDestination, config: PgcdcConfig, tables: tuple[str, ...]
) -> None:
    for table in tables:
        assert rows(destination, config, table) == Counter(pg.execute(f"SELECT * FROM {table}")), table


def slot_position(pg: PgDatabase) -> str:
    ((position,),) = pg.execute(
        f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
    )
    return str(position)


POISONS = {
    "infinity": (
        "INSERT INTO due VALUES (100, 'infinity', 1)",
        ChangeValueError,
        "due",
        "UPDATE due SET due = NULL WHERE id = 100",
    ),
    "retyped": (
        "ALTER TABLE due ALTER COLUMN n TYPE text; UPDATE due SET n = 'x' WHERE id = 1",
        SchemaChangeError,
        "n",
        None,
    ),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_table_is_set_aside_and_the_others_flow(pg: PgDatabase, tmp_path: Path, poison: str) -> None:
    statement, kind, column, repair = POISONS[poison]
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)

    round_of_changes(pg, 1)
    pg.execute(statement)
    round_of_changes(pg, 2)
    first = run_incremental(config, destination)
    assert first.newly_quarantined == ["public.due"] and list(first.quarantined) == ["public.due"]
    assert_exact(pg, destination, config, GOOD)
    assert slot_position(pg) == str(first.confirmed_flush_lsn) and first.confirmed_flush_lsn >= first.end_lsn
    quarantine = read_quarantines(config, destination.lake)["public.due"]
    assert quarantine == first.quarantined["public.due"]
    assert kind.__name__ and (quarantine.column == column or kind is SchemaChangeError)
    assert "re-snapshot" in quarantine.fix and "pgcdc_resnapshot" in quarantine.fix
    assert quarantine.lsn <= first.end_lsn and quarantine.after == first.end_lsn
    assert "\n" not in quarantine.describe()

    # Later drains skip the table's changes, say so, and succeed; the other tables stay exact.
    round_of_changes(pg, 3)
    said: list[str] = []
    second = run_incremental(config, destination, log=said.append)
    assert second.newly_quarantined == [] and list(second.quarantined) == ["public.due"]
    assert any("public.due" in line and "skipped" in line for line in said), said
    assert_exact(pg, destination, config, GOOD)

    # The cause fixed in PostgreSQL, a re-snapshot of the table lifts the quarantine and restores it.
    if repair:
        pg.execute(repair)
    snapshot_tables(config, destination, [TableName("public", "due")])
    round_of_changes(pg, 4)
    third = run_incremental(config, destination)
    assert third.lifted == ["public.due"] and third.quarantined == {} and third.newly_quarantined == []
    assert read_quarantines(config, destination.lake) == {}
    assert_exact(pg, destination, config, (*GOOD, "due"))


def test_on_table_error_stop_fails_the_drain_and_confirms_nothing_past_it(pg: PgDatabase, tmp_path: Path) -> None:
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake", on_table_error="stop")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    before = slot_position(pg)
    pg.execute("INSERT INTO due VALUES (100, 'infinity', 1)")
    with pytest.raises(ChangeValueError, match=r"public\.due.*infinity"):
        run_incremental(config, destination)
    assert slot_position(pg) == before
    assert read_quarantines(config, destination.lake) == {}


@NEWEST_POSTGRES_ONLY  # Dagster's wiring does not depend on the server's version
def test_through_dagster_a_poisoned_table_fails_one_run_and_its_check_until_a_resnapshot(
    pg: PgDatabase, tmp_path: Path, spark_engine: object
) -> None:
    """The jobs a schedule and a user launch: the first drain after the poison commits and confirms the
    other table, then fails naming the table, column, LSN and fix; the table's check is red until a
    re-snapshot lifts the quarantine, while later drains succeed."""
    create_shop(pg)
    config = write_config(tmp_path, pg)
    defs = build_definitions(config)
    lake = tmp_path / "lake"
    with instance_for_test() as instance:
        run_job(defs, instance, "pgcdc_snapshot")
        pg.execute("INSERT INTO orders VALUES (900, 'not a number', 'NaN', NULL, NULL)")
        pg.execute("INSERT INTO notes VALUES ('beside the poison')")
        first = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance, raise_on_error=False)
        assert not first.success
        (failure,) = [event for event in first.all_events if event.is_step_failure]
        message = failure.step_failure_data.error.message  # type: ignore[union-attr]
        assert "public.orders is quarantined" in message and "'amount'" in message and "pgcdc_resnapshot" in message
        assert delta_rows(lake, "notes") == pg_notes(pg)
        assert pgcdc_slot_position(pg) >= LSN.parse(str(materializations(first)[SLOT_KEY]["pgcdc/end_lsn"]))
        assert materializations(first)[SLOT_KEY]["pgcdc/tables_quarantined"] == 1
        assert check_outcomes(first)[(ORDERS_KEY, QUARANTINE_CHECK)] is False

        assert_sensor_requests_only_what_a_resnapshot_fixes(defs, instance, config)

        pg.execute("INSERT INTO notes VALUES ('later'); UPDATE orders SET customer = 'skipped' WHERE id = 1")
        second = run_job(defs, instance, "pgcdc_incremental")
        assert delta_rows(lake, "notes") == pg_notes(pg)
        assert (ORDERS_KEY, QUARANTINE_CHECK) not in check_outcomes(second)  # stays red: not evaluated again
        observed = [event for event in second.all_events if event.event_type_value == "ASSET_OBSERVATION"]
        assert any("quarantined" in str(event.event_specific_data) for event in observed)

        pg.execute("UPDATE orders SET amount = 9 WHERE id = 900")
        run_job(
            defs,
            instance,
            "pgcdc_resnapshot",
            run_config={"ops": {"snapshot_tables": {"config": {"tables": ["public.orders"]}}}},
        )
        pg.execute("UPDATE orders SET customer = 'flowing again' WHERE id = 2")
        third = run_job(defs, instance, "pgcdc_incremental")
        assert check_outcomes(third)[(ORDERS_KEY, QUARANTINE_CHECK)] is True
        assert delta_rows(lake, "orders") == pg_orders(pg)
        assert materializations(third)[SLOT_KEY]["pgcdc/tables_quarantined"] == 0


@NEWEST_POSTGRES_ONLY  # the crash window is pgcdc's own; the versions' streams are covered above
def test_a_kill_after_the_quarantine_record_replays_exactly(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Killed between the quarantine record and the confirm: the rerun applies the other tables exactly,
    keeps the table set aside, reports it as the killed drain would have, and a re-snapshot restores it."""
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    snapshot_tables(config, lake_destination(spark, config))
    for n in range(3):
        round_of_changes(pg, n)
    pg.execute("INSERT INTO due VALUES (100, 'infinity', 1)")
    round_of_changes(pg, 3)
    child = Child(write_config_file(config, tmp_path), env={FAULT_POINT_ENV: "after_quarantine_record"})
    assert child.wait() == -signal.SIGKILL, child.output()
    assert list(read_quarantines(config, None)) == ["public.due"]
    assert LSN.parse(slot_position(pg)) < read_quarantines(config, None)["public.due"].after  # not confirmed past

    rerun = run_incremental(config, lake_destination(spark, config))
    assert rerun.newly_quarantined == ["public.due"]
    for table in GOOD:
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table))
    pg.execute("DELETE FROM due WHERE id = 100")
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "due")])
    round_of_changes(pg, 4)
    last = run_incremental(config, lake_destination(spark, config))
    assert last.lifted == ["public.due"] and last.quarantined == {}
    for table in (*GOOD, "due"):
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table))


def assert_sensor_requests_only_what_a_resnapshot_fixes(
    defs: Definitions, instance: DagsterInstance, config: Path
) -> None:
    """A value fault waits for its fix; a schema fault gets its table's snapshot requested, once."""
    name = "pgcdc_quarantine_sensor"
    assert defs.resolve_sensor_def(name).default_status == DefaultSensorStatus.STOPPED
    waiting = evaluate(defs, name, instance, config)
    assert isinstance(waiting, SkipReason) and "public.orders" in (waiting.skip_message or "")
    pipeline = load_config(str(config))
    (value_fault,) = read_quarantines(pipeline, None).values()
    assert value_fault.fault == "value"
    record_quarantine(pipeline, dataclasses.replace(value_fault, fault="schema"), None)
    sensor = defs.resolve_sensor_def(name)
    with build_sensor_context(instance=instance, resources=sensor_resources(config), sensor_name=name) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult)
    (request,) = result.run_requests or []
    assert request.asset_selection == [AssetKey(["pgcdc", "snapshot", "public", "orders"])]
    with build_sensor_context(
        instance=instance, resources=sensor_resources(config), sensor_name=name, cursor=result.cursor
    ) as context:
        assert isinstance(sensor(context), SkipReason)  # requested once per quarantine
    record_quarantine(pipeline, value_fault, None)
