"""Table maintenance: compact small files, delete files no version inside the retention needs,
keep the log checkpointed and its expired entries cleaned.

Every drain adds files (a MERGE writes its output as new files, inserts land in new small
files) and leaves the replaced ones on storage, so without maintenance a table's file count
and its storage grow with the number of drains, and so does the cost of every MERGE (the
engine reads every file of the target). One call of :func:`maintain_table` per Delta table:

1. **compact**: rewrite small files into files of about ``target_file_bytes``, per partition
   (bucket) when the table is partitioned. One commit, ``dataChange: false``: the rows do not
   change, only the files that hold them. A rewritten file leaves its deletion vector behind (the
   rows it deleted are not written); a file whose deletion vector deletes more than
   ``max_deleted_rows_ratio`` of its rows is rewritten even when compaction would leave it (alone
   in its bucket, or above the target size), so a table under random updates keeps its readers'
   extra work bounded (docs/contracts.md, "Deletion vectors").
2. **vacuum**: delete the data files that no version committed within ``retention_hours``
   references (Delta's VACUUM: a file removed from the table at time t is deleted once
   t < now - retention). Time travel to any version of the window keeps reading; older
   versions may not. Only files that still exist are deleted, and nothing is committed when
   there are none.
3. **log**: a checkpoint at the newest version, then the commits older than the retention that
   the checkpoint covers are deleted, with the ``.crc`` files left of them.

First of all, pgcdc owns the two retention properties of every table it maintains: both
``delta.logRetentionDuration`` and ``delta.deletedFileRetentionDuration`` are set to the
retention (one ``SET TBLPROPERTIES`` commit when either differs; a hand-set value is
overwritten). Every engine's own log clean-up then keeps exactly the window time travel needs,
and every checkpoint (Sail writes one every ten commits) drops the tombstones of files removed
before the window, so neither the log nor the checkpoint grows with a table's age: each
operation's cost stays flat over months (docs/engine-notes.md has the measured per-file and
per-tombstone costs). docs/contracts.md ("Table maintenance") argues why both equal to the
retention is exactly right.

Which engine does the work (the capability seam, ``capabilities.py``): Delta on Spark runs
its own ``OPTIMIZE`` (then ``REORG TABLE ... APPLY (PURGE)`` of the partitions still holding a file
above the ratio: Delta 4.4's ``OPTIMIZE`` leaves a file alone in its bin as it is) and ``VACUUM`` (at the table's file retention, set just before), and writes checkpoints and cleans its log
itself on every tenth commit. An engine without these commands (embedded Sail 0.7.2) gets them
from delta-rs (``deltalake``) in pgcdc's own process, on local paths and on ``s3://`` lakes
alike (``LakeStorage.object_store_options``). delta-rs commits keep the table's protocol
(it adds no table feature) and Sail and Spark read them; docs/engine-notes.md has the checks.
delta-rs's compaction leaves a file alone in its bin as it is, deletion vector and all, so the
partitions holding a file above the ratio are rewritten by a Z-order ``OPTIMIZE`` of each (ordered by
the layout's key, else by the LSN column), which reads the files with their deletion vectors applied.

pgcdc's commit markers are untouched: the maintenance commits (``SET TBLPROPERTIES``, ``OPTIMIZE``,
``VACUUM START``, ``VACUUM END``) carry no ``userMetadata``, so the marker readers in ``markers.py`` pass over them,
and a snapshot commit removed by log cleanup is what ``EXPIRED_SNAPSHOT_LSN`` already covers.

Never run this while a drain writes the same table: the Dagster job runs in the slot's pool.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession

from resources.delta.dataframes import session_settings
from resources.delta.deletion_vectors import deleted_rows, DeletedRows, table_file_deletions
from resources.delta.lake_storage import LakeStorage
from resources.delta.markers import layout_from_property, LAYOUT_PROPERTY, LSN_COLUMN
from resources.delta.snapshot_writes import row_group_rows
from resources.delta.table_files import (
    DELTA_LOG,
    delta_rs_table,
    filesystem_path,
    log_entries,
    log_files,
    storage_files,
)
from resources.delta.table_log import MAINTENANCE_OPERATIONS
from resources.engines.capabilities import engine_capabilities
from resources.locations import join_location

RETENTION_PROPERTIES = ("delta.logRetentionDuration", "delta.deletedFileRetentionDuration")
"""The table properties pgcdc sets to the retention on every table it maintains."""
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)
_INTERVAL_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 24 * 3600, "week": 7 * 24 * 3600}


@dataclass(frozen=True, slots=True)
class FileStats:
    """Data files: how many and how many bytes."""

    files: int
    bytes: int


@dataclass(frozen=True, slots=True)
class TableMaintenance:
    """What maintenance did to one table: the figures the Dagster job records."""

    path: str
    #: "spark" (the engine's OPTIMIZE / VACUUM) or "delta-rs".
    method: str
    version_before: int
    version_after: int
    #: Data files of the newest version, before and after compaction.
    table_before: FileStats
    table_after: FileStats
    #: Data files on storage (every version's), before and after: what vacuum shrinks.
    storage_before: FileStats
    storage_after: FileStats
    #: Rows of the newest version's files and those its deletion vectors delete, before and after.
    deleted_before: DeletedRows
    deleted_after: DeletedRows
    #: Files compaction took out of the table and the files it wrote instead.
    files_compacted: int
    files_written: int
    #: Data files vacuum deleted from storage.
    files_vacuumed: int
    #: Files of ``_delta_log`` deleted (expired commits, their checkpoints and .crc files).
    log_files_removed: int
    log_files_after: int
    duration_s: float
    #: The retention properties this run changed, each as "name: old -> new" (none: they held the retention).
    properties_set: tuple[str, ...] = ()


def maintain_table(
    path: str,
    lake: LakeStorage,
    *,
    retention_hours: float,
    target_file_bytes: int,
    max_deleted_rows_ratio: float = 0.05,
    spark: SparkSession | None = None,
) -> TableMaintenance:
    """Set the retention properties, compact, vacuum and clean the log of the Delta table at
    ``path`` (see the module docstring).

    ``retention_hours`` may be fractional (the soak benchmark compresses a week into minutes;
    users configure whole hours). ``max_deleted_rows_ratio``: a file whose deletion vector deletes more
    than this fraction of its rows is rewritten (module docstring). ``spark`` is the session when one is running; its engine's own
    commands are used when it has them (Delta on Spark), delta-rs otherwise, and without a
    session (embedded Sail needs none for this).
    """
    retention_s = round(retention_hours * 3600)
    if retention_s < 1:
        raise ValueError(f"retention_hours must be at least one second (got {retention_hours!r})")
    started = time.monotonic()
    storage_before = storage_files(lake, path)
    log_before = log_files(lake, path)
    deleted_before = deleted_rows(lake, path)
    if spark is not None and engine_capabilities(spark).delta_commands:
        done = _SparkMaintenance(spark, path, lake).run(retention_s, target_file_bytes, max_deleted_rows_ratio)
    else:
        done = _DeltaRsMaintenance(path, lake).run(retention_s, target_file_bytes, max_deleted_rows_ratio)
    storage_after = storage_files(lake, path)
    log_after = log_files(lake, path)
    return TableMaintenance(
        path=path,
        method=done.method,
        version_before=done.version_before,
        version_after=done.version_after,
        table_before=done.table_before,
        table_after=done.table_after,
        deleted_before=deleted_before,
        deleted_after=deleted_rows(lake, path),
        storage_before=FileStats(len(storage_before), sum(storage_before.values())),
        storage_after=FileStats(len(storage_after), sum(storage_after.values())),
        files_compacted=done.files_compacted,
        files_written=done.files_written,
        files_vacuumed=len(storage_before.keys() - storage_after.keys()),
        log_files_removed=len(log_before - log_after),
        log_files_after=len(log_after),
        duration_s=time.monotonic() - started,
        properties_set=done.properties_set,
    )


def retention_interval(retention_s: int) -> str:
    """The retention as a Delta interval property value: whole hours in hours, else in seconds."""
    return f"interval {retention_s // 3600} hours" if retention_s % 3600 == 0 else f"interval {retention_s} seconds"


def properties_to_set(configuration: dict[str, str], retention_s: int) -> dict[str, str]:
    """The retention properties whose value differs from the retention (unset ones included), each
    mapped to it; an equal duration written otherwise ("interval 7 days") stays as it is."""
    interval = retention_interval(retention_s)
    return {
        name: interval for name in RETENTION_PROPERTIES if _interval_seconds(configuration.get(name, "")) != retention_s
    }


def _property_changes(configuration: dict[str, str], changed: dict[str, str]) -> tuple[str, ...]:
    """What :func:`properties_to_set` changed, for the job's log and metadata."""
    return tuple(f"{name}: {configuration.get(name, '(unset)')} -> {value}" for name, value in changed.items())


