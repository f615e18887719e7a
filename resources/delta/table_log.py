"""Reading a Delta table's commit log directly through the lake's storage client, in O(commits read).

The incremental run decides what to skip and what to apply from each table's own log (the
snapshot marker, the append/replace markers of ``resources/delta/markers.py``). Reading it
through the engine scans every commit the log holds (a Spark job per table per run); this
module reads only the files it needs, with the ``pyarrow.fs`` client of the lake
(``lake_storage.storage_client``: local directories and ``s3://`` lakes, wherever the engine runs):

* with a ``known`` :class:`~resources.delta.destination.TableLog` (from the pgcdc state table,
  possibly stale): the commits after ``known.version``, found by asking for ``version + 1``,
  ``version + 2``, ... until one is missing; plus one read of the known snapshot commit to
  check that ``known`` describes this log (a table deleted and written again restarts its
  versions), and of ``known.version`` itself (when both it and the next commit are gone, log
  cleanup removed commits the read would need). A mismatch falls back to:
* without ``known``: one listing of ``_delta_log``, then the commits newest first, back to the
  newest snapshot commit.

Delta's commit files are ``_delta_log/<version as 20 digits>.json``, one JSON action per line;
pgcdc's markers are in the ``commitInfo`` action's ``userMetadata``. Checkpoints do not keep
``commitInfo``, so a marker in a commit that log cleanup removed is gone: a table whose log no
longer starts at version 0 and holds no snapshot marker has snapshot LSN
:data:`~resources.delta.markers.EXPIRED_SNAPSHOT_LSN` (which says why), and its
layout (:func:`expired_layout`) comes from its newest ``metaData`` action (in the commits after the
newest checkpoint, else in that checkpoint), which checkpoints keep: the table property
:data:`~resources.delta.markers.LAYOUT_PROPERTY` where the engine recorded it, else the layout
``known`` recorded when ``known`` describes the same table (its ``table_id`` is the metadata's
``id``) and the table is partitioned by the bucket column. Read once, when the read first finds the
snapshot commit gone (and once per table to learn the id of a row written before ids were recorded).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from resources.delta.destination import NO_TABLE, TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.lake_storage import LakeStorage, storage_client
from resources.delta.layout import BUCKET_COLUMN, TableLayout
from resources.delta.markers import (
    EXPIRED_SNAPSHOT_LSN,
    fold_table_log,
    layout_from_property,
    LAYOUT_PROPERTY,
    marker_chunks,
    marker_columns,
    marker_layout,
    marker_snapshot_lsn,
    pgcdc_marker,
    SNAPSHOT_CREATE_METADATA,
)
from resources.errors import DeltaLogError
from resources.lsn import LSN
from resources.names import ColumnNumbers, RESNAPSHOT_JOB

LOG_DIRECTORY = "_delta_log"
LAST_CHECKPOINT = "_last_checkpoint"


def read_table_log(path: str, known: TableLog | None = None, lake: LakeStorage | None = None) -> TableLog:
    """The :class:`TableLog` of the table at ``path`` (see the module docstring for what is read); ``lake``
    holds it when it is on an object store (every function here takes it so)."""
    log = _Log(path, lake)
    if known is not None and known.version is not None and known.snapshot_lsn is not None:
        checked = _after_known(log, known)
        if checked is not None:
            return checked
    return _from_listing(log, known)


def newest_marker(path: str, lake: LakeStorage | None = None) -> tuple[int | None, dict[str, Any] | None]:
    """The table's newest version and the pgcdc marker of its newest commit that has one (None, None:
    no table; a marker of None: no kept commit has one): one listing, then commits newest first."""
    log = _Log(path, lake)
    versions, checkpoint = log.versions()
    if not versions and checkpoint is None:
        return None, None
    newest = max(versions[-1] if versions else -1, checkpoint or -1)
    for version in reversed(versions):
        for user_metadata in log.commit(version) or []:
            marker = pgcdc_marker(user_metadata)
            if marker is not None:
                return newest, marker
    return newest, None


MAINTENANCE_OPERATIONS = frozenset({"SET TBLPROPERTIES", "OPTIMIZE", "VACUUM START", "VACUUM END"})
"""The commits maintenance writes (delta-rs and Delta on Spark name them alike). A property commit
is one: were it a writer's, every maintenance run that sets a property would pin the log's
clean-up horizon to itself, and an idle table's log would never be cleaned."""


