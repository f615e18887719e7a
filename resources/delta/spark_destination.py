"""The production :class:`~resources.delta.destination.Destination`: Delta tables through one Spark session."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from resources.config.catalog import CatalogName
from resources.delta import catalog_names, merge, reads, schema_changes, snapshot_writes, table_log
from resources.delta.dataframes import DEFAULT_CHUNK_BYTES, prepare_writes
from resources.delta.destination import TableLog
from resources.delta.key_ranges import KeySpan
from resources.delta.lake_storage import LakeStorage, open_lake
from resources.delta.layout import TableLayout
from resources.history import scd2_merge


class SparkDeltaDestination:
    """Each method is the matching function of resources/delta/ with this session and lake bound.

    ``lake``: the object store holding the tables (from ``open_lake``), whose client reads their logs
    and stages data; None for a lake of local paths."""

    def __init__(self, spark: SparkSession, lake: LakeStorage | None) -> None:
        self.spark = spark
        self.lake = lake
        self._schemas: set[str] = set()  # the catalog namespaces this destination's registrations made sure of

    def write_snapshot(
        self,
        data: pa.Table | Iterable[pa.RecordBatch],
        schema: pa.Schema,
        path: str,
        user_metadata: str,
        *,
        chunk_bytes: int | None = None,
        layout: TableLayout | None = None,
        span: KeySpan | None = None,
        deletion_vectors: bool = False,
    ) -> int:
        return snapshot_writes.write_snapshot(
            self.spark, data, schema, path, user_metadata, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES, layout=layout,
            replace_where=None if span is None else span.predicate(), deletion_vectors=deletion_vectors, lake=self.lake,
        )  # fmt: skip

    def prepare_writes(self) -> None:
        prepare_writes(self.spark)

    def merge_batch(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool = True) -> None:
        merge.merge_batch(self.spark, path, source, key_columns, prune_buckets, self.lake)

    def append_rows(self, path: str, rows: pa.Table, user_metadata: str) -> None:
        merge.append_rows(self.spark, path, rows, user_metadata, self.lake)

    def read_rows(self, path: str, keys: pa.Table | None) -> pa.Table:
        return reads.read_rows(self.spark, path, keys)

    def scan(self, path: str, columns: Sequence[str]) -> Iterator[pa.Table]:
        return reads.delta_batches(self.spark, path, columns)

    def replace_rows(
        self, path: str, probe: pa.Table, rewrite: Callable[[pa.Table], pa.Table], user_metadata: str
    ) -> None:
        merge.replace_rows(self.spark, path, probe, rewrite, user_metadata)

    def merge_versions(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool) -> None:
        scd2_merge.merge_versions(self.spark, path, source, key_columns, prune_buckets, self.lake)

    def replace_versions(
        self,
        path: str,
        rewrite: Callable[[pa.Table | None], pa.Table],
        deletion_vectors: bool,
        layout: TableLayout | None,
    ) -> None:
        scd2_merge.replace_versions(self.spark, path, rewrite, deletion_vectors, layout, self.lake)

    def versions_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        return scd2_merge.read_versions_marker(self.spark, path, self.lake)

    def delete_all_rows(self, path: str) -> None:
        merge.delete_all_rows(self.spark, path)

    def read_table_log(self, path: str, known: TableLog | None) -> TableLog:
        return table_log.read_table_log(path, known, self.lake)  # the lake's storage client: no engine round trip

    def newest_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        return table_log.newest_marker(path, self.lake)

    def rows_unchanged_after(self, path: str, version: int, newest: int) -> bool:
        return table_log.rows_unchanged_after(path, version, newest, self.lake)

    def bytes_added(self, path: str, version: int, newest: int) -> int:
        return table_log.bytes_added(path, version, newest, self.lake)

    def table_schema(self, path: str) -> pa.Schema:
        return schema_changes.table_schema(path, self.lake)  # the log, read by the lake's client: no engine round trip

    def widen_columns(self, path: str, widened: Mapping[str, pa.DataType]) -> None:
        schema_changes.widen_columns(self.spark, path, widened)

    def add_columns(self, path: str, new_columns: pa.Schema) -> None:
        schema_changes.add_columns(self.spark, path, new_columns)

    def fill_columns(self, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
        schema_changes.fill_columns(self.spark, path, values, lsn_column, up_to_lsn)

    def register_table(self, name: CatalogName, path: str, what: str) -> bool:
        if not table_log.table_exists(path, self.lake):  # the lake's client: no engine round trip
            return False
        catalog_names.register_table(self.spark, name, path, what, new_schema=name.schema_sql not in self._schemas)
        self._schemas.add(name.schema_sql)
        return True


def lake_destination(spark: SparkSession, config: PgcdcConfig) -> SparkDeltaDestination:
    """The lake ``config`` names (``delta.root``, ``delta.storage``), checked (``open_lake``: a wrong bucket
    or missing credentials fail here), through ``spark``: what a run receives from its wiring."""
    return SparkDeltaDestination(spark, open_lake(config.delta.root, config.delta.storage))