@dataclass(frozen=True, slots=True)
class _Done:
    method: str
    version_before: int
    version_after: int
    table_before: FileStats
    table_after: FileStats
    files_compacted: int
    files_written: int
    properties_set: tuple[str, ...]


def _no_hooks() -> object:
    """delta-rs post-commit hooks off: no checkpoint or log cleanup of its own choosing in the
    middle of maintenance; :meth:`_DeltaRsMaintenance.run` does both at the end, guarded."""
    from deltalake import PostCommitHookProperties

    return PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


class _DeltaRsMaintenance:
    """delta-rs, in this process: for engines without Delta's maintenance commands."""

    def __init__(self, path: str, lake: LakeStorage) -> None:
        self.path = path
        self.lake = lake

    def _open(self):  # type: ignore[no-untyped-def]  # deltalake.DeltaTable
        return delta_rs_table(self.lake, self.path)

    def _open_at(self, version: int):  # type: ignore[no-untyped-def]
        from deltalake import DeltaTable

        return DeltaTable(self.path, version=version, storage_options=self.lake.object_store_options() or None)

    def run(self, retention_s: int, target_file_bytes: int, max_deleted_rows_ratio: float) -> _Done:
        table = self._open()
        files_before = _add_actions(table)
        version_before, table_before = table.version(), _add_stats(files_before)
        configuration = table.metadata().configuration
        changed = properties_to_set(configuration, retention_s)
        if changed:
            table.alter.set_table_properties(changed, post_commithook_properties=_no_hooks())
            table = self._open()
        writing = _compaction_properties(files_before)  # setting properties left the files as they were
        compacted = table.optimize.compact(
            target_size=target_file_bytes, writer_properties=writing, post_commithook_properties=_no_hooks()
        )
        table = self._open()
        files_compacted, files_written = int(compacted["numFilesRemoved"]), int(compacted["numFilesAdded"])
        for partition in _partitions_to_purge(table, max_deleted_rows_ratio):
            purged = table.optimize.z_order(
                _order_columns(table), partition_filters=list(partition) or None, target_size=target_file_bytes,
                writer_properties=writing, post_commithook_properties=_no_hooks(),
            )  # fmt: skip
            files_compacted += int(purged["numFilesRemoved"])
            files_written += int(purged["numFilesAdded"])
            table = self._open()
        # A full vacuum lists the table's files (as Delta on Spark's VACUUM does) instead of trusting
        # the tombstones: a checkpoint drops a tombstone once it is older than the table's
        # deletedFileRetentionDuration (Sail writes one every ten commits), so a vacuum working
        # from tombstones misses every file whose tombstone expired between two maintenance runs
        # and leaves it on storage for good. A real run (two commits) only when there is a file to delete.
        # No retention argument: the table's deletedFileRetentionDuration, the retention since the
        # property commit above (delta-rs's argument takes whole hours only; the property takes seconds).
        candidates = table.vacuum(dry_run=True, full=True)
        if set(candidates) & storage_files(self.lake, self.path).keys():
            table.vacuum(dry_run=False, full=True, post_commithook_properties=_no_hooks())
            table = self._open()
        version = table.version()
        self._clean_log(_newest_writer_commit(self.lake, self.path), retention_s)
        self._checkpoint(version)
        return _Done(
            method="delta-rs",
            version_before=version_before,
            version_after=version,
            table_before=table_before,
            table_after=_add_stats(_add_actions(table)),
            files_compacted=files_compacted,
            files_written=files_written,
            properties_set=_property_changes(configuration, changed),
        )

    def _checkpoint(self, version: int) -> None:
        """A checkpoint at ``version`` unless it has one (Sail writes one every ten commits)."""
        if f"{version:020d}.checkpoint.parquet" not in log_files(self.lake, self.path):
            self._open_at(version).create_checkpoint()

    def _clean_log(self, keep_from: int, log_retention_s: int) -> None:
        """Delete the log entries older than version ``keep_from`` and ``log_retention_s`` (the table's
        logRetentionDuration, which delta-rs's clean-up reads): a checkpoint there, then Delta's
        clean-up of what it covers, then the orphaned ``.crc`` files. Nothing (no checkpoint
        either) while no file below ``keep_from`` has expired."""
        cutoff = time.time() - log_retention_s
        if not any(
            int(name[:20]) < keep_from and mtime < cutoff for name, mtime in log_entries(self.lake, self.path).items()
        ):
            return
        self._checkpoint(keep_from)
        self._open_at(keep_from).cleanup_metadata()
        self._remove_orphan_checksums()

    def _remove_orphan_checksums(self) -> None:
        """Delete the ``.crc`` files of commits log cleanup removed (Sail writes one per commit;
        delta-rs cleans only the commits and checkpoints): a checksum without its commit is
        read by nobody."""
        names = log_files(self.lake, self.path)
        commits = [int(name[:20]) for name in names if name.endswith(".json")]
        if not commits:
            return
        oldest = min(commits)
        filesystem, log = filesystem_path(self.lake, join_location(self.path, DELTA_LOG))
        for name in names:
            if name.endswith(".crc") and int(name[:20]) < oldest:
                filesystem.delete_file(f"{log}/{name}")  # type: ignore[attr-defined]


