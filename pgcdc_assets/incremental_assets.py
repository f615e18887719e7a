"""The incremental multi-asset: the pipeline's slot asset and one Delta-table asset per table, all fed by one slot drain.

Decisions:

* **One drain for every table.** The slot is shared, and confirming it past a change of a
  table that was not applied would lose that change. So the step always applies every
  table's changes, whatever the selection.
* **Events cost what the drain changed.** The ``pgcdc_incremental`` job selects only the slot
  asset (and its lag check), so Dagster plans one materialization and one check per run, not
  one per table: it writes a planned event for every output a run selects, whether the step
  yields it or not, so optional outputs over every table would still cost each table every run.
  Every drain materializes the slot asset (``slot_metadata``), and materializes a Delta-table
  asset only when the table changed since the drain the slot asset last recorded
  (``changed_tables``): when this drain wrote it, or an earlier drain that Dagster never recorded
  did (one killed after confirming the slot, one outside Dagster, a key-range snapshot's). An asset the run selected gets its
  materialization as an output (``MaterializeResult``); one it did not select (a changed table
  under the schedule's job) as a runtime ``AssetMaterialization``: the same record on the asset's
  page, without the planning, the output handling and the data-version lookups. So a table's
  latest materialization is its latest change, and the slot asset's is the latest drain. A table
  that keeps history (docs/history.md) has a history asset downstream of it, materialized the same
  way by the drains that wrote to its history (``history_metadata``).
* **A table that left the publication** (dropped, renamed, removed from it) keeps its Delta table and
  its asset while the code location defines it (a pipeline that lists ``tables``; one that takes the
  whole publication defines it until the code location reloads): the drain that applies its last
  changes materializes it with ``pgcdc/departed`` (why it left, the fix), later drains record that as
  an ``AssetObservation``, and the slot asset lists such tables (``pgcdc/departed_tables``).
* **Tables without a snapshot are not materialized.** The drain skips their changes
  (nothing to apply them to); the step logs them and records an ``AssetObservation`` with
  ``pgcdc/skipped`` so the asset page says why, instead of a materialization claiming data.
  So does a table the code location defines that is no longer replicated.
* **One drain per slot at a time**: the step runs in the concurrency pool
  ``pgcdc_slot_<slot>``; PostgreSQL itself refuses a second consumer of an active slot.
  Pipelines of one code location with different slots are in different pools and drain
  at the same time.
* **Retries only for ConnectionFailure** (see ``common.user_facing``).
* Checks run in this step after the drain (see ``checks.py``): the lag check once per drain on
  the slot asset, the schema check only for the tables whose schema the drain saw change, the
  quarantine check only for the tables the drain set aside or lifted, as check evaluations whether
  the run selected them or not. Selecting only checks runs the selected ones without draining.
* **A quarantined table fails the run once, after the rest is committed and confirmed**
  (``resources/runs/quarantine.py``): the drain that sets a table aside records everything else,
  then fails with the table's one line, so alerting fires; later drains skip the table, record an
  ``AssetObservation`` saying why, and succeed while its check stays red.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

import re
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from typing import Any
from urllib.parse import quote

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckResult,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetsDefinition,
    DagsterInstance,
    MaterializeResult,
    MetadataValue,
    op,
)

from pgcdc_assets.checks import (
    evaluate_lag_check,
    evaluate_quarantine_check,
    evaluate_schema_check,
    schema_check_due,
    slot_check_specs,
    table_check_specs,
    table_log_reader,
)
from pgcdc_assets.common import TRANSIENT_RETRY_POLICY, user_facing
from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from pgcdc_assets.named_outputs import NamedOutputs
from pgcdc_assets.translator import PgcdcSlotProps, PgcdcTableProps, PgcdcTranslator, schedule_interval
from resources.config import PgcdcConfig
from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.names import PipelineNames, QUARANTINE_CHECK, SCHEMA_CHECK, SLOT_LAG_CHECK, slot_pool, SNAPSHOT_JOB
from resources.postgres.catalog import TableName
from resources.postgres.table_locks import RUN_NAME
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.quarantine import read_quarantines

#: Changed tables listed (with links) in a slot materialization; the count is always complete.
LISTED_TABLES = 50

DrainEvent = MaterializeResult | AssetMaterialization | AssetObservation | AssetCheckResult | AssetCheckEvaluation


def drain_figures(result: IncrementalResult) -> dict[str, Any]:
    """What one drain did and where it left the slot: the part of the metadata the slot asset and a
    changed table's materialization share."""
    return {
        "pgcdc/confirmed_flush_lsn": MetadataValue.text(str(result.confirmed_flush_lsn)),
        "pgcdc/start_lsn": MetadataValue.text(str(result.start_lsn)),
        "pgcdc/end_lsn": MetadataValue.text(str(result.end_lsn)),
        "pgcdc/transactions_applied": MetadataValue.int(result.transactions),
        "pgcdc/changes_applied": MetadataValue.int(result.changes),
        "pgcdc/changes_skipped": MetadataValue.int(result.changes_skipped),
        "pgcdc/slot_lag_bytes_before": MetadataValue.int(result.lag_bytes_before),
        "pgcdc/slot_lag_bytes_after": MetadataValue.int(result.lag_bytes_after),
        "pgcdc/duration_s": MetadataValue.float(round(result.duration_s, 3)),
        "pgcdc/changes_per_second": MetadataValue.float(round(result.changes_per_second, 1)),
        "pgcdc/peak_memory_mib": MetadataValue.float(round(result.peak_memory_mib, 1)),
    }