def rows_unchanged_after(path: str, version: int, newest: int, lake: LakeStorage | None = None) -> bool:
    """Whether every commit after ``version`` up to ``newest`` only maintains the table (table
    properties, compaction, vacuum: :data:`MAINTENANCE_OPERATIONS`),
    so its rows are those of ``version``; reads those commits only."""
    log = _Log(path, lake)
    for later in range(version + 1, newest + 1):
        infos = log.actions(later, "commitInfo")
        if not infos or any(info.get("operation") not in MAINTENANCE_OPERATIONS for info in infos):
            return False
    return True


def bytes_added(path: str, version: int, newest: int, lake: LakeStorage | None = None) -> int:
    """The bytes the commits after ``version`` up to ``newest`` wrote to storage, as their ``add`` actions
    record them: each new data file's ``size``, and each new deletion vector's ``sizeInBytes`` unless it
    is inlined in the log. A file a commit removes and adds again (given a deletion vector, the same
    file on every engine) was not written again: only its deletion vector counts. Reads those commits
    only; one that log clean-up removed counts nothing."""
    log = _Log(path, lake)
    total = 0
    for later in range(version + 1, newest + 1):
        actions = log.parse(f"{later:020d}.json", (log.read(f"{later:020d}.json") or "").splitlines())
        removed = {action["remove"]["path"] for action in actions if "remove" in action}
        for add in (action["add"] for action in actions if "add" in action):
            if add["path"] not in removed:
                total += int(add["size"])
            vector = add.get("deletionVector")
            if vector and vector.get("storageType") != "i":
                total += int(vector["sizeInBytes"])
    return total


def version_with_metadata(path: str, user_metadata: str, lake: LakeStorage | None = None) -> int:
    """The version of the newest commit carrying ``user_metadata`` (a writer's own commit, found by its
    marker so a concurrent writer cannot be mistaken for it): one listing, then the commits newest first."""
    log = _Log(path, lake)
    for version in reversed(log.versions()[0]):
        if user_metadata in (log.commit(version) or []):
            return version
    raise RuntimeError(f"no commit with userMetadata {user_metadata!r} in {path}")


@dataclass(frozen=True, slots=True)
class TableMetadata:
    """What pgcdc reads of a table's newest ``metaData`` action."""

    #: Delta's table id: kept by every commit, overwrites included; new when the table is created again.
    table_id: str
    partition_columns: tuple[str, ...]
    #: The table property :data:`LAYOUT_PROPERTY` (None: absent, as on engines that refuse it).
    layout_property: str | None
    #: The table's schema as Delta records it (``schemaString``: Spark's JSON form of a ``StructType``).
    schema_json: str

    @property
    def bucketed(self) -> bool:
        return BUCKET_COLUMN in self.partition_columns


def read_table_metadata(path: str, lake: LakeStorage | None = None) -> TableMetadata | None:
    """The table's newest metadata (None: no table at ``path``): a listing of its log, the commits after
    its newest checkpoint, newest first, until one has a ``metaData`` action, else that checkpoint's."""
    return _Log(path, lake).metadata()


