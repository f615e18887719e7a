"""How each replicated table appears in Dagster, in the style of dagster-dlt and dagster-sling.

Every table gets two assets: its *snapshot* (the initial copy, taken consistently with the
slot) and its *Delta table* (kept current by incremental drains, downstream of the
snapshot). Each pipeline gets one more: its *slot* (``pgcdc/slot``, ``pgcdc/<pipeline>/slot``),
materialized by every drain, which is what the schedule's job selects. A Delta-table asset is
materialized only by the drains that changed that table, so its latest materialization says
when the table last changed and at which LSN; how recently the pipeline drained is the slot
asset's, and so is the freshness policy (an idle table is as fresh as its slot's last drain).
Subclass :class:`PgcdcTranslator` to change keys, groups or metadata; the assets, jobs, checks
and sensors all ask the translator, so they stay consistent.

Keys hold each table's real schema and table name as parts, whatever characters PostgreSQL let
them have (Dagster takes any string as a key's part): ``pgcdc/My Schema/Order Items``. The names
Dagster requires to match ``^[A-Za-z0-9_]+$`` (the ops' outputs and inputs) are pgcdc's own,
derived from the keys (``named_outputs.py``); descriptions name the table as SQL writes it.

A pipeline of the pgcdc Component (``props.pipeline`` set) gets its own key prefix
``pgcdc/<pipeline>/...`` and groups ``pgcdc_<pipeline>``/``pgcdc_<pipeline>_snapshot``;
the single-file path (``pipeline`` None) keeps the keys and groups it always had.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice, pairwise

from dagster import AssetKey, AssetSpec, FreshnessPolicy, MetadataValue

from pgcdc_assets.dagster_private import cron_string_iterator
from resources.config import PgcdcConfig
from resources.names import PipelineNames
from resources.postgres.catalog import TableName
from resources.runs.catalog_names import catalog_targets

KINDS = {"postgres", "delta", "spark"}
SNAPSHOT_GROUP = "pgcdc_snapshot"
TABLE_GROUP = "pgcdc"

#: Freshness windows of the slot asset as multiples of the schedule's longest gap between ticks:
#: one missed drain warns, two missed drains fail.
FRESHNESS_WARN_INTERVALS = 2
FRESHNESS_FAIL_INTERVALS = 3
#: Ticks looked at to find a schedule's longest gap (a week of a */30 schedule; weekday schedules included).
_CRON_TICKS_EXAMINED = 400


def schedule_interval(cron: str) -> timedelta:
    """The longest gap between consecutive ticks of ``cron`` (UTC): how long a slot may go undrained.

    The longest gap, not the typical one, so a weekday schedule does not mark every table
    stale over the weekend.
    """
    ticks = islice(cron_string_iterator(time.time(), cron, "UTC"), _CRON_TICKS_EXAMINED)
    return max(later - earlier for earlier, later in pairwise(ticks))


@dataclass(frozen=True, slots=True)
class PgcdcTableProps:
    """What a translator may use to describe one table."""

    table: TableName
    delta_path: str
    publication: str
    slot: str
    #: The Component pipeline's name; None on the single-file (PGCDC_CONFIG) path.
    pipeline: str | None = None
    #: Where the table's history lives (docs/history.md); None: it keeps none.
    history_path: str | None = None
    #: ``changelog`` or ``scd2`` (``none`` without history).
    history_mode: str = "none"
    #: The table's name in the catalog (``catalog:``), as readers type it; None: registered nowhere.
    catalog_name: str | None = None
    #: Its history's name in the catalog; None: registered nowhere, or no history.
    history_catalog_name: str | None = None

    @classmethod
    def of(cls, config: PgcdcConfig, table: TableName, names: PipelineNames = PipelineNames()) -> PgcdcTableProps:
        catalog = [str(target.name) for target in catalog_targets(config, table)] + [None, None]
        return cls(
            table, config.table_path(table.schema, table.name), config.publication, config.slot, names.pipeline,
            config.history_path(table.schema, table.name), config.history.mode(table), catalog[0], catalog[1],
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PgcdcSlotProps:
    """What a translator may use to describe one pipeline's slot asset."""

    slot: str
    publication: str
    #: The Component pipeline's name; None on the single-file (PGCDC_CONFIG) path.
    pipeline: str | None = None
    #: The pipeline's schedule.cron: what the freshness policy is derived from.
    cron: str = "*/5 * * * *"

    @classmethod
    def of(cls, config: PgcdcConfig, names: PipelineNames = PipelineNames()) -> PgcdcSlotProps:
        return cls(config.slot, config.publication, names.pipeline, config.schedule.cron)


