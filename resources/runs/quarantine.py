"""Quarantined tables: one table's fault set aside so the others, and the slot, keep flowing.

At hundreds of tables some table always holds a value Delta cannot hold, meets a DDL that needs a
re-snapshot, or is refused by the engine. Stopping the whole drain for it stops the slot, and the
primary keeps WAL until a person acts. With ``on_table_error: quarantine`` (the default) the drain
confines the fault to its table instead:

1. the table's changes not yet in Delta are dropped, and its later changes skipped;
2. a quarantine record is written to the lake (``resources/delta/lake_records.py``) *before* any
   confirm passes those changes, so the slot never moves past a change that is neither in Delta nor
   recorded as missing from it;
3. every other table is applied and the slot confirmed as usual; the run then fails once, naming
   the table, the cause, the column, the LSN and the fix, so alerting fires. Later drains skip the
   table's changes, say so, and succeed.

A re-snapshot lifts it: a snapshot whose consistent point lies past the quarantining drain's end
(``Quarantine.after``) holds every change the drains skipped, and the drains apply what follows it,
exactly as for a table snapshotted for the first time. The next drain reads that from the table's own
log at its start, removes the record and reports the table lifted (its check turns green), so no
snapshot writes a record and no crash between two writes can leave a wrong one. ``on_table_error: stop`` fails the drain at the fault instead, with nothing confirmed past it.

What is confined: :class:`~resources.errors.TableFault` (a value, a schema change) and the engine's
analysis errors on a table's write (its columns or its data refused). Everything else (the engine gone,
the store unreachable, a full disk) fails the run: it is no table's own fault, and setting tables
aside one by one for it would only hide it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any

from resources.cdc.schema import ChangeValueError, SchemaChangeError
from resources.cdc.tables import TableTarget
from resources.config import PgcdcConfig
from resources.config.columns import ColumnClashError
from resources.crash_points import fault_point
from resources.delta.destination import Destination
from resources.delta.lake_records import delete_record, read_records, records_location, write_record
from resources.delta.lake_storage import LakeStorage
from resources.errors import TableFault
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB, TableName

QUARANTINE_RECORDS = "quarantine"
"""The kind of lake record holding a pipeline's quarantined tables, one per table."""


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A table set aside by a fault of its own, and what lifts it."""

    table: str
    path: str
    #: Commit end LSN of the table's first change not applied (at or before the fault).
    lsn: LSN
    #: The end LSN of the drain that set it aside: a snapshot whose consistent point lies past it lifts it.
    after: LSN
    cause: str
    fix: str
    #: The column at fault, when one is.
    column: str | None
    since: str
    #: What kind of fault: ``schema`` (a re-snapshot takes the new schema: fixed by the re-snapshot itself),
    #: ``value`` (a value Delta cannot hold: fixed in PostgreSQL or by replicating the column as text),
    #: ``column`` (two columns Delta cannot tell apart: fixed by the ``columns`` key) or ``engine`` (a write
    #: the engine refused).
    fault: str = "engine"

    def describe(self) -> str:
        """One line: the table, since where, why, and what to do."""
        where = f" (column {self.column!r})" if self.column else ""
        return f"{self.table} is quarantined from {self.lsn} on{where}: {self.cause}: {self.fix}"

    def lifted_by(self, snapshot_lsn: LSN | None) -> bool:
        """Whether a snapshot at ``snapshot_lsn`` replaced the table after it was set aside."""
        return snapshot_lsn is not None and snapshot_lsn > self.after

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table, "path": self.path, "lsn": str(self.lsn), "after": str(self.after),
            "cause": self.cause, "fix": self.fix, "column": self.column, "since": self.since, "fault": self.fault,
        }  # fmt: skip

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Quarantine:
        return cls(
            value["table"], value["path"], LSN.parse(value["lsn"]), LSN.parse(value["after"]), value["cause"],
            value["fix"], value.get("column"), value["since"], value.get("fault", "engine"),
        )  # fmt: skip


def is_table_fault(error: BaseException) -> bool:
    """Whether ``error`` is one table's own fault (module docstring): pgcdc's table faults, and the
    engine's analysis errors (the write's columns or values refused), never a connection or storage failure."""
    if isinstance(error, TableFault):
        return True
    try:
        from pyspark.errors import AnalysisException
    except ImportError:  # no engine client installed: only pgcdc's own faults are known
        return False
    return isinstance(error, AnalysisException)


def quarantine_of(table: str, path: str, lsn: int, after: LSN, error: BaseException) -> Quarantine:
    """The record of ``table`` set aside by ``error`` at ``lsn`` during a drain ending at ``after``."""
    if isinstance(error, TableFault):
        cause, fix, column = error.cause, error.fix, error.column
    else:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        cause = f"the engine refused a write of {table} ({lines[0].strip()})"
        fix = "fix the table or the engine setting named, then re-snapshot the table"
        column = None
    if f"{RESNAPSHOT_JOB}" not in fix:
        fix = f"{fix} (its snapshot asset, or the {RESNAPSHOT_JOB} job naming it, lifts the quarantine)"
    since = datetime.now(UTC).isoformat()
    return Quarantine(table, path, LSN(lsn), after, cause, fix, column, since, _fault_kind(error))


def _fault_kind(error: BaseException) -> str:
    if isinstance(error, ColumnClashError):
        return "column"
    if isinstance(error, SchemaChangeError):
        return "schema"
    return "value" if isinstance(error, ChangeValueError) else "engine"


def quarantine_location(config: PgcdcConfig) -> str:
    return records_location(config.delta.root, QUARANTINE_RECORDS, config.slot)


def read_quarantines(config: PgcdcConfig, lake: LakeStorage | None) -> dict[str, Quarantine]:
    """The pipeline's quarantined tables by name (one LIST of the store; empty nearly always)."""
    records = read_records(quarantine_location(config), lake)
    return {table: Quarantine.from_json(value) for table, value in records.items()}