def expired_layout(metadata: TableMetadata | None, known: TableLog | None) -> TableLayout | None:
    """The layout of a table whose snapshot commit left the log, from its ``metadata``: the table
    property where the engine recorded one, else ``known``'s layout when ``known`` describes this very
    table (same ``table_id``) and the table is bucketed; None otherwise (unbucketed, or not known:
    the drain refuses a bucketed table without a layout).

    ``known``'s layout is trusted without its snapshot commit because a table keeps its layout for
    as long as it keeps its id: a snapshot of a bucketed table writes the layout the table has
    (``resources/runs/snapshot.py``), and only a snapshot of an unbucketed one chooses a layout. So any
    layout recorded for this id, by the snapshot that wrote it or by a log read that found it in the
    snapshot marker, is still the table's, however stale the row otherwise is. A row recorded
    before a table adopted buckets by a re-snapshot says "unbucketed" and is not taken for a layout.
    """
    if metadata is None:
        return None
    created_with = layout_from_property(metadata.layout_property)
    if created_with is not None:
        return created_with
    if known is not None and known.table_id == metadata.table_id and metadata.bucketed:
        return known.layout
    return None


def table_exists(path: str, lake: LakeStorage | None = None) -> bool:
    """Whether a Delta table is at ``path``: its first commit, or a checkpoint after log cleanup (two reads at most)."""
    log = _Log(path, lake)
    return log.commit(0) is not None or log.read(LAST_CHECKPOINT) is not None


def unfinished_create(path: str, lake: LakeStorage | None = None) -> bool:
    """Whether the table at ``path`` is nothing but the empty table pgcdc creates for delta-rs's
    snapshot writer right before its snapshot commit (``snapshot_writes.py``), left so by a process killed in
    between: then it counts as not snapshotted and the next snapshot creates it again.

    What proves it, from the log alone: the log is exactly commit 0 (no later commit, no checkpoint:
    nothing was ever committed after it); that commit adds and removes no data file and carries no
    pgcdc marker (it is a create, not a snapshot); and its ``metaData`` carries
    :data:`~resources.delta.markers.LAYOUT_PROPERTY`, which only pgcdc writes and which pgcdc writes
    into a data-less commit only in that create, or its ``commitInfo`` carries
    :data:`~resources.delta.markers.SNAPSHOT_CREATE_METADATA` (the engine's create on Delta on Spark,
    which refuses that property). A table any other writer made, or one that ever
    held a commit after its creation, is not one (two reads for almost every table: commit 1, and
    commit 0 when commit 1 is missing; a listing only for a data-less create with the property)."""
    log = _Log(path, lake)
    if log.commit(1) is not None:
        return False
    text = log.read(f"{0:020d}.json")
    if text is None:
        return False
    actions = log.parse(f"{0:020d}.json", text.splitlines())
    if any("add" in action or "remove" in action for action in actions):
        return False
    if any(
        pgcdc_marker(action["commitInfo"].get("userMetadata")) is not None
        for action in actions
        if "commitInfo" in action
    ):
        return False
    if not any(
        LAYOUT_PROPERTY in (action["metaData"].get("configuration") or {}) for action in actions if "metaData" in action
    ) and not any(
        action["commitInfo"].get("userMetadata") == SNAPSHOT_CREATE_METADATA
        for action in actions
        if "commitInfo" in action
    ):
        return False
    versions, checkpoint = log.versions()
    return versions == [0] and checkpoint is None and log.read(LAST_CHECKPOINT) is None


def has_commit(path: str, version: int, lake: LakeStorage | None = None) -> bool:
    """Whether the commit file of ``version`` is in the log of the table at ``path`` (one read)."""
    return _Log(path, lake).commit(version) is not None


