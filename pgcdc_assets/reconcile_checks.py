"""Reconciliation asset checks on each Delta-table asset, evaluated by the ``pgcdc_reconcile`` job.

* ``row_count_matches_postgres``: Delta holds exactly as many rows as PostgreSQL publishes.
* ``rows_match_postgres``: every key range holds the same rows (count and hash per range);
  a failure names the ranges and, when they are small, the differing keys.

Both come from one comparison at one fixed LSN (``resources/runs/reconcile.py``): the drain up to
that LSN and PostgreSQL's snapshot at it see the same transactions, so they are exact under
live writes and are errors, not warnings. The op drains the slot first, so it runs in the
slot's concurrency pool like the drain step; its drain is recorded as a drain step's is
(``incremental_assets.drain_events``, as runtime events: an asset-check op has no asset outputs):
the slot asset's materialization, and one for each table it changed. Cost: a read of each table on both sides, hence a job of its
own (run it nightly, or after an incident), never part of a drain.

Per pipeline like the drain step: a named pipeline's op is ``pgcdc_<pipeline>_reconcile_tables``
in job ``pgcdc_<pipeline>_reconcile``, on its ``names.postgres_key``/``names.spark_key`` resources.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

from collections.abc import Iterator, Mapping, Sequence

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSpec,
    AssetKey,
    Field,
    MetadataValue,
    op,
)

from pgcdc_assets.common import TRANSIENT_RETRY_POLICY, user_facing
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.incremental_assets import drain_events, DrainEvent, recorded_position
from pgcdc_assets.named_outputs import NamedOutputs
from resources.names import PipelineNames, RECONCILE_JOB, ROW_COUNT_CHECK, ROWS_MATCH_CHECK, slot_pool
from resources.postgres.catalog import TableName
from resources.runs.reconcile import RANGE_ROWS, reconcile, ReconcileResult, TableReconciliation

SHOWN_RANGES = 20


def reconcile_check_specs(key: AssetKey, job: str) -> list[AssetCheckSpec]:
    """The two checks of one table's asset; ``job`` is the pipeline's reconcile job, named in their descriptions."""
    return [
        AssetCheckSpec(
            ROW_COUNT_CHECK, asset=key, description=f"Delta holds as many rows as PostgreSQL at one fixed LSN ({job})"
        ),
        AssetCheckSpec(
            ROWS_MATCH_CHECK,
            asset=key,
            description=f"Every key range of Delta equals PostgreSQL's at one fixed LSN ({job})",
        ),
    ]


def build_reconcile_checks(
    slot: str,
    tables: Sequence[TableName],
    key_of: Mapping[TableName, AssetKey],
    slot_key: AssetKey,
    names: PipelineNames,
) -> AssetChecksDefinition:
    """One pipeline's reconciliation op: named, resourced and pooled like its drain step (``names``, ``slot``);
    ``slot_key`` is the pipeline's slot asset, which its drain materializes."""
    job = names.scoped(RECONCILE_JOB)
    named = NamedOutputs(check_specs=[spec for table in tables for spec in reconcile_check_specs(key_of[table], job)])

    @op(
        name=names.scoped("reconcile_tables"),
        ins=named.ins,
        out=named.outs,
        pool=slot_pool(slot),
        required_resource_keys={names.postgres_key, names.spark_key},
        retry_policy=TRANSIENT_RETRY_POLICY,
        config_schema={
            "range_rows": Field(
                int, default_value=RANGE_ROWS, description="rows per compared key range (by PostgreSQL's estimate)"
            )
        },
        description="Fix one LSN, drain the slot up to it, compare each table with PostgreSQL's snapshot at it.",
    )
    def reconcile_tables(context: AssetCheckExecutionContext) -> Iterator[DrainEvent]:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        spark: SparkDeltaResource = getattr(context.resources, names.spark_key)
        checked = set(context.selected_asset_check_keys)
        selected = [
            table for table in tables
            if {AssetCheckKey(key_of[table], ROW_COUNT_CHECK), AssetCheckKey(key_of[table], ROWS_MATCH_CHECK)} & checked
        ]  # fmt: skip
        recorded = recorded_position(context.instance, slot_key)
        with user_facing():
            result = reconcile(
                postgres.config, spark.destination, selected, log=context.log.info,
                range_rows=context.op_execution_context.op_config["range_rows"],
            )  # fmt: skip
        yield from drain_events(result.drain, tables, key_of, slot_key, set(), names, context.log.warning, recorded)
        for table in selected:
            for check in (ROW_COUNT_CHECK, ROWS_MATCH_CHECK):
                if AssetCheckKey(key_of[table], check) in checked:
                    yield _check_result(result, table, key_of[table], check)

    return named.checks_definition(reconcile_tables)