class PgcdcTranslator:
    """Table -> AssetSpec for the snapshot asset and for the incrementally maintained Delta table;
    pipeline -> AssetSpec for its slot asset."""

    def _prefix(self, props: PgcdcTableProps | PgcdcSlotProps) -> list[str]:
        return ["pgcdc"] if props.pipeline is None else ["pgcdc", props.pipeline]

    def get_snapshot_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey([*self._prefix(props), "snapshot", props.table.schema, props.table.name])

    def get_table_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey([*self._prefix(props), props.table.schema, props.table.name])

    def get_history_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        """``pgcdc/history/<schema>/<table>``: the table's changelog or SCD type 2 table."""
        return AssetKey([*self._prefix(props), "history", props.table.schema, props.table.name])

    def get_slot_asset_key(self, props: PgcdcSlotProps) -> AssetKey:
        """``pgcdc/slot`` or ``pgcdc/<pipeline>/slot``: one part fewer than any table's key, so never a table's."""
        return AssetKey([*self._prefix(props), "slot"])

    def get_group_name(self, props: PgcdcTableProps | PgcdcSlotProps) -> str:
        return TABLE_GROUP if props.pipeline is None else f"{TABLE_GROUP}_{props.pipeline}"

    def get_snapshot_group_name(self, props: PgcdcTableProps) -> str:
        return SNAPSHOT_GROUP if props.pipeline is None else f"{TABLE_GROUP}_{props.pipeline}_snapshot"

    def get_freshness_policy(self, props: PgcdcSlotProps) -> FreshnessPolicy | None:
        """The slot asset's: stale after missed drains, warn past 2x, fail past 3x the schedule's longest gap.

        On the slot, not on the tables: a table with no changes gets no materialization, and is
        as fresh as its slot's last drain.
        """
        interval = schedule_interval(props.cron)
        return FreshnessPolicy.time_window(
            fail_window=interval * FRESHNESS_FAIL_INTERVALS, warn_window=interval * FRESHNESS_WARN_INTERVALS
        )

    def _metadata(self, props: PgcdcTableProps) -> dict[str, object]:
        pipeline = {} if props.pipeline is None else {"pgcdc/pipeline": props.pipeline}
        return {
            **pipeline,
            "pgcdc/table": props.table.quoted,
            "pgcdc/publication": props.publication,
            "pgcdc/slot": props.slot,
            "pgcdc/delta_path": MetadataValue.path(props.delta_path),
            **_table_location(props.delta_path, props.catalog_name),
        }

    def get_snapshot_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        # skippable: a run configured with an explicit table list (pgcdc_resnapshot) copies only those.
        return AssetSpec(
            key=self.get_snapshot_asset_key(props),
            description=(
                f"Initial copy of PostgreSQL table {props.table.written} into Delta at {props.delta_path}, taken at an LSN"
                f' consistent with replication slot "{props.slot}"; re-materializing it re-snapshots the table.'
            ),
            group_name=self.get_snapshot_group_name(props),
            kinds=KINDS,
            metadata=self._metadata(props),
            skippable=True,
        )

    def get_table_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        # skippable: a drain materializes only the tables it changed (module docstring).
        return AssetSpec(
            key=self.get_table_asset_key(props),
            deps=[self.get_snapshot_asset_key(props)],
            description=(
                f"Delta copy of PostgreSQL table {props.table.written} at {props.delta_path}, kept current by draining"
                f' replication slot "{props.slot}" (publication "{props.publication}") in micro-batches.'
                " Materialized by the drains that changed it: the latest materialization is its latest change."
            ),
            group_name=self.get_group_name(props),
            kinds=KINDS,
            metadata=self._metadata(props),
            skippable=True,
        )

    def get_history_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        """The table's history (``props.history_path`` must be set), downstream of the table; skippable as
        the table is: materialized by the drains that wrote to it."""
        assert props.history_path is not None, "only a table that keeps history has a history asset"
        what = (
            "SCD type 2 table (a row per version of each key)"
            if props.history_mode == "scd2"
            else "changelog (a row per row change)"
        )
        return AssetSpec(
            key=self.get_history_asset_key(props),
            deps=[self.get_table_asset_key(props)],
            description=(
                f"The {what} of PostgreSQL table {props.table.written} at {props.history_path}, written with the table's own"
                " changes by each drain, exactly once (docs/history.md). Materialized by the drains that wrote to it."
            ),
            group_name=self.get_group_name(props),
            kinds=KINDS,
            metadata={
                **self._metadata(props),
                "pgcdc/history_mode": props.history_mode,
                "pgcdc/delta_path": MetadataValue.path(props.history_path),
                **_table_location(props.history_path, props.history_catalog_name),
            },
            skippable=True,
        )

    def get_slot_asset_spec(self, props: PgcdcSlotProps) -> AssetSpec:
        # skippable: a run that selects only checks, or only some tables, need not yield it as an output.
        pipeline = {} if props.pipeline is None else {"pgcdc/pipeline": props.pipeline}
        return AssetSpec(
            key=self.get_slot_asset_key(props),
            description=(
                f'Replication slot "{props.slot}" (publication "{props.publication}"): materialized by every drain,'
                " with its confirmed_flush_lsn, lag, transactions, duration and the tables it changed."
                " Its freshness is the pipeline's: stale when drains stop."
            ),
            group_name=self.get_group_name(props),
            kinds={"postgres"},
            metadata={**pipeline, "pgcdc/slot": props.slot, "pgcdc/publication": props.publication},
            skippable=True,
            freshness_policy=self.get_freshness_policy(props),
        )


def _table_location(path: str, catalog_name: str | None) -> dict[str, str]:
    """What Dagster's UI shows, searches and links a table by: ``dagster/uri``, the Delta table's location as a
    URI, and ``dagster/table_name``, its name for the people who query it: its name in the catalog with
    ``catalog:`` (``spark_catalog.pg_shop.orders``), else the location (what ``delta.`<location>``` queries take)."""
    uri = path if "://" in path else f"file://{path}"
    return {"dagster/uri": uri, "dagster/table_name": catalog_name or path}
