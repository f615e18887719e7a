"""The change applier's handling of Relation and TRUNCATE messages: a table's columns and write mode, bucket pruning, keyless tables, truncates in order."""

from __future__ import annotations

from resources.cdc.apply_flush import TableFlush
from resources.cdc.schema import RESNAPSHOT_FIX, SchemaChangeError
from resources.cdc.tables import APPEND, FULL, KEYED, MARKED_MODES, TableTarget
from resources.config.columns import refuse_excluded_keys
from resources.crash_points import fault_point
from resources.delta.layout import BUCKET_COLUMN
from resources.errors import ConfigurationError
from resources.history import scd2
from resources.history.changelog import (
    history_position,
)
from resources.lsn import LSN
from resources.pgoutput.messages import Relation
from resources.pgtypes import arrow_type, PgColumnType


def _refuse_unsupported_exclusion(target: TableTarget, columns: list[PgColumnType]) -> None:
    """Refuse a column left out of Delta (``columns: {...: exclude}``) where the drain needs its values:
    a key column, a table whose rows are matched by their whole value (REPLICA IDENTITY FULL without
    a primary key: two rows differing only there would be one in Delta), a table keeping a history."""
    excluded = [column for column in columns if column.excluded]
    if not excluded:
        return
    names = ", ".join(column.source_name for column in excluded)
    refuse_excluded_keys(target.table, [columns[i].source_name for i in target.key_index if columns[i].excluded])
    if target.mode == FULL or target.history_path is not None:
        raise ConfigurationError(
            f"{target.table}: column(s) {names} are excluded, but its rows are matched by their whole value "
            "(REPLICA IDENTITY FULL without a primary key) or it keeps a history",
            "leave the column out with the publication's column list instead, then re-snapshot the table",
        )


class OtherRelationError(SchemaChangeError):
    """A Relation message under a table's name carries another relation OID than the one its Delta table
    was copied from: another table now has the name (dropped and created again, or renamed to it)."""


