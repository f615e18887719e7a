"""Asset checks a drain evaluates, at what the drain costs.

* ``schema_matches_postgres``, on each Delta-table asset: the Delta columns and types are what the
  type mapping gives for the published columns, plus ``_pgcdc_lsn`` (and ``_pgcdc_bucket`` for a
  bucketed table). A drain evaluates it only for the tables whose schema may have moved: a
  Relation message in the drain changed their columns (the schema reconciler reports it,
  ``TableResult.schema_changed``; a table with columns dropped in PostgreSQL and kept in Delta
  counts whenever it has changes), or they were snapshotted since the previous drain. For every
  other table the drain does not evaluate it: no catalog round trip, no Delta log read, no event;
  its latest evaluation stays the table's schema status, since nothing that check looks at has
  changed. Selecting only the checks (no drain) evaluates it for every selected table.
* ``table_not_quarantined``, on each Delta-table asset: the drains apply the table's changes; it fails
  (severity ERROR) once a fault of the table's own set it aside (``resources/runs/quarantine.py``),
  naming the cause, the column, the LSN and the fix, and passes again when a re-snapshot lifted it.
  A drain evaluates it only when it sets a table aside or lifts it, so it costs nothing otherwise;
  its latest evaluation stays the table's status meanwhile.
* ``slot_lag_within_bound``, on the pipeline's slot asset: the slot's unconfirmed WAL is at most
  ``checks.max_lag_bytes``; past that the source keeps WAL for us and risks disk or slot loss.
  Once per drain, from the lag the drain measured right after its confirmation.

No row count is taken in a drain: under live writes it could only warn, and on a large table
it is a full scan of the source every run. The exact comparison is the ``pgcdc_reconcile``
job's (``reconcile_checks.py``).

They live in the drain step (not a separate one) so they share its Spark session: a second
step would start a second engine.
"""

from __future__ import annotations

from collections.abc import Callable

from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetKey, MetadataValue
from pyspark.sql import SparkSession

from pgcdc_assets.dagster_resources import PostgresResource
from resources.config import PgcdcConfig
from resources.delta.destination import Destination, NO_TABLE, TableLog
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN
from resources.delta.state_table import known_log, read_state, state_path, StateRow
from resources.names import PipelineNames, QUARANTINE_CHECK, SCHEMA_CHECK, SLOT_LAG_CHECK, SNAPSHOT_JOB
from resources.pgtypes import spark_ddl_type
from resources.postgres.catalog import read_table, TableName
from resources.postgres.column_types import published_column_types
from resources.runs.incremental import IncrementalResult
from resources.runs.quarantine import Quarantine


def table_check_specs(key: AssetKey) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(
            SCHEMA_CHECK,
            asset=key,
            description="Delta columns and types match the published columns (evaluated when a drain saw them change)",
        ),
        AssetCheckSpec(
            QUARANTINE_CHECK,
            asset=key,
            description="the drains apply the table's changes: no fault of its own set it aside (a re-snapshot lifts one)",
        ),
    ]


def evaluate_quarantine_check(key: AssetKey, table: TableName, quarantine: Quarantine | None) -> AssetCheckResult:
    """``table_not_quarantined`` of one table: failed, with the cause and fix, while ``quarantine`` holds it."""
    if quarantine is None:
        return AssetCheckResult(
            asset_key=key, check_name=QUARANTINE_CHECK, passed=True, description=f"the drains apply {table}'s changes"
        )
    metadata = {
        "pgcdc/quarantined_from_lsn": MetadataValue.text(str(quarantine.lsn)),
        "pgcdc/cause": MetadataValue.text(quarantine.cause),
        "pgcdc/fix": MetadataValue.text(quarantine.fix),
        "pgcdc/since": MetadataValue.text(quarantine.since),
    }
    if quarantine.column is not None:
        metadata["pgcdc/column"] = MetadataValue.text(quarantine.column)
    return AssetCheckResult(
        asset_key=key, check_name=QUARANTINE_CHECK, passed=False, severity=AssetCheckSeverity.ERROR,
        description=quarantine.describe(), metadata=metadata,
    )  # fmt: skip


def slot_check_specs(slot_key: AssetKey) -> list[AssetCheckSpec]:
    return [AssetCheckSpec(SLOT_LAG_CHECK, asset=slot_key, description="replication slot lag <= checks.max_lag_bytes")]


