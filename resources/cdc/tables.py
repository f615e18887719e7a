"""How each replicated table is written (keyed MERGE, REPLICA IDENTITY FULL rewrite, keyless append) and what a run counts for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from resources.delta.destination import TableLog
from resources.delta.layout import TableLayout
from resources.lsn import LSN
from resources.pgoutput.messages import Relation
from resources.pgtypes import PgColumnType
from resources.postgres.catalog import TableName

KEYED, FULL, APPEND = "keyed", "full", "append"


MARKED_MODES = (FULL, APPEND)
"""Modes whose Delta commits carry an applied-position marker: replaying their changes is not idempotent."""


@dataclass
class TableStats:
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    truncates: int = 0
    #: Commit end LSN of the newest change applied to Delta in this run.
    applied_lsn: LSN | None = None
    #: A Relation message in this run changed the table's columns (or Delta holds columns PostgreSQL
    #: dropped), or it was snapshotted since the previous drain: its schema check is due.
    schema_changed: bool = False
    #: Why this run's MERGEs of a bucketed table read every bucket, and what restores the pruning
    #: (None: they read only their batches' buckets, or the table is not bucketed).
    unpruned: str | None = None
    #: Change rows this run appended to the table's changelog, or versions it opened in its SCD type 2
    #: table (a seed's rows not counted).
    history_rows: int = 0
    #: The table's version when this run first read its log: the run's own commits are the ones after it.
    version_read: int | None = None
    #: Changes skipped because the table is quarantined (set aside by a fault of its own).
    quarantine_skipped: int = 0


@dataclass(eq=False)
class TableTarget:
    """One replicated table: where its Delta table is and what has been applied to it."""

    table: TableName
    path: str
    #: What the pgcdc state table last recorded of the table's log: a hint for reading it, never a decision.
    known: TableLog | None = None
    #: Read from the table's own log when the run first meets a change for it (ChangeApplier): decides skips.
    log: TableLog | None = None
    stats: TableStats = field(default_factory=TableStats)
    relation: Relation | None = None
    columns: list[PgColumnType] = field(default_factory=list)
    mode: str = KEYED
    key_index: tuple[int, ...] = ()
    #: Delta columns the relation no longer has: written NULL from now on.
    dropped: list[pa.Field] = field(default_factory=list)
    #: Columns Delta holds in a wider type than the relation's (a replay from before a durable widening,
    #: or a column narrowed in PostgreSQL), by name: their values are cast up to it.
    delta_wider: dict[str, pa.DataType] = field(default_factory=dict)
    delta_schema: pa.Schema | None = None
    #: Whether a MERGE may name its batch's buckets as its partition predicate (decided per relation).
    prune_buckets: bool = False
    #: (commit end LSN, position) of the last change in Delta, for keyless and FULL tables (from ``log``, then this run's).
    applied_marker: tuple[int, int] | None = None
    #: (row batch, indexes of this table's rows in it, commit end LSN, position of the batch's first change)
    pending: list[tuple] = field(default_factory=list)
    pending_bytes: int = 0
    warned: bool = False
    #: The run met a change of the table: its applied marker and history are taken from its log.
    met: bool = False
    #: No longer published under its name (dropped, renamed, removed from the publication): the slot's
    #: changes from before that still land (``resources/runs/drain_tables.py``).
    departed: bool = False
    #: Set aside by a fault of its own (quarantined): its changes are skipped until a re-snapshot lifts it.
    quarantined: bool = False
    #: Where the table's changelog (or SCD type 2 table) lives (docs/history.md); None: no history kept.
    history_path: str | None = None
    #: The history is an SCD type 2 table (``resources/history/scd2.py``) rather than a changelog.
    history_scd2: bool = False
    #: SCD type 2: the key columns its versions are per (set with the relation).
    history_key: tuple[str, ...] = ()
    #: SCD type 2: its table is created with deletion vectors (as the table's own ``delta.deletion_vectors`` says).
    history_deletion_vectors: bool = True
    #: SCD type 2: the seed (or re-seed) is still to be written, before the table's first history write of the run.
    history_seed_due: bool = False
    #: The snapshot LSN the changelog's seed holds (read from its newest marker, or seeded by this run).
    history_seed: int | None = None
    #: (commit end LSN, position) of the newest change in the changelog (its log's marker, then this run's).
    history_marker: tuple[int, int] | None = None
    #: The changelog's columns as the writer thread last saw them (None: not read yet this run).
    history_schema: pa.Schema | None = None

    @property
    def layout(self) -> TableLayout | None:
        """The bucketing its log records (None: not bucketed, e.g. written by an earlier pgcdc); ``log`` must be read."""
        assert self.log is not None, "the table's log is read before its changes are merged"
        return self.log.layout

    def skips(self, end_lsn: int) -> bool:
        """Whether a change committed at ``end_lsn`` is already in (or never goes to) the table; ``log`` must be read."""
        assert self.log is not None, "the table's log is read before its first change is routed"
        if self.log.chunks is not None:  # a snapshot in key ranges: decided per row image (ChangeApplier)
            return self.log.chunks.skips_all(end_lsn)
        return self.log.snapshot_lsn is None or end_lsn <= self.log.snapshot_lsn