def drain_metadata(result: IncrementalResult, table: TableName) -> dict[str, Any]:
    """A changed table's materialization metadata; LSNs as X/Y text, counts and lags as numbers to plot."""
    stats = result.tables[str(table)]
    metadata: dict[str, Any] = {
        **drain_figures(result),
        "pgcdc/inserted": MetadataValue.int(stats.inserted),
        "pgcdc/updated": MetadataValue.int(stats.updated),
        "pgcdc/deleted": MetadataValue.int(stats.deleted),
        "pgcdc/truncates": MetadataValue.int(stats.truncates),
        # what the drain's commits to the table wrote: with deletion vectors, in proportion to the rows changed
        "pgcdc/bytes_written": MetadataValue.int(stats.bytes_written),
    }
    if stats.delta_version is not None:
        metadata["pgcdc/delta_version"] = MetadataValue.int(stats.delta_version)
    if stats.applied_lsn is not None:
        metadata["pgcdc/applied_lsn"] = MetadataValue.text(str(stats.applied_lsn))
    if stats.last_applied_lsn is not None:
        metadata["pgcdc/last_applied_lsn"] = MetadataValue.text(str(stats.last_applied_lsn))
    if stats.unpruned is not None:  # a bucketed table whose MERGEs read every bucket, and what restores it
        metadata["pgcdc/bucket_pruning_lost"] = MetadataValue.text(stats.unpruned)
    if stats.history_rows is not None:  # the table keeps a changelog (docs/history.md)
        metadata["pgcdc/history_rows"] = MetadataValue.int(stats.history_rows)
    return metadata


def history_metadata(result: IncrementalResult, table: TableName) -> dict[str, object]:
    """A history asset's materialization metadata: the changes the drain recorded and up to where."""
    stats = result.tables[str(table)]
    metadata: dict[str, object] = {
        "pgcdc/history_rows": MetadataValue.int(stats.history_rows or 0),
        "pgcdc/confirmed_flush_lsn": MetadataValue.text(str(result.confirmed_flush_lsn)),
    }
    if stats.applied_lsn is not None:
        metadata["pgcdc/applied_lsn"] = MetadataValue.text(str(stats.applied_lsn))
    return metadata


def recorded_position(instance: DagsterInstance, slot_key: AssetKey) -> LSN | None:
    """The slot's confirmed position at the last drain Dagster recorded (None: none recorded yet)."""
    event = instance.get_latest_materialization_event(slot_key)
    materialization = event.asset_materialization if event is not None else None
    value = materialization.metadata.get("pgcdc/confirmed_flush_lsn") if materialization is not None else None
    return LSN.parse(str(value.value)) if value is not None else None


def changed_tables(result: IncrementalResult, tables: Sequence[TableName], recorded: LSN | None) -> list[TableName]:
    """The tables of ``tables`` the drain wrote to Delta, or whose newest applied change lies past
    ``recorded`` (``recorded_position``): applied by a drain no materialization recorded."""
    changed = []
    for table in tables:
        stats = result.tables.get(str(table))
        if stats is None:
            continue
        last = stats.last_applied_lsn
        if stats.applied_lsn is not None or (last is not None and (recorded is None or last > recorded)):
            changed.append(table)
    return changed


