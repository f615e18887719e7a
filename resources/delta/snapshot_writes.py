"""Writing a snapshot into Delta as one atomic commit: pieces shipped as temporary views while COPY still runs, then one overwrite."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, functions as F, SparkSession

from resources.delta.lake_storage import remove_tree
from resources.delta.dataframes import chunks, DEFAULT_CHUNK_BYTES, spark_dataframe
from resources.delta.capabilities import engine_capabilities
from resources.delta.layout import BUCKET_COLUMN, TableLayout, with_buckets
from resources.delta.markers import LAYOUT_PROPERTY, layout_property
from resources.delta.table_log import version_with_metadata


STAGING_DIRECTORY = "_pgcdc_staging"
"""Inside a table directory; Delta readers and VACUUM ignore directories starting with '_'."""


SHIP_BYTES = 16 * 1024 * 1024
"""Most Arrow bytes per temporary view a snapshot ships to the server while the source is
still being read (and at most ``chunk_bytes``); smaller batches are gathered to
:data:`SHIP_MIN_BYTES` first, so a table of many small batches does not cost a round trip each."""


SHIP_MIN_BYTES = 4 * 1024 * 1024


def write_snapshot(
    spark: SparkSession,
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    layout: TableLayout | None = None,
    replace_where: str | None = None,
) -> int:
    """Replace the table at ``path`` with ``data`` in one commit; return that commit's version.

    With a ``layout``, every row gets its :data:`~resources.delta.layout.BUCKET_COLUMN` value
    (computed here, on the batches, by the same function a drain uses) and the table is
    partitioned by it, one file per bucket sorted by key: the bucket bounds the file's size
    (Sail 0.7.2 ignores ``maxRecordsPerFile``), and the sort clusters neighbouring keys.
    ``user_metadata`` must then be the marker recording that layout; the table property
    :data:`~resources.delta.markers.LAYOUT_PROPERTY` records it too (it outlives the marker).

    Readers see the old table or the whole new one, never a prefix. Batches are shipped to
    the server as they arrive, each piece (at most :data:`SHIP_BYTES`) as a temporary view,
    so the transfer overlaps with whatever produces ``data``. A snapshot whose views fit in
    one chunk is written directly from their union; a larger one is appended chunk by chunk
    (a union of views each) to a staging table inside ``path`` and then copied over in a
    single overwrite. Memory stays bounded by ``chunk_bytes`` (held by the server, as views,
    until their chunk is written) and a crash leaves only staging debris. The one commit
    carries ``user_metadata`` (e.g. the snapshot LSN), so the marker cannot exist without
    the data.

    ``replace_where`` (a predicate on the table's columns) replaces only the rows it selects (one key
    range of a snapshot in key ranges) and keeps the rest; the commit is made even when nothing is
    removed or added (an empty range), so its marker is never lost.
    """
    if layout is not None:
        batches = data.to_batches() if isinstance(data, pa.Table) else data
        data = (with_buckets(layout, batch) for batch in batches)
        schema = schema.append(pa.field(BUCKET_COLUMN, pa.int64()))
    pieces = chunks(data, schema, max(1, min(chunk_bytes, SHIP_BYTES)), SHIP_MIN_BYTES)
    staging: str | None = None
    pending: list[str] = []  # views shipped but not yet written
    pending_bytes = 0
    try:
        for piece in pieces:
            if pending and pending_bytes >= chunk_bytes:
                staging = _write_staged(spark, pending, path, staging)
                _drop_views(spark, pending)
                pending_bytes = 0
            view = f"pgcdc_snapshot_{uuid.uuid4().hex}"
            spark_dataframe(spark, piece).createOrReplaceTempView(view)
            pending.append(view)
            pending_bytes += piece.nbytes
        if staging is None:
            frame = _union(spark, pending) if pending else spark_dataframe(spark, schema.empty_table())
            _overwrite(frame, path, user_metadata, layout, replace_where)
        else:
            _write_staged(spark, pending, path, staging)
            _drop_views(spark, pending)
            _overwrite(spark.read.format("delta").load(staging), path, user_metadata, layout, replace_where)
            remove_tree(staging)
    finally:
        try:
            _drop_views(spark, pending)
        except Exception:  # noqa: BLE001 - the session is gone; its views went with it
            pass
    return version_with_metadata(path, user_metadata)


def _union(spark: SparkSession, views: Sequence[str]) -> DataFrame:
    frames = [spark.table(view) for view in views]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionAll(frame)
    return union


def _write_staged(spark: SparkSession, views: Sequence[str], path: str, staging: str | None) -> str:
    """Append the views to the staging table (created by the first call); return its path."""
    if staging is None:
        staging = f"{path.rstrip('/')}/{STAGING_DIRECTORY}/{uuid.uuid4().hex}"
        _overwrite(_union(spark, views), staging, None, None)
    else:
        _append(_union(spark, views), staging)
    return staging


def _drop_views(spark: SparkSession, views: list[str]) -> None:
    """Drop the views (the server frees their data) and empty the list."""
    while views:
        spark.catalog.dropTempView(views[-1])
        views.pop()


def _overwrite(
    frame: DataFrame, path: str, user_metadata: str | None, layout: TableLayout | None, replace_where: str | None = None
) -> None:
    """Overwrite the table (schema too), or only the rows ``replace_where`` selects; bucketed by
    ``layout``: one task, so one file, per bucket, sorted by key."""
    delta_commands = engine_capabilities(frame.sparkSession).delta_commands
    if replace_where is not None:
        # Through a union with the (empty) table scan: Sail's replaceWhere refuses type details the
        # scan irons out (resources/delta/merge.py: replace_rows).
        scan = frame.sparkSession.read.format("delta").load(path)
        frame = scan.where(F.lit(False)).unionByName(frame)
    if layout is not None:
        key = [F.col("`" + name.replace("`", "``") + "`") for name in layout.key]
        frame = frame.repartition(BUCKET_COLUMN).sortWithinPartitions(BUCKET_COLUMN, *key)
    writer = frame.write.format("delta").mode("overwrite")
    if replace_where is not None:
        writer = writer.option("replaceWhere", replace_where)
    if replace_where is None or not delta_commands:
        # Sail skips the commit of a write that adds and removes nothing unless the schema is
        # (re)written, which keeps the same schema here; Delta on Spark commits it anyway.
        writer = writer.option("overwriteSchema", "true")
    if layout is not None:
        writer = writer.partitionBy(BUCKET_COLUMN)
    if user_metadata is not None:  # the table itself, not the staging table
        writer = writer.option("userMetadata", user_metadata)
        if not delta_commands:
            # Sail records delta.* writer options as table properties; Delta on Spark refuses
            # property names it does not know, so there the layout lives in the marker only.
            writer = writer.option(LAYOUT_PROPERTY, layout_property(layout))
    writer.save(path)


def _append(frame: DataFrame, path: str) -> None:
    frame.write.format("delta").mode("append").save(path)


def enable_deletion_vectors(spark: SparkSession, path: str) -> None:
    """Turn on Delta's deletion vectors for the table (config ``delta.deletion_vectors``): a MERGE
    then marks changed rows deleted instead of rewriting their files. Only where the engine has
    Delta's SQL commands (the capability seam); Sail 0.7.2 can neither set table properties on a
    path nor write deletion vectors, and callers refuse the setting there before writing."""
    if not engine_capabilities(spark).delta_commands:
        raise RuntimeError("deletion vectors need Delta Lake on Spark (the capability seam says this engine has no Delta commands)")
    spark.sql(
        f"ALTER TABLE delta.`{path.replace('`', '``')}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    ).collect()
