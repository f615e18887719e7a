"""Rewriting some versions of an SCD type 2 table in one commit that carries a marker (docs/history.md).

An SCD type 2 table (``resources/cdc/scd2.py``) changes by closing versions and adding new ones.
A SQL MERGE could do both, but a MERGE carries no ``userMetadata`` on Sail (``resources/delta/engine.py``),
and the table's exactly-once discipline needs the marker in the same commit as its rows. So the
versions a batch touches are selected by a predicate, read, rewritten in Arrow and written back
with an overwrite whose ``replaceWhere`` is that same predicate: readers see the old versions or
the new ones, and the commit carries the marker.

The predicate names the batch's buckets (and the NULL bucket) when the rows carry
:data:`~resources.delta.layout.BUCKET_COLUMN`, a partition column, so the engine reads and rewrites
only those partitions, then the keys' ``xxhash64`` (the engine's own hash, as ``replace_rows`` uses):
every version of a probed key is selected, and a few others on a hash collision, which the rewrite
hands back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
from pyspark.sql import DataFrame, functions as F, SparkSession

from resources.delta.dataframes import spark_dataframe
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.merge import quote_column
from resources.delta.table_log import table_exists

__all__ = [
    "CURRENT_COLUMN",
    "replace_versions",
]

CURRENT_COLUMN = "_pgcdc_is_current"
"""Whether a version is its key's current one (the predicate of a rewrite of every current version)."""


def replace_versions(
    spark: SparkSession,
    path: str,
    keys: pa.Table | None,
    rewrite: Callable[[pa.Table | None], pa.Table],
    user_metadata: str,
) -> None:
    """Replace, in one commit carrying ``user_metadata``, the versions of the keys in ``keys`` (its key
    columns, plus the bucket column to prune by when the table is bucketed), or every current version
    when ``keys`` is None, by ``rewrite``'s answer for them. A path holding no table gets a new one
    holding ``rewrite(None)``, partitioned by the bucket column when the rows have it."""
    if not table_exists(path):
        rows = rewrite(None)
        writer = spark_dataframe(spark, rows).write.format("delta").mode("overwrite").option("userMetadata", user_metadata)
        if BUCKET_COLUMN in rows.column_names:
            writer = writer.partitionBy(BUCKET_COLUMN)
        writer.save(path)
        return
    scan = spark.read.format("delta").load(path)
    predicate = quote_column(CURRENT_COLUMN) if keys is None else _key_predicate(spark, scan, keys)
    replacement = rewrite(scan.where(predicate).toArrow())
    (
        scan.where(F.lit(False))
        .unionByName(spark_dataframe(spark, replacement))
        .write.format("delta")
        .mode("overwrite")
        .option("replaceWhere", predicate)
        .option("userMetadata", user_metadata)
        .save(path)
    )


def _key_predicate(spark: SparkSession, scan: DataFrame, keys: pa.Table) -> str:
    """The versions of ``keys``: their buckets (and NULL's) when the table has them, then the keys' hashes
    (of the keys in the table's own types: the probe goes through a union with the empty scan)."""
    key_columns = [name for name in keys.column_names if name != BUCKET_COLUMN]
    quoted = [quote_column(name) for name in key_columns]
    columns = [F.col(name) for name in quoted]
    probe = scan.select(*columns).where(F.lit(False)).unionByName(spark_dataframe(spark, keys.select(key_columns)))
    hashes = probe.select(F.xxhash64(*columns).alias("hash")).distinct().toArrow()
    predicate = f"xxhash64({', '.join(quoted)}) IN ({', '.join(map(str, sorted(hashes.column('hash').to_pylist())))})"
    if BUCKET_COLUMN in keys.column_names and BUCKET_COLUMN in scan.columns:
        buckets = sorted({int(bucket) for bucket in keys.column(BUCKET_COLUMN).to_pylist() if bucket is not None})
        bucket = quote_column(BUCKET_COLUMN)
        listed = f"{bucket} IN ({', '.join(map(str, buckets))}) OR " if buckets else ""
        predicate = f"({listed}{bucket} IS NULL) AND {predicate}"
    return predicate
