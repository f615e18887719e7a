"""A slot moved by anything but pgcdc is refused before anything is applied (resources/runs/slot_guard.py).

Real PostgreSQL 15 and 18, the in-memory destination (no engine: what is guarded is the slot and
the record in the lake, which lives under the local ``delta.root`` as in production). Every way a
slot moves without pgcdc is made to skip real changes: the drain refuses in one line naming the
gap, confirms nothing (the slot stays where it was moved) and writes no table; a re-snapshot of
every table clears the refusal and leaves the tables equal to PostgreSQL, value for value.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from resources.cdc.drain import start_streaming
from resources.config import parse_config, PgcdcConfig
from resources.errors import SlotError
from resources.lsn import LSN
from resources.pgoutput.options import PgOutputOptions
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.catalog import TableName
from resources.postgres.connections import connect
from resources.postgres.preflight import ensure_slot
from resources.postgres.replication import ReplicationConnection
from resources.postgres.stream import ReplicationStream
from resources.runs.cli import main as pgcdc_main
from resources.runs.incremental import run_incremental
from resources.runs.slot_guard import record_created, SlotGuard, SlotRecord
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from resources.testing.verify import arrow_rows, compare_rows
from tests.support.postgres import PgDatabase

SLOT = "pgcdc_guard_slot"
TABLES = ("acct", "events", "pairs")

DDL = """
CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance numeric(12, 2));
CREATE TABLE events (kind text, n integer);
CREATE TABLE pairs (a integer, b text);
ALTER TABLE pairs REPLICA IDENTITY FULL;
INSERT INTO acct SELECT i, 'owner ' || i, i * 1.5 FROM generate_series(1, 200) i;
INSERT INTO events VALUES ('a', 1), ('a', 1), ('b', 2);
INSERT INTO pairs VALUES (1, 'x'), (1, 'x'), (2, 'y');
CREATE PUBLICATION pub FOR TABLE acct, events, pairs;
"""


def changes(pg: PgDatabase, tag: str) -> None:
    """A few transactions touching every table."""
    pg.execute(f"UPDATE acct SET owner = '{tag}', balance = balance + 1 WHERE id % 9 = 0")
    pg.execute(f"DELETE FROM acct WHERE id % 13 = 0; INSERT INTO events VALUES ('{tag}', 7)")
    pg.execute(f"INSERT INTO pairs VALUES (3, '{tag}'); UPDATE pairs SET b = '{tag}' WHERE a = 2")


def config_for(pg: PgDatabase, lake: Path) -> PgcdcConfig:
    return parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(lake)}})


def assert_exact(pg: PgDatabase, destination: InMemoryDestination, config: PgcdcConfig) -> None:
    """Every table equals PostgreSQL's, value for value and row for row (the oracle of verify.py)."""
    with connect(pg.dsn, application_name="pgcdc-verify", session_settings=SESSION_SETTINGS) as conn:
        for table in TABLES:
            compare_rows(conn, f"public.{table}", *arrow_rows(destination.tables[config.table_path("public", table)]))


