"""The incremental multi-asset: one Delta-table asset per table, all fed by one slot drain.

Decisions:

* **One drain for every table.** The slot is shared, and confirming it past a change of a
  table that was not applied would lose that change. So the step always applies every
  table's changes; a subset selection only narrows which tables get materialization events
  and checks (an unselected table's Delta data may still move).
* **Tables without a snapshot are not materialized.** The drain skips their changes
  (nothing to apply them to); the step logs them and records an ``AssetObservation`` with
  ``pgcdc/skipped`` so the asset page says why, instead of a materialization claiming data.
* **One drain per slot at a time**: the step runs in the concurrency pool
  ``pgcdc_slot_<slot>``; PostgreSQL itself refuses a second consumer of an active slot.
  Pipelines of one code location with different slots are in different pools and drain
  at the same time.
* **Retries only for ConnectionFailure** (see ``common.user_facing``).
* Checks run in this step after the drain (see ``checks.py``: the schema check only for tables
  whose schema the drain saw change); selecting only checks runs them all without draining.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

from collections.abc import Iterator, Mapping, Sequence

from dagster import (
    AssetCheckResult,
    AssetExecutionContext,
    AssetKey,
    AssetObservation,
    AssetsDefinition,
    MaterializeResult,
    MetadataValue,
    multi_asset,
)

from pgcdc_assets.checks import evaluate_table_checks, table_check_specs, table_log_reader
from pgcdc_assets.common import TRANSIENT_RETRY_POLICY, user_facing
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.translator import PgcdcTableProps, PgcdcTranslator, schedule_interval
from resources.config import PgcdcConfig
from resources.incremental import IncrementalResult, run_incremental
from resources.names import PipelineNames, slot_pool, SNAPSHOT_JOB
from resources.postgres.catalog import TableName


def drain_metadata(result: IncrementalResult, table: TableName) -> dict[str, object]:
    """Per-table materialization metadata; LSNs as X/Y text, counts and lags as numbers to plot."""
    stats = result.tables[str(table)]
    metadata: dict[str, object] = {
        "pgcdc/confirmed_flush_lsn": MetadataValue.text(str(result.confirmed_flush_lsn)),
        "pgcdc/start_lsn": MetadataValue.text(str(result.start_lsn)),
        "pgcdc/end_lsn": MetadataValue.text(str(result.end_lsn)),
        "pgcdc/inserted": MetadataValue.int(stats.inserted),
        "pgcdc/updated": MetadataValue.int(stats.updated),
        "pgcdc/deleted": MetadataValue.int(stats.deleted),
        "pgcdc/truncates": MetadataValue.int(stats.truncates),
        "pgcdc/transactions_applied": MetadataValue.int(result.transactions),
        "pgcdc/changes_applied": MetadataValue.int(result.changes),
        "pgcdc/changes_skipped": MetadataValue.int(result.changes_skipped),
        "pgcdc/slot_lag_bytes_before": MetadataValue.int(result.lag_bytes_before),
        "pgcdc/slot_lag_bytes_after": MetadataValue.int(result.lag_bytes_after),
        "pgcdc/duration_s": MetadataValue.float(round(result.duration_s, 3)),
        "pgcdc/changes_per_second": MetadataValue.float(round(result.changes_per_second, 1)),
    }
    if stats.delta_version is not None:
        metadata["pgcdc/delta_version"] = MetadataValue.int(stats.delta_version)
    if stats.applied_lsn is not None:  # None: no change of this table in the drained range
        metadata["pgcdc/applied_lsn"] = MetadataValue.text(str(stats.applied_lsn))
    if stats.last_applied_lsn is not None:  # this run's or, from the pgcdc state, an earlier run's
        metadata["pgcdc/last_applied_lsn"] = MetadataValue.text(str(stats.last_applied_lsn))
    if stats.unpruned is not None:  # a bucketed table whose MERGEs read every bucket, and what restores it
        metadata["pgcdc/bucket_pruning_lost"] = MetadataValue.text(stats.unpruned)
    if stats.history_rows is not None:  # the table keeps a changelog (docs/history.md)
        metadata["pgcdc/history_rows"] = MetadataValue.int(stats.history_rows)
    return metadata


def _skip_reason(result: IncrementalResult, table: TableName, names: PipelineNames) -> str | None:
    """Why the drain did not write ``table``, or None when it did."""
    if str(table) in result.tables_without_snapshot:
        return f"{table} has no snapshot yet: its changes were skipped; run the {names.scoped(SNAPSHOT_JOB)} job for it"
    if str(table) not in result.tables:
        return f"{table} is no longer replicated (not in the publication or 'tables'): reload the code location"
    return None


def build_incremental_assets(
    config: PgcdcConfig, tables: Sequence[TableName], translator: PgcdcTranslator, names: PipelineNames
) -> AssetsDefinition:
    props = {table: PgcdcTableProps.of(config, table, names) for table in tables}
    key_of: Mapping[TableName, AssetKey] = {t: translator.get_table_asset_key(p) for t, p in props.items()}

    @multi_asset(
        name=names.scoped("drain_slot"),
        specs=[translator.get_table_asset_spec(p) for p in props.values()],
        check_specs=[spec for key in key_of.values() for spec in table_check_specs(key)],
        can_subset=True,
        pool=slot_pool(config.slot),
        required_resource_keys={names.postgres_key, names.spark_key},
        retry_policy=TRANSIENT_RETRY_POLICY,
        description="Drain the replication slot once into Delta, confirm it, then check the tables.",
    )
    def drain_slot(context: AssetExecutionContext) -> Iterator[MaterializeResult | AssetObservation | AssetCheckResult]:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        spark: SparkDeltaResource = getattr(context.resources, names.spark_key)
        selected = [table for table in tables if key_of[table] in context.selected_asset_keys]
        with user_facing():
            session = spark.spark_session
            result: IncrementalResult | None = None
            if selected:
                result = run_incremental(
                    postgres.config, session, log=context.log.info, warn=context.log.warning,
                    schedule_gap=schedule_interval(postgres.config.schedule.cron),
                )  # fmt: skip
                for table in selected:
                    reason = _skip_reason(result, table, names)
                    if reason:
                        context.log.warning(reason)
                        yield AssetObservation(asset_key=key_of[table], metadata={"pgcdc/skipped": reason})
                    else:
                        yield MaterializeResult(asset_key=key_of[table], metadata=drain_metadata(result, table))
            checked = set(context.selected_asset_check_keys)
            if checked:
                state = postgres.read_slot()
                lag = None if state is None else postgres.slot_lag_bytes(state)
                table_log = table_log_reader(session, postgres.config)
                for table in tables:
                    yield from evaluate_table_checks(
                        postgres, session, table_log, table, key_of[table], checked, lag, result, names
                    )

    return drain_slot
