"""The slot position pgcdc allowed, recorded in the lake, so a slot moved by anyone else is refused.

A logical slot confirms whatever its consumer says. Anything else that consumes pgcdc's slot
(``pg_recvlogical --start`` on it, ``pgcdc changes --advance``, ``pg_replication_slot_advance()``, a
second pipeline configured with the same slot name) moves ``confirmed_flush_lsn`` past changes
Delta never got, and a drain starting there would report success. So before pgcdc confirms a
position to its slot, it records it (write-ahead, one small write per confirm that moves the
position: :meth:`SlotGuard.allow`), and at every instant the slot's confirmed position is at most
the recorded one. A drain that finds the slot beyond the record refuses before it applies or
confirms anything (:func:`check_slot_position`).

The record is one JSON object per slot and lake, ``<delta.root>/_pgcdc/slots/<slot>/position.json``
(``resources/delta/lake_records.py``): ``allowed``, the highest position pgcdc allowed, and ``gap``,
the positions ``[from, to]`` between which the slot moved without pgcdc (``from`` null for a slot
created anew where the lake recorded an earlier one). A gap stays recorded until no replicated
table holds a copy older than its end, i.e. until every table was re-snapshotted after it
(:func:`tables_behind`): the changes in it are lost to every table, so re-snapshotting one table
does not clear it. The drains of a snapshot in key ranges (``hold``) go on meanwhile: they are
that re-snapshot. The stream's start compares the slot once more (``start_streaming``'s
``checked``), so a move between the check and the stream is refused too.

A slot behind the record is fine (a crash between the record's write and the confirm; a
synchronized failover slot on a promoted standby). No record yet (a lake written before pgcdc
recorded positions): the drain records the slot's position and goes on (where the lake has no
pgcdc state table either, possibly a mistyped ``delta.root`` the drain then refuses, its first
confirm writes the record).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resources.config import PgcdcConfig
from resources.delta.destination import Destination, TableLog
from resources.delta.lake_records import read_record, records_location, write_record
from resources.delta.lake_storage import LakeStorage
from resources.delta.state_table import known_log, read_state, state_path
from resources.errors import ConfigurationError, DRAIN_RESUMES, PgcdcError, SlotError, storage_fault, StorageFault
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB
from resources.postgres.catalog import TableName
from resources.postgres.replication import CreatedSlot
from resources.postgres.slots import SlotState

SLOT_RECORDS = "slots"
"""The kind of record below ``<delta.root>/_pgcdc/``: one directory per slot."""

POSITION_KEY = "position"
"""The one record of a slot's directory."""

NAMED_TABLES = 5
"""Tables a refusal names at most (it counts the others)."""


@dataclass(frozen=True)
class SlotRecord:
    """What the lake records of a slot: the highest position pgcdc allowed it, and a gap not yet closed."""

    allowed: LSN
    #: (the recorded position, or None for a slot created anew; the slot's position found beyond it).
    gap: tuple[LSN | None, LSN] | None = None

    def to_json(self) -> dict[str, object]:
        gap = None if self.gap is None else [None if self.gap[0] is None else str(self.gap[0]), str(self.gap[1])]
        return {"allowed": str(self.allowed), "gap": gap}

    @classmethod
    def from_json(cls, value: dict[str, object]) -> SlotRecord:
        gap = value.get("gap")
        return cls(
            LSN.parse(str(value["allowed"])),
            None if not gap else (None if gap[0] is None else LSN.parse(gap[0]), LSN.parse(gap[1])),  # type: ignore[index]
        )


class SlotGuard:
    """One slot's record in one lake, read once and written only when the position it allows moves."""

    def __init__(self, root: str, slot: str, lake: LakeStorage | None) -> None:
        self.location = records_location(root, SLOT_RECORDS, slot)
        self.lake = lake
        self.record: SlotRecord | None = None

    def read(self) -> SlotRecord | None:
        try:
            value = read_record(self.location, POSITION_KEY, self.lake)
        except OSError as error:  # pyarrow's and the local filesystem's errors alike
            raise self._unusable("read", error) from None
        self.record = None if value is None else SlotRecord.from_json(value)
        return self.record

    def write(self, record: SlotRecord) -> None:
        try:
            write_record(self.location, POSITION_KEY, record.to_json(), self.lake)
        except OSError as error:
            raise self._unusable("write", error) from None
        self.record = record

    def _unusable(self, doing: str, error: OSError) -> PgcdcError:
        """A storage error (multi-line, naming no fix) as one line naming the location and delta.root."""
        if doing == "write":
            fault = storage_fault(error, f"pgcdc's slot record at {self.location}", "delta.root", DRAIN_RESUMES)
            if fault is not None:
                return fault
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0].strip()
        return ConfigurationError(
            f"cannot {doing} pgcdc's slot record at {self.location} ({first_line})",
            "check delta.root and delta.storage: it must be a writable location holding the snapshots",
        )

    def allow(self, position: LSN) -> None:
        """Record ``position`` before the slot is confirmed there (the drain's ``before_confirm``); nothing
        when the record already allows it, so a drain writes once per confirm that moves the slot."""
        if self.record is None:
            self.write(SlotRecord(position))
        elif position > self.record.allowed:
            self.write(SlotRecord(position, self.record.gap))

    def created(self, position: LSN) -> None:
        """The slot was created at ``position``. Where the lake recorded an earlier slot of this name,
        the new one has none of the changes before it, so every table copied before it is behind: a
        gap until each is copied again. A first slot has no table behind it (the snapshot that created
        it copies them after it; ``refuse_partial_recopy`` covers copies of a lake without a record)."""
        self.write(SlotRecord(position, None if self.read() is None else (None, position)))