class _SparkMaintenance:
    """Delta on Spark's own commands; it checkpoints and cleans its log on its own commits."""

    def __init__(self, spark: SparkSession, path: str, lake: LakeStorage) -> None:
        self.spark = spark
        self.path = path
        self.lake = lake
        self.table = "delta.`" + path.replace("`", "``") + "`"

    def _detail(self) -> tuple[int, FileStats, dict[str, str]]:
        """Newest version, the data files of the newest version, the table properties."""
        row = self.spark.sql(f"DESCRIBE DETAIL {self.table}").select("numFiles", "sizeInBytes", "properties").first()
        assert row is not None
        newest = self.spark.sql(f"DESCRIBE HISTORY {self.table} LIMIT 1").select("version").first()
        assert newest is not None
        return (
            int(newest["version"]),
            FileStats(int(row["numFiles"]), int(row["sizeInBytes"])),
            dict(row["properties"] or {}),
        )

    def run(self, retention_s: int, target_file_bytes: int, max_deleted_rows_ratio: float) -> _Done:
        version_before, table_before, configuration = self._detail()
        changed = properties_to_set(configuration, retention_s)
        if changed:
            assignments = ", ".join(f"'{name}' = '{value}'" for name, value in changed.items())
            self.spark.sql(f"ALTER TABLE {self.table} SET TBLPROPERTIES ({assignments})").collect()
        with session_settings(self.spark, {"spark.databricks.delta.optimize.maxFileSize": str(target_file_bytes)}):
            metrics = self.spark.sql(f"OPTIMIZE {self.table}").select("metrics.*").first()
            assert metrics is not None
            files_compacted, files_written = int(metrics["numFilesRemoved"]), int(metrics["numFilesAdded"])
            partitions = _partitions_to_purge(delta_rs_table(self.lake, self.path), max_deleted_rows_ratio)
            if partitions:
                where = " OR ".join(
                    "(" + " AND ".join(f"`{column.replace('`', '``')}` = '{value.replace(chr(39), chr(39) * 2)}'" for column, _, value in partition) + ")"
                    for partition in partitions if partition
                )  # fmt: skip
                purge = f"REORG TABLE {self.table}" + (f" WHERE {where}" if where else "") + " APPLY (PURGE)"
                purged = self.spark.sql(purge).select("metrics.*").first()
                assert purged is not None
                files_compacted += int(purged["numFilesRemoved"])
                files_written += int(purged["numFilesAdded"])
            # No RETAIN: the table's deletedFileRetentionDuration, the retention since the
            # property commit above (so Delta's retention-duration guard holds as well).
            self.spark.sql(f"VACUUM {self.table}").collect()
        version_after, table_after, _ = self._detail()
        return _Done(
            method="spark",
            version_before=version_before,
            version_after=version_after,
            table_before=table_before,
            table_after=table_after,
            files_compacted=files_compacted,
            files_written=files_written,
            properties_set=_property_changes(configuration, changed),
        )


