"""The destination seam: what the change applier and the snapshot need from the lake.

:class:`Destination` is the whole surface the CDC side writes through, in Arrow terms only
(no Spark here), so the folding, ordering and chunking logic can run against an in-memory
table in fast unit tests (``resources/testing/memory_destination.py``) and against Delta
through Spark in production (``resources/delta/spark_destination.py``). The batch layouts
(:data:`~resources.delta.merge.OP_COLUMN`, unchanged flags, old-key columns) are the ones
:func:`resources.delta.merge.merge_batch` documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import pyarrow as pa


class Destination(Protocol):
    """One lake of tables addressed by path; every method is one commit or one read."""

    def write_snapshot(self, data: pa.Table | Iterable[pa.RecordBatch], schema: pa.Schema, path: str, user_metadata: str) -> int:
        """Replace the table at ``path`` with ``data`` in one commit; return that commit's version."""

    def merge_batch(self, path: str, source: pa.Table, key_columns: Sequence[str]) -> None:
        """Apply a folded batch, at most one change per key (keyed tables)."""

    def append_rows(self, path: str, rows: pa.Table, user_metadata: str) -> None:
        """Append rows in one commit carrying ``user_metadata`` (keyless tables)."""

    def replace_rows(
        self, path: str, probe: pa.Table, rewrite: Callable[[pa.Table], pa.Table], user_metadata: str
    ) -> None:
        """Replace every row that may equal a row of ``probe`` by ``rewrite``'s answer (REPLICA IDENTITY FULL)."""

    def delete_all_rows(self, path: str) -> None:
        """Empty the table (TRUNCATE)."""

    def read_applied_marker(self, path: str) -> tuple[int, int] | None:
        """The newest (end LSN, position) an append or replace commit applied, unless a snapshot followed."""

    def table_schema(self, path: str) -> pa.Schema:
        """The table's current schema."""

    def widen_columns(self, path: str, widened: Mapping[str, pa.DataType]) -> None:
        """Change the named columns to wider types (the safe widenings only)."""

    def add_columns(self, path: str, new_columns: pa.Schema) -> None:
        """Add nullable columns."""

    def fill_columns(self, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
        """Set added columns on the rows written at or below ``up_to_lsn`` (the values PostgreSQL gave them)."""
