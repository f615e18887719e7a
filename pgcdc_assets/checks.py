"""Asset checks on each replicated Delta table, run in the drain step right after the drain.

* ``row_count_matches_postgres``: Delta holds as many rows as PostgreSQL publishes (the
  publication's row filter applied). Writes committed after the drain's end LSN make it fail
  until the next drain, so it is a warning, not an error.
* ``schema_matches_postgres``: the Delta columns and types are what the type mapping gives
  for the published columns today, plus ``_pgcdc_lsn`` (and ``_pgcdc_bucket`` for a bucketed table).
* ``slot_lag_within_bound``: the slot's unconfirmed WAL is at most ``checks.max_lag_bytes``;
  past that the source keeps WAL for us and risks disk or slot loss.

They live in the drain step (not a separate one) so they share its Spark session: a second
step would start a second engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from dagster import AssetCheckKey, AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetKey, MetadataValue
from pyspark.sql import SparkSession

from pgcdc_assets.dagster_resources import PostgresResource
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN, read_snapshot_marker
from resources.names import ROW_COUNT_CHECK, SCHEMA_CHECK, SLOT_LAG_CHECK
from resources.pgtypes import column_type_from_catalog, pg_type_catalog_params, pg_type_catalog_query, spark_ddl_type
from resources.postgres.catalog import read_table, TableName


def table_check_specs(key: AssetKey) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(ROW_COUNT_CHECK, asset=key, description="Delta row count equals PostgreSQL's"),
        AssetCheckSpec(SCHEMA_CHECK, asset=key, description="Delta columns and types match the published columns"),
        AssetCheckSpec(SLOT_LAG_CHECK, asset=key, description="replication slot lag <= checks.max_lag_bytes"),
    ]


def postgres_row_count(postgres: PostgresResource, table: TableName) -> int:
    """Rows the publication publishes: ONLY for plain tables and the row filter, as the snapshot copies."""
    with postgres.connect() as conn:
        info = read_table(conn, postgres.config.publication, table)
        only = "ONLY " if info.relkind == "r" else ""
        where = f" WHERE {info.row_filter}" if info.row_filter else ""
        row = conn.execute(f"SELECT pg_catalog.count(*) FROM {only}{info.table.quoted}{where}").fetchone()
    assert row is not None
    return int(row[0])


def postgres_columns(postgres: PostgresResource, table: TableName) -> list[tuple[str, str]]:
    """(name, Delta type) of the published columns, by the same mapping the snapshot uses."""
    with postgres.connect() as conn:
        info = read_table(conn, postgres.config.publication, table)
        rows = conn.execute(
            pg_type_catalog_query(), pg_type_catalog_params((c.type_oid, c.type_modifier) for c in info.columns)
        ).fetchall()
    return [
        (column.name, spark_ddl_type(column_type_from_catalog(column.name, row)))
        for column, row in zip(info.columns, rows, strict=True)
    ]


def delta_columns(spark: SparkSession, path: str) -> list[tuple[str, str]]:
    return [(field.name, field.dataType.simpleString()) for field in spark.read.format("delta").load(path).schema]


def evaluate_table_checks(
    postgres: PostgresResource,
    spark: SparkSession,
    table: TableName,
    key: AssetKey,
    selected: set[AssetCheckKey],
    slot_lag: int | None,
) -> Iterator[AssetCheckResult]:
    """The selected checks of one table; ``slot_lag`` None means the slot does not exist."""
    config = postgres.config
    path = config.table_path(table.schema, table.name)
    snapshot_lsn, layout = read_snapshot_marker(spark, path)
    has_snapshot = snapshot_lsn is not None
    no_snapshot = f"no snapshot of {table} at {path}: run the pgcdc_snapshot job"

    if AssetCheckKey(key, ROW_COUNT_CHECK) in selected:
        if not has_snapshot:
            yield AssetCheckResult(
                asset_key=key, check_name=ROW_COUNT_CHECK, passed=False, severity=AssetCheckSeverity.WARN,
                description=no_snapshot,
            )  # fmt: skip
        else:
            delta_rows = spark.read.format("delta").load(path).count()
            pg_rows = postgres_row_count(postgres, table)
            yield AssetCheckResult(
                asset_key=key,
                check_name=ROW_COUNT_CHECK,
                passed=delta_rows == pg_rows,
                severity=AssetCheckSeverity.WARN,
                metadata={"delta_rows": MetadataValue.int(delta_rows), "postgres_rows": MetadataValue.int(pg_rows)},
                description=None if delta_rows == pg_rows else f"Delta has {delta_rows} rows, PostgreSQL {pg_rows}",
            )

    if AssetCheckKey(key, SCHEMA_CHECK) in selected:
        if not has_snapshot:
            yield AssetCheckResult(asset_key=key, check_name=SCHEMA_CHECK, passed=False, description=no_snapshot)
        else:
            expected = [*postgres_columns(postgres, table), (LSN_COLUMN, "bigint")]
            if layout is not None:
                expected.append((BUCKET_COLUMN, "bigint"))
            actual = delta_columns(spark, path)
            missing = [f"{name} {kind}" for name, kind in expected if (name, kind) not in actual]
            unexpected = [f"{name} {kind}" for name, kind in actual if (name, kind) not in expected]
            yield AssetCheckResult(
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

    if AssetCheckKey(key, SLOT_LAG_CHECK) in selected:
        bound = config.checks.max_lag_bytes
        if slot_lag is None:
            yield AssetCheckResult(
                asset_key=key, check_name=SLOT_LAG_CHECK, passed=False,
                description=f'replication slot "{config.slot}" does not exist: run the pgcdc_snapshot job',
            )  # fmt: skip
        else:
            yield AssetCheckResult(
                asset_key=key,
                check_name=SLOT_LAG_CHECK,
                passed=slot_lag <= bound,
                metadata={"slot_lag_bytes": MetadataValue.int(slot_lag), "max_lag_bytes": MetadataValue.int(bound)},
            )
