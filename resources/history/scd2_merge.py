"""Writing an SCD type 2 table: a batch's versions in one MERGE, whole-table events in one overwrite (docs/history.md).

An SCD type 2 table (``resources/history/scd2.py``) changes by closing versions and adding new ones,
and its exactly-once discipline needs a marker in the same commit as the rows. A MERGE carries no
``userMetadata`` on Sail (``resources/engines/engine.py``), so the marker is a row of the table: the
**marker row**, all of whose columns are NULL but :data:`MARKER_COLUMN` (the changelog's marker
JSON) and whose bucket is NULL. Every write updates it in the same commit as the versions. Queries
of versions pass over it by themselves: its ``_pgcdc_is_current`` and ``_pgcdc_valid_from_lsn`` are
NULL.

* A batch of changes is one MERGE (:func:`merge_versions`): its source holds a *close* row per key
  whose current version the batch ends, the batch's new versions and the new marker row. A close
  row deletes its key's current version (matched on the key and ``_pgcdc_valid_to_lsn IS NULL``)
  and the version goes back in closed (its values, read just before, with the closing LSN and
  time); the new versions and the new marker row are inserted, the old marker row deleted (matched
  null-safe on the NULL keys). The MERGE names the close rows' buckets and the NULL bucket, where
  the marker row lives, so the engine reads only those partitions, and a table with deletion
  vectors marks the deleted rows instead of rewriting files. The buckets are a hundred times finer
  than the table's (:func:`finer_layout`), so the write reads a fraction of what the table's MERGE
  reads.
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
from resources.delta.dataframes import prepare_writes
from resources.delta.lake_storage import LakeStorage, remove_tree
from resources.delta.layout import BUCKET_COLUMN, HASH, row_buckets, TableLayout
from resources.delta.markers import layout_from_property
from resources.delta.merge import DELETE_ROW_COLUMN, key_lists, quote_column, run_command
from resources.delta.snapshot_writes import write_snapshot
from resources.delta.staging import STAGE_FILE_BYTES, stage_parquet, staged_source_sql, STAGING_DIRECTORY
from resources.delta.table_log import read_table_metadata, table_exists
from resources.engines.capabilities import engine_capabilities

__all__ = [
    "CLOSE_COLUMN",
    "CLOSED_SET",
    "CURRENT_COLUMN",
    "finer_layout",
    "MARKER_COLUMN",
    "merge_versions",
    "NARROWEST_VERSIONS_RANGE",
    "read_versions_marker",
    "replace_versions",
    "VALID_TO_LSN_COLUMN",
    "VERSIONS_BUCKET_SPLIT",
]

VERSIONS_BUCKET_SPLIT = 100
"""How many partitions of an SCD type 2 table a bucket of its table's layout makes (:func:`finer_layout`).

