"""The snapshot multi-asset: one asset per table, each a consistent copy into Delta.

Materializing any subset copies only those tables. Tables copy in parallel
(``snapshot.parallel_tables``) and each table's materialization is reported as soon as it
finishes, so a failing table does not hide the ones that made it; the step fails at the
end naming every failure.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    op,
    TableColumn,
    TableSchema,
)
from pydantic import Field

from pgcdc_assets.common import TRANSIENT_RETRY_POLICY, user_facing
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.named_outputs import NamedOutputs
from pgcdc_assets.translator import PgcdcTableProps, PgcdcTranslator
from resources.config import PgcdcConfig
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN
from resources.delta.spark_destination import SparkDeltaDestination
from resources.engines.lazy_session import engine_start_seconds
from resources.errors import ConfigurationError, ConnectionFailure, explain, SlotError
from resources.names import PipelineNames, RESNAPSHOT_JOB, slot_pool
from resources.postgres.catalog import TableName
from resources.postgres.preflight import ensure_slot
from resources.postgres.publication import ensure_publication
from resources.postgres.table_locks import RUN_NAME
from resources.runs.phases import describe_phases, phase_metadata, Phases
from resources.runs.slot_guard import record_created
from resources.runs.snapshot import refuse_partial_recopy, snapshot_each, SnapshotProgress, SnapshotResult

#: Seconds between progress lines per table: often enough to show life, rare enough to read.
PROGRESS_INTERVAL_S = 2.0


class SnapshotRunConfig(Config):
    """Run config of the snapshot step (``ops: {snapshot_tables: {config: {tables: [...]}}}``)."""

    tables: list[str] = Field(
        default_factory=list,
        description=(
            "schema.table names to (re-)snapshot, read as PostgreSQL reads them: double-quote a name with"
            ' capitals, spaces, dots or other characters (\'"My Schema"."Order Items"\'); empty = every selected table'
        ),
    )


def snapshot_metadata(result: SnapshotResult) -> dict[str, Any]:
    """What a snapshot materialization records; the LSN as X/Y text, the way PostgreSQL prints it."""
    columns = [
        TableColumn(name, type=delta_type, description=f"PostgreSQL {pg_type}", tags={"pgcdc/postgres_type": pg_type})
        for name, pg_type, delta_type in result.columns
    ]
    columns.append(
        TableColumn(LSN_COLUMN, type="bigint", description="commit LSN that last wrote the row (snapshot LSN here)")
    )
    if result.layout is not None:
        columns.append(
            TableColumn(BUCKET_COLUMN, type="bigint", description=f"partition column: {result.layout.describe()}")
        )
    return {
        "dagster/row_count": MetadataValue.int(result.rows),
        "dagster/column_schema": MetadataValue.table_schema(TableSchema(columns=columns)),
        "pgcdc/delta_path": MetadataValue.path(result.path),
        "pgcdc/delta_version": MetadataValue.int(result.delta_version),
        "pgcdc/snapshot_lsn": MetadataValue.text(str(result.snapshot_lsn)),
        "pgcdc/duration_s": MetadataValue.float(round(result.duration_s, 3)),
        "pgcdc/rows_per_second": MetadataValue.float(round(result.rows_per_second, 1)),
        "pgcdc/copy_rows_per_second": MetadataValue.float(round(result.copy_rows_per_second, 1)),
        "pgcdc/chunks": MetadataValue.int(result.chunks),
        "pgcdc/workers": MetadataValue.int(result.workers),
        "pgcdc/layout": MetadataValue.text(result.layout.describe() if result.layout is not None else "not bucketed"),
        "pgcdc/mode": MetadataValue.text(result.mode),
        **({} if result.catalog_name is None else {"dagster/table_name": MetadataValue.text(result.catalog_name)}),
        **(
            {}
            if result.catalog_refusal is None
            else {"pgcdc/catalog_refusal": MetadataValue.text(result.catalog_refusal)}
        ),
    }


class _ProgressLog:
    """Turns the copy's progress callbacks (from worker threads) into throttled run-log lines."""

    def __init__(self, context: AssetExecutionContext) -> None:
        self._context = context
        self._last: dict[TableName, float] = {}
        self._lock = threading.Lock()

    def __call__(self, progress: SnapshotProgress) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(progress.table, 0.0) < PROGRESS_INTERVAL_S:
                return
            self._last[progress.table] = now
        self._context.log.info(progress.describe())


def _requested_tables(
    run_config: SnapshotRunConfig, selected: Sequence[TableName], defined: Sequence[TableName], names: PipelineNames
) -> list[TableName]:
    if not run_config.tables:
        return list(selected)
    requested = [TableName.parse(name) for name in run_config.tables]
    unknown = [table for table in requested if table not in defined]
    if unknown:
        raise ConfigurationError(
            f"no snapshot asset for {', '.join(table.written for table in unknown)}",
            "name tables of the publication as schema.table, double-quoting a name as SQL would"
            ' (public."Order Items"; reload the code location after adding tables)',
        )
    unselected = [table for table in requested if table not in selected]
    if unselected:
        raise ConfigurationError(
            f"{', '.join(table.written for table in unselected)} named in run config but not selected",
            f"select their snapshot assets too, or run the {names.scoped(RESNAPSHOT_JOB)} job",
        )
    return requested


