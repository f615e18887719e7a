"""Writing a snapshot into Delta as one atomic commit: streamed into delta-rs while COPY still runs (into a
table delta-rs creates on an engine without Delta's commands, e.g. embedded Sail; into the table the
engine creates on Delta on Spark), or staged as Parquet files, then one engine overwrite (every key range
of a snapshot in key ranges, and a Delta on Spark table delta-rs must not write into)."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal, TYPE_CHECKING

import pandas  # noqa: F401 (imported with the code location, not in a snapshot step: see below)
import pyarrow as pa
from pyarrow.fs import FileType
from pyspark.sql import DataFrame, functions as F, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from resources.crash_points import fault_point
from resources.delta.dataframes import DEFAULT_CHUNK_BYTES, nullable_schema, prepare_writes, session_settings
from resources.delta.delta_types import statistics_columns
from resources.delta.lake_storage import LakeStorage, object_store_options, remove_tree, storage_client
from resources.delta.layout import BUCKET_COLUMN, TableLayout, with_buckets
from resources.delta.markers import LAYOUT_PROPERTY, layout_property, SNAPSHOT_CREATE_METADATA
from resources.delta.staging import STAGE_FILE_BYTES, stage_parquet, staged_frame, STAGING_DIRECTORY
from resources.delta.table_log import has_commit, LOG_DIRECTORY, table_exists, unfinished_create, version_with_metadata
from resources.engines.capabilities import engine_capabilities
from resources.locations import is_object_store

if TYPE_CHECKING:
    from deltalake import DeltaTable

# pyarrow imports pandas on its first conversion of Python or NumPy values (a snapshot's first bucket
# column, say), 0.15-0.45 s in a fresh process, on the thread feeding the writer while the COPY runs:
# imported above, that is paid when the code location loads, not in a run's first snapshot step.

DICTIONARY_PAGE_BYTES = 64 * 1024
"""delta-rs's Parquet writer gives up dictionary encoding for a column chunk once its dictionary
outgrows this (1 MiB by default): measured with 200k rows × 33 columns, 64 KiB cut the write's CPU
from 0.72-0.85 s to 0.31 s and the files from 24.0 to 20.2 MB (1M narrow rows: 0.32-0.40 → 0.23 s,
18.3 → 19.3 MB); columns with few distinct values keep their dictionaries."""


ROW_GROUP_ROWS = 128 * 1024
"""Most rows per Parquet row group delta-rs writes (its default: about 1M), which it buffers, encoded,
per open file: a streamed 10M-row narrow snapshot (10 range buckets) peaked at 655 MiB RSS with
the default, 358 MiB with this."""


ROW_GROUP_BYTES = 16 * 1024 * 1024
"""Most Arrow bytes per Parquet row group delta-rs writes, so that its buffer follows bytes, not rows:
it holds about three times a row group's Arrow bytes until the group is flushed: writing 450k rows of
1 KB of incompressible text held 534 MiB in groups of 128k rows, 234 MiB in groups of 16k (about 180
of it the writer's own, whatever the group). Wide rows get fewer rows per group (:func:`row_group_rows`)."""


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
    deletion_vectors: bool = False,
    lake: LakeStorage | None = None,
    rows_outside_where: bool = False,
) -> int:
    """Replace the table at ``path`` with ``data`` in one commit; return that commit's version.
    ``lake`` holds ``path`` when it is on an object store (as in every function here that takes it).

    ``deletion_vectors``: a write that creates the table creates it with
    :data:`DELETION_VECTORS_PROPERTY` on, so MERGEs then mark changed rows deleted instead of
    rewriting their files (docs/contracts.md, "Deletion vectors"); an existing table keeps its
    protocol and properties either way.

    With a ``layout``, every row gets its :data:`~resources.delta.layout.BUCKET_COLUMN` value
    (computed here, on the batches, by the same function a drain uses) and the table is
    partitioned by it: the bucket bounds the file's size. ``user_metadata`` must then be the
    marker recording that layout; the table property :data:`~resources.delta.markers.LAYOUT_PROPERTY`
    records it too when the write creates the table (it outlives the marker), where the engine
    takes it.

    Readers see the old table or the whole new one, never a prefix, and the commit carries
    ``user_metadata`` (e.g. the snapshot LSN), so the marker cannot exist without the data.
    Which writer, the capability seam says (``delta_rs_snapshots``):

    * **delta-rs** (an engine without Delta's commands, e.g. embedded Sail; not for
      ``replace_where``): the batches stream into delta-rs's writer in this process as they
      arrive (:func:`_write_with_delta_rs`), rows in arrival order within a bucket (COPY's heap
      order): 1.6-2x the engine path's speed on 2 cores (docs/engine-notes.md, "Snapshots
      written by delta-rs").
    * **the engine creates, delta-rs writes the rows** (Delta on Spark; not for ``replace_where``):
      :func:`_write_into_engine_table`, where the table's protocol, schema and partitioning let
      delta-rs write into it; else
    * **the engine** (key ranges; Delta on Spark where delta-rs does not write): :func:`_write_with_engine`.

    ``replace_where`` (a predicate on the table's columns) replaces only the rows it selects (one key
    range of a snapshot in key ranges) and keeps the rest; the commit is made even when nothing is
    removed or added (an empty range), so its marker is never lost. Delta on Spark refuses written
    rows the predicate does not select unless ``rows_outside_where`` (an SCD type 2 rewrite replaces
    the current versions with versions some of which it closed).
    """
    data = _watched(data)
    if layout is not None:
        data = (with_buckets(layout, batch) for batch in data)
        schema = schema.append(pa.field(BUCKET_COLUMN, pa.int64()))
    if replace_where is None and unfinished_create(path, lake):
        discard_unfinished_create(path, lake)
    capabilities, whole_table = engine_capabilities(spark), replace_where is None
    if whole_table and capabilities.delta_rs_snapshots:
        _write_with_delta_rs(data, schema, path, user_metadata, layout, deletion_vectors, lake)
    elif not (
        whole_table
        and capabilities.delta_rs_snapshot_rows
        and _write_into_engine_table(spark, data, schema, path, user_metadata, layout, deletion_vectors, lake)
    ):
        creates = whole_table and not table_exists(path, lake)
        _write_with_engine(
            spark,
            data,
            schema,
            path,
            user_metadata,
            layout,
            replace_where,
            deletion_vectors and creates,
            creates,
            rows_outside_where,
            max(1, min(chunk_bytes, STAGE_FILE_BYTES)),
            lake,
        )
    fault_point("after_snapshot_commit")
    return version_with_metadata(path, user_metadata, lake)