Writing a version costs a scan of every row of the partitions the write names, twice (the closed
versions' values, then the MERGE, whose insert scan reads every column: docs/engine-notes.md),
where the table's own MERGE scans its partitions once. In partitions of the table's size the SCD
type 2 write alone costs 1.5 times the table's MERGE: 200 random keys of a 10M-row table,
10M rows read twice. In partitions 100 times finer (10,000 keys of the default range layout) the
same keys touch 181 of 1,000 partitions, 1.8M rows: 0.34 times the table's MERGE
(docs/benchmarks.md, "SCD type 2 cost"). The price is files: a write adds a small file to every
partition it touches (up to its number of keys), which maintenance compacts."""

NARROWEST_VERSIONS_RANGE = 100
"""Fewest keys in a range partition of an SCD type 2 table :func:`finer_layout` makes: not a partition per key."""


def finer_layout(layout: TableLayout) -> TableLayout:
    """The layout of a new SCD type 2 table of a table laid out by ``layout``: the same key and kind,
    each bucket split in :data:`VERSIONS_BUCKET_SPLIT` (a hundred times the hash buckets; ranges a
    hundredth as wide, but not narrower than :data:`NARROWEST_VERSIONS_RANGE` keys unless the table's are)."""
    if layout.kind == HASH:
        return TableLayout(HASH, layout.key, layout.size * VERSIONS_BUCKET_SPLIT, layout.hash)
    width = max(layout.size // VERSIONS_BUCKET_SPLIT, min(layout.size, NARROWEST_VERSIONS_RANGE))
    return TableLayout(layout.kind, layout.key, width, layout.hash)


def versions_layout(
    spark: SparkSession, path: str, table_layout: TableLayout | None, lake: LakeStorage | None = None
) -> TableLayout | None:
    """The layout the SCD type 2 table at ``path`` is bucketed by, its table being laid out by ``table_layout``.

    A table that exists keeps the layout it was created with, recorded in its
    :data:`~resources.delta.markers.LAYOUT_PROPERTY`: :func:`finer_layout`'s for tables created since it
    exists, the table's own for older ones, which keep working as they are (a table can change its
    partitioning only by being written whole again, and an overwrite keeps the table's properties). A
    bucketed table without the property (an engine that refuses it, Delta on Spark) is bucketed by the
    table's layout. A new table gets the finer layout where the write records the property: every
    engine but Delta on Spark, whose new tables keep the table's layout."""
    metadata = read_table_metadata(path, lake)
    if metadata is not None:
        recorded = layout_from_property(metadata.layout_property) if metadata.bucketed else None
        return recorded if recorded is not None else table_layout
    if table_layout is None or engine_capabilities(spark).delta_commands:
        return table_layout
    return finer_layout(table_layout)


def merge_versions(
    spark: SparkSession,
    path: str,
    source: pa.Table,
    key_columns: Sequence[str],
    prune_buckets: bool,
    lake: LakeStorage | None = None,
) -> None:
    """One MERGE of a batch's close rows, new versions and marker row (module docstring); with
    ``prune_buckets`` (the key holds the layout's key), only the source's buckets and the NULL bucket.
    The source's rows are bucketed by the table's layout: they go where the SCD type 2 table's own
    puts them (:func:`versions_layout`).

    A version is closed by deleting it and inserting it again closed, not by updating it: Sail 0.7.2
    reads every column of the target in all three scans of an update MERGE, but only the key,
    bucket and row position in two of a delete-and-insert's (docs/engine-notes.md). The closed
    versions' values come from one read of the versions the batch closes (:func:`_closed_versions`),
    with the same predicate the MERGE deletes by, so what is read is what is deleted. Measured with
    200 random updates into 3M versions: 0.6x the update MERGE's time (docs/benchmarks.md)."""
    if BUCKET_COLUMN in source.column_names:
        source = _rebucketed(source, versions_layout(spark, path, None, lake))
    closing = source.column(CLOSE_COLUMN)
    columns = [name for name in source.column_names if name != CLOSE_COLUMN]
    deletes = source.filter(closing).select(columns)  # the close rows and the marker row
    buckets = _bucket_predicate(deletes) if prune_buckets and BUCKET_COLUMN in columns else None
    staging = f"{path.rstrip('/')}/{STAGING_DIRECTORY}"
    closes = deletes.filter(pc.is_null(deletes.column(MARKER_COLUMN)))
    closed = _closed_versions(spark, path, closes, key_columns, buckets, f"{staging}/versions_closes", lake)
    inserts = pa.concat_tables(
        [closed, source.filter(pc.or_(pc.invert(closing), pc.is_valid(source.column(MARKER_COLUMN)))).select(columns)]
    )
    merge_source = pa.concat_tables([
        deletes.append_column(DELETE_ROW_COLUMN, pa.repeat(pa.scalar(True), deletes.num_rows)),
        inserts.append_column(DELETE_ROW_COLUMN, pa.repeat(pa.scalar(False), inserts.num_rows)),
    ])  # fmt: skip
    on = " AND ".join(f"t.{quote_column(key)} <=> s.{quote_column(key)}" for key in key_columns)
    on += f" AND t.{quote_column(VALID_TO_LSN_COLUMN)} IS NULL AND s.{DELETE_ROW_COLUMN}"
    on += "".join(f" AND {term}" for term in _current_rows(deletes, key_columns, buckets))
    inserted = ", ".join(quote_column(name) for name in columns)
    values = ", ".join(f"s.{quote_column(name)}" for name in columns)
    staged = f"{staging}/versions_source"
    remove_tree(staged, lake)  # what a crashed MERGE left where it cannot be removed (object stores)
    stage_parquet(merge_source, merge_source.schema, staged, STAGE_FILE_BYTES, lake)
    prepare_writes(spark)
    try:
        run_command(
            spark,
            f"MERGE INTO delta.{quote_column(path)} t USING ({staged_source_sql(merge_source.schema, staged)}) s ON {on} "
            f"WHEN MATCHED THEN DELETE "
            f"WHEN NOT MATCHED AND NOT s.{DELETE_ROW_COLUMN} THEN INSERT ({inserted}) VALUES ({values})",
        )
    finally:
        remove_tree(staged, lake)


def _rebucketed(rows: pa.Table, layout: TableLayout | None) -> pa.Table:
    """``rows`` with their bucket column computed by ``layout`` (None: as they are). The marker row's
    NULL key has the NULL bucket, where the marker row lives."""
    if layout is None:
        return rows
    buckets = row_buckets(
        layout, {name: rows.column(name) for name in layout.key if name in rows.column_names}, rows.num_rows
    )
    return rows.set_column(rows.column_names.index(BUCKET_COLUMN), BUCKET_COLUMN, buckets)


def _closed_versions(
    spark: SparkSession,
    path: str,
    closes: pa.Table,
    key_columns: Sequence[str],
    buckets: str | None,
    staged: str,
    lake: LakeStorage | None,
) -> pa.Table:
    """The current versions the close rows ``closes`` end, closed: their values with the close rows'
    :data:`CLOSED_SET` columns, in ``closes``' columns and types. Read by joining the staged close
    rows to the target's current versions in the buckets the MERGE names (``buckets``), with the
    key lists that let the engine drop other rows right after its scan."""
    if not closes.num_rows:
        return closes
    remove_tree(staged, lake)
    stage_parquet(closes, closes.schema, staged, STAGE_FILE_BYTES, lake)
    try:
        picked = ", ".join(
            f"{'s' if name in CLOSED_SET else 't'}.{quote_column(name)} AS {quote_column(name)}"
            for name in closes.column_names
        )
        on = " AND ".join(f"t.{quote_column(key)} = s.{quote_column(key)}" for key in key_columns)
        where = " AND ".join([
            f"t.{quote_column(VALID_TO_LSN_COLUMN)} IS NULL", f"t.{quote_column(MARKER_COLUMN)} IS NULL",
            *_current_rows(closes, key_columns, buckets),
        ])  # fmt: skip
        closed = spark.sql(
            f"SELECT {picked} FROM delta.{quote_column(path)} t JOIN ({staged_source_sql(closes.schema, staged)}) s "
            f"ON {on} WHERE {where}"
        ).toArrow()
    finally:
        remove_tree(staged, lake)
    return pa.Table.from_arrays(
        [closed.column(field.name).cast(field.type) for field in closes.schema], schema=closes.schema
    )


def _current_rows(rows: pa.Table, key_columns: Sequence[str], buckets: str | None) -> list[str]:
    """Conditions on the target ``t`` that every version a MERGE of ``rows`` matches meets: in
    ``buckets`` (the partition predicate), and each integer key in the rows' short list of values
    (:func:`~resources.delta.merge.key_lists`) or NULL (the marker row)."""
    terms = [] if buckets is None else [buckets]
    for key in key_columns:
        terms += [f"({listed} OR t.{quote_column(key)} IS NULL)" for listed in key_lists(rows, [key])]
    return terms


def _bucket_predicate(rows: pa.Table) -> str:
    """``(t.<bucket> IN (the rows' buckets) OR t.<bucket> IS NULL)``: the NULL bucket holds the marker row."""
    buckets = sorted({int(bucket) for bucket in rows.column(BUCKET_COLUMN).to_pylist() if bucket is not None})
    bucket = f"t.{quote_column(BUCKET_COLUMN)}"
    listed = f"{bucket} IN ({', '.join(map(str, buckets))}) OR " if buckets else ""
    return f"({listed}{bucket} IS NULL)"


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
    ``deletion_vectors``. Bucketed by :func:`versions_layout` of ``layout`` (the table's layout),
    partitioned by the bucket column: ``rewrite`` sees and returns rows without the bucket column,
    which the write computes.

    The rows may be the whole table (a seed of millions of rows): they go through
    ``write_snapshot``, which stages them (or streams them into delta-rs for a new table on an
    engine without Delta's commands) instead of sending them through the engine's client."""
    layout = versions_layout(spark, path, layout, lake)
    current = None
    predicate = None
    closed = None
    if table_exists(path, lake):
        scan = spark.read.format("delta").load(path)
        predicate = f"{quote_column(CURRENT_COLUMN)} OR {quote_column(MARKER_COLUMN)} IS NOT NULL"
        if (BUCKET_COLUMN in scan.columns) != (layout is not None):
            # The table's layout changed (a re-snapshot adopting buckets): no partition of the table can be
            # replaced alone, so the whole table is written again, its closed versions as they were.
            closed = scan.where(f"NOT ({predicate})").drop(BUCKET_COLUMN).toArrow()
        current = scan.where(predicate).toArrow()
        current = current.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in current.column_names else current
    rows = rewrite(current)
    rows = rows.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in rows.column_names else rows
    if closed is not None:
        rows = pa.concat_tables([closed.select(rows.schema.names).cast(rows.schema), rows])
        predicate = None
    marker = rows.filter(pc.is_valid(rows.column(MARKER_COLUMN))).column(MARKER_COLUMN)[0].as_py()
    write_snapshot(
        spark,
        rows,
        rows.schema,
        path,
        marker,
        layout=layout,
        replace_where=predicate,
        deletion_vectors=deletion_vectors,
        lake=lake,
        rows_outside_where=True,  # the rewrite closes current versions: they leave the predicate
    )


def read_versions_marker(
    spark: SparkSession, path: str, lake: LakeStorage | None = None
) -> tuple[int | None, dict[str, Any] | None]:
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