class RelationHandling(TableFlush):
    """What a Relation message or a TRUNCATE changes for a table, in order with its other changes."""

    # -- schema

    def _use_relation(self, target: TableTarget, relation: Relation, end: int, seq: int) -> None:
        """Adopt a table's Relation message (at position ``seq`` of the transaction ending at ``end``)."""
        previous = target.relation
        if (
            previous is not None
            and previous.columns == relation.columns
            and previous.replica_identity == relation.replica_identity
        ):
            target.relation = relation
            return
        if target.pending:
            self._flush_target(target)
        self._writer.collect(wait=True)  # the schema is read and changed below, behind the queued writes
        columns = self._types.columns(relation)
        key_index = tuple(i for i, column in enumerate(relation.columns) if column.is_key)
        if relation.replica_identity == "f":
            # A primary key rules out duplicate rows: such a table is matched per key, as a keyed one.
            names = [column.name for column in relation.columns]
            primary_key = self._types.primary_key(relation)
            if primary_key and all(name in names for name in primary_key):
                target.mode, target.key_index = KEYED, tuple(names.index(name) for name in primary_key)
            else:
                target.mode, target.key_index = FULL, tuple(range(len(relation.columns)))
        elif key_index:
            target.mode, target.key_index = KEYED, key_index
        else:
            target.mode, target.key_index = APPEND, ()
        _refuse_unsupported_exclusion(target, columns)
        if target.history_scd2:
            target.history_key = scd2.history_key(target, [column.column for column in columns])
        if self._schema.reconcile(target, columns, previous, relation, end, seq):
            target.stats.schema_changed = True
        target.relation = relation
        target.columns = columns
        self._choose_bucket_pruning(target)

    def _choose_bucket_pruning(self, target: TableTarget) -> None:
        """Decide how a bucketed table's MERGEs find their rows under this relation.

        A row's bucket is a function of the layout's key columns alone (``resources/delta/layout.py``),
        whatever the replica identity says, and a row whose bucket cannot be computed is written to the
        NULL bucket, which every bucket predicate includes. A MERGE names its batch's buckets only when
        they locate every row it can touch: the changes are matched by a key that contains the layout's
        key, whose columns the layout still buckets. Otherwise (replica identity FULL without a primary
        key, an index without the layout's columns, a layout column dropped or retyped, a layout no
        record names any more) the MERGE reads every bucket: exact, as PostgreSQL's subscriber is under
        any identity, and said in the run's metadata with what restores the pruning.
        """
        bucketed = target.delta_schema is not None and BUCKET_COLUMN in target.delta_schema.names
        layout = target.layout
        target.prune_buckets = False
        if layout is None and not bucketed:
            return
        if not bucketed:
            raise SchemaChangeError(
                f"the snapshot of {target.table} recorded {layout.describe()} but its Delta table has no {BUCKET_COLUMN} "  # type: ignore[union-attr]
                "column (rewritten by another writer?)",
                RESNAPSHOT_FIX,
            )
        if target.mode == APPEND:
            return  # appends read nothing
        types = {column.column: arrow_type(column) for column in target.columns}
        matched = [target.columns[i].column for i in target.key_index] if target.mode == KEYED else []
        if layout is None:
            why = (
                "no record of its layout is left (its snapshot commit left the Delta log and the pgcdc state has none)"
            )
            restore = "remove the table's Delta directory and snapshot the table again"
        elif any(name not in types for name in layout.key):
            why = f"its layout column(s) ({', '.join(layout.key)}) are no longer published"
            restore = "publish them again, or remove the table's Delta directory and snapshot the table again"
        elif not layout.can_bucket([types[name] for name in layout.key]):
            why = f"its layout column(s) ({', '.join(layout.key)}) changed type"
            restore = "remove the table's Delta directory and snapshot the table again"
        elif not set(layout.key) <= set(matched):
            identity = f"({', '.join(matched)})" if matched else "whole rows (REPLICA IDENTITY FULL)"
            why = (
                f"its changes are matched by {identity}, which does not hold its layout's key ({', '.join(layout.key)})"
            )
            restore = f"a replica identity that includes ({', '.join(layout.key)}) again"
        else:
            target.prune_buckets = True
            target.stats.unpruned = None
            return
        target.stats.unpruned = f"{why}: its MERGEs read every bucket until {restore}"
        self._log(f"{target.table}: {target.stats.unpruned}")

    def _warn_keyless(self, target: TableTarget, op: str) -> None:
        self.changes_skipped += 1
        if not target.warned:
            target.warned = True
            kind = {"U": "an UPDATE", "D": "a DELETE"}[op]
            self._log(
                f"warning: {target.table} has no replica identity but {kind} arrived; skipped "
                "(give the table a primary key or REPLICA IDENTITY FULL, then re-snapshot it)"
            )

    # -- writing

    def _truncate(self, target: TableTarget, relation: Relation, end: int, seq: int) -> None:
        if target.relation is not relation:
            self._use_relation(target, relation, end, seq)
        if target.mode in MARKED_MODES and target.applied_marker is not None and (end, seq) <= target.applied_marker:
            return
        if target.pending:
            self._flush_target(target)
        fault_point("before_merge")
        self._write_event_history(target, "truncate", None, end, seq, int(history_position(seq)))
        self._writer.write(self._destination.delete_all_rows, target.path)
        target.stats.truncates += 1
        target.stats.applied_lsn = LSN(end)
        chunks = target.log.chunks if target.log is not None else None
        if chunks is not None:
            # A range copied at or after the truncate holds rows written after it, which the delete
            # just removed: copy each such range again (its new point lies beyond this change).
            for k, point in enumerate(chunks.points):
                if point is not None and point >= end:
                    self._recopy(target, k, end, "a TRUNCATE emptied it after its copy")
