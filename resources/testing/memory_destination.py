"""An in-memory :class:`~resources.delta.destination.Destination` and static column types.

They let the change applier's folding, ordering and chunk boundaries be tested without
PostgreSQL or Spark. The merge follows the documented semantics of
:func:`resources.delta.merge.merge_batch` (matched delete, matched update keeping flagged
unchanged values, insert carrying flagged values from the row under the old key); the Delta
tests compare the two on the same batches, so this stays honest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from resources.config.catalog import CatalogName
from resources.delta.batch_columns import (
    CLOSE_COLUMN,
    CLOSED_SET,
    CURRENT_COLUMN,
    MARKER_COLUMN,
    OLD_KEY_PREFIX,
    OP_COLUMN,
    unchanged_flag_column,
    UNCHANGED_PREFIX,
    VALID_TO_LSN_COLUMN,
)
from resources.delta.destination import NO_TABLE, TableLog
from resources.delta.key_ranges import KeySpan
from resources.delta.layout import BUCKET_COLUMN, TableLayout, with_buckets
from resources.delta.markers import fold_table_log, pgcdc_marker
from resources.errors import CatalogRefusal
from resources.pgoutput.messages import Relation
from resources.pgtypes import PgColumnType

#: Type oid -> (format_type name, base type name) of the types the static resolver knows.
STATIC_TYPES: dict[int, tuple[str, str]] = {
    16: ("boolean", "bool"),
    20: ("bigint", "int8"),
    21: ("smallint", "int2"),
    23: ("integer", "int4"),
    25: ("text", "text"),
    701: ("double precision", "float8"),
}


class StaticTypes:
    """The ``TypeResolver`` interface from a fixed table instead of pg_type."""

    def __init__(self, added: Mapping[str, set[tuple]] | None = None, primary_key: tuple[str, ...] = ()) -> None:
        """``added``: what :meth:`added_columns` answers (column -> PostgreSQL's missing-value facts);
        ``primary_key``: what :meth:`primary_key` answers for every relation."""
        self._added = dict(added or {})
        self._primary_key = primary_key

    def columns(self, relation: Relation) -> list[PgColumnType]:
        return [
            PgColumnType(
                column=c.name,
                type_oid=c.type_oid,
                type_name=STATIC_TYPES[c.type_oid][0],
                base_name=STATIC_TYPES[c.type_oid][1],
            )
            for c in relation.columns
        ]

    def primary_key(self, relation: Relation) -> tuple[str, ...]:
        return self._primary_key

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]:
        return {name: self._added[name] for name in names if name in self._added}

    def attributes(self, relation: Relation) -> list[tuple[int, str, bool]]:
        """The relation's columns numbered in order, none dropped."""
        return [(number, column.name, False) for number, column in enumerate(relation.columns, 1)]


class InMemoryDestination:
    """Tables as Arrow tables in a dict, with each table's commit log of userMetadata."""

    #: No object store: what the runs keep beside the tables (their state) goes to local paths.
    lake = None

    def __init__(self) -> None:
        self.tables: dict[str, pa.Table] = {}
        self.commits: dict[str, list[str | None]] = {}
        self.log_reads: list[str] = []
        #: How many times a drain prepared the engine for writes (:meth:`prepare_writes`).
        self.writes_prepared = 0
        #: The tables registered by name (:meth:`register_table`): name -> path, as a catalog holds them.
        self.catalog: dict[CatalogName, str] = {}

    def _commit(self, path: str, table: pa.Table, user_metadata: str | None = None) -> int:
        self.tables[path] = table
        self.commits.setdefault(path, []).append(user_metadata)
        return len(self.commits[path]) - 1

    def rows(self, path: str) -> list[dict]:
        """The table's rows as dicts (order not meaningful)."""
        return self.tables[path].to_pylist()

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
        """As the Delta snapshot write: the rows bucketed by ``layout``; with ``span``, only that key
        range's rows replaced (a new table at a new path)."""
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches(list(data), schema=schema)
        if layout is not None:
            table = with_buckets(layout, table)
        if span is None:
            return self._commit(path, table, user_metadata)
        kept = (
            [row for row in self.tables[path].to_pylist() if not span.holds(row[span.key])]
            if path in self.tables
            else []
        )
        return self._commit(path, pa.Table.from_pylist(kept + table.to_pylist(), schema=table.schema), user_metadata)

    def prepare_writes(self) -> None:
        """Nothing to prepare in memory; counted in :attr:`writes_prepared`."""
        self.writes_prepared += 1

    def merge_batch(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool = True) -> None:
        """As the Delta MERGE, partition pruning included: a pruned bucketed batch sees only the target
        rows in its buckets and the NULL bucket, so a wrong bucket shows as a duplicate or a row left
        behind, as it would in Delta."""
        target = self.tables[path]
        names = source.column_names
        value_columns = [n for n in names if n != OP_COLUMN and not n.startswith((UNCHANGED_PREFIX, OLD_KEY_PREFIX))]
        old_keys = [n for n in names if n.startswith(OLD_KEY_PREFIX)]
        moved_flag = next((n for n in old_keys if n != OLD_KEY_PREFIX + BUCKET_COLUMN), None)
        before = target.to_pylist()
        pruned: list[dict] = []
        if prune_buckets and BUCKET_COLUMN in value_columns:
            buckets = set(source.column(BUCKET_COLUMN).to_pylist()) | {None}
            old_buckets = (
                set(source.column(OLD_KEY_PREFIX + BUCKET_COLUMN).to_pylist()) | {None} if moved_flag else set()
            )
            pruned = [row for row in before if row[BUCKET_COLUMN] not in buckets]
            old_rows = [row for row in before if row[BUCKET_COLUMN] in old_buckets]
            before = [row for row in before if row[BUCKET_COLUMN] in buckets]
        else:
            old_rows = before
        by_key = {tuple(row[k] for k in key_columns): row for row in before}
        old_key_columns = [n for n in old_keys if n != OLD_KEY_PREFIX + BUCKET_COLUMN]
        by_old_key = {tuple(row[n.removeprefix(OLD_KEY_PREFIX)] for n in old_key_columns): row for row in old_rows}
        rows = {key: dict(row) for key, row in by_key.items()}
        seen: set[tuple] = set()
        for change in source.to_pylist():
            key = tuple(change[k] for k in key_columns)
            if key in seen:
                raise ValueError(f"two changes for key {key} in one MERGE batch: fold the batch per key first")
            seen.add(key)
            kept = {n for n in value_columns if change.get(unchanged_flag_column(n)) is True}
            moved = moved_flag is not None and change[moved_flag] is not None
            old = by_old_key.get(tuple(change[n] for n in old_key_columns)) if moved else None
            if key in rows and None not in key:
                if change[OP_COLUMN] == "D":
                    del rows[key]
                else:
                    rows[key].update({n: change[n] for n in value_columns if n not in key_columns and n not in kept})
                    if moved and old is not None:  # no old row: a replay, the move is in Delta already
                        rows[key].update({n: old[n] for n in kept})
            elif change[OP_COLUMN] != "D":
                row = dict.fromkeys(target.column_names)
                for n in value_columns:
                    if n in kept and old_keys:
                        row[n] = old[n] if old is not None else None
                    else:
                        row[n] = change[n]
                rows[key] = row
        self._commit(path, pa.Table.from_pylist(pruned + list(rows.values()), schema=target.schema))

    def append_rows(self, path: str, rows: pa.Table, user_metadata: str) -> None:
        target = self.tables.get(path, rows.schema.empty_table())
        self._commit(
            path, pa.Table.from_pylist(target.to_pylist() + rows.to_pylist(), schema=target.schema), user_metadata
        )

    def read_rows(self, path: str, keys: pa.Table | None) -> pa.Table:
        table = self.tables[path]
        if keys is None:
            return table
        wanted = {tuple(row.values()) for row in keys.to_pylist()}
        return pa.Table.from_pylist(
            [row for row in table.to_pylist() if tuple(row[n] for n in keys.column_names) in wanted],
            schema=table.schema,
        )

    def scan(self, path: str, columns: Sequence[str]) -> Iterator[pa.Table]:
        yield self.tables[path].select(list(columns))

    def replace_rows(
        self, path: str, probe: pa.Table, rewrite: Callable[[pa.Table], pa.Table], user_metadata: str
    ) -> None:
        target = self.tables[path]
        probed = {tuple(row.values()) for row in probe.to_pylist()}
        selected: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []
        for row in target.to_pylist():
            (selected if tuple(row[n] for n in probe.column_names) in probed else kept).append(row)
        replacement = rewrite(pa.Table.from_pylist(selected, schema=target.schema))
        self._commit(path, pa.Table.from_pylist(kept + replacement.to_pylist(), schema=target.schema), user_metadata)

    def merge_versions(self, path: str, source: pa.Table, key_columns: Sequence[str], prune_buckets: bool) -> None:
        """As the Delta MERGE of ``resources/history/scd2_merge.py``, bucket pruning included."""
        target = self.tables[path]
        rows = target.to_pylist()
        closing = source.filter(source.column(CLOSE_COLUMN))  # the MERGE names the buckets of the rows that close
        buckets = (
            set(closing.column(BUCKET_COLUMN).to_pylist()) | {None}
            if prune_buckets and BUCKET_COLUMN in target.column_names
            else None
        )
        open_at = {
            tuple(row[k] for k in key_columns): i
            for i, row in enumerate(rows)
            if row[VALID_TO_LSN_COLUMN] is None and (buckets is None or row[BUCKET_COLUMN] in buckets)
        }
        matched: set[int] = set()
        for change in source.to_pylist():
            at = open_at.get(tuple(change[k] for k in key_columns)) if change[CLOSE_COLUMN] else None
            if at is not None:
                if at in matched:
                    raise ValueError("two source rows match one version")
                matched.add(at)
                rows[at].update({name: change[name] for name in CLOSED_SET})
            elif not change[CLOSE_COLUMN] or change[MARKER_COLUMN] is not None:
                rows.append({name: change.get(name) for name in target.column_names})
        self._commit(path, pa.Table.from_pylist(rows, schema=target.schema))

    def replace_versions(
        self,
        path: str,
        rewrite: Callable[[pa.Table | None], pa.Table],
        deletion_vectors: bool,
        layout: TableLayout | None,
    ) -> None:
        if path not in self.tables:
            created = rewrite(None)
            self._commit(path, with_buckets(layout, created) if layout is not None else created)
            return
        target = self.tables[path]
        selected: list[dict[str, object]] = []
        kept: list[dict[str, object]] = []
        for row in target.to_pylist():
            (selected if row[CURRENT_COLUMN] or row[MARKER_COLUMN] is not None else kept).append(row)
        chosen = pa.Table.from_pylist(selected, schema=target.schema)
        replacement = rewrite(chosen.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in chosen.column_names else chosen)
        if layout is not None:
            replacement = with_buckets(
                layout,
                replacement.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in replacement.column_names else replacement,
            )
        self._commit(path, pa.Table.from_pylist(kept + replacement.to_pylist(), schema=replacement.schema))

    def versions_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        if path not in self.tables:
            return None, None
        markers = [row[MARKER_COLUMN] for row in self.tables[path].to_pylist() if row[MARKER_COLUMN] is not None]
        return 0, (json.loads(markers[0])["pgcdc"] if markers else None)

    def delete_all_rows(self, path: str) -> None:
        self._commit(path, self.tables[path].schema.empty_table())

    def read_table_log(self, path: str, known: TableLog | None) -> TableLog:
        """Read whole every time (``known`` is not needed in memory); counted in :attr:`log_reads`."""
        self.log_reads.append(path)
        commits = self.commits.get(path)
        if not commits:
            return NO_TABLE
        newest = len(commits) - 1
        return fold_table_log(((version, [commits[version]]) for version in range(newest, -1, -1)), newest, None)

    def register_table(self, name: CatalogName, path: str, what: str) -> bool:
        """A catalog that takes any name once: the name held by another path is refused, as on Spark."""
        if not self.commits.get(path):
            return False
        held = self.catalog.setdefault(name, path)
        if held != path:
            raise CatalogRefusal(
                f"{what} cannot be registered in catalog {name.catalog} as {name}: the name holds a table at {held}",
                "drop or rename that table, or set another catalog.schema",
            )
        return True

    def newest_marker(self, path: str) -> tuple[int | None, dict[str, Any] | None]:
        commits = self.commits.get(path)
        if not commits:
            return None, None
        markers = [marker for marker in map(pgcdc_marker, commits) if marker is not None]
        return len(commits) - 1, markers[-1] if markers else None

    def rows_unchanged_after(self, path: str, version: int, newest: int) -> bool:
        """It writes no maintenance commits: only a table with no commit after ``version`` is unchanged."""
        return version == newest

    def bytes_added(self, path: str, version: int, newest: int) -> int:
        """Its commits write no files."""
        return 0

    def table_schema(self, path: str) -> pa.Schema:
        return self.tables[path].schema

    def widen_columns(self, path: str, widened: Mapping[str, pa.DataType]) -> None:
        target = self.tables[path]
        schema = pa.schema([field.with_type(widened.get(field.name, field.type)) for field in target.schema])
        self._commit(path, target.cast(schema))

    def add_columns(self, path: str, new_columns: pa.Schema) -> None:
        target = self.tables[path]
        for field in new_columns:
            target = target.append_column(field, pa.nulls(target.num_rows, field.type))
        self._commit(path, target)

    def fill_columns(self, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
        target = self.tables[path]
        fills = values.to_pylist()[0]
        filled = {field.name: field for field in values.schema}  # a column added again may change type
        schema = pa.schema(
            [
                *(filled.get(f.name, f) for f in target.schema),
                *(f for f in values.schema if f.name not in target.column_names),
            ]
        )
        rows = target.to_pylist()
        for row in rows:
            for name, value in fills.items():
                row[name] = value if row[lsn_column] <= up_to_lsn else row.get(name)
        self._commit(path, pa.Table.from_pylist(rows, schema=schema))
