"""Applying a batch of changes to a Delta table: keyed MERGE, the REPLICA IDENTITY FULL row rewrite, appends and TRUNCATE."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F, SparkSession

from resources.delta.dataframes import spark_dataframe
from resources.delta.lake_storage import remove_tree
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.snapshot_writes import STAGING_DIRECTORY


OP_COLUMN = "_pgcdc_op"
"""Merge source column holding 'I', 'U' or 'D' for each change."""


UNCHANGED_PREFIX = "_pgcdc_unchanged_"
"""Merge source columns ``_pgcdc_unchanged_<col>``: True keeps the target's value (unchanged TOAST)."""


OLD_KEY_PREFIX = "_pgcdc_oldkey_"
"""Merge source columns ``_pgcdc_oldkey_<key>``: the row's key before a key-changing update, whose
target row supplies unchanged-TOAST values when the new key has no target row yet."""


def unchanged_flag_column(column: str) -> str:
    return f"{UNCHANGED_PREFIX}{column}"


def quote_column(identifier: str) -> str:
    return "`" + identifier.replace("`", "``") + "`"


def merge_batch(
    spark: SparkSession,
    path: str,
    source: pa.Table,
    key_columns: Sequence[str],
    prune_buckets: bool = True,
) -> None:
    """Apply one batch of changes, at most one per key, with a single MERGE.

    ``source`` holds the row values, :data:`OP_COLUMN` and optional boolean
    ``_pgcdc_unchanged_<col>`` columns: where True, an update keeps the target's value
    (PostgreSQL does not resend unchanged TOASTed values). With ``_pgcdc_oldkey_<key>``
    columns (set only on a key-changing update that kept such values), the kept values come
    from the target row under the old key instead, whether or not the new key matches a row.
    The MERGE rejects two changes for one key, so callers fold a batch per key first.

    A bucketed table's batch carries each row's :data:`~resources.delta.layout.BUCKET_COLUMN`
    (and ``_pgcdc_oldkey__pgcdc_bucket`` beside the old key), written with the row. With
    ``prune_buckets`` (the caller's promise that the buckets locate every row the batch can
    touch: the key it matches by holds the layout's key), the MERGE names the batch's buckets
    and the NULL bucket as a partition predicate on the target, so the engine reads and rewrites
    only those partitions: a delete or the old row of a moved key carries its own (old) key's
    bucket, and the row under an old key that supplies kept values is read from the old keys'
    buckets. Rows are matched on the key alone, so a row found in the NULL bucket (written while
    its bucket could not be computed) moves to its own.

    The source is staged as Parquet (:func:`_merge_source`) rather than shipped as a view:
    the engine builds its join's hash table from the side that looks smaller, and it sizes
    a file scan by its compressed bytes but an in-memory relation by its Arrow bytes. A view
    of a few tens of thousands of rows already "looks" bigger than a compressed table of
    millions, and then Sail hashes the whole target table (three times: its MERGE plan runs
    the join once for inserts, once for rewritten files and once for removes), so memory
    grows with the table instead of the batch and the MERGE takes about twice as long
    (measured in docs/engine-notes.md).
    """
    value_columns = [
        name
        for name in source.column_names
        if name != OP_COLUMN and not name.startswith(UNCHANGED_PREFIX) and not name.startswith(OLD_KEY_PREFIX)
    ]
    flags = {name for name in source.column_names if name.startswith(UNCHANGED_PREFIX)}
    old_keys = [name for name in source.column_names if name.startswith(OLD_KEY_PREFIX)]
    pruned = prune_buckets and BUCKET_COLUMN in value_columns
    matched_on = list(key_columns)
    staged = _merge_source(path)
    spark_dataframe(spark, source).write.mode("overwrite").parquet(staged)
    staged_source = f"parquet.{quote_column(staged)}"
    target = f"delta.{quote_column(path)}"
    kept = [name for name in value_columns if unchanged_flag_column(name) in flags]
    if old_keys and kept:
        # A key-changing update that kept TOAST values: the row under the old key holds them.
        join = " AND ".join(
            f"o.{quote_column(name.removeprefix(OLD_KEY_PREFIX))} = s.{quote_column(name)}"
            for name in old_keys
            if name != OLD_KEY_PREFIX + BUCKET_COLUMN  # the key finds the row, wherever it is
        )
        carried = ", ".join(f"o.{quote_column(name)} AS {quote_column(_carried(name))}" for name in kept)
        found_on = quote_column(old_keys[0].removeprefix(OLD_KEY_PREFIX))
        carried += f", o.{found_on} IS NOT NULL AS {OLD_ROW_FOUND}"
        old_rows = target
        if pruned:
            old_rows = f"(SELECT * FROM {target} WHERE {_in_buckets(source, OLD_KEY_PREFIX + BUCKET_COLUMN, '')})"
        using = f"(SELECT s.*, {carried} FROM {staged_source} s LEFT JOIN {old_rows} o ON {join})"
    else:
        using = staged_source
    on = " AND ".join(f"t.{quote_column(key)} = s.{quote_column(key)}" for key in matched_on)
    if pruned:
        on += f" AND {_in_buckets(source, BUCKET_COLUMN, 't.')}"
    moved_flag = next((name for name in old_keys if name != OLD_KEY_PREFIX + BUCKET_COLUMN), None)
    moved = f"s.{quote_column(moved_flag)} IS NOT NULL" if moved_flag else "false"
    updates = ", ".join(
        f"{quote_column(name)} = "
        + (
            f"CASE WHEN NOT s.{quote_column(unchanged_flag_column(name))} THEN s.{quote_column(name)} "
            # A moved row keeps the value of the row under its old key, even where its new key
            # still matches a row (one the same batch deletes): that row's value is stale. Without
            # a row under the old key (a replay: the move is applied already) the row keeps its value.
            + (f"WHEN {moved} AND s.{OLD_ROW_FOUND} THEN s.{quote_column(_carried(name))} " if using != staged_source else "")
            + f"ELSE t.{quote_column(name)} END"
            if name in kept
            else f"s.{quote_column(name)}"
        )
        for name in value_columns
        if name not in matched_on
    )
    insert_columns = ", ".join(quote_column(name) for name in value_columns)
    insert_values = ", ".join(
        f"CASE WHEN s.{quote_column(unchanged_flag_column(name))} THEN s.{quote_column(_carried(name))} ELSE s.{quote_column(name)} END"
        if name in kept and using != staged_source
        else f"s.{quote_column(name)}"
        for name in value_columns
    )
    matched_update = f"WHEN MATCHED THEN UPDATE SET {updates}" if updates else ""
    try:
        spark.sql(
            f"MERGE INTO {target} t USING {using} s ON {on} "
            f"WHEN MATCHED AND s.{OP_COLUMN} = 'D' THEN DELETE "
            f"{matched_update} "
            f"WHEN NOT MATCHED AND s.{OP_COLUMN} <> 'D' THEN INSERT ({insert_columns}) VALUES ({insert_values})"
        ).collect()
    finally:
        remove_tree(staged)