def slot_position(pg: PgDatabase, slot: str = SLOT) -> LSN:
    ((lsn,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return LSN.parse(lsn)


def wal_position(pg: PgDatabase) -> LSN:
    ((lsn,),) = pg.execute("SELECT pg_current_wal_flush_lsn()::text")
    return LSN.parse(lsn)


def drained(pg: PgDatabase, tmp_path: Path) -> tuple[PgcdcConfig, InMemoryDestination]:
    """A pipeline snapshotted and drained once, its slot where pgcdc left it."""
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    changes(pg, "first")
    run_incremental(config, destination)
    assert_exact(pg, destination, config)
    return config, destination


def advance(pg: PgDatabase, config: PgcdcConfig, tmp_path: Path) -> str:
    pg.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_flush_lsn())", (SLOT,))
    return ""


def recvlogical(pg: PgDatabase, config: PgcdcConfig, tmp_path: Path) -> str:
    """``pg_recvlogical --start`` on pgcdc's slot up to the current WAL position: it confirms what it wrote."""
    subprocess.run(
        [
            str(pg.server.bin_dir / "pg_recvlogical"), "-d", pg.dsn, "--slot", SLOT, "--start",
            "-E", str(wal_position(pg)), "--no-loop", "-f", str(tmp_path / "recvlogical.out"),
            "-o", "proto_version=1", "-o", "publication_names=pub",
        ],
        check=True, timeout=60,
    )  # fmt: skip
    return ""


def changes_advance(pg: PgDatabase, config: PgcdcConfig, tmp_path: Path) -> str:
    """``pgcdc changes --advance``: it warns on stderr before it moves the slot."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert pgcdc_main(["changes", "--dsn", pg.dsn, "--slot", SLOT, "--publication", "pub", "--advance"]) == 0
    return err.getvalue()


def second_pipeline(pg: PgDatabase, config: PgcdcConfig, tmp_path: Path) -> str:
    """A second pipeline configured with the same slot name, snapshotting and draining into a lake of its own."""
    other = config_for(pg, tmp_path / "other_lake")
    elsewhere = InMemoryDestination()
    snapshot_tables(other, elsewhere)
    run_incremental(other, elsewhere)
    assert_exact(pg, elsewhere, other)  # it drained the changes itself: they are in its lake, not pgcdc's
    return ""


WAYS: dict[str, Callable[[PgDatabase, PgcdcConfig, Path], str]] = {
    "pg_replication_slot_advance": advance,
    "pg_recvlogical": recvlogical,
    "pgcdc_changes_advance": changes_advance,
    "second_pipeline": second_pipeline,
}


def refused_drain(config: PgcdcConfig, destination: InMemoryDestination, pg: PgDatabase) -> str:
    """The drain's refusal; asserts it confirmed nothing and wrote no table."""
    position = slot_position(pg)
    tables = dict(destination.tables)
    commits = {path: len(log) for path, log in destination.commits.items()}
    with pytest.raises(SlotError) as refused:
        run_incremental(config, destination)
    assert slot_position(pg) == position
    assert destination.tables == tables and all(destination.tables[p] is t for p, t in tables.items())
    assert {path: len(log) for path, log in destination.commits.items()} == commits
    return str(refused.value)


def expected_refusal(recorded: LSN, moved: LSN, behind: str, count: int) -> str:
    return (
        f'replication slot "{SLOT}" moved from {recorded}, the position pgcdc recorded in its lake, to {moved}'
        " without pgcdc: the changes in between never reached Delta (another consumer of the slot such as"
        " pg_recvlogical --start, pgcdc changes --advance, pg_replication_slot_advance(), or a second pipeline"
        " configured with the same slot name); nothing was applied or confirmed: re-snapshot every table: run the"
        f" pgcdc_resnapshot job with no table list (every table missed those changes; {count} of 3 still hold a"
        f" copy from before {moved}: {behind}); give any other consumer a slot of its own"
    )


@pytest.mark.parametrize("way", WAYS)
def test_a_slot_moved_without_pgcdc_is_refused_before_anything_is_applied(
    pg: PgDatabase, tmp_path: Path, way: str
) -> None:
    config, destination = drained(pg, tmp_path)
    recorded = slot_position(pg)
    guard = SlotGuard(config.delta.root, SLOT, None)
    assert guard.read() == SlotRecord(recorded)  # the drain recorded its last confirm before making it
    changes(pg, "skipped")

    warning = WAYS[way](pg, config, tmp_path)
    moved = slot_position(pg)
    assert moved > recorded
    if way == "pgcdc_changes_advance":
        assert warning == (
            f'pgcdc: warning: moving replication slot "{SLOT}" from {recorded} to {moved}: if a pgcdc pipeline'
            " drains this slot, these changes never reach its Delta tables and its next drain refuses until every"
            " table is re-snapshotted (the pgcdc_resnapshot job with no table list)\n"
        )

    every = "public.acct, public.events, public.pairs"
    assert refused_drain(config, destination, pg) == expected_refusal(recorded, moved, every, 3)
    assert guard.read() == SlotRecord(moved, (recorded, moved))  # the gap is recorded: later confirms keep it
    changes(pg, "later")
    assert refused_drain(config, destination, pg) == expected_refusal(recorded, moved, every, 3)


def test_the_refusal_stays_until_every_table_is_re_snapshotted_then_the_drains_are_exact(
    pg: PgDatabase, tmp_path: Path
) -> None:
    config, destination = drained(pg, tmp_path)
    recorded = slot_position(pg)
    changes(pg, "skipped")
    advance(pg, config, tmp_path)
    moved = slot_position(pg)
    refused_drain(config, destination, pg)

    # One table re-snapshotted (its snapshot asset): the slot does not move, the others still missed the gap.
    snapshot_tables(config, destination, [TableName("public", "events")])
    assert slot_position(pg) == moved
    assert refused_drain(config, destination, pg) == expected_refusal(recorded, moved, "public.acct, public.pairs", 2)

    # Every table (the resnapshot job with no table list): the gap is closed, the drains flow again.
    changes(pg, "during")
    snapshot_tables(config, destination)
    changes(pg, "after")
    result = run_incremental(config, destination)
    assert result.start_lsn == moved and result.confirmed_flush_lsn == slot_position(pg)
    assert SlotGuard(config.delta.root, SLOT, None).read() == SlotRecord(result.confirmed_flush_lsn)
    assert_exact(pg, destination, config)
    changes(pg, "later")
    run_incremental(config, destination)
    assert_exact(pg, destination, config)


def test_a_slot_behind_the_record_drains_and_a_lake_without_a_record_gets_one(pg: PgDatabase, tmp_path: Path) -> None:
    """Behind: a crash between the record and the confirm (or a synchronized slot on a promoted standby).
    No record: a lake written before pgcdc recorded positions; the drain records the slot's position."""
    config, destination = drained(pg, tmp_path)
    guard = SlotGuard(config.delta.root, SLOT, None)
    ahead = LSN(slot_position(pg) + 10_000_000)
    guard.write(SlotRecord(ahead))
    changes(pg, "behind")
    result = run_incremental(config, destination)
    assert guard.read() == SlotRecord(ahead)  # nothing confirmed beyond the record: no write
    assert_exact(pg, destination, config)

    Path(guard.location, "position.json").unlink()
    changes(pg, "unrecorded")
    again = run_incremental(config, destination)
    assert again.start_lsn == result.confirmed_flush_lsn
    assert guard.read() == SlotRecord(again.confirmed_flush_lsn)
    assert_exact(pg, destination, config)


def test_chunked_drains_end_with_the_record_at_the_slot_and_a_drain_that_confirms_nothing_writes_nothing(
    pg: PgDatabase, tmp_path: Path
) -> None:
    """Many chunks, each confirmed: the record ends where the slot does (the order, record then
    confirm, is what tests/test_slot_guard_faults.py kills in between). A drain up to the slot's own
    position confirms nothing and leaves the record's file untouched."""
    config, destination = drained(pg, tmp_path)
    guard = SlotGuard(config.delta.root, SLOT, None)
    for i in range(40):
        pg.execute(f"INSERT INTO events VALUES ('chunk', {i})")
    result = run_incremental(config, destination, max_chunk_changes=5)
    assert result.confirmed_flush_lsn == slot_position(pg)
    assert guard.read() == SlotRecord(result.confirmed_flush_lsn)
    assert_exact(pg, destination, config)

    record = Path(guard.location, "position.json").stat()
    idle = run_incremental(config, destination, end_lsn=slot_position(pg))
    assert idle.confirmed_flush_lsn == result.confirmed_flush_lsn
    after = Path(guard.location, "position.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (record.st_ino, record.st_mtime_ns)


def test_a_slot_created_anew_is_refused_until_every_table_is_copied_after_it(pg: PgDatabase, tmp_path: Path) -> None:
    """A lost slot recreated (what the snapshot run does first, ``ensure_slot``) with the tables not yet
    copied again (a snapshot run that stopped there): the new slot lacks every change before it."""
    config, destination = drained(pg, tmp_path)
    pg.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
    changes(pg, "lost")
    record_created(config, None, ensure_slot(config.postgres.dsn, SLOT))
    created = slot_position(pg)
    assert SlotGuard(config.delta.root, SLOT, None).read() == SlotRecord(created, (None, created))

    assert refused_drain(config, destination, pg) == (
        f'replication slot "{SLOT}" was created anew at {created}, after tables were copied for the slot it'
        " replaces; nothing was applied or confirmed: re-snapshot every table: run the pgcdc_resnapshot job with"
        f" no table list (every table missed those changes; 3 of 3 still hold a copy from before {created}:"
        " public.acct, public.events, public.pairs); give any other consumer a slot of its own"
    )
    snapshot_tables(config, destination)
    changes(pg, "after")
    run_incremental(config, destination)
    assert_exact(pg, destination, config)


def test_a_re_snapshot_in_key_ranges_drains_through_the_gap_and_closes_it(pg: PgDatabase, tmp_path: Path) -> None:
    """A table copied in key ranges is re-snapshotted by drains that hold the slot (one range each):
    they go on while the gap is open (they are the re-snapshot), and the gap stays until every table is copied."""
    pg.execute(DDL)
    heap = pg.execute("SELECT pg_relation_size('acct')")[0][0]
    config = parse_config(
        {
            "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")},
            "snapshot": {"chunked_above_mb": 0, "key_chunk_mb": heap / 2**20 / 2.5},  # three ranges
        }
    )  # fmt: skip
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    changes(pg, "first")
    run_incremental(config, destination)
    recorded = slot_position(pg)
    changes(pg, "skipped")
    advance(pg, config, tmp_path)
    moved = slot_position(pg)

    (acct,) = snapshot_tables(config, destination, [TableName("public", "acct")])
    assert acct.key_ranges and acct.chunks == 3
    assert slot_position(pg) > moved  # the walk's drains confirmed, recording each position first
    assert SlotGuard(config.delta.root, SLOT, None).read() == SlotRecord(slot_position(pg), (recorded, moved))
    assert refused_drain(config, destination, pg) == expected_refusal(recorded, moved, "public.events, public.pairs", 2)

    changes(pg, "during")
    snapshot_tables(config, destination)
    changes(pg, "after")
    run_incremental(config, destination)
    assert SlotGuard(config.delta.root, SLOT, None).read() == SlotRecord(slot_position(pg))
    assert_exact(pg, destination, config)


def test_a_slot_moved_between_the_check_and_the_stream_start_is_refused_unread(pg: PgDatabase, tmp_path: Path) -> None:
    """The drain compares the slot with the record before its stream starts; the stream's start
    compares again (the slot is held from then on), so a move in between confirms nothing either."""
    config, _ = drained(pg, tmp_path)
    checked = slot_position(pg)
    changes(pg, "in between")
    advance(pg, config, tmp_path)
    moved = slot_position(pg)
    with ReplicationConnection(pg.dsn, application_name="pgcdc_incremental") as rc:
        stream = ReplicationStream(rc)
        with pytest.raises(SlotError) as refused:
            start_streaming(stream, SLOT, PgOutputOptions(["pub"], streaming="on"), checked)
        assert not stream.streaming
    assert str(refused.value) == (
        f'replication slot "{SLOT}" moved from {checked} to {moved} while this drain started, by another consumer'
        " of the slot; nothing was applied or confirmed: run the drain again: it names the fix"
    )
    assert slot_position(pg) == moved
