"""Writing an SCD type 2 table: a batch's versions in one MERGE, whole-table events in one overwrite (docs/history.md).

An SCD type 2 table (``resources/cdc/scd2.py``) changes by closing versions and adding new ones,
and its exactly-once discipline needs a marker in the same commit as the rows. A MERGE carries no
``userMetadata`` on Sail (``resources/delta/engine.py``), so the marker is a row of the table: the
**marker row**, all of whose columns are NULL but :data:`MARKER_COLUMN` (the changelog's marker
JSON) and whose bucket is NULL. Every write updates it in the same commit as the versions. Queries
of versions pass over it by themselves: its ``_pgcdc_is_current`` and ``_pgcdc_valid_from_lsn`` are
NULL.

* A batch of changes is one MERGE (:func:`merge_versions`): its source holds a *close* row per key
  whose current version the batch ends (matched on the key and ``_pgcdc_valid_to_lsn IS NULL``:
  updated with the closing LSN and time), the batch's new versions (never matched: inserted), and the
  new marker row (matched with the old one, null-safe on the NULL keys). The MERGE names the batch's
  buckets and the NULL bucket, where the marker row lives, so the engine reads only those
  partitions, and a table with deletion vectors marks the closed rows instead of rewriting files.
* A TRUNCATE, the fill of columns added with a default and a snapshot's seed rewrite every current
  version (:func:`replace_versions`): the current versions and the marker row are read, and written
  back by the caller's rewrite with an overwrite whose ``replaceWhere`` selects the same rows (the
  commit also carries the marker as its ``userMetadata``, as a snapshot's does).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F, SparkSession

from resources.delta.batch_columns import CLOSE_COLUMN, CLOSED_SET, CURRENT_COLUMN, MARKER_COLUMN, VALID_TO_LSN_COLUMN
from resources.delta.dataframes import spark_dataframe
from resources.delta.lake_storage import LakeStorage, remove_tree
from resources.delta.layout import BUCKET_COLUMN, TableLayout
from resources.delta.merge import quote_column
from resources.delta.snapshot_writes import STAGING_DIRECTORY, write_snapshot
from resources.delta.table_log import table_exists

__all__ = [
    "CLOSE_COLUMN",
    "CLOSED_SET",
    "CURRENT_COLUMN",
    "MARKER_COLUMN",
    "merge_versions",
    "read_versions_marker",
    "replace_versions",
    "VALID_TO_LSN_COLUMN",
]



def merge_versions(
    spark: SparkSession,
    path: str,
    source: pa.Table,
    key_columns: Sequence[str],
    prune_buckets: bool,
    lake: LakeStorage | None = None,
) -> None:
    """One MERGE of a batch's close rows, new versions and marker row (module docstring); with
    ``prune_buckets`` (the key holds the layout's key), only the source's buckets and the NULL bucket."""
    columns = [name for name in source.column_names if name != CLOSE_COLUMN]
    on = " AND ".join(f"t.{quote_column(key)} <=> s.{quote_column(key)}" for key in key_columns)
    on += f" AND t.{quote_column(VALID_TO_LSN_COLUMN)} IS NULL AND s.{quote_column(CLOSE_COLUMN)}"
    if prune_buckets and BUCKET_COLUMN in columns:
        buckets = sorted({int(bucket) for bucket in source.column(BUCKET_COLUMN).to_pylist() if bucket is not None})
        bucket = f"t.{quote_column(BUCKET_COLUMN)}"
        listed = f"{bucket} IN ({', '.join(map(str, buckets))}) OR " if buckets else ""
        on += f" AND ({listed}{bucket} IS NULL)"
    updates = ", ".join(f"{quote_column(name)} = s.{quote_column(name)}" for name in CLOSED_SET)
    inserted = ", ".join(quote_column(name) for name in columns)
    values = ", ".join(f"s.{quote_column(name)}" for name in columns)
    # Staged as Parquet for the reason merge_batch gives: the engine then hashes the source, not the table.
    staged = f"{path.rstrip('/')}/{STAGING_DIRECTORY}/versions_source"
    spark_dataframe(spark, source).write.mode("overwrite").parquet(staged)
    try:
        spark.sql(
            f"MERGE INTO delta.{quote_column(path)} t USING parquet.{quote_column(staged)} s ON {on} "
            f"WHEN MATCHED THEN UPDATE SET {updates} "
            f"WHEN NOT MATCHED AND (NOT s.{quote_column(CLOSE_COLUMN)} OR s.{quote_column(MARKER_COLUMN)} IS NOT NULL) "
            f"THEN INSERT ({inserted}) VALUES ({values})"
        ).collect()
    finally:
        remove_tree(staged, lake)


def replace_versions(
    spark: SparkSession,
    path: str,
    rewrite: Callable[[pa.Table | None], pa.Table],
    deletion_vectors: bool,
    layout: TableLayout | None,
    lake: LakeStorage | None = None,
) -> None:
    """Replace every current version and the marker row by ``rewrite``'s answer for them, in one commit.
    A path holding no table gets a new one holding ``rewrite(None)``, with deletion vectors when
    ``deletion_vectors``. Bucketed by ``layout`` (partitioned by the bucket column, as the table is):
    ``rewrite`` sees and returns rows without the bucket column, which the write computes.

    The rows may be the whole table (a seed of millions of rows): they go through
    ``write_snapshot``, which stages them (or streams them into delta-rs for a new table on an
    engine without Delta's commands) instead of sending them through the engine's client."""
    current = None
    predicate = None
    if table_exists(path, lake):
        scan = spark.read.format("delta").load(path)
        predicate = f"{quote_column(CURRENT_COLUMN)} OR {quote_column(MARKER_COLUMN)} IS NOT NULL"
        current = scan.where(predicate).toArrow()
        current = current.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in current.column_names else current
    rows = rewrite(current)
    rows = rows.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in rows.column_names else rows
    marker = rows.filter(pc.is_valid(rows.column(MARKER_COLUMN))).column(MARKER_COLUMN)[0].as_py()
    write_snapshot(
        spark, rows, rows.schema, path, marker, layout=layout, replace_where=predicate, deletion_vectors=deletion_vectors,
        lake=lake,
    )


def read_versions_marker(spark: SparkSession, path: str, lake: LakeStorage | None = None) -> tuple[int | None, dict[str, Any] | None]:
    """(0, the marker row's pgcdc marker) of the SCD type 2 table at ``path``, (None, None) without a
    table: the shape of :meth:`Destination.newest_marker`. Reads the NULL bucket only, when bucketed."""
    if not table_exists(path, lake):
        return None, None
    scan = spark.read.format("delta").load(path)
    where = F.col(quote_column(MARKER_COLUMN)).isNotNull()
    if BUCKET_COLUMN in scan.columns:
        where = F.col(quote_column(BUCKET_COLUMN)).isNull() & where
    markers = scan.where(where).select(quote_column(MARKER_COLUMN)).toArrow().column(0).to_pylist()
    return 0, (json.loads(markers[0])["pgcdc"] if markers else None)
