"""What pgcdc keeps in Delta besides the rows: the LSN column, commit markers and the commit log reads.

Every pgcdc commit that the next run must be able to find carries a JSON marker in its Delta
``userMetadata``, ``{"pgcdc": {"kind": ...}}``:

* ``snapshot``: the table was (re)written from a COPY at ``snapshot_lsn``; changes at or below
  it are already in the rows. ``layout`` (absent: unbucketed, as every table written before
  pgcdc chose layouts) is the table's bucketing (``resources/delta/layout.py``). A table copied in
  primary-key ranges has ``chunks`` (``resources/delta/key_ranges.py``: the ranges, and the
  consistent point of each one done so far, ``range``: the one this commit copied) and a
  ``snapshot_lsn`` only once every range is done.
* ``append`` / ``replace``: a keyless append or a REPLICA IDENTITY FULL rewrite applied the
  changes of one transaction up to position ``applied_seq`` of the commit ending at
  ``applied_lsn``; a replay skips exactly those.

Other writers' metadata (free text, other JSON) is ignored. Markers are built and parsed here, with
no engine: the runs read only the commits they need with ``resources/delta/table_log.py`` (through
their destination) and fold them with :func:`fold_table_log`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from resources.delta.destination import TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.layout import TableLayout
from resources.lsn import LSN
from resources.names import ColumnNumbers

LSN_COLUMN = "_pgcdc_lsn"
"""The column every Delta table gets: the commit end LSN of the change that wrote the row (the snapshot LSN for copied rows)."""

APPEND_MARKER, REPLACE_MARKER = "append", "replace"
"""Marker kinds of the commits that apply changes without a key (keyless append, REPLICA IDENTITY FULL rewrite)."""


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """One Delta commit as recorded in ``_delta_log``."""

    version: int
    timestamp_ms: int
    operation: str
    user_metadata: str | None


EXPIRED_SNAPSHOT_LSN = LSN(0)
"""The snapshot LSN of a table whose snapshot commit has left the log.