def _write_with_engine(
    spark: SparkSession,
    data: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    layout: TableLayout | None,
    replace_where: str | None,
    new_with_deletion_vectors: bool,
    creates: bool,
    rows_outside_where: bool,
    file_bytes: int,
    lake: LakeStorage | None,
) -> None:
    """The engine's write of :func:`write_snapshot` (key ranges; Delta on Spark where delta-rs does not
    write): one file per bucket, sorted by key (the sort clusters neighbouring keys; Sail 0.7.2 ignores ``maxRecordsPerFile``). This process writes
    the batches, as they arrive, into Parquet files (at most :data:`STAGE_FILE_BYTES` of Arrow
    each) under ``<path>/_pgcdc_staging/<uuid>`` with pyarrow, which releases the GIL, so the
    staging overlaps whatever produces ``data`` and the engine holds nothing meanwhile. Then
    the engine reads the staged files and overwrites the table in the one commit; the staging
    directory is removed afterwards (a crash leaves only staging debris). Against shipping each
    piece as a Spark Connect temporary view (docs/engine-notes.md, "Staged Parquet and a bounded
    engine pool"): about 0.2 CPU-seconds less per million narrow rows and one engine operation
    per snapshot. The staged files name their columns by position (``c0``, ``c1``, ...), so no
    column name can trip a Parquet reader, and are cast back to exactly the types
    :func:`spark_dataframe` would give.
    """
    staging = f"{path.rstrip('/')}/{STAGING_DIRECTORY}/{uuid.uuid4().hex}"
    try:
        stage_parquet(data, schema, staging, file_bytes, lake)
        fault_point("after_snapshot_staged")
        _overwrite(
            staged_frame(spark, schema, staging),
            schema,
            path,
            user_metadata,
            layout,
            replace_where,
            new_with_deletion_vectors,
            rows_outside_where,
            statistics=statistics_columns(schema, _key(layout)) if creates else None,
        )
    finally:
        remove_tree(staging, lake)


