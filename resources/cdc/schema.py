"""Keeping a table's Delta schema in step with its Relation messages, and the errors when it cannot."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pyarrow as pa

from resources.cdc.renames import added_again, behind_new_columns, unproven_addition
from resources.cdc.tables import MARKED_MODES, TableTarget
from resources.cdc.writer import OrderedWriter
from resources.config.columns import as_text_fix, refuse_case_clash
from resources.delta.delta_types import delta_type_name, is_safe_widening
from resources.delta.destination import Destination
from resources.delta.markers import LSN_COLUMN
from resources.errors import TableFault
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB
from resources.pgoutput.messages import Relation, RelationColumn
from resources.pgtypes import arrow_type, PgColumnType, PgValueError, to_arrow
from resources.postgres.column_types import ColumnTypes

RESNAPSHOT_FIX = f"re-snapshot the table (materialize its snapshot asset or run the {RESNAPSHOT_JOB} job)"


class SchemaChangeError(TableFault):
    """A column changed in a way Delta cannot follow in place."""


class ChangeValueError(TableFault):
    """A changed value does not fit its Delta column."""


class SchemaReconciler:
    """Adds, widens and back-fills Delta columns as Relation messages change a table.

    Every call goes through the applier's :class:`~resources.cdc.writer.OrderedWriter`, behind
    the writes already queued, so schema changes land in order with the rows.
    """

    def __init__(
        self,
        destination: Destination,
        writer: OrderedWriter,
        types: ColumnTypes,
        log: Callable[[str], None],
        before_fill: Callable[[TableTarget, pa.Table, int, int], None] | None = None,
    ) -> None:
        """``before_fill(target, values, end, seq)`` runs right before added columns are back-filled
        (the table's changelog records the fill first)."""
        self._destination = destination
        self._writer = writer
        self._types = types
        self._log = log
        self._before_fill = before_fill

    def reconcile(
        self,
        target: TableTarget,
        columns: list[PgColumnType],
        previous: Relation | None,
        relation: Relation,
        end: int,
        seq: int,
    ) -> bool:
        """Adopt ``columns`` (of ``relation``, at position ``seq`` of the transaction ending at ``end``):
        add, widen and back-fill columns in Delta, refuse what Delta cannot follow, note dropped ones.

        Returns whether the table's schema differs from what Delta held or the previous Relation
        message said (``previous`` is None for the run's first one): the drain evaluates the schema
        check only then. Columns dropped in PostgreSQL but kept in Delta count every time, since
        one run cannot tell a drop since the previous run from an older one."""
        if target.delta_schema is None:
            target.delta_schema = self._writer.call(self._destination.table_schema, target.path)
        existing = {f.name: f.type for f in target.delta_schema}
        kept = [(column, attribute) for column, attribute in zip(columns, relation.columns) if not column.excluded]
        # Columns new since the previous Relation message (or, for the first one of the run, new
        # to Delta), and columns of a name Delta has added again (DROP and ADD): the rows already in
        # Delta need what PostgreSQL gave its existing rows.
        seen = [c.column for c in target.columns if not c.excluded] if previous is not None else list(existing)
        again = self._added_again(target, relation, [column for column, _ in kept], seen, existing)
        added, widened = self._typed(target, [column for column, _ in kept if column.column not in again], existing)
        new = [column for column, _ in kept if column.column not in seen or column.column in again]
        fills = self._fills(target, relation, kept, new, end, seq)
        added = [f for f in added if f.name not in fills]
        names = [column.column for column, _ in kept]
        if widened:
            self._log(f"{target.table}: widening {', '.join(sorted(widened))} (rewrites the Delta table)")
            self._writer.commit(self._destination.widen_columns, target.path, widened)
        if added:
            self._log(f"{target.table}: adding column(s) {', '.join(f.name for f in added)}")
            self._writer.commit(self._destination.add_columns, target.path, pa.schema(added))
        if fills:
            self._log(
                f"{target.table}: setting {', '.join(fills)} in the rows written up to {LSN(end)} to the value "
                "PostgreSQL gave the rows that existed when the column was added (rewrites the Delta table)"
            )
            values = pa.table({name: value for name, value in fills.items()})
            if self._before_fill is not None:
                self._before_fill(target, values, end, seq)
            self._writer.commit(self._destination.fill_columns, target.path, values, LSN_COLUMN, end)
        if widened or added or fills:
            target.delta_schema = self._writer.call(self._destination.table_schema, target.path)
        target.dropped = [f for f in target.delta_schema if f.name not in names and not f.name.startswith("_pgcdc_")]
        return previous is not None or bool(widened or added or fills or target.dropped)

    def _added_again(
        self,
        target: TableTarget,
        relation: Relation,
        columns: list[PgColumnType],
        seen: list[str],
        existing: dict[str, pa.DataType],
    ) -> set[str]:
        """The (Delta) names of ``columns`` that are columns of a name Delta has, added again since
        (DROP and ADD, as one ALTER TABLE may do), decided from the catalog; refuses what it cannot prove.

        A column Delta has standing after one new to it in the message is such a column, or the new one
        is an older column renamed: the catalog must prove the first (``resources/cdc/renames.py``). A
        column whose Delta type differs is such a column when the catalog proves it, or else a type
        change (:meth:`_typed` decides). Names here are Delta's (the configuration may rename a
        column); the catalog knows PostgreSQL's."""
        source = {c.column: c.source_name for c in [*target.columns, *columns]}
        names = [column.column for column in columns]
        behind = behind_new_columns(seen, names)
        recorded = target.log.columns if target.log is not None else None
        attributes = functools.cache(lambda: self._types.attributes(relation))
        retyped = [
            column.column
            for column in columns
            if column.column in existing
            and column.column not in behind
            and delta_type_name(existing[column.column]) != delta_type_name(arrow_type(column))
        ]
        again = behind + [name for name in retyped if added_again(recorded, [source.get(name, name)], attributes)]
        why = unproven_addition(
            recorded,
            [source.get(name, name) for name in seen],
            [source.get(name, name) for name in names],
            attributes,
            [source.get(name, name) for name in again],
        )
        if why is not None:
            raise SchemaChangeError(f"{target.table}: {why}", RESNAPSHOT_FIX)
        if again:
            self._log(f"{target.table}: {', '.join(again)} dropped and added again in PostgreSQL (a new column)")
        return set(again)

    @staticmethod
    def _typed(
        target: TableTarget, columns: list[PgColumnType], existing: dict[str, pa.DataType]
    ) -> tuple[list[pa.Field], dict[str, pa.DataType]]:
        """The columns Delta lacks and the ones it widens; refuses a type Delta cannot follow in place, and
        a new column whose name differs only in case from one Delta has (kept after a DROP, say)."""
        added: list[pa.Field] = []
        widened: dict[str, pa.DataType] = {}
        target.delta_wider = {}
        in_delta = [(name, name) for name in existing if not name.startswith("_pgcdc_")]
        for column in columns:
            wanted = arrow_type(column)
            current = existing.get(column.column)
            if current is None:
                refuse_case_clash(target.table, [*in_delta, (column.source_name, column.column)])
                added.append(pa.field(column.column, wanted))
            elif delta_type_name(current) != delta_type_name(wanted):
                if column.as_text:
                    raise SchemaChangeError(
                        f"column {column.column!r} of {target.table} is replicated as text by the configuration's "
                        f"columns, but its Delta column is {delta_type_name(current)} (set after its snapshot)",
                        RESNAPSHOT_FIX,
                    )
                if is_safe_widening(wanted, current):
                    # Delta is wider already: a replay of changes from before a widening whose commit is
                    # durable (a crash before the confirm), or a column narrowed in PostgreSQL. Every value
                    # fits: it is written in Delta's type.
                    target.delta_wider[column.column] = current
                    continue
                if not is_safe_widening(current, wanted):
                    raise SchemaChangeError(
                        f"column {column.column!r} of {target.table} changed type from "
                        f"{delta_type_name(current)} to {column.type_name} ({delta_type_name(wanted)})",
                        RESNAPSHOT_FIX,
                    )
                widened[column.column] = wanted
        return added, widened

    def _fills(
        self,
        target: TableTarget,
        relation: Relation,
        kept: list[tuple[PgColumnType, RelationColumn]],
        new: list[PgColumnType],
        end: int,
        seq: int,
    ) -> dict[str, pa.Array]:
        """The value (one-element typed array) each newly appearing column must get in the rows
        already in Delta, for the columns that need one.

        ``ALTER TABLE ... ADD COLUMN c ... DEFAULT x`` gives existing rows ``x`` without any row
        change in the WAL: PostgreSQL 11+ stores a non-volatile default once as the column's
        missing value (pg_attribute.attmissingval). A volatile default, or one set after the
        column was added, is in the rows themselves and cannot be told from the catalog.
        """
        if not new:
            return {}
        if target.mode in MARKED_MODES and target.applied_marker is not None and target.applied_marker >= (end, seq):
            return {}  # a replay: changes after this Relation message are in Delta, so it was handled before
        facts = self._types.added_columns(relation, [c.source_name for c in new])
        in_delta = {f.name for f in target.delta_schema or []}
        fills: dict[str, pa.Array] = {}
        for column, attribute in kept:
            if column not in new:
                continue
            name = column.column
            seen = facts.get(column.source_name)
            if not seen:
                # Gone again (dropped or renamed) before we looked, which also clears its missing value.
                # It is a dropped column in Delta from here on; only the rows written before it was
                # added lack what PostgreSQL gave them there (NULL instead), which no longer exists in
                # PostgreSQL. Refusing would stop every ADD COLUMN ... DROP COLUMN between two runs.
                self._log(
                    f"warning: {target.table}: column {name} was added and is gone again (dropped or renamed) "
                    "before this run: rows written before it was added hold NULL in it in Delta"
                )
                continue
            if len(seen) > 1:
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} differs between its partitions: "
                    "what its existing rows hold cannot be told from the catalog",
                    RESNAPSHOT_FIX,
                )
            ((type_oid, has_missing, missing, has_default),) = seen
            if has_missing and type_oid != attribute.type_oid:
                # A type change rewrites the table and clears the missing value: this one belongs to
                # a column of the same name added again since.
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} was added and has since been dropped and added again: "
                    "what its existing rows held cannot be read any more",
                    RESNAPSHOT_FIX,
                )
            if has_missing:
                try:
                    fills[name] = to_arrow(pa.array([missing], pa.string()), column)
                except PgValueError as exc:
                    raise ChangeValueError(
                        f"cannot apply the default of the added column {name!r} to {target.table}: {exc}",
                        as_text_fix(target.table, column.source_name),
                        column=name,
                    ) from exc
            elif has_default:
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} was added with a default that PostgreSQL wrote into the "
                    "existing rows without logging them (a volatile default, or a default set after the column "
                    "was added)",
                    RESNAPSHOT_FIX,
                )
            elif name in in_delta:
                # Added again under the name of a column dropped earlier (kept in Delta): existing rows are NULL.
                fills[name] = pa.nulls(1, arrow_type(column))
        return fills
