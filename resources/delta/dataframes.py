"""Arrow -> Spark DataFrames: the nullable schema Delta gets, and slicing large tables into Spark Connect sized chunks."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Arrow bytes sent per createDataFrame: bounds client memory and stays under Spark Connect's
local-relation cache threshold (64 MiB by default)."""


WRITE_SETTINGS: dict[str, str] = {"spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS"}
"""Session settings every Delta write of pgcdc's relies on, whatever the engine.

Apache Spark stores a ``timestamp`` (timestamptz) column as Parquet INT96 by default. Spark
reads that back, but Arrow-based readers (delta-rs, pyarrow, pandas, DuckDB) decode INT96 as
``timestamp[ns]``, which ends in 1677 and 2262: PostgreSQL's ``infinity`` (stored at the int64
microsecond limits) and any timestamp outside those years fail to read there (found by the
randomized workload on Spark, docs/engine-notes.md). INT64 microseconds is what Sail writes
anyway; ``timestamp_ntz`` is INT64 on every engine."""

_PREPARED_SESSIONS: weakref.WeakSet[SparkSession] = weakref.WeakSet()


def prepare_writes(spark: SparkSession) -> None:
    """Apply :data:`WRITE_SETTINGS` to the session, once per session (a caller's session included)."""
    if spark in _PREPARED_SESSIONS:
        return
    for key, value in WRITE_SETTINGS.items():
        spark.conf.set(key, value)
    _PREPARED_SESSIONS.add(spark)


@contextmanager
def session_settings(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Session settings for the commands inside, restored afterwards."""
    previous = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, earlier in previous.items():
            if earlier is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, earlier)


def nullable_schema(schema: pa.Schema) -> pa.Schema:
    """Every Delta column pgcdc writes is nullable.

    Sail 0.7.2 silently ignores ``mergeSchema`` on a table with a NOT NULL column, so
    columns could never be added; and a source dropping NOT NULL later would need an
    ALTER that Sail lacks. PostgreSQL already enforces the constraint upstream.
    """
    return pa.schema([field.with_nullable(True) for field in schema])


def spark_dataframe(spark: SparkSession, table: pa.Table) -> DataFrame:
    """Arrow to Spark without Python rows, keeping naive timestamps as timestamp_ntz; the session
    is prepared for pgcdc's writes (:func:`prepare_writes`), since every write but a rewrite of a
    table in place starts here."""
    prepare_writes(spark)
    table = table.cast(nullable_schema(table.schema))
    return spark.createDataFrame(table, schema=from_arrow_schema(table.schema, prefer_timestamp_ntz=True))


def chunks(
    data: pa.Table | Iterable[pa.RecordBatch], schema: pa.Schema, chunk_bytes: int, min_bytes: int | None = None
) -> Iterator[pa.Table]:
    """Regroup batches into tables of at least ``min_bytes`` (default ``chunk_bytes``), slicing
    batches larger than ``chunk_bytes``; always yields at least one."""
    batches = data.to_batches() if isinstance(data, pa.Table) else data
    least = chunk_bytes if min_bytes is None else min(min_bytes, chunk_bytes)
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    yielded = False
    for batch in batches:
        for piece in _slices(batch, chunk_bytes):
            pending.append(piece)
            pending_bytes += piece.nbytes
            if pending_bytes >= least:
                yield pa.Table.from_batches(pending, schema)
                yielded = True
                pending, pending_bytes = [], 0
    if pending or not yielded:
        yield pa.Table.from_batches(pending, schema)


def _slices(batch: pa.RecordBatch, chunk_bytes: int) -> Iterator[pa.RecordBatch]:
    """Zero-copy slices of at most about ``chunk_bytes``, so one huge batch cannot defeat the bound."""
    if batch.nbytes <= chunk_bytes or batch.num_rows <= 1:
        yield batch
        return
    rows_per_slice = max(1, batch.num_rows * chunk_bytes // batch.nbytes)
    for start in range(0, batch.num_rows, rows_per_slice):
        yield batch.slice(start, rows_per_slice)