def record_quarantine(config: PgcdcConfig, quarantine: Quarantine, lake: LakeStorage | None) -> None:
    """Write the record, durably, before the drain confirms anything past the table's unapplied changes."""
    write_record(quarantine_location(config), quarantine.table, quarantine.to_json(), lake)
    fault_point("after_quarantine_record")


def lift_quarantine(config: PgcdcConfig, table: str, lake: LakeStorage | None) -> None:
    """Remove the table's record (a snapshot past it replaced the table)."""
    delete_record(quarantine_location(config), table, lake)


class Quarantines:
    """One drain's quarantined tables: those it found set aside (each lifted when a re-snapshot replaced
    it) and those it sets aside itself (:meth:`set_aside`, the change applier's ``set_aside``)."""

    def __init__(
        self, config: PgcdcConfig, destination: Destination, targets: Mapping[TableName, TableTarget], end_lsn: LSN,
        say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self._config = config
        self._lake = destination.lake
        self._targets = {str(table): target for table, target in targets.items()}
        self._end_lsn = end_lsn
        self._say = say
        self.active: dict[str, Quarantine] = {}
        self.new: list[str] = []
        self.lifted: list[str] = []

    @classmethod
    def start(
        cls, config: PgcdcConfig, destination: Destination, targets: Mapping[TableName, TableTarget],
        drained: tuple[LSN, LSN], say: Callable[[str], None],
    ) -> Quarantines:  # fmt: skip
        """Read the pipeline's records; a table whose log now holds a snapshot past its record is lifted (its
        record removed), any other is set aside before the drain meets its changes. ``drained`` is the
        drain's (start, end): a record its own drain never confirmed past (killed before its final
        confirm) counts as new, so this drain reports it and fails as that one would have."""
        start_lsn, end_lsn = drained
        quarantines = cls(config, destination, targets, end_lsn, say)
        for name, quarantine in read_quarantines(config, destination.lake).items():
            target = quarantines._targets.get(name)
            if target is None or target.path != quarantine.path:
                continue  # no longer replicated here: the record stays for when it is again
            recorded = target.log or target.known
            if recorded is None or not quarantine.lifted_by(recorded.snapshot_lsn):
                if target.log is None:  # the state may predate the re-snapshot: the table's own log decides
                    target.log = destination.read_table_log(target.path, target.known)
                    target.stats.version_read = target.log.version
                recorded = target.log
            if quarantine.lifted_by(recorded.snapshot_lsn):
                lift_quarantine(config, name, destination.lake)
                quarantines.lifted.append(name)
                say(f"{name}: re-snapshotted at {recorded.snapshot_lsn}, its quarantine is lifted")
            else:
                target.quarantined = True
                quarantines.active[name] = quarantine
                if start_lsn < quarantine.after:  # its drain was killed before its final confirm: never reported
                    quarantines.new.append(name)
        return quarantines

    def set_aside(self, table: TableName, lsn: int, error: Exception) -> bool:
        """(The change applier's ``set_aside``.) Record ``table`` as quarantined when ``error`` is its own fault."""
        if not is_table_fault(error):
            return False
        name = str(table)
        quarantine = quarantine_of(name, self._targets[name].path, lsn, self._end_lsn, error)
        record_quarantine(self._config, quarantine, self._lake)
        self.active[name] = quarantine
        self.new.append(name)
        self._say(f"error: {quarantine.describe()}; the other tables are applied and the slot moves on")
        return True

    def report(self, targets: Mapping[TableName, TableTarget]) -> None:
        """Say, for each table still set aside, how many of its changes this drain skipped and why."""
        for table, target in targets.items():
            quarantine = self.active.get(str(table))
            if quarantine is not None and str(table) not in self.new:
                self._say(
                    f"warning: {target.stats.quarantine_skipped} change(s) of {table} skipped: {quarantine.describe()}"
                )
