"""How each replicated table appears in Dagster, in the style of dagster-dlt and dagster-sling.

Every table gets two assets: its *snapshot* (the initial copy, taken consistently with the
slot) and its *Delta table* (kept current by incremental drains, downstream of the
snapshot). Subclass :class:`PgcdcTranslator` to change keys, groups or metadata; the
assets, jobs, checks and sensors all ask the translator, so they stay consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

from dagster import AssetKey, AssetSpec, MetadataValue

from resources.postgres.catalog import TableName
from resources.config import PgcdcConfig

KINDS = {"postgres", "delta", "spark"}
SNAPSHOT_GROUP = "pgcdc_snapshot"
TABLE_GROUP = "pgcdc"


@dataclass(frozen=True, slots=True)
class PgcdcTableProps:
    """What a translator may use to describe one table."""

    table: TableName
    delta_path: str
    publication: str
    slot: str

    @classmethod
    def of(cls, config: PgcdcConfig, table: TableName) -> PgcdcTableProps:
        return cls(table, config.table_path(table.schema, table.name), config.publication, config.slot)


class PgcdcTranslator:
    """Table -> AssetSpec for the snapshot asset and for the incrementally maintained Delta table."""

    def get_snapshot_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey(["pgcdc", "snapshot", props.table.schema, props.table.name])

    def get_table_asset_key(self, props: PgcdcTableProps) -> AssetKey:
        return AssetKey(["pgcdc", props.table.schema, props.table.name])

    def _metadata(self, props: PgcdcTableProps) -> dict[str, object]:
        return {
            "pgcdc/table": props.table.quoted,
            "pgcdc/publication": props.publication,
            "pgcdc/slot": props.slot,
            "pgcdc/delta_path": MetadataValue.path(props.delta_path),
            "dagster/uri": f"file://{props.delta_path}" if "://" not in props.delta_path else props.delta_path,
        }

    def get_snapshot_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        # skippable: a run configured with an explicit table list (pgcdc_resnapshot) copies only those.
        return AssetSpec(
            key=self.get_snapshot_asset_key(props),
            description=(
                f"Initial copy of PostgreSQL table {props.table} into Delta at {props.delta_path}, taken at an LSN"
                f' consistent with replication slot "{props.slot}"; re-materializing it re-snapshots the table.'
            ),
            group_name=SNAPSHOT_GROUP,
            kinds=KINDS,
            metadata=self._metadata(props),
            skippable=True,
        )

    def get_table_asset_spec(self, props: PgcdcTableProps) -> AssetSpec:
        # skippable: a table without a snapshot yet is reported and left unmaterialized by a drain.
        return AssetSpec(
            key=self.get_table_asset_key(props),
            deps=[self.get_snapshot_asset_key(props)],
            description=(
                f"Delta copy of PostgreSQL table {props.table} at {props.delta_path}, kept current by draining"
                f' replication slot "{props.slot}" (publication "{props.publication}") in micro-batches.'
            ),
            group_name=TABLE_GROUP,
            kinds=KINDS,
            metadata=self._metadata(props),
            skippable=True,
        )