def _recover_lost_slot(
    postgres: PostgresResource, to_copy: Sequence[TableName], defined: Sequence[TableName], names: PipelineNames
) -> bool:
    """Drop a lost slot when this run re-snapshots every table; True when it did.

    A lost slot has skipped changes of every table, so recreating it is only safe together
    with a fresh copy of all of them; a narrower run must not touch it.
    """
    state = postgres.read_slot()
    if state is None or not state.invalidated:
        return False
    if set(to_copy) != set(defined):
        raise SlotError(
            f'replication slot "{state.slot_name}" is lost (wal_status lost), and this run copies only'
            f" {len(to_copy)} of {len(defined)} tables",
            f"run the {names.scoped(RESNAPSHOT_JOB)} job without a table list: it recreates the slot and re-snapshots every table",
        )
    with postgres.connect() as conn:
        try:
            conn.execute("SELECT pg_catalog.pg_drop_replication_slot(%s::pg_catalog.name)", (state.slot_name,))
        except psycopg.Error as error:
            raise explain(error, postgres.dsn, slot=state.slot_name) from None
    return True


def build_snapshot_assets(
    config: PgcdcConfig, tables: Sequence[TableName], translator: PgcdcTranslator, names: PipelineNames
) -> AssetsDefinition:
    """One op covering every table, subsettable per table.

    Its outputs are named by pgcdc (``named_outputs.py``), so any table PostgreSQL accepts loads.
    Resources are found under the pipeline's keys (``names.postgres_key``/``spark_key``), so
    every pipeline of a code location brings its own source and engine settings.
    """
    props = {table: PgcdcTableProps.of(config, table, names) for table in tables}
    keys: Mapping[AssetKey, TableName] = {translator.get_snapshot_asset_key(p): t for t, p in props.items()}
    key_of = {table: key for key, table in keys.items()}
    named = NamedOutputs(specs=[translator.get_snapshot_asset_spec(p) for p in props.values()])

    @op(
        name=names.scoped("snapshot_tables"),
        ins=named.ins,
        out=named.outs,
        required_resource_keys={names.postgres_key, names.spark_key},
        retry_policy=TRANSIENT_RETRY_POLICY,
        description="Copy the selected tables into Delta, each consistent with the replication slot.",
        # A table copied in key ranges drains the slot between its ranges (and holds it while it copies
        # one), and no drain may confirm past a one-snapshot copy in flight: never beside a drain run.
        pool=slot_pool(config.slot),
    )
    def snapshot_tables(context: AssetExecutionContext, config: SnapshotRunConfig) -> Iterator[MaterializeResult]:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        spark: SparkDeltaResource = getattr(context.resources, names.spark_key)
        selected = [table for table in tables if key_of[table] in context.selected_asset_keys]
        step = Phases()
        RUN_NAME.set(f"run {context.run.run_id}")  # named in its table locks' sessions
        with user_facing():
            to_copy = _requested_tables(config, selected, tables, names)
            with step.timed("configuration"):
                settings = postgres.config
            with step.timed("slot_check"):
                if _recover_lost_slot(postgres, to_copy, tables, names):
                    context.log.warning(
                        f'replication slot "{settings.slot}" was lost: dropped it; recreating it and'
                        f" re-snapshotting all {len(to_copy)} tables"
                    )
            with step.timed("publication"):
                ensure_publication(settings)
            with step.timed("engine_start"):
                destination = spark.snapshot_destination()
            with step.timed("recopy_check"):
                refuse_partial_recopy(settings, destination, to_copy, tables)
            with step.timed("slot"):
                created = ensure_slot(settings.postgres.dsn, settings.slot, failover=settings.slot_failover)
                record_created(settings, destination.lake, created)
        yield from _copy_all(context, settings, destination, to_copy, key_of, step)

    return named.assets_definition(snapshot_tables)


def _copy_all(
    context: AssetExecutionContext,
    config: PgcdcConfig,
    destination: SparkDeltaDestination,
    tables: Sequence[TableName],
    key_of: Mapping[TableName, AssetKey],
    step: Phases,
) -> Iterator[MaterializeResult]:
    """Copy ``tables``; each materialization's ``pgcdc/phase_seconds/...`` metadata holds the step's
    phases before the copies (``step``, the same for every table) and the table's own. An engine
    started on first use during the copies (a table in key ranges) adds its start to the step's
    ``engine_start`` in the last log line."""
    progress = _ProgressLog(context)
    failures: list[BaseException] = []
    context.log.info(
        f"snapshotting {len(tables)} table(s), {config.snapshot.parallel_tables} at a time"
        f" (start-up: {describe_phases(step.as_dict())})"
    )
    for table, outcome in snapshot_each(config, destination, tables, on_progress=progress, phases=step):
        if isinstance(outcome, BaseException):
            context.log.error(f"snapshot {table} failed: {outcome}")
            failures.append(outcome)
            continue
        context.log.info(
            f"snapshot {table}: {outcome.rows:,} rows at LSN {outcome.snapshot_lsn} in {outcome.duration_s:.1f} s"
            f" ({outcome.mode}; copied at {outcome.copy_rows_per_second:,.0f} rows/s) -> Delta version {outcome.delta_version}; {describe_phases(outcome.phases)}"
        )
        if outcome.catalog_refusal is not None:
            context.log.warning(outcome.catalog_refusal)
        metadata = {**snapshot_metadata(outcome), **phase_metadata({**step.as_dict(), **outcome.phases})}
        yield MaterializeResult(asset_key=key_of[table], metadata=metadata)
    started_later = engine_start_seconds(destination.spark)
    if started_later is not None:
        step.add("engine_start", started_later)
    context.log.info(f"snapshot step phases: {describe_phases(step.as_dict())}")
    if failures:
        # Transient copy failures are retried by the policy; everything else needs a fix first.
        raise Failure(
            description=f"{len(failures)} of {len(tables)} table snapshot(s) failed: " + "; ".join(map(str, failures)),
            allow_retries=all(isinstance(failure, ConnectionFailure) for failure in failures),
        )
