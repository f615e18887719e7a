"""Reading a Delta table back as Arrow, in slices that bound the client's memory.

Reconciliation reads whole tables. ``DataFrame.toArrow`` collects its result in the client,
so a large table is read as ``slices`` disjoint parts, each selected by the engine with
``pmod(xxhash64(<columns>), slices) = i``: every row lands in exactly one slice, on any Spark
engine (Sail's and Spark's ``xxhash64`` take every type pgcdc writes). Each slice is a scan
of the table, so ``slices`` should be as small as memory allows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql import functions as F
from pyspark.sql import Column, SparkSession


def delta_schema(spark: SparkSession, path: str) -> pa.Schema:
    """The Delta table's columns, as Arrow (read from the log; no data is scanned)."""
    return spark.read.format("delta").load(path).limit(0).toArrow().schema


def delta_slices(
    spark: SparkSession, path: str, columns: Sequence[str], hash_columns: Sequence[str], slices: int
) -> Iterator[pa.Table]:
    """``columns`` of every row of the table at ``path``, as ``slices`` tables (by a hash of ``hash_columns``)."""
    frame = spark.read.format("delta").load(path).select(*[_column(name) for name in columns])
    if slices <= 1:
        yield frame.toArrow()
        return
    bucket = F.pmod(F.xxhash64(*[_column(name) for name in hash_columns]), F.lit(slices))
    for index in range(slices):
        yield frame.where(bucket == F.lit(index)).toArrow()


def _column(name: str) -> Column:
    """A column by its exact name (backtick-quoted: names may hold dots or spaces)."""
    return F.col("`" + name.replace("`", "``") + "`")