def record_created(config: PgcdcConfig, lake: LakeStorage | None, slot: CreatedSlot | SlotState) -> None:
    """After ``ensure_slot``: record the position of a slot it created (nothing for one it found).

    Written right after the creation (its position is only known then): a crash before the write
    leaves the slot beyond the record, which the next drain reads as a gap, closed by the copies
    that follow the creation (or, without a record at all, the first drain records its position)."""
    if not isinstance(slot, CreatedSlot):
        return
    try:
        SlotGuard(config.delta.root, config.slot, lake).created(slot.consistent_point)
    except (ConfigurationError, StorageFault):
        # An unusable lake: the copies that follow fail naming it. Nothing is lost without this record:
        # a drain finds a slot created beyond an earlier record and refuses the same way (a first slot
        # gets its record from its first drain).
        return


def copied_from(log: TableLog) -> LSN | None:
    """The oldest position whose later changes the table's Delta copy needs: its snapshot's, or a
    snapshot in key ranges' oldest range point; None: no copy (its changes are skipped)."""
    if log.chunks is not None:
        points = [point for point in log.chunks.points if point is not None]
        return LSN(min(points)) if points else None
    return log.snapshot_lsn


def tables_behind(
    config: PgcdcConfig, destination: Destination, tables: Sequence[TableName], position: LSN
) -> list[TableName]:
    """The tables whose copy is older than ``position`` (so they missed changes before it), each read
    from its own log (the state's row only saves the commits it knows)."""
    state = read_state(state_path(config.delta.root, config.slot), destination.lake)
    behind = []
    for table in tables:
        path = config.table_path(table.schema, table.name)
        start = copied_from(destination.read_table_log(path, known_log(state, str(table), path)))
        if start is not None and start < position:
            behind.append(table)
    return behind


def check_slot_position(
    config: PgcdcConfig,
    destination: Destination,
    tables: Sequence[TableName],
    position: LSN,
    holding: bool,
) -> SlotGuard:
    """The guard of the drain starting at ``position``, the slot's confirmed position; refuses when the
    slot moved beyond the record (now or in a gap not yet closed) and a table still holds a copy from
    before. ``holding``: a drain of a snapshot in key ranges, which goes on (it is the re-snapshot).

    Costs one read when the slot is where pgcdc left it; a new gap is recorded before the refusal."""
    guard = SlotGuard(config.delta.root, config.slot, destination.lake)
    record = guard.read()
    if record is None:  # a lake from before the record: the slot's position is taken as pgcdc's
        if read_state(state_path(config.delta.root, config.slot), destination.lake):
            guard.allow(position)  # (a lake without a state may be a wrong delta.root: its first confirm records)
        return guard
    if position > record.allowed:
        start = record.gap[0] if record.gap is not None else record.allowed
        record = SlotRecord(position, (start, position))
        guard.write(record)
    if record.gap is None:
        return guard
    behind = tables_behind(config, destination, tables, record.gap[1])
    if not behind:
        guard.write(SlotRecord(record.allowed))  # every table was copied after the gap
    elif not holding:
        raise moved_slot(config, record.gap, behind, len(tables))
    return guard


def moved_slot(
    config: PgcdcConfig, gap: tuple[LSN | None, LSN], behind: Sequence[TableName], replicated: int
) -> SlotError:
    """The refusal: the gap, what moves a slot, and the fix (every table, since all missed the gap)."""
    start, end = gap
    named = ", ".join(str(table) for table in behind[:NAMED_TABLES])
    more = f" and {len(behind) - NAMED_TABLES} more" if len(behind) > NAMED_TABLES else ""
    if start is None:
        what = f"was created anew at {end}, after tables were copied for the slot it replaces"
    else:
        what = (
            f"moved from {start}, the position pgcdc recorded in its lake, to {end} without pgcdc:"
            " the changes in between never reached Delta (another consumer of the slot such as"
            " pg_recvlogical --start, pgcdc changes --advance, pg_replication_slot_advance(), or a second"
            " pipeline configured with the same slot name)"
        )
    return SlotError(
        f'replication slot "{config.slot}" {what}; nothing was applied or confirmed',
        f"re-snapshot every table: run the {RESNAPSHOT_JOB} job with no table list (every table missed those"
        f" changes; {len(behind)} of {replicated} still hold a copy from before {end}: {named}{more});"
        " give any other consumer a slot of its own",
    )
