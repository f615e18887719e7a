"""Record what a real PostgreSQL sends for a fixed workload (``resources/testing/recorded_changes.py``).

The workload covers a keyed table (inserts, updates, deletes, a key change, an update leaving a
TOASTed value unchanged), a keyless table with duplicate rows and a TRUNCATE, and a REPLICA
IDENTITY FULL table with duplicates. The committed recording, ``tests/data/recorded_run.json``, is
written by ``python -m tests.support.change_recorder DSN`` against an empty database.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import psycopg

from resources.lsn import LSN
from resources.pgoutput.messages import Relation
from resources.pgoutput.options import PgOutputOptions
from resources.pgtypes import PgColumnType
from resources.postgres.catalog import TableName
from resources.postgres.column_types import TypeResolver
from resources.postgres.copy import copy_pieces, unparsed
from resources.postgres.replication import ReplicationConnection
from resources.postgres.slots import read_slot
from resources.postgres.stream import ReplicationStream
from resources.runs.consistent_copy import consistent_copy
from resources.testing.memory_destination import InMemoryDestination
from resources.testing.recorded_changes import question, RecordedCopy, Recording, replay_drain, replay_snapshot

RECORDING = Path(__file__).resolve().parent.parent / "data" / "recorded_run.json"

SLOT = "pgcdc_recorded"
PUBLICATION = "pgcdc_recorded_pub"
TABLES = (TableName("public", "acct"), TableName("public", "events"), TableName("public", "pairs"))

DDL = f"""
CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance double precision, doc text);
ALTER TABLE acct ALTER doc SET STORAGE EXTERNAL;
CREATE TABLE events (kind text, n integer);
CREATE TABLE pairs (a integer, b text);
ALTER TABLE pairs REPLICA IDENTITY FULL;
INSERT INTO acct SELECT i, 'owner ' || i, i * 1.5, NULL FROM generate_series(1, 20) i;
UPDATE acct SET doc = repeat('toasted ', 400) WHERE id = 1;
INSERT INTO events VALUES ('a', 1), ('a', 1), ('b', 2);
INSERT INTO pairs VALUES (1, 'x'), (1, 'x'), (2, 'y');
CREATE PUBLICATION {PUBLICATION} FOR TABLE acct, events, pairs;
"""

WORKLOAD = (
    "UPDATE acct SET balance = balance + 1 WHERE id % 3 = 0",
    "DELETE FROM acct WHERE id % 5 = 0",
    "UPDATE acct SET id = id + 100 WHERE id = 2",
    "INSERT INTO acct VALUES (200, NULL, NULL, NULL), (201, 'new', -1, NULL)",
    "UPDATE acct SET owner = 'toast unchanged' WHERE id = 1",
    "INSERT INTO events VALUES ('c', 3), ('a', 1)",
    "UPDATE pairs SET b = 'z' WHERE ctid = (SELECT min(ctid) FROM pairs WHERE a = 1)",
    "INSERT INTO pairs VALUES (2, 'y')",
    "TRUNCATE events",
    "INSERT INTO events VALUES ('after', 9), ('after', 9)",
    "DELETE FROM pairs WHERE a = 2",
    "INSERT INTO pairs VALUES (3, 'w'), (3, 'w')",
)


class RecordingTypes:
    """The live ``TypeResolver``, its answers kept JSON-shaped under their question."""

    def __init__(self, live: TypeResolver) -> None:
        self._live = live
        self.catalog: dict[str, Any] = {}

    def columns(self, relation: Relation) -> list[PgColumnType]:
        answer = self._live.columns(relation)
        self.catalog[question("columns", relation)] = [dataclasses.asdict(col) for col in answer]
        return answer

    def primary_key(self, relation: Relation) -> tuple[str, ...]:
        answer = self._live.primary_key(relation)
        self.catalog[question("primary_key", relation)] = list(answer)
        return answer

    def attributes(self, relation: Relation) -> list[tuple[int, str, bool]]:
        answer = self._live.attributes(relation)
        self.catalog[question("attributes", relation)] = [list(row) for row in answer]
        return answer

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]:
        answer = self._live.added_columns(relation, names)
        self.catalog[question("added_columns", relation, names)] = {
            name: sorted(map(list, facts)) for name, facts in answer.items()
        }
        return answer


def _copy(dsn: str, table: TableName) -> RecordedCopy:
    """The table's COPY bytes at a temporary slot's consistent point, as the snapshot reads them."""
    with consistent_copy(dsn, PUBLICATION, table) as copy:
        data = bytearray()
        rows = 0
        for (piece, count), _ in copy_pieces(copy.conn.pgconn, copy.info.copy_query(), unparsed, 1 << 24, 1 << 20):
            data += piece
            rows += count
        return RecordedCopy(table, copy.point, copy.columns, bytes(data), rows)


def record(dsn: str) -> Recording:
    """Run the workload on the empty database at ``dsn`` and record it (the slot is dropped after)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute("SELECT pg_catalog.pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
        try:
            state = read_slot(conn, SLOT)
            assert state is not None and state.confirmed_flush_lsn is not None
            copies = [_copy(dsn, table) for table in TABLES]
            for statement in WORKLOAD:
                conn.execute(statement)
            options = PgOutputOptions([PUBLICATION], streaming="on")
            with ReplicationConnection(dsn, application_name="pgcdc_recorder") as rc:
                end_lsn = rc.identify_system().xlogpos
                stream = ReplicationStream(rc)
                stream.start(SLOT, options=options)
                frames = [(LSN(frame.wal_start), bytes(frame.payload)) for frame in stream.drain(end_lsn)]
                version = rc.server_version_num
                proto = options.resolve_proto_version(version)
            recording = Recording(SLOT, version, proto, state.confirmed_flush_lsn, end_lsn, copies, frames, {})
            # The applier's catalog questions, answered by the server, while replaying what was recorded.
            types = RecordingTypes(TypeResolver(conn))
            destination = InMemoryDestination()
            replay_snapshot(recording, destination)
            replay_drain(recording, destination, types)
            recording.catalog = types.catalog
            recording.final_rows = {
                str(table): [list(row) for row in conn.execute(f"SELECT * FROM {table.schema}.{table.name}").fetchall()]
                for table in TABLES
            }
        finally:
            conn.execute("SELECT pg_catalog.pg_drop_replication_slot(%s)", (SLOT,))
    return recording


if __name__ == "__main__":
    record(sys.argv[1]).save(RECORDING)
