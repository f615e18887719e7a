"""A whole snapshot and a whole drain replayed from what a real PostgreSQL sent, recorded: no server.

A :class:`Recording` holds, byte for byte, what the runs read from PostgreSQL below their preflight:

* per table, the COPY output (text format) at a temporary slot's consistent point, that point and the
  published columns' types (``resources/runs/consistent_copy.py`` reads the same three);
* the XLogData frames of the permanent slot from its start to ``end_lsn`` (WAL start and pgoutput
  bytes of each), as ``ReplicationStream`` received them;
* the answers the catalog gave the change applier (``resources.postgres.column_types.TypeResolver``),
  keyed by question, so a replay asks nothing that was not asked of the server;
* PostgreSQL's rows at the end of the workload, with multiplicity: what the replay must produce.

``tests/support/change_recorder.py`` writes one against a live server. :func:`replay_snapshot` parses
the COPY bytes with the snapshot's own :class:`~resources.postgres.copy.PieceParser` into
``Destination.write_snapshot`` with a snapshot marker (an unbucketed table, as a small table's snapshot writes); :func:`replay_drain` runs the drain loop
(``resources/cdc/drain.py``) with the real assembler and applier over :class:`RecordedChanges`.
Not covered here, because it is the server's side: preflight, slot and publication reads, and the
temporary slots the snapshot creates.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from resources.cdc.applier import ChangeApplier
from resources.cdc.drain import drain
from resources.cdc.tables import TableTarget
from resources.cdc.transactions import TransactionAssembler
from resources.delta.destination import Destination
from resources.delta.markers import LSN_COLUMN, snapshot_marker
from resources.lsn import LSN
from resources.pgoutput.messages import Relation
from resources.pgtypes import arrow_schema, PgColumnType
from resources.postgres.catalog import TableName
from resources.postgres.column_types import ColumnTypes
from resources.postgres.copy import PieceParser
from resources.postgres.frames import XLogData

__all__ = ["RecordedChanges", "RecordedCopy", "RecordedTypes", "Recording", "replay_drain", "replay_snapshot"]

ROW_CHANGES = frozenset(b"IUD")
"""pgoutput Insert, Update, Delete: the messages ``ReplicationStream.drain_batches`` hands out in lists."""


@dataclass(frozen=True)
class RecordedCopy:
    """One table's snapshot COPY as PostgreSQL sent it."""

    table: TableName
    point: LSN
    columns: list[PgColumnType]
    data: bytes  # COPY's text format
    rows: int


@dataclass
class Recording:
    slot: str
    #: The recording server's ``server_version_num`` (the frames' pgoutput version follows from it).
    server_version_num: int
    proto_version: int
    start_lsn: LSN
    end_lsn: LSN
    copies: list[RecordedCopy]
    #: (WAL start, pgoutput message) of every XLogData frame, in order.
    frames: list[tuple[LSN, bytes]]
    #: question (see :func:`question`) -> the catalog's answer, JSON-shaped.
    catalog: dict[str, Any]
    #: table -> its rows at end_lsn, each a list of values (JSON types).
    final_rows: dict[str, list[list[Any]]] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        data = {
            "slot": self.slot,
            "server_version_num": self.server_version_num,
            "proto_version": self.proto_version,
            "start_lsn": int(self.start_lsn),
            "end_lsn": int(self.end_lsn),
            "copies": [
                {
                    "table": [c.table.schema, c.table.name], "point": int(c.point), "rows": c.rows,
                    "columns": [dataclasses.asdict(col) for col in c.columns], "data": c.data.decode(),
                }
                for c in self.copies
            ],
            "frames": [[int(lsn), payload.hex()] for lsn, payload in self.frames],
            "catalog": self.catalog,
            "final_rows": self.final_rows,
        }  # fmt: skip
        path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> Recording:
        data = json.loads(path.read_text())
        return cls(
            slot=data["slot"],
            server_version_num=data["server_version_num"],
            proto_version=data["proto_version"],
            start_lsn=LSN(data["start_lsn"]),
            end_lsn=LSN(data["end_lsn"]),
            copies=[
                RecordedCopy(
                    TableName(*c["table"]),
                    LSN(c["point"]),
                    [PgColumnType(**col) for col in c["columns"]],
                    c["data"].encode(),
                    c["rows"],
                )
                for c in data["copies"]
            ],  # fmt: skip
            frames=[(LSN(lsn), bytes.fromhex(payload)) for lsn, payload in data["frames"]],
            catalog=data["catalog"],
            final_rows=data["final_rows"],
        )


def question(method: str, relation: Relation, *args: Any) -> str:
    """The key of one catalog question: the method, the relation (by name and oid) and its arguments."""
    return json.dumps([method, relation.namespace, relation.name, relation.oid, *args])


