"""Applying a batch of changes to a Delta table: keyed MERGE, the REPLICA IDENTITY FULL row rewrite, appends and TRUNCATE."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F, SparkSession

from resources.delta.batch_columns import OLD_KEY_PREFIX, OP_COLUMN, unchanged_flag_column, UNCHANGED_PREFIX
from resources.delta.dataframes import prepare_writes, spark_dataframe
from resources.delta.delta_types import statistics_columns
from resources.delta.lake_storage import LakeStorage, remove_tree
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.staging import STAGE_FILE_BYTES, stage_parquet, staged_source_sql, STAGING_DIRECTORY
from resources.engines.capabilities import engine_capabilities

DELETE_ROW_COLUMN = "_pgcdc_delete_row"
"""Column a delete-and-insert MERGE adds to its source (:func:`merge_statement`): True on the row that
deletes its key's target row, False on the row that inserts the change's new image."""


def quote_column(identifier: str) -> str:
    return "`" + identifier.replace("`", "``") + "`"


def merge_batch(
    spark: SparkSession,
    path: str,
    source: pa.Table,
    key_columns: Sequence[str],
    prune_buckets: bool = True,
    lake: LakeStorage | None = None,
) -> None:
    """Apply one batch of changes, at most one per key, with a single MERGE (``lake``: the object-store
    lake holding ``path``, whose client stages the source).

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

    The source is staged as Parquet (:func:`_merge_source`), written by this process with pyarrow
    (no engine job, and no Arrow shipped over Spark Connect: on Delta on Spark the engine's
    Parquet write cost 2-6 s per MERGE, docs/engine-notes.md), rather than shipped as a view:
    the engine builds its join's hash table from the side that looks smaller, and it sizes
    a file scan by its compressed bytes but an in-memory relation by its Arrow bytes. A view
    of a few tens of thousands of rows already "looks" bigger than a compressed table of
    millions, and then Sail hashes the whole target table (three times: its MERGE plan runs
    the join once for inserts, once for rewritten files and once for removes), so memory
    grows with the table instead of the batch and the MERGE takes about twice as long
    (measured in docs/engine-notes.md).
    """
    staged = _merge_source(path)
    remove_tree(staged, lake)  # what a crashed MERGE left where it cannot be removed (object stores)
    stage_parquet(source, source.schema, staged, STAGE_FILE_BYTES, lake)
    prepare_writes(spark)
    delete_and_insert = engine_capabilities(spark).merge_delete_and_insert
    try:
        run_command(spark, merge_statement(path, staged, source, key_columns, prune_buckets, delete_and_insert))
    finally:
        remove_tree(staged, lake)


def run_command(spark: SparkSession, statement: str) -> None:
    """Run a SQL command (MERGE, DELETE) for its effect: ``spark.sql`` executes a command at once, on
    every engine; a ``.collect()`` of its result would be two more round trips (the result relation
    sent back, and a configuration read): 0.3 s of a drain on embedded Sail, 2 s on a fresh Delta on
    Spark (docs/engine-notes.md, "A drain on Delta on Spark, statement by statement")."""
    spark.sql(statement)


def merge_statement(
    path: str,
    staged: str,
    source: pa.Table,
    key_columns: Sequence[str],
    prune_buckets: bool = True,
    delete_and_insert: bool = True,
) -> str:
    """The MERGE statement :func:`merge_batch` runs to apply ``source`` (staged as Parquet at
    ``staged``) to the Delta table at ``path``: a pure function of its arguments (``source``'s column
    names, bucket and key values), so the statement is tested without an engine.

    Rows are matched on ``key_columns``. A change whose :data:`OP_COLUMN` is 'D' deletes its
    matched row; any other updates the matched row (every value column but the key) or, unmatched,
    is inserted. A column with an unchanged flag keeps the target's value where the flag is True;
    with old-key columns as well, the source is joined to the rows under the old keys, whose values
    a moved row keeps. With ``prune_buckets`` and a bucketed source, the ON clause names the
    source's buckets and the NULL bucket as a partition predicate on the target (:func:`_in_buckets`);
    for a short batch it lists the batch's integer keys as well (:func:`key_lists`).

    With ``delete_and_insert``, where every change replaces whole rows (no kept value) and a row has
    columns besides the key, the MERGE deletes and inserts instead (:func:`_delete_and_insert_statement`);
    :func:`merge_batch` asks the engine's capabilities (``merge_delete_and_insert``): the form is
    cheaper on Sail and dearer on Delta on Spark.
    """
    value_columns = _value_columns(source)
    flags = {name for name in source.column_names if name.startswith(UNCHANGED_PREFIX)}
    old_keys = [name for name in source.column_names if name.startswith(OLD_KEY_PREFIX)]
    pruned = prune_buckets and BUCKET_COLUMN in value_columns
    matched_on = list(key_columns)
    staged_source = f"({staged_source_sql(source.schema, staged)})"
    target = f"delta.{quote_column(path)}"
    kept = [name for name in value_columns if unchanged_flag_column(name) in flags]
    if delete_and_insert and not kept and any(name not in matched_on for name in value_columns):
        return _delete_and_insert_statement(target, staged_source, source, matched_on, pruned, value_columns)
    old_rows_joined = bool(old_keys and kept)
    using = (
        _joined_to_old_rows(target, staged_source, source, old_keys, kept, pruned) if old_rows_joined else staged_source
    )
    on = _match(source, matched_on, pruned)
    moved_flag = next((name for name in old_keys if name != OLD_KEY_PREFIX + BUCKET_COLUMN), None)
    moved = f"s.{quote_column(moved_flag)} IS NOT NULL" if moved_flag else "false"
    updates = ", ".join(
        f"{quote_column(name)} = "
        + (
            f"CASE WHEN NOT s.{quote_column(unchanged_flag_column(name))} THEN s.{quote_column(name)} "
            # A moved row keeps the value of the row under its old key, even where its new key
            # still matches a row (one the same batch deletes): that row's value is stale. Without
            # a row under the old key (a replay: the move is applied already) the row keeps its value.
            + (f"WHEN {moved} AND s.{OLD_ROW_FOUND} THEN s.{quote_column(_carried(name))} " if old_rows_joined else "")
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
        if name in kept and old_rows_joined
        else f"s.{quote_column(name)}"
        for name in value_columns
    )
    matched_update = f"WHEN MATCHED THEN UPDATE SET {updates}" if updates else ""
    return (
        f"MERGE INTO {target} t USING {using} s ON {on} "
        f"WHEN MATCHED AND s.{OP_COLUMN} = 'D' THEN DELETE "
        f"{matched_update} "
        f"WHEN NOT MATCHED AND s.{OP_COLUMN} <> 'D' THEN INSERT ({insert_columns}) VALUES ({insert_values})"
    )


def _joined_to_old_rows(
    target: str, staged_source: str, source: pa.Table, old_keys: Sequence[str], kept: Sequence[str], pruned: bool
) -> str:
    """:func:`merge_statement`'s source for key-changing updates that kept TOAST values: the staged
    source joined to the rows under the old keys, which hold those values (``_carried`` columns and
    :data:`OLD_ROW_FOUND`); read only from the old keys' buckets when ``pruned``."""
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
    return f"(SELECT s.*, {carried} FROM {staged_source} s LEFT JOIN {old_rows} o ON {join})"