def _watched(data: pa.Table | Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``data``'s batches, with the fault point ``during_snapshot_write`` once the writer holds the
    first one and asks for more (``resources/crash_points.py``)."""
    for number, batch in enumerate(data.to_batches() if isinstance(data, pa.Table) else data):
        yield batch
        if number == 0:
            fault_point("during_snapshot_write")


def discard_unfinished_create(path: str, lake: LakeStorage | None = None) -> None:
    """Take away the table at ``path`` that :func:`~resources.delta.table_log.unfinished_create`
    recognises (the empty table a killed snapshot created and never committed to), so the path
    holds no table and the snapshot creates it as new, with the layout it chooses now (its layout
    property is set at creation only, so the one left behind could be stale).

    Only the log goes: its commit 0 first (from then on there is no table), then the rest of
    ``_delta_log`` (a killed writer's temporary files). Nothing else in the directory is touched: it
    may be a directory pgcdc did not create; Parquet files a killed write left are referenced by no
    commit, and the maintenance job's full vacuum deletes them once older than the retention."""
    filesystem, directory = storage_client(path, lake)
    log = f"{directory.rstrip('/')}/{LOG_DIRECTORY}"
    filesystem.delete_file(f"{log}/{0:020d}.json")  # type: ignore[attr-defined]
    try:
        filesystem.delete_dir(log)  # type: ignore[attr-defined]
    except FileNotFoundError:  # an object store: no directory object once its last file is gone
        pass


def _write_with_delta_rs(
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    layout: TableLayout | None,
    deletion_vectors: bool,
    lake: LakeStorage | None,
) -> None:
    """Overwrite the table at ``path`` with ``data`` in one delta-rs commit carrying ``user_metadata``.

    The batches stream from the COPY straight into delta-rs's Parquet writer (in Rust, outside the
    GIL), so encoding overlaps the copy and nothing is staged or read again.

    A new table is created first, empty (version 0), with :data:`LAYOUT_PROPERTY` (and
    :data:`DELETION_VECTORS_PROPERTY` when ``deletion_vectors``): delta-rs 1.6
    refuses table properties it does not know in a write, but takes them in a create. So the
    snapshot commit of a new table is version 1. When the write fails, the created table is taken
    away again (the whole directory when this write made it, else only the log); a process killed in
    between leaves it, which :func:`~resources.delta.table_log.unfinished_create` recognises: the
    table counts as not snapshotted and the next snapshot creates it again
    (:func:`discard_unfinished_create`). An existing table keeps its properties, as with the engine.
    """
    from deltalake import DeltaTable

    storage_options = object_store_options(path, lake) or None
    partition_by = [BUCKET_COLUMN] if layout is not None else []  # [], not None: None keeps old partitioning
    created = not table_exists(path, lake)
    filesystem, directory = storage_client(path, lake)
    new_directory = created and filesystem.get_file_info(directory).type == FileType.NotFound  # type: ignore[attr-defined]
    if created and not is_object_store(path):
        # Through the lake's storage client, as staging does: a path it cannot create fails with the
        # OSError naming the cause (delta-rs says only "Could not create local directory").
        filesystem.create_dir(directory, recursive=True)  # type: ignore[attr-defined]
    if created:
        configuration = {LAYOUT_PROPERTY: layout_property(layout), **statistics_columns(schema, _key(layout))}
        if deletion_vectors:
            configuration[DELETION_VECTORS_PROPERTY] = "true"
        fault_point("before_snapshot_create")
        DeltaTable.create(
            path, nullable_schema(schema), partition_by=partition_by, configuration=configuration,
            storage_options=storage_options, raise_if_key_not_exists=False,
        )  # fmt: skip
        fault_point("after_snapshot_create")
    try:
        _delta_rs_overwrite(path, data, schema, user_metadata, partition_by, storage_options, schema_mode="overwrite")
    except BaseException:
        if created:
            _take_away_create(path, new_directory, lake)
        raise


def _take_away_create(path: str, new_directory: bool, lake: LakeStorage | None) -> None:
    """After a failed snapshot write, the table it created, if it holds nothing else (no commit 1):
    the whole directory when the write made it, else only the log."""
    if has_commit(path, 1, lake):
        return
    if new_directory:
        remove_tree(path, lake, keep_parent=True)  # the directory was made here: all of it is this write's
    else:
        discard_unfinished_create(path, lake)  # a directory that was there before keeps everything else


def _delta_rs_overwrite(
    table: str | DeltaTable,
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    user_metadata: str,
    partition_by: list[str],
    storage_options: dict[str, str] | None,
    schema_mode: Literal["overwrite"] | None,
) -> None:
    """Overwrite ``table`` (a path, or a loaded ``DeltaTable``) with ``data`` in one delta-rs commit carrying
    ``user_metadata``, streamed from ``data`` into delta-rs's Parquet writer (in Rust, outside the GIL).
    ``schema_mode`` ``"overwrite"`` writes the table's metadata anew (schema, partitioning); None keeps it,
    and ``data`` must then match the table's schema."""
    from deltalake import CommitProperties, PostCommitHookProperties, write_deltalake, WriterProperties

    target = nullable_schema(schema)
    failures: list[BaseException] = []

    def batches() -> Iterator[pa.RecordBatch]:
        """``data`` as ``target`` batches, keeping what the source raised: delta-rs reports it as
        a DeltaError naming it, and callers tell a refused value from a lost connection by type."""
        try:
            for batch in data.to_batches() if isinstance(data, pa.Table) else data:
                yield pa.RecordBatch.from_arrays(batch.columns, schema=target)
        except BaseException as error:
            failures.append(error)
            raise

    source = batches()
    try:
        first = next(source, None)  # its rows' width sizes the row groups
        everything = source if first is None else itertools.chain([first], source)
        row_bytes = first.nbytes // first.num_rows if first is not None and first.num_rows else None
        reader = pa.RecordBatchReader.from_batches(target, everything)
        write_deltalake(
            table, reader, mode="overwrite", schema_mode=schema_mode, partition_by=partition_by,
            storage_options=storage_options, commit_properties=CommitProperties(custom_metadata={"userMetadata": user_metadata}),
            writer_properties=WriterProperties(
                compression="SNAPPY", dictionary_page_size_limit=DICTIONARY_PAGE_BYTES,
                max_row_group_size=row_group_rows(row_bytes),
            ),
            # no checkpoint or log cleanup of delta-rs's choosing: the engine and maintenance.py decide those
            post_commithook_properties=PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False),
        )  # fmt: skip
    except BaseException:
        if failures:
            raise failures[0]  # noqa: B904 (the writer's own failure; the one caught here is its consequence)
        raise


def row_group_rows(row_bytes: int | None) -> int:
    """Rows per Parquet row group for rows of about ``row_bytes`` each (None: not known):
    :data:`ROW_GROUP_BYTES` of them, at most :data:`ROW_GROUP_ROWS` and at least 1024 (a row group's
    statistics and page headers cost about the same whatever its rows)."""
    if not row_bytes:
        return ROW_GROUP_ROWS
    return max(1024, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES // row_bytes))


DELTA_RS_READER_FEATURES = frozenset({"deletionVectors", "timestampNtz"})
DELTA_RS_WRITER_FEATURES = frozenset({"appendOnly", "invariants", "deletionVectors", "timestampNtz"})
"""The table features of a table delta-rs writes a snapshot's rows into on Delta on Spark: those of the
tables Delta on Spark creates for pgcdc (deletion vectors, naive timestamps; ``appendOnly`` and
``invariants`` come with writer version 7), checked to come out as Spark's own write leaves them
(docs/engine-notes.md, "Snapshots on Spark: the engine creates, delta-rs writes the rows"). A table
with any other feature (column mapping, say, set by a cluster's defaults) is written by the engine."""


def _write_into_engine_table(
    spark: SparkSession,
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    layout: TableLayout | None,
    deletion_vectors: bool,
    lake: LakeStorage | None,
) -> bool:
    """Delta on Spark's snapshot write: the table is Spark's (its protocol, properties, schema and
    partitioning), the rows are delta-rs's, streamed from the COPY in this process as on Sail.

    A new table is created first by the engine: an empty overwrite with exactly the options of its
    own snapshot write (:func:`_overwrite`: schema, partitioning, deletion vectors), carrying
    :data:`~resources.delta.markers.SNAPSHOT_CREATE_METADATA`, so protocol and properties are what
    Spark gives the table, and the snapshot commit, delta-rs's overwrite carrying ``user_metadata``,
    is version 1. delta-rs keeps the table's metadata (no ``metaData`` action), so it writes only
    where that metadata is the snapshot's: the same schema (as Delta's JSON) and partitioning, and
    a protocol of :data:`DELTA_RS_READER_FEATURES` / :data:`DELTA_RS_WRITER_FEATURES` at most.
    Otherwise (a re-snapshot that changes columns or layout, a table with other features) this
    returns False before reading ``data``, and the engine writes the snapshot.

    The rows reach the lake from this process, through delta-rs with the lake's storage options:
    the process reaches the lake anyway (it stages data and reads every table's log there,
    wherever the engine runs). A failed write takes the table it created away again (as
    :func:`_write_with_delta_rs` does); one killed in between leaves the create, which
    :func:`~resources.delta.table_log.unfinished_create` recognises."""
    from deltalake import DeltaTable

    storage_options = object_store_options(path, lake) or None
    partition_by = [BUCKET_COLUMN] if layout is not None else []
    spark_schema = from_arrow_schema(nullable_schema(schema), prefer_timestamp_ntz=True)
    created = not table_exists(path, lake)
    filesystem, directory = storage_client(path, lake)
    new_directory = created and filesystem.get_file_info(directory).type == FileType.NotFound  # type: ignore[attr-defined]
    if created:
        prepare_writes(spark)
        empty = spark.createDataFrame([], spark_schema)
        _overwrite(
            empty, schema, path, SNAPSHOT_CREATE_METADATA, layout, deletion_vectors=deletion_vectors, arranged=False,
            statistics=statistics_columns(schema, _key(layout)),
        )  # fmt: skip
        fault_point("after_snapshot_create")
    table = DeltaTable(path, storage_options=storage_options)
    if not _delta_rs_keeps(table, spark_schema.jsonValue(), partition_by):
        return False
    try:
        _delta_rs_overwrite(table, data, schema, user_metadata, partition_by, storage_options, schema_mode=None)
    except BaseException:
        if created:
            _take_away_create(path, new_directory, lake)
        raise
    return True


def _delta_rs_keeps(table: DeltaTable, schema: dict[str, object], partition_by: list[str]) -> bool:
    """Whether delta-rs may overwrite the rows of the loaded ``table`` keeping its metadata: its schema
    is ``schema`` (Delta's JSON form), its partition columns ``partition_by``, and its protocol needs
    no feature beyond :data:`DELTA_RS_READER_FEATURES` / :data:`DELTA_RS_WRITER_FEATURES`."""
    protocol = table.protocol()
    readable = protocol.min_reader_version <= 1 or (
        protocol.min_reader_version == 3 and set(protocol.reader_features or ()) <= DELTA_RS_READER_FEATURES
    )
    writable = protocol.min_writer_version <= 2 or (
        protocol.min_writer_version == 7 and set(protocol.writer_features or ()) <= DELTA_RS_WRITER_FEATURES
    )
    return (
        readable
        and writable
        and list(table.metadata().partition_columns) == partition_by
        and json.loads(table.schema().to_json()) == schema
    )


def _overwrite(
    frame: DataFrame,
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    layout: TableLayout | None,
    replace_where: str | None = None,
    deletion_vectors: bool = False,
    rows_outside_where: bool = False,
    arranged: bool = True,
    statistics: Mapping[str, str] | None = None,
) -> None:
    """Overwrite the table (schema too, ``schema`` as Arrow), or only the rows ``replace_where`` selects; bucketed by
    ``layout``: one task, so one file, per bucket, sorted by key (unless not ``arranged``: a frame
    without rows needs no shuffle). ``deletion_vectors``: the write
    creates the table, with :data:`DELETION_VECTORS_PROPERTY` on (a writer option every engine
    records as the table property when it creates the table; never given for an existing table,
    whose protocol stays as it is); ``statistics`` likewise (``delta_types.statistics_columns``), which Sail
    is given on every overwrite, as it is the layout property."""
    delta_commands = engine_capabilities(frame.sparkSession).delta_commands
    if replace_where is not None:
        # Through a union with the (empty) table scan: Sail's replaceWhere refuses type details the
        # scan irons out (resources/delta/merge.py: replace_rows).
        scan = frame.sparkSession.read.format("delta").load(path)
        frame = scan.where(F.lit(False)).unionByName(frame)
    if layout is not None and arranged:
        key = [F.col("`" + name.replace("`", "``") + "`") for name in layout.key]
        frame = frame.repartition(BUCKET_COLUMN).sortWithinPartitions(BUCKET_COLUMN, *key)
    writer = frame.write.format("delta").mode("overwrite")
    if replace_where is not None:
        writer = writer.option("replaceWhere", replace_where)
    if replace_where is None or not delta_commands:
        # Sail skips the commit of a write that adds and removes nothing unless the schema is
        # (re)written, which keeps the same schema here; Delta on Spark, see below.
        writer = writer.option("overwriteSchema", "true")
    if layout is not None:
        writer = writer.partitionBy(BUCKET_COLUMN)
    writer = writer.option("userMetadata", user_metadata)
    if deletion_vectors:
        writer = writer.option(DELETION_VECTORS_PROPERTY, "true")
    for name, value in (statistics or {}).items():
        writer = writer.option(name, value)
    if not delta_commands:
        # Sail records delta.* writer options as table properties; Delta on Spark refuses
        # property names it does not know, so there the layout lives in the marker only.
        # (Sail creates tables through here only when told to: bench.snapshot --writers engine.)
        writer = writer.option(LAYOUT_PROPERTY, layout_property(layout))
        if statistics is None:
            for name, value in statistics_columns(schema, _key(layout)).items():
                writer = writer.option(name, value)
    if replace_where is not None and delta_commands:
        # Delta on Spark skips the commit of a write that adds and removes nothing unless told not
        # to (a session setting: the session's writes are serialised while a range is replaced).
        settings = RECORD_EMPTY_COMMITS | (UNCHECKED_REPLACE_WHERE if rows_outside_where else {})
        with session_settings(frame.sparkSession, settings):
            writer.save(path)
    else:
        writer.save(path)


RECORD_EMPTY_COMMITS = {"spark.databricks.delta.skipRecordingEmptyCommits": "false"}
"""Delta on Spark's setting that makes it record a commit without actions (an empty key range's)."""

UNCHECKED_REPLACE_WHERE = {"spark.databricks.delta.replaceWhere.constraintCheck.enabled": "false"}
"""Delta on Spark's setting that lets an overwrite with ``replaceWhere`` write rows its predicate does not
select (by default it fails with DELTA_VIOLATE_CONSTRAINT_WITH_VALUES); Sail never checks them."""


DELETION_VECTORS_PROPERTY = "delta.enableDeletionVectors"
"""The Delta table property that makes MERGE, UPDATE and DELETE write deletion vectors (Sail, Delta on
Spark 3.1+); set when pgcdc creates a table, never later: Sail cannot set a property on a path."""


def _key(layout: TableLayout | None) -> list[str] | None:
    """The columns a bucketed table keeps statistics on (``statistics_columns``); None: every column."""
    return list(layout.key) if layout is not None else None