def slot_metadata(result: IncrementalResult, changed: Mapping[TableName, AssetKey]) -> dict[str, Any]:
    """The slot asset's metadata of one drain: where the slot stands, what the drain did, which tables it changed."""
    listed = list(changed.items())[:LISTED_TABLES]
    links = "\n".join(f"- [{_markdown_text(table.written)}]({asset_page(key)})" for table, key in listed)
    more = f"\n- and {len(changed) - len(listed)} more" if len(changed) > len(listed) else ""
    metadata: dict[str, Any] = {
        **drain_figures(result),
        "pgcdc/tables_changed": MetadataValue.int(len(changed)),
        "pgcdc/bytes_written": MetadataValue.int(sum(stats.bytes_written for stats in result.tables.values())),
        "pgcdc/changed_tables": MetadataValue.md(links + more if changed else "none"),
    }
    if result.tables_without_snapshot:
        metadata["pgcdc/tables_without_snapshot"] = MetadataValue.text(", ".join(result.tables_without_snapshot))
    if result.departed:  # no longer published, their Delta tables kept (resources/runs/drain_tables.py)
        metadata["pgcdc/departed_tables"] = MetadataValue.md(
            "\n".join(f"- {line}" for line in result.departed.values())
        )
    if result.unregistered:  # written and confirmed, but not registered by name (resources/runs/catalog_names.py)
        metadata["pgcdc/unregistered_tables"] = MetadataValue.md(
            "\n".join(f"- {line}" for line in result.unregistered.values())
        )
    metadata["pgcdc/tables_quarantined"] = MetadataValue.int(len(result.quarantined))
    if result.quarantined:
        metadata["pgcdc/quarantined_tables"] = MetadataValue.md(
            "\n".join(f"- {quarantine.describe()}" for quarantine in result.quarantined.values())
        )
    return metadata


def asset_page(key: AssetKey) -> str:
    """The UI's page of ``key``: each part percent-encoded, so a space, ``/`` or quote in a table's name stays in its part."""
    return "/assets/" + "/".join(quote(part, safe="") for part in key.path)


def _markdown_text(text: str) -> str:
    """``text`` shown as itself in Markdown link text: ``\\``, brackets, ``*``, backticks and angle brackets
    escaped (``_`` is left: inside a word, as in ``order_items``, Markdown reads it as itself)."""
    return re.sub(r"([\\\[\]*`<>])", r"\\\1", text)


def materialization(selected: Set[AssetKey], key: AssetKey, metadata: dict[str, Any]) -> DrainEvent:
    """An output when the run selected ``key`` (planned, so expected), else a runtime event (module docstring)."""
    if key in selected:
        return MaterializeResult(asset_key=key, metadata=metadata)
    return AssetMaterialization(asset_key=key, metadata=metadata)


def check_event(selected: Set[AssetCheckKey], result: AssetCheckResult) -> DrainEvent:
    """The check's result as an output when the run selected it, else as an evaluation event of its own."""
    asset_key, check_name = result.asset_key, result.check_name
    assert asset_key is not None and check_name is not None  # pgcdc's checks name both
    if AssetCheckKey(asset_key, check_name) in selected:
        return result
    return AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=check_name,
        passed=result.passed,
        metadata=result.metadata,
        severity=result.severity,
        description=result.description,
    )


def _skip_reason(result: IncrementalResult, table: TableName, names: PipelineNames) -> str | None:
    """Why the drain did not write ``table``, or None when it could have."""
    quarantine = result.quarantined.get(str(table))
    if quarantine is not None:
        return quarantine.describe()
    if str(table) in result.tables_without_snapshot:
        return f"{table.written} has no snapshot yet: its changes were skipped; run the {names.scoped(SNAPSHOT_JOB)} job for it"
    if str(table) not in result.tables:
        return f"{table.written} is no longer replicated (not in the publication or 'tables'): reload the code location"
    return None


def drain_events(
    result: IncrementalResult,
    tables: Sequence[TableName],
    key_of: Mapping[TableName, AssetKey],
    slot_key: AssetKey,
    selected: Set[AssetKey],
    names: PipelineNames,
    log_warning: Callable[[str], None],
    recorded: LSN | None,
    history_key_of: Mapping[TableName, AssetKey] | None = None,
) -> Iterator[DrainEvent]:
    """What one drain records: its changed tables' materializations (and their histories', when it wrote
    to them: ``history_key_of``), why any table was skipped, and the slot's; ``recorded`` is the slot's
    position at the last recorded drain (``recorded_position``)."""
    changed = {table: key_of[table] for table in changed_tables(result, tables, recorded)}
    for table in tables:
        reason = _skip_reason(result, table, names)
        departed = result.departed.get(str(table))
        if reason:
            log_warning(reason)
            yield AssetObservation(asset_key=key_of[table], metadata={"pgcdc/skipped": reason})
        elif table in changed:
            metadata = drain_metadata(result, table)
            if departed is not None:  # its last changes, drained after it left the publication
                metadata["pgcdc/departed"] = MetadataValue.text(departed)
            yield materialization(selected, key_of[table], metadata)
            history_key = (history_key_of or {}).get(table)
            if history_key is not None and result.tables[str(table)].history_rows:
                yield materialization(selected, history_key, history_metadata(result, table))
        elif departed is not None:
            yield AssetObservation(asset_key=key_of[table], metadata={"pgcdc/departed": departed})
    yield materialization(selected, slot_key, slot_metadata(result, changed))


