"""The pgcdc state table: one row per replicated table, so a run need not open the tables it does not change.

A small Delta table per lake and slot, ``<delta.root>/_pgcdc/state/<slot>``, read and written by
delta-rs in pgcdc's process (neither a run's start nor its end needs an engine statement). Each
row records what a table's own log said (:class:`~resources.delta.destination.TableLog`) as of the
Delta version in the row, and the newest change pgcdc applied to it. The snapshot writes rows
after its commits; an incremental run reads the table once at its start and rewrites it, before
its final confirm, when it read any table's log.

It is a cache, never the truth: skip and apply decisions come from each table's own log, read
(from the row's version on) when a run meets a change for the table. A row that is missing,
stale (a crash between a table's commit and the state write, a lost race between two writers)
or wrong (a table deleted and written again) costs a longer log read, never a wrong skip.
What a run uses a row for without that check: the refusal "no replicated table has a
snapshot" (a wrong root has no state either) and the Delta version and applied LSN reported
for tables without changes (which may lag behind after a crash until the table next changes).
Two things a row holds that a log may lose once log cleanup removed the snapshot commit: the layout
of a bucketed table, where the engine keeps no table property naming it (Delta on Spark; a table
that adopted buckets by a re-snapshot on any engine), and the column numbers the snapshot recorded
(``resources/cdc/renames.py``). A row's layout counts then only for the table with the row's
``table_id`` (Delta's ``metaData.id``), which keeps its layout for life
(``resources.delta.table_log.expired_layout``); its column numbers only when the commits after the
row's version are all there (no newer snapshot among them).

Every write replaces the whole table (one file of one row per table), so what a run reads stays
one small file (and the engine reads the log from its newest checkpoint) whatever the number of
runs. The replaced files and the log entries (one commit per write) stay on disk until the
maintenance job vacuums the table and cleans its log, like any Delta table's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, UTC

import pyarrow as pa

from resources.delta.dataframes import nullable_schema
from resources.delta.destination import TableLog
from resources.delta.lake_storage import LakeStorage, object_store_options
from resources.delta.layout import TableLayout
from resources.delta.reads import delta_rs_rows
from resources.delta.table_log import table_exists
from resources.locations import join_location
from resources.lsn import LSN
from resources.names import ColumnNumbers

PGCDC_TABLES_DIRECTORY = "_pgcdc"
"""``<delta.root>/_pgcdc/``: pgcdc's own Delta tables (its state), maintained with the replicated ones;
no PostgreSQL schema name maps there in practice (``_pgcdc.state`` would)."""

STATE_TABLES_DIRECTORY = (PGCDC_TABLES_DIRECTORY, "state")
"""``<delta.root>/_pgcdc/state/``: one state table per slot below it."""

STATE_SCHEMA = pa.schema(
    [
        pa.field("table", pa.string()),
        pa.field("path", pa.string()),
        pa.field("snapshot_lsn", pa.int64()),
        pa.field("snapshot_version", pa.int64()),
        pa.field("delta_version", pa.int64()),
        pa.field("applied_lsn", pa.int64()),
        pa.field("marker_lsn", pa.int64()),
        pa.field("marker_seq", pa.int64()),
        pa.field("layout", pa.string()),  # TableLayout.to_json as JSON; null: unbucketed
        pa.field("table_id", pa.string()),  # Delta's metaData.id of the table the layout belongs to; null: not read
        pa.field("columns", pa.string()),  # ColumnNumbers.to_json of the snapshot as JSON; null: not recorded
        pa.field("updated_at", pa.timestamp("us", tz="UTC")),
    ]
)


@dataclass(frozen=True, slots=True)
class StateRow:
    """One table's row: its log as of ``log.version`` and the newest change pgcdc applied to it."""

    table: str
    path: str
    log: TableLog
    applied_lsn: LSN | None


def state_path(root: str, slot: str) -> str:
    return join_location(root, *STATE_TABLES_DIRECTORY, slot)