def _delete_and_insert_statement(
    target: str,
    staged_source: str,
    source: pa.Table,
    key_columns: Sequence[str],
    pruned: bool,
    value_columns: Sequence[str],
) -> str:
    """:func:`merge_statement`'s MERGE for changes that replace whole rows: its source is each change
    as a row that deletes its key's target row (:data:`DELETE_ROW_COLUMN` true, the only rows the ON
    clause matches) and, unless it is a delete, as a row that inserts its new image (false).

    Nothing then reads a target row's values, only its key, and Sail 0.7.2 reads only the key and
    bucket columns of the target in two of the three scans its MERGE plan makes (an update reads
    every column in all three). On deletion-vector tables that cut the MERGE of 200 random updates
    to 0.43x at 3M rows and 0.78x at 100k; 20,000 and 200,000 updates into 3M rows 0.72x and 0.64x;
    on copy-on-write tables 0.75x (docs/engine-notes.md). The outcome is the update's: the old row is
    gone, the new image is in the table, which is also what an update writes on a deletion-vector
    table (the old row marked deleted, the new image in a new file). The two source rows come from
    a ``UNION ALL`` of the staged file with itself, not from a staged copy twice as long: that copy
    held twice the batch in this process. On Delta on Spark the doubled source costs more than it
    saves: the update form took 0.72-0.75x as long there (``merge_delete_and_insert``)."""
    doubled = (
        f"(SELECT *, true AS {DELETE_ROW_COLUMN} FROM {staged_source} UNION ALL "
        f"SELECT *, false AS {DELETE_ROW_COLUMN} FROM {staged_source} WHERE {OP_COLUMN} <> 'D')"
    )
    columns = ", ".join(quote_column(name) for name in value_columns)
    values = ", ".join(f"s.{quote_column(name)}" for name in value_columns)
    return (
        f"MERGE INTO {target} t USING {doubled} s ON {_match(source, key_columns, pruned, f's.{DELETE_ROW_COLUMN}')} "
        f"WHEN MATCHED THEN DELETE "
        f"WHEN NOT MATCHED AND NOT s.{DELETE_ROW_COLUMN} AND s.{OP_COLUMN} <> 'D' THEN INSERT ({columns}) VALUES ({values})"
    )


