"""The destination seam: what the runs (snapshot, drain, the change applier) need from the lake.

:class:`Destination` is the whole surface the runs write and read tables through, in Arrow terms
only (no Spark here), so a whole run, its folding, ordering and chunking logic included, can run
against an in-memory table in fast tests (``resources/testing/memory_destination.py``) and against
Delta through Spark in production (``resources/delta/spark_destination.py``). A run receives its
destination from its wiring (the Dagster resources, the ``pgcdc`` command), which opens the lake
and the engine once. The batch layouts
(:data:`~resources.delta.merge.OP_COLUMN`, unchanged flags, old-key columns) are the ones
:func:`resources.delta.merge.merge_batch` documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from resources.config.catalog import CatalogName
from resources.delta.key_ranges import KeyRanges, KeySpan
from resources.delta.lake_storage import LakeStorage
from resources.delta.layout import TableLayout
from resources.lsn import LSN
from resources.names import ColumnNumbers


@dataclass(frozen=True, slots=True)
class TableLog:
    """What a table's own commit log says pgcdc has done to it, as of Delta version ``version``.

    It is the single source of truth for skipping and applying changes. A copy kept elsewhere
    (the pgcdc state table) may be handed back to :meth:`Destination.read_table_log` as
    ``known``: the read then checks it against the log and reads only the commits after it.
    """

    #: LSN of the newest snapshot commit; None: never snapshotted (every change is skipped).
    snapshot_lsn: LSN | None
    #: Version of that snapshot commit; None when unknown (it left the log, or no snapshot).
    snapshot_version: int | None
    #: The newest version of the table; None: no table at the path.
    version: int | None
    #: (commit end LSN, position) of the newest append/replace marker since that snapshot.
    applied_marker: tuple[int, int] | None
    #: The bucketing that snapshot recorded (docs/contracts.md, "Table layout"); once its commit left
    #: the log, the table property ``delta.pgcdc.layout`` of the newest metadata, else the layout a
    #: ``known`` row recorded for the same table (``table_id``). None: unbucketed, or not known.
    layout: TableLayout | None
    #: Delta's ``metaData.id`` of the table (kept by every overwrite, new when the table is created
    #: again at the path): which table ``layout`` belongs to. None: not read.
    table_id: str | None = None
    #: A snapshot in primary-key ranges (the newest snapshot marker's): which ranges are done at which
    #: point; ``snapshot_lsn`` is None until all are. None: a snapshot of the whole table at once.
    chunks: KeyRanges | None = None
    #: The published columns' attnums and the table's attribute count that snapshot recorded (tells a
    #: RENAME COLUMN from DROP and ADD). None: not recorded (a snapshot before pgcdc recorded them, or its
    #: commit left the log).
    columns: ColumnNumbers | None = None

    @property
    def being_snapshotted(self) -> bool:
        """Snapshotted, or part-way through a snapshot in key ranges (some changes apply)."""
        return self.snapshot_lsn is not None or self.chunks is not None


NO_TABLE = TableLog(None, None, None, None, None)
"""The log of a path holding no table."""


class Destination(Protocol):
    """One lake of tables addressed by path; every method is one commit or one read."""

    #: The object store holding the tables, for what the runs read and write beside them through its
    #: storage client (the pgcdc state table, a table's metadata); None: local paths only (or no store).
    lake: LakeStorage | None

    def write_snapshot(
        self,
        data: pa.Table | Iterable[pa.RecordBatch],
        schema: pa.Schema,
        path: str,
        user_metadata: str,
        *,
        chunk_bytes: int | None = None,
        layout: TableLayout | None = None,
        span: KeySpan | None = None,
        deletion_vectors: bool = False,
    ) -> int:
        """Replace the table at ``path`` with ``data`` in one commit carrying ``user_metadata``; return that
        commit's version. With ``layout``, each row gets its bucket and the table is partitioned by it; with
        ``span``, only the rows of that key range are replaced (the commit is made even when empty);
        ``deletion_vectors``: a table the write creates gets them. ``chunk_bytes`` bounds what is staged at once
        (None: the writer's default)."""

    def prepare_writes(self) -> None:
        """Make the engine ready for writes (on Spark Connect its session's first call, which costs
        0.3-0.9 s on embedded Sail, and pgcdc's write settings). A drain calls it on its writer thread
        once its first change is queued, so the first write does not pay it while the next chunk is
        decoded (an idle drain calls no engine)."""

    def merge_batch(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool = True) -> None:
        """Apply a folded batch, at most one change per key (keyed tables); with ``prune_buckets``, only
        the batch's buckets (and the NULL bucket) hold rows it can touch."""

    def append_rows(self, path: str, rows: pa.Table, user_metadata: str) -> None:
        """Append rows in one commit carrying ``user_metadata`` (keyless tables, changelogs); creates a missing table."""

    def read_rows(self, path: str, keys: pa.Table | None) -> pa.Table:
        """The rows whose columns named in ``keys`` equal one of its rows (every row when None)."""

    def scan(self, path: str, columns: Sequence[str]) -> Iterator[pa.Table]:
        """``columns`` of every row, in pieces as they come (one scan, the client's memory bounded)."""

    def replace_rows(
        self, path: str, probe: pa.Table, rewrite: Callable[[pa.Table], pa.Table], user_metadata: str
    ) -> None:
        """Replace every row that may equal a row of ``probe`` by ``rewrite``'s answer (REPLICA IDENTITY FULL)."""

    def merge_versions(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool) -> None:
        """One MERGE of an SCD type 2 table's close rows, new versions and marker row (``resources/history/scd2_merge.py``)."""

    def replace_versions(
        self,
        path: str,
        rewrite: Callable[[pa.Table | None], pa.Table],
        deletion_vectors: bool,
        layout: TableLayout | None,
    ) -> None:
        """Replace every current version and the marker row of an SCD type 2 table by ``rewrite``'s answer
        for them, in one commit; a new table (with ``deletion_vectors``) holding ``rewrite(None)`` where none is."""

    def versions_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        """:meth:`newest_marker` for an SCD type 2 table: its marker row's marker."""

    def delete_all_rows(self, path: str) -> None:
        """Empty the table (TRUNCATE)."""

    def read_table_log(self, path: str, known: TableLog | None) -> TableLog:
        """The table's :class:`TableLog` from its own log: only the commits after ``known.version``
        when ``known`` (an earlier answer, possibly stale) still matches the log, else from the
        newest commit back to the newest snapshot commit. Never more than those commits."""

    def newest_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        """The table's newest version (None: no table) and the pgcdc marker of its newest commit that has one."""

    def rows_unchanged_after(self, path: str, version: int, newest: int) -> bool:
        """Whether the commits after ``version`` up to ``newest`` only maintain the table (its rows are those of ``version``)."""

    def bytes_added(self, path: str, version: int, newest: int) -> int:
        """The bytes of data files and deletion vectors the commits after ``version`` up to ``newest`` wrote."""

    def table_schema(self, path: str) -> pa.Schema:
        """The table's current schema."""

    def widen_columns(self, path: str, widened: Mapping[str, pa.DataType]) -> None:
        """Change the named columns to wider types (the safe widenings only)."""

    def add_columns(self, path: str, new_columns: pa.Schema) -> None:
        """Add nullable columns."""

    def fill_columns(self, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
        """Set added columns on the rows written at or below ``up_to_lsn`` (the values PostgreSQL gave them);
        a column the table has takes the type of ``values`` (dropped and added again with another type)."""

    def register_table(self, name: CatalogName, path: str, what: str) -> bool:
        """Register the Delta table at ``path`` in the engine's catalog as ``name``, an external table (nothing when
        it is); False when no table is at ``path`` yet. Raises ``CatalogRefusal`` (naming ``what``) when the
        catalog refuses the name or the name holds another table (``resources/delta/catalog_names.py``)."""