def known_log(state: dict[str, StateRow], table: str, path: str) -> TableLog | None:
    """The table's log as the state knows it, to hand to a log read as ``known``; None when the
    state has no row for the table at ``path`` (a row for another path is another table)."""
    row = state.get(table)
    return row.log if row is not None and row.path == path else None


def read_state(path: str, lake: LakeStorage | None = None) -> dict[str, StateRow]:
    """The rows by table name (the newest one where a lost race left two); empty without a state table.

    Read by delta-rs in this process, not by the engine: one small file, and on Delta on Spark a
    JVM job per drain (1.9 s warm, 6.5-13 s as a fresh engine's first statement, docs/engine-notes.md).
    ``lake`` holds the state when it is on an object store (as for :func:`write_state`)."""
    if not table_exists(path, lake):
        return {}
    data = delta_rs_rows(path, storage_options=object_store_options(path, lake) or None)
    rows: dict[str, tuple[datetime, StateRow]] = {}
    for record in data.to_pylist():
        if record["snapshot_lsn"] is None or record["delta_version"] is None:
            continue
        marker = None if record["marker_lsn"] is None else (record["marker_lsn"], record["marker_seq"])
        row = StateRow(
            record["table"],
            record["path"],
            TableLog(
                LSN(record["snapshot_lsn"]),
                record["snapshot_version"],
                record["delta_version"],
                marker,
                TableLayout.from_json(json.loads(record["layout"])) if record.get("layout") else None,
                record.get("table_id"),  # absent from states written before table ids were recorded
                columns=ColumnNumbers.from_json(json.loads(record["columns"])) if record.get("columns") else None,
            ),
            None if record["applied_lsn"] is None else LSN(record["applied_lsn"]),
        )
        updated = record["updated_at"]
        if row.table not in rows or updated > rows[row.table][0]:
            rows[row.table] = (updated, row)
    return {table: row for table, (_, row) in rows.items()}


def write_state(
    path: str,
    previous: dict[str, StateRow],
    changed: Iterable[StateRow],
    forget: Iterable[str] = (),
    lake: LakeStorage | None = None,
) -> None:
    """Replace the state with ``previous`` updated by ``changed`` (rows of snapshotted tables only:
    a row saying "no snapshot" could hide a snapshot whose own state write was lost), without the
    rows of the tables named in ``forget`` (found without a snapshot: their Delta table went away).

    Written by delta-rs in this process, one file in one commit: no engine statement (on a fresh
    engine the first statement costs 0.5-0.7 s on Sail and 2-3 s on Delta on Spark,
    docs/engine-notes.md)."""
    forgotten = set(forget)
    rows = {table: row for table, row in previous.items() if table not in forgotten}
    rows.update((row.table, row) for row in changed if row.log.snapshot_lsn is not None and row.log.version is not None)
    now = datetime.now(UTC)
    table = pa.Table.from_pylist(
        [
            {
                "table": row.table,
                "path": row.path,
                "snapshot_lsn": int(row.log.snapshot_lsn),  # type: ignore[arg-type]
                "snapshot_version": row.log.snapshot_version,
                "delta_version": row.log.version,
                "applied_lsn": None if row.applied_lsn is None else int(row.applied_lsn),
                "marker_lsn": None if row.log.applied_marker is None else row.log.applied_marker[0],
                "marker_seq": None if row.log.applied_marker is None else row.log.applied_marker[1],
                "layout": None if row.log.layout is None else json.dumps(row.log.layout.to_json()),
                "table_id": row.log.table_id,
                "columns": None if row.log.columns is None else json.dumps(row.log.columns.to_json()),
                "updated_at": now,
            }
            for row in sorted(rows.values(), key=lambda row: row.table)
        ],
        schema=STATE_SCHEMA,
    )
    from deltalake import PostCommitHookProperties, write_deltalake

    write_deltalake(
        path, table.cast(nullable_schema(table.schema)), mode="overwrite", schema_mode="overwrite",
        storage_options=object_store_options(path, lake) or None,
        # a checkpoint at the table's interval keeps the read short; log clean-up is maintenance's (maintenance.py)
        post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False),
    )  # fmt: skip
