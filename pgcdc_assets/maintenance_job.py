"""The ``pgcdc_maintenance`` job and its schedule: compaction, vacuum and log clean-up of every
Delta table the pipeline writes (``resources/delta/maintenance.py`` does the work).

Decisions:

* **An op job, not assets.** Maintenance changes files, not data: it must not look like a new
  materialization of a table. It records an ``AssetObservation`` per table asset (files and
  bytes before and after, files removed) so the figures sit on the table's asset page.
* **The slot's pool.** The op runs in ``pgcdc_slot_<slot>``, the pool of the drain step, so it
  never runs while a drain of the same slot writes the same tables (with the pool's limit
  of 1; see README).
* **pgcdc owns the retention properties.** Each run sets ``delta.logRetentionDuration`` and
  ``delta.deletedFileRetentionDuration`` to ``maintenance.retention_hours`` where they differ
  (a hand-set value is overwritten), logs it and records it as ``pgcdc/retention_properties_set``.
* **Stopped by default**, like the drain schedule: a team turns it on once it has chosen the
  retention.
* **Every table of the pipeline, plus pgcdc's own tables under ``<delta.root>/_pgcdc/``.** A table
  not snapshotted yet is skipped; a table that fails is logged and the others still get their
  maintenance; the step then fails naming the tables that did not.
"""

# No `from __future__ import annotations`: Dagster reads the decorated function's annotations at runtime.

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    Failure,
    job,
    JobDefinition,
    MetadataValue,
    op,
    OpExecutionContext,
    ScheduleDefinition,
)

from pgcdc_assets.common import user_facing
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from resources.config import HISTORY_SUFFIX, PgcdcConfig, SCD2_SUFFIX
from resources.delta.lake_storage import open_lake
from resources.delta.maintenance import describe, maintain_table, TableMaintenance
from resources.delta.state_table import PGCDC_TABLES_DIRECTORY
from resources.delta.table_files import delta_tables_under, is_delta_table
from resources.locations import join_location
from resources.names import MAINTENANCE_JOB, MAINTENANCE_SCHEDULE, PipelineNames, slot_pool
from resources.postgres.table_locks import RUN_NAME, TableLocks


def maintenance_metadata(result: TableMaintenance) -> dict[str, Any]:
    """Per-table observation metadata: numbers to plot over runs."""
    return {
        "pgcdc/files_before": MetadataValue.int(result.table_before.files),
        "pgcdc/files_after": MetadataValue.int(result.table_after.files),
        "pgcdc/bytes_before": MetadataValue.int(result.table_before.bytes),
        "pgcdc/bytes_after": MetadataValue.int(result.table_after.bytes),
        # rows the deletion vectors delete / rows of the data files: what every read drops, compaction purges
        "pgcdc/deleted_rows_fraction_before": MetadataValue.float(round(result.deleted_before.fraction, 6)),
        "pgcdc/deleted_rows_fraction_after": MetadataValue.float(round(result.deleted_after.fraction, 6)),
        "pgcdc/files_compacted": MetadataValue.int(result.files_compacted),
        "pgcdc/files_written": MetadataValue.int(result.files_written),
        "pgcdc/files_removed": MetadataValue.int(result.files_vacuumed),
        "pgcdc/storage_files_before": MetadataValue.int(result.storage_before.files),
        "pgcdc/storage_files_after": MetadataValue.int(result.storage_after.files),
        "pgcdc/storage_bytes_before": MetadataValue.int(result.storage_before.bytes),
        "pgcdc/storage_bytes_after": MetadataValue.int(result.storage_after.bytes),
        "pgcdc/log_files_removed": MetadataValue.int(result.log_files_removed),
        "pgcdc/log_files": MetadataValue.int(result.log_files_after),
        "pgcdc/delta_version": MetadataValue.int(result.version_after),
        "pgcdc/maintenance_method": MetadataValue.text(result.method),
        # pgcdc owns the table's delta.logRetentionDuration / delta.deletedFileRetentionDuration
        "pgcdc/retention_properties_set": MetadataValue.text("; ".join(result.properties_set) or "none"),
        "pgcdc/duration_s": MetadataValue.float(round(result.duration_s, 3)),
    }


def build_maintenance(
    config: PgcdcConfig, table_keys: Mapping[str, AssetKey], names: PipelineNames
) -> tuple[JobDefinition, ScheduleDefinition]:
    """The pipeline's job and its schedule; ``table_keys`` maps each table's Delta path to its asset key."""

    @op(
        name=names.scoped("maintain_tables"),
        pool=slot_pool(config.slot),
        out={},
        required_resource_keys={names.postgres_key, names.spark_key},
        description="Compact, vacuum and clean the log of every Delta table of the pipeline.",
    )
    def maintain_tables(context: OpExecutionContext) -> Iterator[AssetObservation]:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        spark: SparkDeltaResource = getattr(context.resources, names.spark_key)
        settings = postgres.config
        RUN_NAME.set(f"run {context.run.run_id}")  # named in its table locks' sessions
        with user_facing():
            lake = open_lake(settings.delta.root, settings.delta.storage)
            paths: Sequence[str] = [
                *table_keys,
                # changelogs and SCD type 2 tables (docs/history.md), beside their tables: the ones that exist
                *(
                    path + suffix
                    for path in table_keys
                    for suffix in (HISTORY_SUFFIX, SCD2_SUFFIX)
                    if is_delta_table(lake, path + suffix)
                ),
                *delta_tables_under(lake, join_location(settings.delta.root, PGCDC_TABLES_DIRECTORY)),
            ]
            # The embedded engine (Sail) has no maintenance commands: delta-rs does the work, and no
            # engine needs to start. Any other engine is asked (resources/engines/capabilities.py).
            session = None if spark.mode == "embedded" else spark.spark_session
            failed = []
            locks = TableLocks(settings.postgres.dsn, settings.slot, "maintenance")
            for path in paths:
                if not is_delta_table(lake, path):
                    context.log.info(f"{path}: no Delta table yet (not snapshotted): nothing to maintain")
                    continue
                try:
                    with locks.holding(path):  # no drain or snapshot writes it meanwhile
                        result = maintain_table(
                            path,
                            lake,
                            retention_hours=settings.maintenance.retention_hours,
                            target_file_bytes=settings.maintenance.target_file_bytes,
                            max_deleted_rows_ratio=settings.maintenance.max_deleted_rows_ratio,
                            spark=session,
                        )
                except Exception as error:  # noqa: BLE001 - one table's failure must not stop the others'
                    context.log.error(f"{path}: maintenance failed: {' '.join(str(error).split())[:500]}")
                    failed.append(path)
                    continue
                context.log.info(describe(result))
                if path in table_keys:
                    yield AssetObservation(asset_key=table_keys[path], metadata=maintenance_metadata(result))
            locks.close()
        if failed:
            raise Failure(
                description=f"maintenance failed for {', '.join(failed)}: see the step's log for each cause, fix, run again",
                allow_retries=False,
            )

    @job(
        name=names.scoped(MAINTENANCE_JOB),
        description="Table maintenance: compaction, vacuum after maintenance.retention_hours, log checkpoint and clean-up.",
    )
    def maintenance_job() -> None:
        maintain_tables()

    schedule = ScheduleDefinition(
        name=names.scoped(MAINTENANCE_SCHEDULE),
        cron_schedule=config.maintenance.cron,
        job=maintenance_job,
        default_status=DefaultScheduleStatus.STOPPED,
        description=f"Runs {names.scoped(MAINTENANCE_JOB)} on maintenance.cron from the pgcdc configuration.",
    )
    return maintenance_job, schedule