class RecordedTypes:
    """``ColumnTypes`` answered from a recording's catalog answers; a question never asked of the server fails."""

    def __init__(self, catalog: dict[str, Any]) -> None:
        self._catalog = catalog

    def _answer(self, key: str) -> Any:
        if key not in self._catalog:
            raise KeyError(f"the recording holds no catalog answer to {key}: record it again")
        return self._catalog[key]

    def columns(self, relation: Relation) -> list[PgColumnType]:
        return [PgColumnType(**col) for col in self._answer(question("columns", relation))]

    def primary_key(self, relation: Relation) -> tuple[str, ...]:
        return tuple(self._answer(question("primary_key", relation)))

    def attributes(self, relation: Relation) -> list[tuple[int, str, bool]]:
        return [tuple(row) for row in self._answer(question("attributes", relation))]

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]:
        answer = self._answer(question("added_columns", relation, names))
        return {name: {tuple(fact) for fact in facts} for name, facts in answer.items()}


class RecordedChanges:
    """A :class:`~resources.cdc.change_source.ChangeSource` replaying recorded frames; remembers what it was confirmed.

    Batches row changes as ``ReplicationStream.drain_batches`` does (consecutive Insert/Update/Delete
    payloads in lists of about ``max_batch_bytes``) and ends where it ends: after the first Commit
    ending at or past the end, or before a Begin whose commit lies at or past it.
    """

    def __init__(
        self, frames: list[tuple[LSN, bytes]], start_lsn: LSN, on_confirm: Callable[[LSN], None] | None = None
    ) -> None:
        """``on_confirm`` runs at each confirm, before the position is recorded: a test looks at the
        destination there, at the moment the slot would be told the position is durable."""
        self._frames = frames
        self._confirmed = start_lsn
        self._streaming = True
        self._on_confirm = on_confirm
        #: Every position confirmed, in order; :attr:`sent` those a status update carried.
        self.confirmed: list[LSN] = []
        self.sent: list[LSN] = []

    @property
    def streaming(self) -> bool:
        return self._streaming

    @property
    def confirmed_lsn(self) -> LSN:
        return self._confirmed

    def drain_batches(
        self, end_lsn: LSN, *, stop: bool = True, max_batch_bytes: int = 1 << 20
    ) -> Iterator[XLogData | list[bytes]]:
        try:
            yield from self._drain(end_lsn, max_batch_bytes)
        finally:
            if stop:
                self.stop()

    def _drain(self, end_lsn: LSN, max_batch_bytes: int) -> Iterator[XLogData | list[bytes]]:
        rows: list[bytes] = []
        rows_bytes = 0
        for wal_start, payload in self._frames:
            if payload[0] in ROW_CHANGES:  # pgoutput sends them only inside a transaction or streamed block
                rows.append(payload)
                rows_bytes += len(payload)
                if rows_bytes >= max_batch_bytes:
                    yield rows
                    rows, rows_bytes = [], 0
                continue
            if rows:
                yield rows
                rows, rows_bytes = [], 0
            if payload[0] == ord("B") and int.from_bytes(payload[1:9], "big") >= end_lsn:
                return  # a transaction whose commit lies at or past the end: the next drain's
            yield XLogData(wal_start, wal_start, 0, memoryview(payload))
            if payload[0] == ord("C") and int.from_bytes(payload[10:18], "big") >= end_lsn:
                return
        if rows:
            yield rows

    def confirm(self, lsn: LSN) -> None:
        if self._on_confirm is not None:
            self._on_confirm(lsn)
        self._confirmed = lsn
        self.confirmed.append(lsn)

    def send_status(self, reply_requested: bool = False) -> None:
        self.sent.append(self._confirmed)

    def keepalive(self) -> None:
        self.sent.append(self._confirmed)

    def stop(self, timeout: float = 60.0) -> None:
        self._streaming = False


def snapshot_path(table: TableName) -> str:
    return f"lake/{table.schema}/{table.name}"


def replay_snapshot(recording: Recording, destination: Destination) -> None:
    """Each recorded COPY parsed by the snapshot's parser into one snapshot commit with its marker."""
    for copy in recording.copies:
        schema = arrow_schema(copy.columns).append(pa.field(LSN_COLUMN, pa.int64()))
        batch = PieceParser(copy.columns, schema, copy.point)(bytearray(copy.data), copy.rows)
        marker = snapshot_marker(copy.point, recording.slot, str(copy.table))
        destination.write_snapshot(pa.Table.from_batches([batch], schema), schema, snapshot_path(copy.table), marker)


def replay_drain(
    recording: Recording,
    destination: Destination,
    types: ColumnTypes | None = None,
    *,
    log: Callable[[str], None] | None = None,
    on_confirm: Callable[[LSN], None] | None = None,
) -> RecordedChanges:
    """Drain the recorded frames into ``destination`` as ``run_incremental`` drains the slot (the same
    assembler, applier and ``drain`` loop, default chunk limits); ``types``: the catalog's answers,
    default the recorded ones. Returns the source, holding what was confirmed."""
    say = log or (lambda message: None)
    source = RecordedChanges(recording.frames, recording.start_lsn, on_confirm)
    targets = {copy.table: TableTarget(copy.table, snapshot_path(copy.table)) for copy in recording.copies}
    applier = ChangeApplier(
        destination, types if types is not None else RecordedTypes(recording.catalog), targets,
        max_changes=200_000, max_bytes=1 << 26, log=say, heartbeat=source.keepalive,
    )  # fmt: skip
    with TransactionAssembler(recording.proto_version, None) as assembler:
        drain(source, assembler, applier, recording.end_lsn, say, time.monotonic())
    return source