def _newest_writer_commit(lake: LakeStorage, path: str) -> int:
    """The newest version not written by maintenance: the newest snapshot, drain or other writer's commit.

    Log clean-up keeps it and everything after it, so maintenance never takes a commit (and its
    marker) out of the log that would have stayed without maintenance: a table's log is cleaned
    only as far as its own writers have moved it. Maintenance commits nothing on an idle table,
    so this reads a few commit files, newest first.
    """
    versions = sorted((int(name[:20]) for name in log_files(lake, path) if name.endswith(".json")), reverse=True)
    filesystem, log = filesystem_path(lake, join_location(path, DELTA_LOG))
    for version in versions:
        with filesystem.open_input_stream(f"{log}/{version:020d}.json") as commit:  # type: ignore[attr-defined]
            actions = commit.read().decode("utf-8").splitlines()
        infos = [json.loads(line)["commitInfo"] for line in actions if line.startswith('{"commitInfo"')]
        if not infos or infos[0].get("operation") not in MAINTENANCE_OPERATIONS:
            return version
    return versions[-1]


def _partitions_to_purge(table: object, max_deleted_rows_ratio: float) -> list[tuple[tuple[str, str, str], ...]]:
    """The partitions (as delta-rs partition filters; one empty filter: an unpartitioned table) holding
    a file whose deletion vector deletes more than ``max_deleted_rows_ratio`` of its rows."""
    return sorted({
        file.partition for file in table_file_deletions(table) if file.deleted and file.deleted > max_deleted_rows_ratio * file.rows
    })  # fmt: skip


