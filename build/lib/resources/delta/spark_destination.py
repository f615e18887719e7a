"""The production :class:`~resources.delta.destination.Destination`: Delta tables through one Spark session."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession

from resources.delta import merge, reads, schema_changes, snapshot_writes, table_log
from resources.delta.destination import TableLog


class SparkDeltaDestination:
    """Each method is the matching function of resources/delta/ with this session bound."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    def write_snapshot(self, data: pa.Table | Iterable[pa.RecordBatch], schema: pa.Schema, path: str, user_metadata: str) -> int:
        return snapshot_writes.write_snapshot(self.spark, data, schema, path, user_metadata)

    def merge_batch(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool = True) -> None:
        merge.merge_batch(self.spark, path, source, key_columns, prune_buckets)

    def append_rows(self, path: str, rows: pa.Table, user_metadata: str) -> None:
        merge.append_rows(self.spark, path, rows, user_metadata)

    def read_rows(self, path: str, keys: pa.Table | None) -> pa.Table:
        return reads.read_rows(self.spark, path, keys)

    def replace_rows(
        self, path: str, probe: pa.Table, rewrite: Callable[[pa.Table], pa.Table], user_metadata: str
    ) -> None:
        merge.replace_rows(self.spark, path, probe, rewrite, user_metadata)

    def delete_all_rows(self, path: str) -> None:
        merge.delete_all_rows(self.spark, path)

    def read_table_log(self, path: str, known: TableLog | None) -> TableLog:
        return table_log.read_table_log(path, known)  # the lake's storage client: no engine round trip

    def newest_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        return table_log.newest_marker(path)

    def rows_unchanged_after(self, path: str, version: int, newest: int) -> bool:
        return table_log.rows_unchanged_after(path, version, newest)

    def table_schema(self, path: str) -> pa.Schema:
        return schema_changes.table_schema(self.spark, path)

    def widen_columns(self, path: str, widened: Mapping[str, pa.DataType]) -> None:
        schema_changes.widen_columns(self.spark, path, widened)

    def add_columns(self, path: str, new_columns: pa.Schema) -> None:
        schema_changes.add_columns(self.spark, path, new_columns)

    def fill_columns(self, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
        schema_changes.fill_columns(self.spark, path, values, lsn_column, up_to_lsn)