class _Log:
    """One table's ``_delta_log`` on its store."""

    def __init__(self, path: str, lake: LakeStorage | None) -> None:
        self.filesystem, root = storage_client(path, lake)
        self.directory = f"{root.rstrip('/')}/{LOG_DIRECTORY}"

    def read(self, name: str) -> str | None:
        """The file ``name`` of the log directory as text; None when it does not exist."""
        try:
            with self.filesystem.open_input_stream(f"{self.directory}/{name}") as stream:  # type: ignore[attr-defined]
                data = stream.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.corrupt(name, error) from None

    def parse(self, name: str, lines: Iterable[str]) -> list[dict[str, Any]]:
        """The JSON actions of ``lines`` of the log file ``name`` (blank lines skipped)."""
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except ValueError as error:
            raise self.corrupt(name, error) from None

    def corrupt(self, name: str, error: ValueError) -> DeltaLogError:
        """A log file that is not what Delta writes (truncated, or other bytes): one line naming it and the fix.
        The table cannot be read by any engine until then, so the drain fails as a whole, confirming nothing."""
        table = self.directory.rsplit("/", 1)[0]
        detail = (str(error).splitlines() or [type(error).__name__])[0][:120]
        return DeltaLogError(
            f"the Delta log of {table} is corrupt: {self.directory}/{name} is not a whole commit ({detail})",
            f"restore that file from a backup, or move {table} aside and re-snapshot the table (its snapshot asset,"
            f" or the {RESNAPSHOT_JOB} job naming it); nothing was confirmed to the slot past what Delta holds",
        )

    def commit(self, version: int) -> list[str | None] | None:
        """The userMetadata of the commit file ``version`` (a list: Delta allows one commitInfo,
        but nothing is assumed); None when the file does not exist."""
        actions = self.actions(version, "commitInfo")
        return None if actions is None else [action.get("userMetadata") for action in actions]

    def actions(self, version: int, kind: str) -> list[dict[str, Any]] | None:
        """The ``kind`` actions of the commit file ``version``; None when the file does not exist."""
        text = self.read(f"{version:020d}.json")
        if text is None:
            return None
        prefix = '{"' + kind + '"'
        return [
            action[kind]
            for action in self.parse(
                f"{version:020d}.json", (line for line in text.splitlines() if line.startswith(prefix))
            )
        ]

    def metadata(self) -> TableMetadata | None:
        """The newest ``metaData`` action: the newest commit after the newest checkpoint that has one,
        else the checkpoint's (one listing, those commits, one column of the checkpoint)."""
        versions, checkpoint = self.versions()
        for version in reversed([v for v in versions if checkpoint is None or v > checkpoint]):
            for metadata in self.actions(version, "metaData") or []:
                return _table_metadata(metadata, (metadata.get("configuration") or {}).get(LAYOUT_PROPERTY))
        if checkpoint is None:
            return None
        return self._checkpoint_metadata(checkpoint)

    def _checkpoint_metadata(self, version: int) -> TableMetadata | None:
        """The ``metaData`` of checkpoint ``version`` (classic or multi-part parquet files)."""
        import pyarrow.parquet as pq
        from pyarrow import fs

        selector = fs.FileSelector(self.directory)
        names = [
            entry.path
            for entry in self.filesystem.get_file_info(selector)  # type: ignore[attr-defined]
            if entry.base_name.startswith(f"{version:020d}.checkpoint.") and entry.base_name.endswith(".parquet")
        ]
        for name in sorted(names):
            rows = pq.read_table(name, columns=["metaData"], filesystem=self.filesystem).column("metaData")
            for metadata in rows.to_pylist():
                if metadata is not None:
                    return _table_metadata(metadata, dict(metadata.get("configuration") or []).get(LAYOUT_PROPERTY))
        return None

    def versions(self) -> tuple[list[int], int | None]:
        """The versions of the commit files present, ascending, and the newest checkpoint's version."""
        from pyarrow import fs

        selector = fs.FileSelector(self.directory, allow_not_found=True)
        try:
            entries = self.filesystem.get_file_info(selector)  # type: ignore[attr-defined]
        except NotADirectoryError:  # a path under a regular file: no table there
            return [], None
        commits: list[int] = []
        checkpoint: int | None = None
        for entry in entries:
            name = entry.base_name
            if not name[:20].isdigit():
                continue
            if name.endswith(".json") and len(name) == 25:
                commits.append(int(name[:20]))
            elif ".checkpoint." in name:
                checkpoint = max(checkpoint or 0, int(name[:20]))
        return sorted(commits), checkpoint


def _table_metadata(metadata: dict[str, Any], layout_property: str | None) -> TableMetadata:
    return TableMetadata(
        str(metadata.get("id")),
        tuple(metadata.get("partitionColumns") or ()),
        layout_property,
        str(metadata.get("schemaString") or ""),
    )


