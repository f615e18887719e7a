"""Whole runs against the in-memory destination: real PostgreSQL (15 and 18), no engine.

The snapshot run and the incremental run receive their destination, so the same runs that write
Delta through Spark in production write :class:`~resources.testing.memory_destination.InMemoryDestination`
here: every write and every read of the tables (snapshot commits, key-range replacements, MERGEs,
appends, FULL rewrites, the tables' logs) goes through the seam. The pgcdc state table is written by
delta-rs under the local ``delta.root``, as in production. Each test ends with the in-memory tables
equal to PostgreSQL's, row for row with multiplicity.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.compute as pc

from resources.config import parse_config, PgcdcConfig
from resources.delta.markers import LSN_COLUMN
from resources.delta.state_table import read_state, state_path
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.reconcile import reconcile
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from tests.support.postgres import PgDatabase

SLOT = "pgcdc_memory_slot"
TABLES = ("acct", "events", "pairs")

DDL = """
CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance double precision);
CREATE TABLE events (kind text, n integer);
CREATE TABLE pairs (a integer, b text);
ALTER TABLE pairs REPLICA IDENTITY FULL;
INSERT INTO acct SELECT i, 'owner ' || i, i * 1.5 FROM generate_series(1, 400) i;
INSERT INTO events VALUES ('a', 1), ('a', 1), ('b', 2);
INSERT INTO pairs VALUES (1, 'x'), (1, 'x'), (2, 'y');
CREATE PUBLICATION pub FOR TABLE acct, events, pairs;
"""

CHANGES = """
UPDATE acct SET balance = balance + 1 WHERE id % 7 = 0;
DELETE FROM acct WHERE id % 11 = 0;
UPDATE acct SET id = id + 1000 WHERE id < 4;
INSERT INTO acct VALUES (2000, NULL, NULL), (2001, 'new', -1);
UPDATE acct SET owner = 'moved again' WHERE id = 1001;
INSERT INTO events VALUES ('c', 3), ('a', 1);
UPDATE pairs SET b = 'z' WHERE ctid = (SELECT min(ctid) FROM pairs WHERE a = 1);
INSERT INTO pairs VALUES (2, 'y');
"""


def config_for(pg: PgDatabase, lake: Path, **snapshot: float) -> PgcdcConfig:
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": SLOT,
            "delta": {"root": str(lake)},
            "snapshot": snapshot,
        }
    )


def memory_rows(destination: InMemoryDestination, config: PgcdcConfig, table: str) -> Counter[tuple]:
    """The table's rows in ``destination``, PostgreSQL's columns only (no LSN or bucket column)."""
    data = destination.tables[config.table_path("public", table)]
    names = [name for name in data.column_names if not name.startswith("_pgcdc_")]
    return Counter(tuple(row[name] for name in names) for row in data.select(names).to_pylist())


def postgres_rows(pg: PgDatabase, table: str) -> Counter[tuple]:
    return Counter(pg.execute(f"SELECT * FROM {table}"))


def assert_same(pg: PgDatabase, destination: InMemoryDestination, config: PgcdcConfig) -> None:
    for table in TABLES:
        assert memory_rows(destination, config, table) == postgres_rows(pg, table), table


def test_a_whole_snapshot_and_incremental_runs_against_the_in_memory_destination(
    pg: PgDatabase, tmp_path: Path
) -> None:
    pg.execute(DDL)
    config = config_for(pg, tmp_path / "lake")
    destination = InMemoryDestination()

    results = snapshot_tables(config, destination)
    assert [str(result.table) for result in results] == [f"public.{table}" for table in TABLES]
    assert [result.rows for result in results] == [400, 3, 3]
    assert_same(pg, destination, config)
    snapshotted = read_state(state_path(config.delta.root, SLOT))
    assert sorted(snapshotted) == [f"public.{table}" for table in TABLES]

    pg.execute(CHANGES)
    drained = run_incremental(config, destination)
    assert_same(pg, destination, config)
    acct = drained.tables["public.acct"]
    assert (acct.inserted, acct.deleted) == (2, 36)  # a key change is an update; 36 multiples of 11 up to 396
    assert drained.tables["public.events"].inserted == 2
    assert drained.confirmed_flush_lsn >= drained.end_lsn

    pg.execute("TRUNCATE events; INSERT INTO events VALUES ('after', 9); DELETE FROM pairs WHERE a = 2")
    again = run_incremental(config, destination)
    assert again.tables["public.events"].truncates == 1
    assert_same(pg, destination, config)
    idle = run_incremental(config, destination)
    assert idle.changes == 0 and idle.confirmed_flush_lsn >= again.confirmed_flush_lsn
    assert_same(pg, destination, config)
    # Without catalog:, nothing is registered and no registration is recorded (tests/test_catalog_names.py has it set).
    assert destination.catalog == {} and not (tmp_path / "lake" / "_pgcdc" / "catalog").exists()
    assert not drained.unregistered and not any(result.catalog_name or result.catalog_refusal for result in results)

    # Reconciliation reads the tables through the destination too: equal, then one row lost.
    pg.execute("UPDATE acct SET owner = 'before reconcile' WHERE id = 5")
    checked = reconcile(config, destination, range_rows=50)
    assert sorted(checked.tables) == [f"public.{table}" for table in TABLES] and not checked.skipped
    assert all(outcome.passed for outcome in checked.tables.values())
    assert_same(pg, destination, config)  # the drain up to the reconciliation point applied the update
    path = config.table_path("public", "acct")
    kept = destination.tables[path].filter(pc.not_equal(destination.tables[path].column("id"), 6))
    destination.write_snapshot(kept, kept.schema, path, destination.commits[path][-1] or "")
    lost = reconcile(config, destination, range_rows=50).tables["public.acct"]
    assert not lost.passed and (lost.postgres_rows, lost.delta_rows) == (lost.delta_rows + 1, lost.delta_rows)
    assert lost.differing_keys == ["6"]


def test_a_snapshot_in_key_ranges_and_its_re_snapshot_against_the_in_memory_destination(
    pg: PgDatabase, tmp_path: Path
) -> None:
    pg.execute(DDL)
    heap = pg.execute("SELECT pg_relation_size('acct')")[0][0]
    config = config_for(pg, tmp_path / "lake", chunked_above_mb=0, key_chunk_mb=heap / 2**20 / 3.5)  # four ranges
    destination = InMemoryDestination()

    (acct,) = snapshot_tables(config, destination, [TableName("public", "acct")])
    assert acct.key_ranges and acct.chunks == 4 and acct.rows == 400
    snapshot_tables(config, destination, [TableName("public", "events"), TableName("public", "pairs")])
    assert_same(pg, destination, config)
    path = config.table_path("public", "acct")
    log = destination.read_table_log(path, None)
    assert log.chunks is not None and log.chunks.complete and log.snapshot_lsn == acct.snapshot_lsn

    pg.execute(CHANGES)
    run_incremental(config, destination)
    assert_same(pg, destination, config)

    # A re-snapshot in place: each range replaced on its own, the others drained as before.
    pg.execute("UPDATE acct SET owner = 'during' WHERE id % 5 = 0")
    (again,) = snapshot_tables(config, destination, [TableName("public", "acct")])
    assert again.key_ranges and again.snapshot_lsn > acct.snapshot_lsn
    assert_same(pg, destination, config)
    lsns = destination.tables[path].column(LSN_COLUMN).to_pylist()
    assert min(lsns) >= int(acct.snapshot_lsn)  # every row copied again or changed since the first snapshot