def _match(source: pa.Table, key_columns: Sequence[str], pruned: bool, condition: str | None = None) -> str:
    """A MERGE's ON clause: the key's equality, then ``condition``, the bucket predicate (``pruned``)
    and the key lists."""
    terms = [f"t.{quote_column(key)} = s.{quote_column(key)}" for key in key_columns]
    if condition is not None:
        terms.append(condition)
    if pruned:
        terms.append(_in_buckets(source, BUCKET_COLUMN, "t."))
    return " AND ".join(terms + key_lists(source, key_columns))


def _value_columns(source: pa.Table) -> list[str]:
    """The columns of ``source`` that are the table's (not the merge's own)."""
    return [
        name
        for name in source.column_names
        if name != OP_COLUMN and not name.startswith(UNCHANGED_PREFIX) and not name.startswith(OLD_KEY_PREFIX)
    ]


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


KEY_LIST_MOST_VALUES = 500
"""Most distinct values of a key column :func:`key_lists` lists in a MERGE's ON clause.

Sail 0.7.2 reads every row of the partitions a MERGE targets (no file or row-group skipping by
statistics, no filter pushed into its scan) and joins each with the source three times; a literal
``IN`` list on the target's key is applied right after the scan, so the joins see only candidate
rows. Measured with 200 uniformly random updates on deletion-vector tables: an update MERGE took
0.70x as long at 3M and 10M rows, and the same at 100k (docs/engine-notes.md, "Finding a MERGE's
rows on deletion-vector tables"). A long list costs more to plan and evaluate than it saves: about
the same at 1,000 values, 1.8x slower at 20,000."""


def key_lists(source: pa.Table, key_columns: Sequence[str]) -> list[str]:
    """``t.<key> IN (<the source's distinct values>)`` for each integer key column with at most
    :data:`KEY_LIST_MOST_VALUES` of them, else ``t.<key> BETWEEN <lowest> AND <highest>``: a
    conjunct the ON clause's ``t.<key> = s.<key>`` implies, so it changes no match, only how many
    target rows reach the join (see the constant). Like the list, the range is applied right after
    the scan: a chunk of new rows (keys above every key in the table) lets no target row reach the
    joins, a chunk of updates only the rows in its key span (docs/engine-notes.md, "Incremental
    CDC"). Other types are not listed (no literal whose rendering could differ from the engine's value)."""
    listed = []
    for key in key_columns:
        column = source.column(key)
        if not pa.types.is_integer(column.type):
            continue
        values = pc.unique(column.drop_null())
        if 0 < len(values) <= KEY_LIST_MOST_VALUES:
            rendered = ", ".join(str(int(value)) for value in sorted(values.to_pylist()))
            listed.append(f"t.{quote_column(key)} IN ({rendered})")
        elif len(values) > 0:
            lowest, highest = pc.min_max(values).values()
            listed.append(f"t.{quote_column(key)} BETWEEN {int(lowest.as_py())} AND {int(highest.as_py())}")
    return listed


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
    predicate = f"xxhash64({', '.join(quote_column(name) for name in probe.column_names)}) IN ({', '.join(map(str, sorted(hashes)))})"
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


def append_rows(
    spark: SparkSession, path: str, rows: pa.Table, user_metadata: str, lake: LakeStorage | None = None
) -> None:
    """Append ``rows`` in one commit carrying ``user_metadata`` (the progress marker of keyless tables
    and changelogs).

    The rows are staged as Parquet by this process and read by the engine, as a MERGE's source is,
    rather than shipped as Arrow through the engine's client: the changelog appends of a drain of
    1.6M changes took 8.3 s against 13.7 s on Sail 0.7.2 (docs/benchmarks.md, "Changelog cost")."""
    staged = f"{path.rstrip('/')}/{STAGING_DIRECTORY}/append"
    remove_tree(staged, lake)  # what a crashed append left where it cannot be removed (object stores)
    stage_parquet(rows, rows.schema, staged, STAGE_FILE_BYTES, lake)
    prepare_writes(spark)
    writer = spark.sql(staged_source_sql(rows.schema, staged)).write.format("delta").mode("append")
    if not engine_capabilities(spark).delta_commands:
        # Sail records delta.* writer options as the properties of a table the append creates (a changelog)
        for name, value in statistics_columns(rows.schema, None).items():
            writer = writer.option(name, value)
    try:
        writer.option("userMetadata", user_metadata).save(path)
    finally:
        remove_tree(staged, lake)


def delete_all_rows(spark: SparkSession, path: str) -> None:
    """Empty the table keeping its schema and history (Sail has no TRUNCATE TABLE)."""
    run_command(spark, f"DELETE FROM delta.{quote_column(path)}")