def build_incremental_assets(
    config: PgcdcConfig, tables: Sequence[TableName], translator: PgcdcTranslator, names: PipelineNames
) -> AssetsDefinition:
    props = {table: PgcdcTableProps.of(config, table, names) for table in tables}
    key_of: Mapping[TableName, AssetKey] = {t: translator.get_table_asset_key(p) for t, p in props.items()}
    history_key_of = {t: translator.get_history_asset_key(p) for t, p in props.items() if p.history_path is not None}
    slot_props = PgcdcSlotProps.of(config, names)
    slot_key = translator.get_slot_asset_key(slot_props)

    named = NamedOutputs(
        specs=[
            translator.get_slot_asset_spec(slot_props),
            *(translator.get_table_asset_spec(p) for p in props.values()),
            *(translator.get_history_asset_spec(p) for p in props.values() if p.history_path is not None),
        ],
        check_specs=[
            *slot_check_specs(slot_key),
            *(spec for key in key_of.values() for spec in table_check_specs(key)),
        ],
    )

    @op(
        name=names.scoped("drain_slot"),
        ins=named.ins,
        out=named.outs,
        pool=slot_pool(config.slot),
        required_resource_keys={names.postgres_key, names.spark_key},
        retry_policy=TRANSIENT_RETRY_POLICY,
        description="Drain the replication slot once into Delta, confirm it, then record the drain and what it changed.",
    )
    def drain_slot(context: AssetExecutionContext) -> Iterator[DrainEvent]:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        spark: SparkDeltaResource = getattr(context.resources, names.spark_key)
        selected = context.selected_asset_keys
        checked = set(context.selected_asset_check_keys)
        RUN_NAME.set(f"run {context.run.run_id}")  # named in its table locks' sessions
        with user_facing():
            if selected:
                recorded = recorded_position(context.instance, slot_key)
                result = run_incremental(
                    postgres.config, spark.destination, log=context.log.info, warn=context.log.warning,
                    schedule_gap=schedule_interval(postgres.config.schedule.cron),
                )  # fmt: skip
                yield from drain_events(
                    result, tables, key_of, slot_key, selected, names, context.log.warning, recorded, history_key_of
                )
                yield check_event(checked, evaluate_lag_check(postgres.config, slot_key, result.lag_bytes_after, names))
                for table in tables:
                    if str(table) in result.newly_quarantined or str(table) in result.lifted:
                        quarantine = result.quarantined.get(str(table))
                        yield check_event(checked, evaluate_quarantine_check(key_of[table], table, quarantine))
                due = [table for table in tables if schema_check_due(table, result)]
            else:  # only checks selected: evaluate those, without draining
                if AssetCheckKey(slot_key, SLOT_LAG_CHECK) in checked:
                    state = postgres.read_slot()
                    lag = None if state is None else postgres.slot_lag_bytes(state)
                    yield evaluate_lag_check(postgres.config, slot_key, lag, names)
                yield from _quarantine_checks(postgres.config, spark, tables, key_of, checked)
                due = [table for table in tables if AssetCheckKey(key_of[table], SCHEMA_CHECK) in checked]
                result = None
            if due:
                session = spark.spark_session
                table_log = table_log_reader(postgres.config, spark.destination)
                for table in due:
                    without_snapshot = result is not None and str(table) in result.tables_without_snapshot
                    yield check_event(
                        checked,
                        evaluate_schema_check(
                            postgres, session, table_log, table, key_of[table], without_snapshot, names
                        ),
                    )
            if result is not None and result.newly_quarantined:
                raise QuarantineFailure(result)

    return named.assets_definition(drain_slot)


class QuarantineFailure(PgcdcError):
    """The drain set tables aside: raised after every other table is committed and confirmed, so the run fails once."""

    def __init__(self, result: IncrementalResult) -> None:
        quarantines = [result.quarantined[name] for name in result.newly_quarantined]
        others = (
            f" (and {len(quarantines) - 1} more table(s), listed on the slot asset)" if len(quarantines) > 1 else ""
        )
        first = quarantines[0]
        super().__init__(
            f"{first.describe().removesuffix(f': {first.fix}')}{others}; every other table was applied and the slot "
            f"confirmed at {result.confirmed_flush_lsn}",
            first.fix,
        )


def _quarantine_checks(
    config: PgcdcConfig,
    spark: SparkDeltaResource,
    tables: Sequence[TableName],
    key_of: Mapping[TableName, AssetKey],
    checked: Set[AssetCheckKey],
) -> Iterator[AssetCheckResult]:
    """The selected ``table_not_quarantined`` checks, from the pipeline's records (no drain)."""
    selected = [table for table in tables if AssetCheckKey(key_of[table], QUARANTINE_CHECK) in checked]
    if selected:
        quarantined = read_quarantines(config, spark.destination.lake)
        for table in selected:
            yield evaluate_quarantine_check(key_of[table], table, quarantined.get(str(table)))
