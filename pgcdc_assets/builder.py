"""Build the whole Dagster code location from one pgcdc configuration file.

Kept apart from ``definitions.py`` (which loads ``$PGCDC_CONFIG`` on import, as
``dagster dev`` needs) so tests and other code locations can build definitions for any file.
"""

from __future__ import annotations

import os

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    define_asset_job,
    Definitions,
    in_process_executor,
    ScheduleDefinition,
)

from pgcdc_assets.common import discover_tables
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.incremental_assets import build_incremental_assets
from pgcdc_assets.maintenance_job import build_maintenance
from pgcdc_assets.snapshot_assets import build_snapshot_assets
from pgcdc_assets.translator import PgcdcTableProps, PgcdcTranslator
from resources.config import CONFIG_ENV_VAR, load_config
from resources.names import INCREMENTAL_JOB, INCREMENTAL_SCHEDULE, RESNAPSHOT_JOB, SNAPSHOT_JOB
from sensors.slot_sensors import build_new_tables_sensor, build_slot_health_sensor, build_slot_lag_sensor


def build_definitions(
    config_file: str | os.PathLike[str] | None = None, translator: PgcdcTranslator | None = None
) -> Definitions:
    """Assets, jobs, checks, schedule, sensors and resources for the tables of ``config_file``.

    ``config_file`` defaults to ``$PGCDC_CONFIG``. Every job runs in one process: each is a single step, and a subprocess per step would
    only add a second Python and a second Spark engine on the machine.
    """
    config = load_config(config_file)
    config_path = os.path.abspath(config_file or os.environ[CONFIG_ENV_VAR])
    translator = translator or PgcdcTranslator()
    tables = discover_tables(config)
    props = {table: PgcdcTableProps.of(config, table) for table in tables}

    snapshot_assets = build_snapshot_assets(config, tables, translator)
    incremental_assets = build_incremental_assets(config, tables, translator)
    snapshot_selection = AssetSelection.assets(snapshot_assets)
    snapshot_job = define_asset_job(
        SNAPSHOT_JOB,
        selection=snapshot_selection,
        description="Initial snapshot: creates the publication (if configured) and the slot, copies every table.",
    )
    resnapshot_job = define_asset_job(
        RESNAPSHOT_JOB,
        selection=snapshot_selection,
        description=(
            "Re-snapshot while the slot keeps going. Run config ops.snapshot_tables.config.tables lists"
            " schema.table names (empty = all). A lost slot is dropped, recreated, and every table re-copied."
        ),
    )
    incremental_job = define_asset_job(
        INCREMENTAL_JOB,
        selection=AssetSelection.assets(incremental_assets),
        description="Drain the slot once: apply every committed change to Delta, then confirm the slot.",
    )
    schedule = ScheduleDefinition(
        name=INCREMENTAL_SCHEDULE,
        cron_schedule=config.schedule.cron,
        job=incremental_job,
        default_status=DefaultScheduleStatus.STOPPED,
        description="Drains the slot on schedule.cron from the pgcdc configuration.",
    )
    snapshot_keys = {table: translator.get_snapshot_asset_key(p) for table, p in props.items()}
    maintenance_job, maintenance_schedule = build_maintenance(
        config, {p.delta_path: translator.get_table_asset_key(p) for p in props.values()}
    )
    return Definitions(
        assets=[snapshot_assets, incremental_assets],
        jobs=[snapshot_job, resnapshot_job, incremental_job, maintenance_job],
        schedules=[schedule, maintenance_schedule],
        sensors=[
            build_slot_lag_sensor(),
            build_new_tables_sensor(snapshot_keys),
            build_slot_health_sensor(),
        ],
        resources={
            "postgres": PostgresResource(config_file=config_path),
            "spark": SparkDeltaResource.from_pgcdc_config(config),
        },
        executor=in_process_executor,
    )
