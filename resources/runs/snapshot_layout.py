"""Which layout a snapshot writes a table in: the one it has, else one chosen from PostgreSQL's size estimate.

Both snapshot modes (one snapshot, ``resources/runs/snapshot.py``; key ranges,
``resources/runs/key_range_copy.py``) ask here. A table keeps its layout for as long as it keeps its
Delta id: a drain whose snapshot marker has left the log trusts a layout recorded for the table's
id (its table property, the pgcdc state row), so that record must stay true (docs/contracts.md,
"Table layout").
"""

from __future__ import annotations

import psycopg
import pyarrow as pa

from resources.config import BucketSettings
from resources.delta.destination import TableLog
from resources.delta.lake_storage import LakeStorage
from resources.delta.layout import BUCKET_COLUMN, choose_layout, is_range_key, LayoutError, TableLayout, TableSize
from resources.delta.table_log import read_table_metadata, unfinished_create
from resources.errors import ConfigurationError
from resources.postgres.catalog import key_range, primary_key_columns, size_estimate, TableInfo, TableName


def existing_layout(table: TableName, path: str, log: TableLog, lake: LakeStorage | None) -> TableLayout | None:
    """The layout of the Delta table at ``path`` if it is bucketed (None: no table, or unbucketed), as
    its ``log`` says (read as a drain reads it, with the pgcdc state's row as ``known``: the snapshot
    marker, else :func:`~resources.delta.table_log.expired_layout`); a bucketed table whose layout no
    record names any more is refused: re-bucketing it in place could contradict a layout recorded for
    it elsewhere (``lake``: the object store holding ``path``, whose client reads its metadata). The empty table a killed snapshot created and never committed to
    (:func:`~resources.delta.table_log.unfinished_create`) has no layout: nothing was ever recorded
    for it, and the snapshot writer creates it again (``resources/delta/snapshot_writes.py``)."""
    layout = log.layout
    if layout is None:
        metadata = read_table_metadata(path, lake)
        if metadata is not None and metadata.bucketed and not unfinished_create(path, lake):
            raise ConfigurationError(
                f"the Delta table of {table} is bucketed ({BUCKET_COLUMN}) but no record of its layout is left "
                "(its snapshot commit left the log and the pgcdc state has no row for this table)",
                "remove the table's Delta directory, then snapshot the table again",
            )
    return layout


def table_layout(
    conn: psycopg.Connection, info: TableInfo, schema: pa.Schema, buckets: BucketSettings, existing: TableLayout | None
) -> TableLayout | None:
    """The table's bucketing: by its replica identity key (the primary key under REPLICA IDENTITY
    FULL, which otherwise names every column), sized from PostgreSQL's estimate unless configured,
    read inside the snapshot's transaction.

    A bucketed table keeps its layout (``existing``, from :func:`existing_layout`), whatever the
    configuration or the table's key says now (module docstring): a row's bucket depends on the
    layout's columns alone, so the layout stays true under any key, and rows whose layout columns
    are gone go to the NULL bucket. Drains prune by it while their key holds the layout's key.
    """
    if existing is not None:
        return existing
    key = primary_key_columns(conn, info.oid) if info.replica_identity == "f" else info.key_columns
    published = {column.name for column in info.columns}
    usable = bool(key) and all(name in published for name in key)
    if not usable:
        return None  # no usable key: merged by row value or appended, not by key
    key_types = [schema.field(name).type for name in key]
    override = buckets.override(info.table)
    rows, pages = size_estimate(conn, info.oid)
    span = key_range(conn, info.table, key[0]) if override is None and is_range_key(key_types) else None
    try:
        return choose_layout(key, key_types, TableSize(rows, pages, span), override, buckets.target_rows)
    except LayoutError as exc:
        raise ConfigurationError(
            f"delta.buckets.tables.{info.table}: {exc}", "use count (hash buckets) for this table instead of width"
        ) from None
