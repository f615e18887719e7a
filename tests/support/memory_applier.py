"""The change applier on the in-memory destination: a keyed table with its snapshot, and committed
transactions assembled from pgoutput message bodies."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from resources.cdc.transactions import CommittedTransaction, TransactionAssembler
from resources.delta.layout import TableLayout, with_buckets
from resources.delta.markers import LSN_COLUMN, snapshot_marker
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.testing.memory_destination import InMemoryDestination
from tests.support.pgoutput_messages import begin, commit, relation

OID = 16384

TABLE = TableName("public", "t")

PATH = "lake/public/t"

SNAPSHOT_LSN = 100

SCHEMA = pa.schema([("id", pa.int32()), ("body", pa.string()), (LSN_COLUMN, pa.int64())])


def keyed_relation() -> bytes:
    return relation(OID, "t", [("id", 23, True), ("body", 25, False)])


def transactions(
    bodies: list[list[bytes]], tmp_path: Path, *, first_end: int = SNAPSHOT_LSN + 10
) -> list[CommittedTransaction]:
    """Each body (messages between Begin and Commit) as one committed transaction, ends 10 apart."""
    done = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    with TransactionAssembler(1, tmp_path) as assembler:
        for index, body in enumerate(bodies):
            end = first_end + 10 * index
            for message in [begin(end - 1, 1000 + index), *body, commit(end - 1, end)]:
                txn = assembler.feed(memoryview(message), end - 5)
                if txn is not None:
                    done.append(txn)
    return done


def destination_with_snapshot(rows: list[tuple[int, str]], layout: TableLayout | None = None) -> InMemoryDestination:
    destination = InMemoryDestination()
    table = pa.Table.from_pylist([{"id": i, "body": b, LSN_COLUMN: SNAPSHOT_LSN} for i, b in rows], schema=SCHEMA)
    if layout is not None:
        table = with_buckets(layout, table)
    destination.write_snapshot(
        table, table.schema, PATH, snapshot_marker(LSN(SNAPSHOT_LSN), "slot", str(TABLE), layout)
    )
    return destination