def _merge_source(path: str) -> str:
    """Where :func:`merge_batch` stages its source: one directory per table, overwritten by
    every MERGE, so even where it cannot be removed (object stores) it holds one batch at most."""
    return f"{path.rstrip('/')}/{STAGING_DIRECTORY}/merge_source"


def _in_buckets(source: pa.Table, column: str, qualifier: str) -> str:
    """``(<qualifier><bucket column> IN (the buckets in source's column) OR ... IS NULL)``, the partition
    predicate: the NULL bucket holds the rows written while their bucket could not be computed
    (``resources/delta/layout.py``: ``row_buckets``); Sail prunes on the whole disjunction."""
    column_name = f"{qualifier}{quote_column(BUCKET_COLUMN)}"
    buckets = sorted(value for value in pc.unique(source.column(column)).to_pylist() if value is not None)
    listed = f"{column_name} IN ({', '.join(str(int(bucket)) for bucket in buckets)}) OR " if buckets else ""
    return f"({listed}{column_name} IS NULL)"


OLD_ROW_FOUND = "_pgcdc_old_row_found"
"""Set in a MERGE's source beside the carried values: whether a row under the old key was found."""


def _carried(column: str) -> str:
    return f"_pgcdc_carried_{column}"


def replace_rows(
    spark: SparkSession,
    path: str,
    probe: pa.Table,
    rewrite: Callable[[pa.Table], pa.Table],
    user_metadata: str,
) -> None:
    """Rewrite, in one commit carrying ``user_metadata``, every row that may equal a row of
    ``probe`` (typed values of some of the table's columns): ``rewrite`` gets those rows (all
    columns, as Arrow) and returns the rows to put in their place.

    The rows are selected by ``xxhash64`` over ``probe``'s columns, the engine's own hash, so
    every row equal to a probe row is selected (and a few others, on a hash collision, which
    ``rewrite`` hands back unchanged). The selection is a literal ``IN`` list usable as the
    ``replaceWhere`` predicate of an overwrite, the one write that removes rows and carries
    ``userMetadata``: read and replaced rows are the same set, and readers see the old rows or
    the new ones. Sail 0.7.2 refuses a subquery there and plans about 0.2 ms per listed value,
    so callers keep ``probe`` to a few thousand rows.

    The written rows go through a union with the (empty) table scan: Sail's replaceWhere unions
    the new rows with the kept rows of rewritten files as they are stored, and refuses a
    difference in type details a scan irons out (a list's element name, a timestamp's time zone
    name).
    """
    scan = spark.read.format("delta").load(path)
    columns = [F.col(quote_column(name)) for name in probe.column_names]
    probed = scan.select(*columns).where(F.lit(False)).unionByName(spark_dataframe(spark, probe))
    hashes = probed.select(F.xxhash64(*columns).alias("hash")).distinct().toArrow().column("hash").to_pylist()
    predicate = (
        f"xxhash64({', '.join(quote_column(name) for name in probe.column_names)}) IN ({', '.join(map(str, sorted(hashes)))})"
    )
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


def append_rows(spark: SparkSession, path: str, rows: pa.Table, user_metadata: str) -> None:
    """Append ``rows`` in one commit carrying ``user_metadata`` (the keyless tables' progress marker)."""
    spark_dataframe(spark, rows).write.format("delta").mode("append").option("userMetadata", user_metadata).save(path)


def delete_all_rows(spark: SparkSession, path: str) -> None:
    """Empty the table keeping its schema and history (Sail has no TRUNCATE TABLE)."""
    spark.sql(f"DELETE FROM delta.{quote_column(path)}").collect()
