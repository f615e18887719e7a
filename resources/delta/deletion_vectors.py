"""The rows a Delta table's deletion vectors delete, per data file and in all, read by delta-rs from
the log and the deletion vector files (whichever engine wrote them): what maintenance's purge decides
on and what it reports."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from resources.delta.lake_storage import LakeStorage
from resources.delta.table_files import delta_rs_table


@dataclass(frozen=True, slots=True)
class DeletedRows:
    """Rows in the data files of a table's newest version, and how many of them its deletion vectors delete
    (rows every reader reads and drops until compaction rewrites their files)."""

    rows: int
    deleted: int

    @property
    def fraction(self) -> float:
        return self.deleted / self.rows if self.rows else 0.0


@dataclass(frozen=True, slots=True)
class FileDeletions:
    """One data file of the newest version: its partition values, rows, and rows its deletion vector deletes."""

    partition: tuple[tuple[str, str, str], ...]  # delta-rs partition filters: (column, "=", value)
    rows: int
    deleted: int


def deleted_rows(lake: LakeStorage, path: str) -> DeletedRows:
    """The rows of the newest version's data files and the rows their deletion vectors delete."""
    files = file_deletions(lake, path)
    return DeletedRows(sum(file.rows for file in files), sum(file.deleted for file in files))


def file_deletions(lake: LakeStorage, path: str) -> list[FileDeletions]:
    """Every data file of the table's newest version with the rows its deletion vector deletes: what
    the purge decides on (a file above ``max_deleted_rows_ratio`` is rewritten)."""
    return table_file_deletions(delta_rs_table(lake, path))


def table_file_deletions(table: object) -> list[FileDeletions]:
    """Every data file of ``table`` (a ``deltalake.DeltaTable``) with what its deletion vector deletes.

    delta-rs hands deletion vectors out as selection vectors (one boolean per row, false where deleted)
    keyed by the file's URI; its add actions give the file's path relative to the table, row count and
    partition values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    actions = pa.table(table.get_add_actions(flatten=True))  # type: ignore[attr-defined]
    partition_columns = [name for name in actions.column_names if name.startswith("partition.")]
    root = unquote(table.table_uri).rstrip("/") + "/"  # type: ignore[attr-defined]
    deleted: dict[str, int] = {}
    vectors = pa.table(table.deletion_vectors())  # type: ignore[attr-defined]
    for uri, selection in zip(vectors.column("filepath").to_pylist(), vectors.column("selection_vector")):
        kept = selection.values
        deleted[unquote(uri).removeprefix(root)] = len(kept) - (pc.sum(kept).as_py() or 0)
    files = []
    for action in actions.select(["path", "num_records", *partition_columns]).to_pylist():
        partition = tuple(
            (name.removeprefix("partition."), "=", str(action[name]))
            for name in partition_columns
            if action[name] is not None
        )
        files.append(FileDeletions(partition, action["num_records"] or 0, deleted.get(unquote(action["path"]), 0)))
    return files