def postgres_columns(postgres: PostgresResource, table: TableName) -> list[tuple[str, str]]:
    """(name, Delta type) of the published columns, by the same mapping (and configured columns) the snapshot uses."""
    with postgres.connect() as conn:
        config = postgres.config
        types = published_column_types(conn, read_table(conn, config.publication, table), config.column_overrides)
    return [(column.column, spark_ddl_type(column)) for column in types]


def delta_columns(spark: SparkSession, path: str) -> list[tuple[str, str]]:
    return [(field.name, field.dataType.simpleString()) for field in spark.read.format("delta").load(path).schema]


def table_log_reader(config: PgcdcConfig, destination: Destination) -> Callable[[TableName], TableLog]:
    """Each table's log as a drain reads it (through ``destination``): from where the pgcdc state left it, so a bucketed
    table's layout is known on every engine after Delta's log cleanup removed its snapshot commit
    (the state row names it, docs/contracts.md). The state is read once, when first needed."""
    state: dict[str, StateRow] | None = None

    def read(table: TableName) -> TableLog:
        nonlocal state
        if state is None:
            state = read_state(state_path(config.delta.root, config.slot), destination.lake)
        path = config.table_path(table.schema, table.name)
        return destination.read_table_log(path, known_log(state, str(table), path))

    return read


def schema_check_due(table: TableName, drained: IncrementalResult) -> bool:
    """Whether the drain ``drained`` may have moved ``table``'s schema (module docstring)."""
    stats = drained.tables.get(str(table))
    return stats is None or stats.schema_changed or str(table) in drained.tables_without_snapshot


def evaluate_schema_check(
    postgres: PostgresResource,
    spark: SparkSession,
    table_log: Callable[[TableName], TableLog],
    table: TableName,
    key: AssetKey,
    without_snapshot: bool,
    names: PipelineNames,
) -> AssetCheckResult:
    """``schema_matches_postgres`` of one table; ``without_snapshot``: the drain found no snapshot of it;
    ``table_log`` is a :func:`table_log_reader`."""
    path = postgres.config.table_path(table.schema, table.name)
    log = NO_TABLE if without_snapshot else table_log(table)
    if log.snapshot_lsn is None:
        return AssetCheckResult(
            asset_key=key, check_name=SCHEMA_CHECK, passed=False,
            description=f"no snapshot of {table} at {path}: run the {names.scoped(SNAPSHOT_JOB)} job",
        )  # fmt: skip
    expected = [*postgres_columns(postgres, table), (LSN_COLUMN, "bigint")]
    if log.layout is not None:
        expected.append((BUCKET_COLUMN, "bigint"))
    actual = delta_columns(spark, path)
    missing = [f"{name} {kind}" for name, kind in expected if (name, kind) not in actual]
    unexpected = [f"{name} {kind}" for name, kind in actual if (name, kind) not in expected]
    return AssetCheckResult(
        asset_key=key,
        check_name=SCHEMA_CHECK,
        passed=not missing and not unexpected,
        metadata={
            "expected": MetadataValue.text(", ".join(f"{n} {k}" for n, k in expected)),
            "delta": MetadataValue.text(", ".join(f"{n} {k}" for n, k in actual)),
            "missing_in_delta": MetadataValue.text(", ".join(missing)),
            "not_in_postgres": MetadataValue.text(", ".join(unexpected)),
        },
    )


def evaluate_lag_check(
    config: PgcdcConfig, slot_key: AssetKey, slot_lag: int | None, names: PipelineNames
) -> AssetCheckResult:
    """``slot_lag_within_bound`` of the pipeline's slot asset; ``slot_lag`` None means the slot does not exist."""
    bound = config.checks.max_lag_bytes
    if slot_lag is None:
        return AssetCheckResult(
            asset_key=slot_key, check_name=SLOT_LAG_CHECK, passed=False,
            description=f'replication slot "{config.slot}" does not exist: run the {names.scoped(SNAPSHOT_JOB)} job',
        )  # fmt: skip
    return AssetCheckResult(
        asset_key=slot_key,
        check_name=SLOT_LAG_CHECK,
        passed=slot_lag <= bound,
        metadata={"slot_lag_bytes": MetadataValue.int(slot_lag), "max_lag_bytes": MetadataValue.int(bound)},
    )