Delta deletes commits older than ``delta.logRetentionDuration`` (30 days by default) once a newer
checkpoint covers them, so a table replicated for longer than that has lost its snapshot commit,
and with it the marker. The LSN no longer matters by then: every incremental run confirms the slot
past the WAL position at its start, so the slot passed the snapshot LSN with the first run after
the snapshot, long before the commit expired. A table whose log no longer starts at version 0 and
holds no marker is therefore snapshotted at this LSN (nothing of what the slot sends is skipped)
rather than treated as never snapshotted, which would skip all its changes."""


LAYOUT_PROPERTY = "delta.pgcdc.layout"
"""The table property the snapshot that creates a table records its layout in (``none``: created
unbucketed), where the writer takes it (Sail, and delta-rs's create of a new table; Delta on Spark
refuses unknown ``delta.*`` names, delta-rs's writes refuse unknown names).
Table properties live in the table's metadata, which every checkpoint repeats, so the layout
outlives the snapshot commit's marker when log cleanup removes it. Engines set it only when the
table is created (writer options do not change an existing table's properties), so a table that
adopted buckets later still says ``none``: its layout outlives the marker in the pgcdc state, under
the table's Delta id (``resources/delta/table_log.py: expired_layout``, docs/contracts.md, "Table layout")."""


SNAPSHOT_CREATE_METADATA = '{"pgcdc_create": "snapshot"}'
"""The userMetadata of the data-less commit in which the engine creates a table whose snapshot rows
delta-rs then writes (Delta on Spark, ``resources/delta/snapshot_writes.py``): not a marker (no
``pgcdc`` object, so every marker read passes over it), only what tells that create, left alone by a
process killed before the snapshot commit, from an empty table another writer made
(``resources/delta/table_log.py: unfinished_create``)."""


def layout_property(layout: TableLayout | None) -> str:
    return json.dumps(layout.to_json()) if layout is not None else "none"


def layout_from_property(value: str | None) -> TableLayout | None:
    """The layout a :data:`LAYOUT_PROPERTY` value names (None: absent, or ``none``)."""
    return TableLayout.from_json(json.loads(value)) if value and value != "none" else None


def fold_table_log(
    commits_newest_first: Iterable[tuple[int, Iterable[str | None]]], newest: int, known: TableLog | None
) -> TableLog:
    """The :class:`TableLog` of a log whose newest version is ``newest``, from its commits'
    userMetadata, newest first: the newest snapshot marker (its LSN and layout), and the newest append/replace marker
    after it (the rows a marker vouches for went with a later snapshot). Where the commits given
    hold no snapshot marker, ``known`` says what was true at the commit before the oldest of them
    (None: nothing before them). The commits continue ``known``'s log, so its table id carries over
    (an overwrite keeps the id; a table created again restarts its versions)."""
    applied: tuple[int, int] | None = None
    table_id = known.table_id if known is not None else None
    for version, commit in commits_newest_first:
        for user_metadata in commit:
            marker = pgcdc_marker(user_metadata)
            if marker is None:
                continue
            kind = marker.get("kind")
            if kind == "snapshot":
                return TableLog(
                    marker_snapshot_lsn(marker),
                    version,
                    newest,
                    applied,
                    marker_layout(marker),
                    table_id,
                    marker_chunks(marker),
                    marker_columns(marker),
                )
            if kind in (APPEND_MARKER, REPLACE_MARKER) and applied is None:
                applied = int(LSN.parse(marker["applied_lsn"])), int(marker["applied_seq"])
    if known is None:
        return TableLog(None, None, newest, applied, None)
    return TableLog(
        known.snapshot_lsn,
        known.snapshot_version,
        newest,
        applied or known.applied_marker,
        known.layout,
        table_id,
        known.chunks,
        known.columns,
    )


def applied_marker(kind: str, end: int, seq: int) -> str:
    """The marker of an append or replace commit: changes up to ``seq`` of the transaction ending at ``end``."""
    return json.dumps({"pgcdc": {"kind": kind, "applied_lsn": str(LSN(end)), "applied_seq": seq}})


def snapshot_marker(
    snapshot_lsn: LSN | None,
    slot: str,
    table: str,
    layout: TableLayout | None = None,
    chunks: KeyRanges | None = None,
    copied_range: int | None = None,
    columns: ColumnNumbers | None = None,
) -> str:
    """The marker of a snapshot commit: the rows are the table as of ``snapshot_lsn``, bucketed by ``layout``.

    For a snapshot in key ranges, ``chunks`` says which ranges are done at which point (this commit
    copied ``copied_range``) and ``snapshot_lsn`` is None until every range is done. ``columns``: the
    published columns' attnums and the attribute count as of the copy's point.
    """
    marker: dict[str, Any] = {"kind": "snapshot"}
    if snapshot_lsn is not None:
        marker["snapshot_lsn"] = str(snapshot_lsn)
    marker.update(slot=slot, table=table)
    if layout is not None:
        marker["layout"] = layout.to_json()
    if chunks is not None:
        marker["chunks"] = {**chunks.to_json(), "range": copied_range}
    if columns is not None:
        marker["columns"] = columns.to_json()
    return json.dumps({"pgcdc": marker})


def marker_snapshot_lsn(marker: dict[str, Any]) -> LSN | None:
    """A snapshot marker's LSN; None for a snapshot in key ranges not complete yet."""
    value = marker.get("snapshot_lsn")
    return LSN.parse(value) if value else None


def marker_chunks(marker: dict[str, Any]) -> KeyRanges | None:
    """The key ranges a snapshot marker recorded (None: a snapshot of the whole table at once)."""
    chunks = marker.get("chunks")
    return KeyRanges.from_json(chunks) if chunks else None


def marker_layout(marker: dict[str, Any]) -> TableLayout | None:
    """The layout a snapshot marker recorded (None: unbucketed, as every marker written before layouts)."""
    layout = marker.get("layout")
    return TableLayout.from_json(layout) if layout else None


def marker_columns(marker: dict[str, Any]) -> ColumnNumbers | None:
    """The column numbers a snapshot marker recorded (None: a marker written before they were recorded)."""
    columns = marker.get("columns")
    return ColumnNumbers.from_json(columns) if columns else None


def pgcdc_marker(user_metadata: str | None) -> dict[str, Any] | None:
    """The ``pgcdc`` object of a commit's userMetadata; None for no metadata or another writer's."""
    if not user_metadata:
        return None
    try:
        marker = json.loads(user_metadata)
    except ValueError:
        return None  # another writer's free-form metadata
    pgcdc = marker.get("pgcdc") if isinstance(marker, dict) else None
    return pgcdc if isinstance(pgcdc, dict) else None