def _check_result(result: ReconcileResult, table: TableName, key: AssetKey, check: str) -> AssetCheckResult:
    common = {
        "pgcdc/reconcile_lsn": MetadataValue.text(str(result.lsn)),
        "pgcdc/changes_drained": MetadataValue.int(result.drain.changes),
    }
    outcome = result.tables.get(str(table))
    if outcome is None:
        reason = result.skipped.get(str(table), "not compared")
        return AssetCheckResult(asset_key=key, check_name=check, passed=False, description=reason, metadata=common)
    counts = {
        "postgres_rows": MetadataValue.int(outcome.postgres_rows),
        "delta_rows": MetadataValue.int(outcome.delta_rows),
        "pgcdc/duration_s": MetadataValue.float(round(outcome.duration_s, 3)),
    }
    if check == ROW_COUNT_CHECK:
        equal = outcome.postgres_rows == outcome.delta_rows
        return AssetCheckResult(
            asset_key=key,
            check_name=check,
            passed=equal,
            metadata={**common, **counts},
            description=None if equal else f"Delta has {outcome.delta_rows} rows, PostgreSQL {outcome.postgres_rows}",
        )
    return AssetCheckResult(
        asset_key=key,
        check_name=check,
        passed=outcome.passed,
        metadata={**common, **counts, **_range_metadata(outcome)},
        description=None if outcome.passed else _mismatch_summary(outcome),
    )


def _range_metadata(outcome: TableReconciliation) -> dict[str, MetadataValue]:
    metadata: dict[str, MetadataValue] = {
        "ranges": MetadataValue.text(outcome.ranging),
        "columns_compared": MetadataValue.text(", ".join(outcome.columns)),
        "mismatched_ranges": MetadataValue.int(len(outcome.mismatches)),
    }
    if outcome.not_in_delta:
        metadata["columns_not_in_delta"] = MetadataValue.text(", ".join(outcome.not_in_delta))
    if outcome.mismatches:
        metadata["mismatches"] = MetadataValue.md(
            "| range | PostgreSQL rows | Delta rows |\n|---|---|---|\n"
            + "\n".join(
                f"| `{m.range}` | {m.postgres_rows} | {m.delta_rows} |" for m in outcome.mismatches[:SHOWN_RANGES]
            )
        )
    if outcome.differing_keys:
        metadata["differing_keys"] = MetadataValue.text(", ".join(outcome.differing_keys))
    if outcome.differing_rows is not None:
        metadata["differing_rows"] = MetadataValue.int(outcome.differing_rows)
    return metadata


def _mismatch_summary(outcome: TableReconciliation) -> str:
    ranges = "; ".join(m.range for m in outcome.mismatches[:3])
    more = f" and {len(outcome.mismatches) - 3} more" if len(outcome.mismatches) > 3 else ""
    keys = f"; differing keys: {', '.join(outcome.differing_keys)}" if outcome.differing_keys else ""
    return f"{len(outcome.mismatches)} range(s) differ: {ranges}{more}{keys}; re-snapshot the table to repair it"