def _order_columns(table: object) -> list[str]:
    """What a purge's Z-order sorts by: the layout's key (the order snapshots write), else the LSN column."""
    layout = layout_from_property(table.metadata().configuration.get(LAYOUT_PROPERTY))  # type: ignore[attr-defined]
    return list(layout.key) if layout is not None else [LSN_COLUMN]


def _compaction_properties(actions: Any) -> object:  # deltalake.WriterProperties
    """delta-rs's own codec for compaction (ZSTD, level 4) in row groups of about
    ``ROW_GROUP_BYTES`` of the table's rows as stored: delta-rs buffers the row group of each file it
    writes, on each of its concurrent tasks (one per core), and its default of about 1M rows per group
    held 416 MiB compacting 450k rows of 1 KB of incompressible text into four files on two cores;
    199 MiB in groups of 16k rows. Compressible rows are narrow as stored, so their groups stay large."""
    from deltalake import WriterProperties

    sizes, counts = actions.column("size_bytes").to_pylist(), actions.column("num_records").to_pylist()
    rows = sum(count for count in counts if count)  # a file without statistics has no count
    row_bytes = sum(size for size, count in zip(sizes, counts) if count) // rows if rows else None
    return WriterProperties(compression="ZSTD", compression_level=4, max_row_group_size=row_group_rows(row_bytes))


def _add_actions(table: Any) -> Any:
    """The table's data files, one row each (path, size, record count, statistics), as delta-rs lists them."""
    return table.get_add_actions(flatten=True)


def _add_stats(actions: Any) -> FileStats:
    return FileStats(actions.num_rows, sum(actions.column("size_bytes").to_pylist()))


def _interval_seconds(value: str) -> int | None:
    """A Delta interval property value in seconds; None when unset or not of the form ``interval N unit``."""
    match = _INTERVAL.match(value)
    if match is None:
        return None
    return int(match.group(1)) * _INTERVAL_SECONDS[match.group(2).lower()]


def describe(result: TableMaintenance) -> str:
    """One log line with the counts."""
    return (
        f"{result.path} ({result.method}): files {result.table_before.files} -> {result.table_after.files}"
        f" ({result.files_compacted} compacted into {result.files_written}),"
        f" {result.table_before.bytes} -> {result.table_after.bytes} bytes;"
        f" rows deleted by deletion vectors {result.deleted_before.fraction:.2%} -> {result.deleted_after.fraction:.2%};"
        f" storage {result.storage_before.files} -> {result.storage_after.files} files"
        f" ({result.files_vacuumed} vacuumed); log files removed {result.log_files_removed};"
        f" version {result.version_before} -> {result.version_after}; {result.duration_s:.2f} s"
        + (f"; set {', '.join(result.properties_set)}" if result.properties_set else "")
    )
