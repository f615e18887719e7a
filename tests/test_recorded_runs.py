"""A whole snapshot and a whole drain with no server: what PostgreSQL sent, recorded, replayed into memory.

``tests/data/recorded_run.json`` (``tests/support/change_recorder.py`` wrote it against a real
PostgreSQL) holds the COPY bytes of three tables at their snapshot points, every XLogData frame
of the slot up to the end of a workload, the catalog's answers to the change applier and
PostgreSQL's rows at the end. The unit test parses the COPY bytes with the snapshot's parser into
:class:`~resources.testing.memory_destination.InMemoryDestination`, then runs the drain loop
(``resources/cdc/drain.py``, with the real transaction assembler and change applier) over
:class:`~resources.testing.recorded_changes.RecordedChanges` and checks the tables equal
PostgreSQL's, row for row with multiplicity, and that the drain confirmed exactly the recording's
end, once the destination held everything.

Covered: everything a run does below the server's answers (COPY parsing, snapshot commit and
marker, pgoutput decoding, transaction assembly, folding, MERGE/append/FULL rewrite/TRUNCATE on
the destination, confirm order). Not covered (the server's side, in tests/test_memory_runs.py):
preflight, publication and slot reads, IDENTIFY_SYSTEM, the snapshot's temporary slots, and the
pgcdc state table. The pg-tier test records the workload again on a live server and checks its
replay gives the same tables, so the committed recording cannot drift from what PostgreSQL sends.
"""

from __future__ import annotations

from collections import Counter

from resources.lsn import LSN
from resources.testing.memory_destination import InMemoryDestination
from resources.testing.recorded_changes import Recording, replay_drain, replay_snapshot, snapshot_path
from tests.support.change_recorder import record, RECORDING
from tests.support.postgres import PgDatabase


def memory_tables(recording: Recording, destination: InMemoryDestination) -> dict[str, Counter[tuple]]:
    """Each recorded table's rows in ``destination``, PostgreSQL's columns only."""
    tables = {}
    for copy in recording.copies:
        data = destination.tables[snapshot_path(copy.table)]
        names = [name for name in data.column_names if not name.startswith("_pgcdc_")]
        tables[str(copy.table)] = Counter(tuple(row[name] for name in names) for row in data.select(names).to_pylist())
    return tables


def replayed(recording: Recording) -> tuple[dict[str, Counter[tuple]], list[tuple[LSN, dict[str, Counter[tuple]]]]]:
    """The tables after the replayed snapshot and drain, and at each confirm the position and the tables then."""
    destination = InMemoryDestination()
    replay_snapshot(recording, destination)
    confirms: list[tuple[LSN, dict[str, Counter[tuple]]]] = []
    replay_drain(
        recording, destination, on_confirm=lambda lsn: confirms.append((lsn, memory_tables(recording, destination)))
    )
    return memory_tables(recording, destination), confirms


def expected_tables(recording: Recording) -> dict[str, Counter[tuple]]:
    return {table: Counter(map(tuple, rows)) for table, rows in recording.final_rows.items()}


def test_a_recorded_snapshot_and_drain_replayed_into_memory_equal_postgresql() -> None:
    recording = Recording.load(RECORDING)
    tables, confirms = replayed(recording)
    assert tables == expected_tables(recording)
    assert sum(tables["public.events"].values()) == 2 and sum(tables["public.pairs"].values()) == 4  # duplicates kept
    acct = {row[0]: row for row in tables["public.acct"]}
    assert acct[1][1:] == ("toast unchanged", 1.5, "toasted " * 400)  # the unchanged TOAST value kept
    # The last confirm is exactly the recording's end, made when the destination already held every change.
    assert confirms[-1] == (recording.end_lsn, expected_tables(recording))
    positions = [lsn for lsn, _ in confirms]
    assert positions == sorted(set(positions)) and positions[0] > recording.start_lsn


def test_a_new_recording_replays_to_the_committed_one(pg: PgDatabase) -> None:
    fresh = record(pg.dsn)
    committed = Recording.load(RECORDING)
    assert expected_tables(fresh) == expected_tables(committed)
    assert replayed(fresh)[0] == replayed(committed)[0] == expected_tables(fresh)
    assert [(c.table, c.columns, c.data) for c in fresh.copies] == [
        (c.table, c.columns, c.data) for c in committed.copies
    ]
