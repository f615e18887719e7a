"""Build a pgcdc pipeline's Dagster definitions: from one configuration file, or per pipeline of the Component.

Kept apart from ``definitions.py`` (which loads ``$PGCDC_CONFIG`` on import, as
``dagster dev`` needs) so tests and other code locations can build definitions for any file.
``build_pipeline_definitions`` is what both paths share: the pgcdc Component
(``pgcdc_assets/component.py``) calls it once per pipeline with that pipeline's names.
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
from pgcdc_assets.dagster_private import UnresolvedAssetJobDefinition
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.incremental_assets import build_incremental_assets
from pgcdc_assets.maintenance_job import build_maintenance
from pgcdc_assets.reconcile_checks import build_reconcile_checks
from pgcdc_assets.snapshot_assets import build_snapshot_assets
from pgcdc_assets.translator import PgcdcSlotProps, PgcdcTableProps, PgcdcTranslator
from resources.config import CONFIG_ENV_VAR, load_config, PgcdcConfig
from resources.names import (
    INCREMENTAL_JOB,
    INCREMENTAL_SCHEDULE,
    PipelineNames,
    RECONCILE_JOB,
    RESNAPSHOT_JOB,
    SNAPSHOT_JOB,
)
from resources.postgres.catalog import TableName
from sensors.quarantine_sensor import build_quarantine_sensor
from sensors.slot_sensors import build_new_tables_sensor, build_slot_health_sensor, build_slot_lag_sensor


def pipeline_job(
    names: PipelineNames, job: str, selection: AssetSelection, description: str
) -> UnresolvedAssetJobDefinition:
    """A pipeline's asset job, named for it and run in one process.

    Every pgcdc job is a single step, and a subprocess per step would only add a second
    Python and a second Spark engine on the machine.
    """
    return define_asset_job(
        names.scoped(job), selection=selection, description=description, executor_def=in_process_executor
    )


def build_pipeline_definitions(
    config: PgcdcConfig,
    names: PipelineNames,
    postgres: PostgresResource,
    translator: PgcdcTranslator,
    tables: list[TableName] | None = None,
) -> Definitions:
    """Assets, jobs, checks, schedule, sensors and resources of one pipeline, every name from ``names``.

    ``postgres`` is the resource that re-reads ``config`` at run time (only a file path and
    a pipeline name are Dagster config); ``tables`` defaults to what ``config`` lists or
    publishes. A further job for every pipeline is one ``pipeline_job(names, ...)`` line here.
    """
    tables = tables if tables is not None else discover_tables(config)
    props = {table: PgcdcTableProps.of(config, table, names) for table in tables}

    snapshot_assets = build_snapshot_assets(config, tables, translator, names)
    incremental_assets = build_incremental_assets(config, tables, translator, names)
    slot_key = translator.get_slot_asset_key(PgcdcSlotProps.of(config, names))
    reconcile_checks = build_reconcile_checks(
        config.slot, tables, {table: translator.get_table_asset_key(p) for table, p in props.items()}, slot_key, names
    )
    snapshot_selection = AssetSelection.assets(snapshot_assets)
    incremental_job = pipeline_job(
        names,
        INCREMENTAL_JOB,
        # Only the slot asset (and its lag check): Dagster plans an event for every selected asset
        # and check, while a drain materializes just the tables it changed (incremental_assets.py).
        AssetSelection.assets(slot_key),
        "Drain the slot once: apply every committed change to Delta, confirm the slot, materialize the slot"
        " asset and the tables the drain changed.",
    )
    jobs = [
        pipeline_job(
            names,
            SNAPSHOT_JOB,
            snapshot_selection,
            "Initial snapshot: creates the publication (if configured) and the slot, copies every table.",
        ),
        pipeline_job(
            names,
            RESNAPSHOT_JOB,
            snapshot_selection,
            f"Re-snapshot while the slot keeps going. Run config ops.{names.scoped('snapshot_tables')}.config.tables"
            " lists schema.table names (empty = all). A lost slot is dropped, recreated, and every table re-copied.",
        ),
        incremental_job,
        pipeline_job(
            names,
            RECONCILE_JOB,
            AssetSelection.checks(reconcile_checks),
            "Reconcile: fix one LSN, drain the slot up to it, compare every table with PostgreSQL at it"
            " (counts and per-key-range hashes). Reads every table: run it on its own schedule, not per drain.",
        ),
    ]
    schedule = _incremental_schedule(config, names, incremental_job)
    snapshot_keys = {table: translator.get_snapshot_asset_key(p) for table, p in props.items()}
    maintenance_job, maintenance_schedule = build_maintenance(
        config, {p.delta_path: translator.get_table_asset_key(p) for p in props.values()}, names
    )
    return Definitions(
        assets=[snapshot_assets, incremental_assets],
        jobs=[*jobs, maintenance_job],
        asset_checks=[reconcile_checks],
        schedules=[schedule, maintenance_schedule],
        sensors=[
            build_slot_lag_sensor(names),
            build_new_tables_sensor(snapshot_keys, names),
            build_slot_health_sensor(names),
            build_quarantine_sensor(snapshot_keys, names),
        ],
        resources={
            names.postgres_key: postgres,
            names.spark_key: SparkDeltaResource.from_pgcdc_config(config),
        },
    )


def _incremental_schedule(
    config: PgcdcConfig, names: PipelineNames, incremental_job: UnresolvedAssetJobDefinition
) -> ScheduleDefinition:
    """The drain on ``schedule.cron``, stopped until an operator starts it."""
    return ScheduleDefinition(
        name=names.scoped(INCREMENTAL_SCHEDULE),
        cron_schedule=config.schedule.cron,
        job=incremental_job,
        default_status=DefaultScheduleStatus.STOPPED,
        description="Drains the slot on schedule.cron from the pgcdc configuration.",
    )


def build_definitions(
    config_file: str | os.PathLike[str] | None = None, translator: PgcdcTranslator | None = None
) -> Definitions:
    """The single-file code location: the one pipeline of ``config_file`` (default ``$PGCDC_CONFIG``).

    Its names are the unscoped ones (``pgcdc_snapshot``, ``pgcdc/<schema>/<table>``, resource
    keys ``postgres``/``spark``), as before the Component existed. Materializations started
    from the asset graph run in one process too.
    """
    config = load_config(config_file)
    config_path = os.path.abspath(config_file or os.environ[CONFIG_ENV_VAR])
    pipeline = build_pipeline_definitions(
        config, PipelineNames(), PostgresResource(config_file=config_path), translator or PgcdcTranslator()
    )
    return Definitions.merge(pipeline, Definitions(executor=in_process_executor))