def _after_known(log: _Log, known: TableLog) -> TableLog | None:
    """``known`` advanced by the commits after it; None when ``known`` does not match this log.

    ``known`` is a hint: its snapshot LSN and layout count only when its snapshot commit, read
    here, carries them. A snapshot commit gone with log cleanup (the log no longer starts at
    version 0) counts as :data:`EXPIRED_SNAPSHOT_LSN`, with the layout :func:`expired_layout`
    finds, as for a log read from the start; a ``known`` naming another table id is not this table's.
    """
    assert known.version is not None and known.snapshot_lsn is not None
    if known.snapshot_version is None:
        if known.snapshot_lsn != EXPIRED_SNAPSHOT_LSN:
            return None
    else:
        snapshot_commit = log.commit(known.snapshot_version)
        if snapshot_commit is None and log.commit(0) is None:
            metadata = log.metadata()
            if metadata is None or known.table_id not in (None, metadata.table_id):
                return None  # another table now lives at this path
            layout = expired_layout(metadata, known)
            # The row's column numbers stay true: a newer snapshot would be among the commits read below.
            columns = known.columns if known.table_id == metadata.table_id else None
            known = TableLog(
                EXPIRED_SNAPSHOT_LSN,
                None,
                known.version,
                known.applied_marker,
                layout,
                metadata.table_id,
                None,
                columns,
            )
        else:
            recorded = None if snapshot_commit is None else _snapshot(snapshot_commit)
            if recorded is None or recorded[:2] != (known.snapshot_lsn, known.layout):
                return None  # not this log's snapshot (another table now lives at this path)
            # The state keeps neither a snapshot's key ranges nor its column numbers: they come from its
            # commit, read here anyway.
            known = replace(known, chunks=recorded[2], columns=recorded[3])
            if known.table_id is None:  # a row written before ids were recorded: learn it while the marker is here
                metadata = log.metadata()
                known = replace(known, table_id=metadata.table_id if metadata is not None else None)
    assert known.version is not None  # kept by the replacements above
    if log.commit(known.version) is None and log.commit(known.version + 1) is None:
        return None  # beyond this log, or commits after it are gone with log cleanup: a gap
    newer: list[tuple[int, list[str | None]]] = []
    while (commit := log.commit(known.version + len(newer) + 1)) is not None:
        newer.append((known.version + len(newer) + 1, commit))
    return fold_table_log(reversed(newer), known.version + len(newer), known)


def _from_listing(log: _Log, known: TableLog | None) -> TableLog:
    """Newest commit first, back to the newest snapshot commit (or the oldest commit kept); the table's
    id from its newest metadata. ``known`` (a row that did not match the log read from it: a gap, or
    another table) only gives the layout :func:`expired_layout` allows."""
    versions, checkpoint = log.versions()
    if not versions and checkpoint is None:
        return NO_TABLE
    newest = max(versions[-1] if versions else -1, checkpoint or -1)

    def newest_first() -> Iterable[tuple[int, list[str | None]]]:
        for version in reversed(versions):
            commit = log.commit(version)
            if commit is not None:
                yield version, commit

    found = fold_table_log(newest_first(), newest, None)
    metadata = log.metadata()
    table_id = metadata.table_id if metadata is not None else None
    if found.snapshot_version is None and (not versions or versions[0] > 0):  # no snapshot marker left
        layout = expired_layout(metadata, known)
        return TableLog(EXPIRED_SNAPSHOT_LSN, None, newest, found.applied_marker, layout, table_id)
    return replace(found, table_id=table_id)


def _snapshot(
    commit: list[str | None],
) -> tuple[LSN | None, TableLayout | None, KeyRanges | None, ColumnNumbers | None] | None:
    """The snapshot LSN, layout, key ranges and column numbers of the snapshot marker in ``commit``; None without one."""
    for user_metadata in commit:
        marker = pgcdc_marker(user_metadata)
        if marker is not None and marker.get("kind") == "snapshot":
            return marker_snapshot_lsn(marker), marker_layout(marker), marker_chunks(marker), marker_columns(marker)
    return None
