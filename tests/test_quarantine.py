"""One table's fault stays in that table: the drain applies every other table, the slot moves on, the
table is quarantined with its cause and fix, later drains skip it, and a re-snapshot restores it exactly.

Real PostgreSQL (15 and 18); the in-memory destination (the same runs, no engine) except where the
engine is what refuses.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from resources.cdc.schema import ChangeValueError, SchemaChangeError
from resources.config import parse_config, PgcdcConfig
from resources.names import TableName
from resources.runs.incremental import run_incremental
from resources.runs.quarantine import read_quarantines
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from tests.support.postgres import PgDatabase

SLOT = "pgcdc_quarantine_slot"
GOOD = ("acct", "events", "pairs")

DDL = """
CREATE TABLE acct (id bigint PRIMARY KEY, owner text);
CREATE TABLE events (kind text, n integer);
CREATE TABLE pairs (a integer, b text);
ALTER TABLE pairs REPLICA IDENTITY FULL;
CREATE TABLE due (id int PRIMARY KEY, due date, n int);
INSERT INTO acct SELECT i, 'owner ' || i FROM generate_series(1, 50) i;
INSERT INTO events VALUES ('a', 1), ('a', 1);
INSERT INTO pairs VALUES (1, 'x'), (1, 'x');
INSERT INTO due SELECT i, date '2026-01-01' + i, i FROM generate_series(1, 20) i;
CREATE PUBLICATION pub FOR TABLE acct, events, pairs, due;
"""


def round_of_changes(pg: PgDatabase, n: int) -> None:
    """Changes to every good table, several transactions, around the poisoned one."""
    pg.execute(
        f"""
        UPDATE acct SET owner = 'round {n}' WHERE id % 3 = {n % 3};
        INSERT INTO acct VALUES ({1000 + n}, 'new {n}');
        INSERT INTO events VALUES ('round', {n}), ('round', {n});
        INSERT INTO pairs VALUES ({n}, 'y');
        UPDATE due SET due = due + 1 WHERE id = 5;
        """
    )


def config_for(pg: PgDatabase, lake: Path, on_table_error: str = "quarantine") -> PgcdcConfig:
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": SLOT,
            "delta": {"root": str(lake)},
            "on_table_error": on_table_error,
        }
    )


def rows(destination: InMemoryDestination, config: PgcdcConfig, table: str) -> Counter[tuple]:
    data = destination.tables[config.table_path("public", table)]
    names = [name for name in data.column_names if not name.startswith("_pgcdc_")]
    return Counter(tuple(row[name] for name in names) for row in data.select(names).to_pylist())


def assert_exact(
    pg: PgDatabase, destination: InMemoryDestination, config: PgcdcConfig, tables: tuple[str, ...]
) -> None:
    for table in tables:
        assert rows(destination, config, table) == Counter(pg.execute(f"SELECT * FROM {table}")), table


def slot_position(pg: PgDatabase) -> str:
    ((position,),) = pg.execute(
        f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
    )
    return str(position)


POISONS = {
    "infinity": (
        "INSERT INTO due VALUES (100, 'infinity', 1)",
        ChangeValueError,
        "due",
        "UPDATE due SET due = NULL WHERE id = 100",
    ),
    "retyped": (
        "ALTER TABLE due ALTER COLUMN n TYPE text; UPDATE due SET n = 'x' WHERE id = 1",
        SchemaChangeError,
        "n",
        None,
    ),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_table_is_set_aside_and_the_others_flow(pg: PgDatabase, tmp_path: Path, poison: str) -> None:
    statement, kind, column, repair = POISONS[poison]
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)

    round_of_changes(pg, 1)
    pg.execute(statement)
    round_of_changes(pg, 2)
    first = run_incremental(config, destination)
    assert first.newly_quarantined == ["public.due"] and list(first.quarantined) == ["public.due"]
    assert_exact(pg, destination, config, GOOD)
    assert slot_position(pg) == str(first.confirmed_flush_lsn) and first.confirmed_flush_lsn >= first.end_lsn
    quarantine = read_quarantines(config, destination.lake)["public.due"]
    assert quarantine == first.quarantined["public.due"]
    assert kind.__name__ and (quarantine.column == column or kind is SchemaChangeError)
    assert "re-snapshot" in quarantine.fix and "pgcdc_resnapshot" in quarantine.fix
    assert quarantine.lsn <= first.end_lsn and quarantine.after == first.end_lsn
    assert "\n" not in quarantine.describe()

    # Later drains skip the table's changes, say so, and succeed; the other tables stay exact.
    round_of_changes(pg, 3)
    said: list[str] = []
    second = run_incremental(config, destination, log=said.append)
    assert second.newly_quarantined == [] and list(second.quarantined) == ["public.due"]
    assert any("public.due" in line and "skipped" in line for line in said), said
    assert_exact(pg, destination, config, GOOD)

    # The cause fixed in PostgreSQL, a re-snapshot of the table lifts the quarantine and restores it.
    if repair:
        pg.execute(repair)
    snapshot_tables(config, destination, [TableName("public", "due")])
    assert read_quarantines(config, destination.lake) == {}
    round_of_changes(pg, 4)
    third = run_incremental(config, destination)
    assert third.quarantined == {} and third.newly_quarantined == []
    assert_exact(pg, destination, config, (*GOOD, "due"))


def test_a_lost_record_removal_is_lifted_by_the_drain(pg: PgDatabase, tmp_path: Path) -> None:
    """The table's own log decides: a record left beside a re-snapshot (a crash before its removal) is lifted."""
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    pg.execute("INSERT INTO due VALUES (100, 'infinity', 1)")
    first = run_incremental(config, destination)
    kept = read_quarantines(config, destination.lake)
    assert list(kept) == ["public.due"] == first.newly_quarantined
    pg.execute("DELETE FROM due WHERE id = 100")
    snapshot_tables(config, destination, [TableName("public", "due")])
    from resources.runs.quarantine import record_quarantine

    record_quarantine(config, kept["public.due"], destination.lake)  # as if the snapshot's removal was lost
    round_of_changes(pg, 1)
    again = run_incremental(config, destination)
    assert again.lifted == ["public.due"] and again.quarantined == {}
    assert read_quarantines(config, destination.lake) == {}
    assert_exact(pg, destination, config, (*GOOD, "due"))


def test_on_table_error_stop_fails_the_drain_and_confirms_nothing_past_it(pg: PgDatabase, tmp_path: Path) -> None:
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake", on_table_error="stop")
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    before = slot_position(pg)
    pg.execute("INSERT INTO due VALUES (100, 'infinity', 1)")
    with pytest.raises(ChangeValueError, match=r"public\.due.*infinity"):
        run_incremental(config, destination)
    assert slot_position(pg) == before
    assert read_quarantines(config, destination.lake) == {}
