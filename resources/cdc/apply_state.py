"""The state the parts of the change applier share (``resources/cdc/applier.py`` and its ``apply_*`` modules).

:class:`~resources.cdc.applier.ChangeApplier` is assembled from one class per concern; each part
reads and writes these attributes, which ``ChangeApplier.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from resources.cdc.schema import SchemaReconciler
from resources.cdc.tables import TableTarget
from resources.cdc.writer import OrderedWriter
from resources.delta.destination import Destination, TableLog
from resources.names import TableName
from resources.pgoutput.messages import Relation
from resources.postgres.column_types import ColumnTypes


class ApplierState:
    """Attributes only: what routing, folding, rewriting and history hand-off share."""

    _destination: Destination
    _types: ColumnTypes
    _targets: Mapping[TableName, TableTarget]
    _max_changes: int
    _max_bytes: int
    _max_merge_rows: int
    _max_replace_values: int
    _recopy_range: Callable[[TableName, str, TableLog, int], None] | None
    _log: Callable[[str], None]
    _relations: dict[int, Relation]
    _target_by_oid: dict[int, TableTarget | None]
    _complete_end: int
    _transactions: dict[int, tuple[int, datetime]]
    _writer: OrderedWriter
    _schema: SchemaReconciler
    pending_changes: int
    pending_bytes: int
    transactions: int
    changes_applied: int
    changes_skipped: int
