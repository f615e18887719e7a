"""Big-table snapshots read as ctid ranges by parallel sessions under one exported snapshot.

Real PostgreSQL 15 and 18, the embedded Sail engine, Delta read back by delta-rs: the parallel
read must give the same table as one COPY, row for row with multiplicity, also while other
sessions write, and for keyless and partitioned tables.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.errors import ConfigurationError, SnapshotError
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres import connections
from resources.postgres.catalog import ColumnInfo, TableInfo, TableName
from resources.postgres.connections import connect
from resources.postgres.ctid_copy import block_ranges
from resources.postgres.preflight import ensure_slot
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_table, snapshot_tables
from resources.testing.verify import compare_table, delta_rows
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.marker_reads import read_snapshot_lsn
from tests.support.memory_child import measured
from tests.support.postgres import PgDatabase
from tests.support.snapshot_checks import assert_md5_payloads

pytest_plugins = ["tests.support.spark_fixtures"]

SLOT = "pgcdc_slot"


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("blocks", [0, 1, 2, 127, 128, 129, 1000, 1001, 4097])
@pytest.mark.parametrize("chunk", [1, 3, 128, 5000])
def test_block_ranges_partition_every_tuple_id(blocks: int, chunk: int) -> None:
    ranges = block_ranges(blocks, chunk)
    assert ranges[0][0] == 0 and ranges[-1][1] is None  # nothing before, nothing after is left out
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start  # adjacent, so disjoint and gap-free
    sizes = [end - start for start, end in ranges[:-1] if end is not None]
    assert all(size > 0 for size in sizes)
    assert len(ranges) == max(1, -(-blocks // chunk))
    assert all(size <= chunk for size in sizes) and max(sizes, default=0) - min(sizes, default=0) <= 1


def test_ranged_copy_query_keeps_the_row_filter_and_qualifies_operators() -> None:
    column = ColumnInfo("id", 1, 20, -1, "bigint", True, True)
    info = TableInfo(1, TableName("public", "t"), "r", "d", (column,), "(id > 5) OR (id < 2)")
    assert info.copy_query((128, 256)) == (
        'COPY (SELECT "id" FROM ONLY "public"."t" WHERE ((id > 5) OR (id < 2))'
        " AND ctid OPERATOR(pg_catalog.>=) '(128,0)'::pg_catalog.tid"
        " AND ctid OPERATOR(pg_catalog.<) '(256,0)'::pg_catalog.tid) TO STDOUT WITH (FORMAT text)"
    )
    assert info.copy_query((256, None)).endswith(
        "AND ctid OPERATOR(pg_catalog.>=) '(256,0)'::pg_catalog.tid) TO STDOUT WITH (FORMAT text)"
    )


@pytest.mark.parametrize(("key", "value"), [("workers", 0), ("chunk_mb", 0), ("workers", "many")])
def test_bad_chunk_settings_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"'snapshot.{key}'"):
        parse_config({"postgres": {"dsn": "host=x"}, "publication": "p", "snapshot": {key: value}})


# --------------------------------------------------------------------------- against PostgreSQL


def _content(path: Path) -> Counter[tuple]:
    """The Delta table's rows without pgcdc's columns, with multiplicity."""
    schema, rows = delta_rows(str(path))
    names = [name for name in schema.names if not name.startswith("_pgcdc_")]
    return Counter(tuple(repr(row[name]) for name in names) for row in rows)


def test_parallel_ctid_chunks_give_the_table_one_copy_gives(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    pg.execute(
        """
        CREATE TABLE narrow (id bigint PRIMARY KEY, v text, f float8, at timestamptz);
        INSERT INTO narrow SELECT g, md5(g::text) || repeat('v', 400), g / 3.0,
            timestamptz '2024-01-01 00:00Z' + g * interval '1 s' FROM generate_series(1, 6000) g;
        DELETE FROM narrow WHERE id % 11 = 0;  -- holes, and dead tuples in every range
        UPDATE narrow SET v = 'moved ' || id WHERE id % 13 = 0;  -- new versions at the end of the heap
        CREATE TABLE dups (word text, n int);  -- keyless: the same row many times, across ranges
        INSERT INTO dups SELECT 'w' || (g % 300) || repeat('d', 400), g % 7 FROM generate_series(1, 5000) g;
        INSERT INTO dups VALUES (NULL, NULL), (NULL, NULL);
        CREATE TABLE measures (id int, region text, v float8, pad text) PARTITION BY LIST (region);
        CREATE TABLE measures_eu PARTITION OF measures FOR VALUES IN ('eu');
        CREATE TABLE measures_us PARTITION OF measures FOR VALUES IN ('us');
        INSERT INTO measures SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, g / 4.0, repeat('x', 400)
            FROM generate_series(1, 9000) g;
        CREATE PUBLICATION via_root FOR TABLE narrow, dups, measures WITH (publish_via_partition_root = true);
        CREATE PUBLICATION via_leaves FOR TABLE measures;
        CREATE PUBLICATION filtered FOR TABLE narrow (id, v) WHERE (id % 5 <> 0);
        """
    )
    ensure_slot(pg.dsn, SLOT)
    published = {
        "via_root": ["narrow", "dups", "measures"],
        "via_leaves": ["measures_eu", "measures_us"],
        "filtered": ["narrow"],
    }
    for publication, tables in published.items():
        for name in tables:
            parallel = tmp_path / publication / f"{name}_parallel"
            split = snapshot_table(
                pg.dsn, publication, TableName("public", name), SparkDeltaDestination(spark, None), str(parallel),
                slot=SLOT, workers=3, chunk_mb=1,
            )  # fmt: skip
            assert split.chunks >= 2 and split.workers == min(3, split.chunks), (name, split.chunks)
            assert read_snapshot_lsn(spark, str(parallel)) == split.snapshot_lsn
            assert {row[LSN_COLUMN] for row in delta_rows(str(parallel))[1]} == {int(split.snapshot_lsn)}
            if publication != "via_leaves":  # the leaves are the root's rows again
                one = tmp_path / publication / f"{name}_one"
                single = snapshot_table(
                    pg.dsn,
                    publication,
                    TableName("public", name),
                    SparkDeltaDestination(spark, None),
                    str(one),
                    slot=SLOT,
                    workers=1,
                )
                assert (single.chunks, single.workers) == (1, 1)
                assert split.rows == single.rows and _content(parallel) == _content(one), name
            if publication == "filtered":  # what the row filter and column list publish, no more
                ((published_rows,),) = pg.execute("SELECT count(*) FROM narrow WHERE id % 5 <> 0")
                assert split.rows == published_rows and delta_rows(str(parallel))[0].names == [
                    "id",
                    "v",
                    LSN_COLUMN,
                    BUCKET_COLUMN,
                ]
                continue
            with connect(pg.dsn, application_name="test", session_settings=SESSION_SETTINGS) as conn:
                assert compare_table(conn, f"public.{name}", str(parallel)) == split.rows


def test_parallel_chunks_under_concurrent_writes_then_drains_are_exact(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    """Writers commit all through the snapshot; the drain then applies exactly the changes after the
    snapshot LSN. A worker whose snapshot were later than the slot's would see some of them and
    the keyless table, where every insert is an append, would end with duplicates."""
    pg.execute(
        """
        CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint, note text);
        INSERT INTO accounts SELECT g, 1000, repeat('n', 30) FROM generate_series(1, 40000) g;
        CREATE TABLE ledger (account bigint, amount bigint, note text);
        INSERT INTO ledger SELECT g % 1000, g % 97, repeat('l', 30) FROM generate_series(1, 40000) g;
        ALTER TABLE ledger REPLICA IDENTITY FULL;
        CREATE PUBLICATION pub FOR TABLE accounts, ledger;
        """
    )
    config = parse_config(
        {
            # accounts copy-on-write (the opt-out), ledger with deletion vectors (the default)
            "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
            "delta": {"root": str(tmp_path), "deletion_vectors_tables": {"public.accounts": False}},
            "snapshot": {"workers": 3, "chunk_mb": 1, "parallel_tables": 2},
        }
    )  # fmt: skip
    stop = threading.Event()
    committed = [0]

    def write() -> None:
        """pgbench-like transactions: move money between accounts, log it, now and then open or close one."""
        with pg.connect() as conn:
            n = 0
            while not stop.is_set():
                n += 1
                with conn.transaction():
                    conn.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (n * 7919 % 40000 + 1,))
                    conn.execute(
                        "UPDATE accounts SET balance = balance + 1, note = 'moved' WHERE id = %s",
                        (n * 104729 % 40000 + 1,),
                    )
                    conn.execute("INSERT INTO ledger VALUES (%s, 1, 'during')", (n % 1000,))
                    if n % 5 == 0:
                        conn.execute("INSERT INTO accounts VALUES (%s, 0, 'opened')", (100000 + n,))
                        conn.execute(
                            "DELETE FROM ledger WHERE ctid = (SELECT min(ctid) FROM ledger WHERE account = %s)",
                            (n % 1000,),
                        )
                    if n % 7 == 0:
                        conn.execute("DELETE FROM accounts WHERE id = %s", (n * 31 % 40000 + 1,))
                committed[0] = n

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while committed[0] < 20:  # writes are under way before the snapshot starts
            time.sleep(0.01)
        results = snapshot_tables(config, lake_destination(spark, config))
        during = committed[0]
    finally:
        stop.set()
        writer.join()
    assert [r.chunks >= 3 and r.workers == 3 for r in results] == [True, True]
    assert_deletion_vectors(config, {"public.accounts": False, "public.ledger": True})
    assert committed[0] > during > 20  # the writer was still committing while the copies ran
    run_incremental(config, lake_destination(spark, config), log=lambda line: None)
    with connect(pg.dsn, application_name="test", session_settings=SESSION_SETTINGS) as conn:
        assert compare_table(conn, "public.accounts", config.table_path("public", "accounts"), key=("id",)) > 40000
        assert compare_table(conn, "public.ledger", config.table_path("public", "ledger")) > 40000


#: What a snapshot's process in three ctid-chunk workers may add to its resident memory at its worst:
#: a few 1 MiB pieces per worker, what the writer gathers and delta-rs's Parquet writer (a row group of
#: 16 MiB of Arrow data per open file, and its runtime). Measured 2026-11-26: 179-195 MiB, more than
#: the 55 MB table: a fixed cost, which test_snapshot.py shows does not grow with the table (the
#: tracemalloc and Arrow-sampling figures it replaces said 10 MiB).
PARALLEL_PEAK_MIB = 256
#: The most Arrow's pool may hold at once: a few 1 MiB pieces per worker (read ahead, being parsed,
#: parsed ahead) and those delta-rs has taken. Measured 20-24 MiB: less than half the table.
PARALLEL_ARROW_MIB = 40


def test_parallel_chunks_copy_with_bounded_memory(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    """Three workers over 4 MB ranges of a 55 MB heap, in a child process that reports its peak resident
    memory over its baseline and Arrow's pool maximum (tests/support/memory_child.py), against a stated bound."""
    rows = 50_000
    pg.execute(
        f"""
        CREATE TABLE big (id int PRIMARY KEY, payload text);
        INSERT INTO big SELECT g, repeat(md5(g::text), 31) FROM generate_series(1, {rows}) g;
        CREATE PUBLICATION pub FOR TABLE big;
        """
    )  # 1 KB rows stay inline: a heap of about 55 MB, read as 4 MB ranges
    ensure_slot(pg.dsn, SLOT)
    memory = measured("snapshot", pg.dsn, "pub", "public.big", str(tmp_path / "big"), SLOT, str(1024 * 1024), "3", "4")
    assert memory["rows"] == rows and memory["chunks"] >= 8 and memory["workers"] == 3
    assert memory["peak_mib"] - memory["baseline_mib"] < PARALLEL_PEAK_MIB, memory
    assert memory["arrow_max_mib"] < PARALLEL_ARROW_MIB, memory
    assert memory["progress_chunks"] == [memory["chunks"]] * len(memory["progress_chunks"])
    assert memory["last_chunks_done"] >= memory["chunks"] - memory["workers"] and memory["last_eta_s"] is not None
    assert f"ctid chunks {memory['last_chunks_done']}/{memory['chunks']} done, about" in memory["last_progress"]
    assert memory["mode"] == f"{memory['chunks']} ctid chunks on 3 sessions under one snapshot"
    assert_md5_payloads(str(tmp_path / "big"), rows)
    with psycopg.connect(pg.dsn) as conn:
        (temporary,) = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE temporary").fetchone() or (1,)
    assert temporary == 0


def test_a_refused_value_in_one_range_fails_the_table_and_leaves_nothing(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    pg.execute(
        """
        CREATE TABLE prices (id int PRIMARY KEY, amount numeric(10,2), pad text);
        INSERT INTO prices SELECT g, g / 4.0, repeat('p', 400) FROM generate_series(1, 4000) g;
        UPDATE prices SET amount = 'NaN' WHERE id = 3999;  -- a new version near the heap's end
        CREATE PUBLICATION pub FOR TABLE prices;
        """
    )
    ensure_slot(pg.dsn, SLOT)
    assert pg.execute("SELECT pg_relation_size('prices') > 1024 * 1024")[0][0]  # more than one 1 MB range
    path = tmp_path / "prices"
    with pytest.raises(SnapshotError) as refused:
        snapshot_table(
            pg.dsn,
            "pub",
            TableName("public", "prices"),
            SparkDeltaDestination(spark, None),
            str(path),
            slot=SLOT,
            workers=3,
            chunk_mb=1,
        )
    assert "public.prices" in str(refused.value) and "'NaN'" in str(refused.value) and "amount" in str(refused.value)
    assert not (path / "_delta_log").exists() and read_snapshot_lsn(spark, str(path)) is None
    leftovers = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgcdc_snapshot'"
    deadline = time.monotonic() + 10
    while pg.execute(leftovers)[0][0] and time.monotonic() < deadline:  # backends exit just after their client
        time.sleep(0.05)
    assert pg.execute(leftovers)[0][0] == 0
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE temporary")[0][0] == 0


PLANTED = """
    CREATE SCHEMA evil;
    CREATE FUNCTION evil.planted() RETURNS boolean LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'planted object called'; END$$;
    CREATE FUNCTION evil.pg_export_snapshot() RETURNS text LANGUAGE sql AS $$SELECT evil.planted()::text$$;
    CREATE FUNCTION evil.pg_relation_size(oid) RETURNS bigint LANGUAGE sql AS $$SELECT evil.planted()::int::bigint$$;
    CREATE FUNCTION evil.pg_relation_size(regclass) RETURNS bigint LANGUAGE sql AS $$SELECT evil.planted()::int::bigint$$;
    CREATE FUNCTION evil.current_setting(text) RETURNS text LANGUAGE sql AS $$SELECT evil.planted()::text$$;
    CREATE FUNCTION evil.tid_compare(tid, tid) RETURNS boolean LANGUAGE sql AS $$SELECT evil.planted()$$;
    CREATE OPERATOR evil.>= (LEFTARG = tid, RIGHTARG = tid, FUNCTION = evil.tid_compare);
    CREATE OPERATOR evil.< (LEFTARG = tid, RIGHTARG = tid, FUNCTION = evil.tid_compare);
    CREATE DOMAIN evil.tid AS pg_catalog.tid CHECK (evil.planted());
"""


def test_parallel_chunks_call_nothing_a_search_path_could_plant(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new SQL (heap size, snapshot export and import, ctid ranges) is pg_catalog-qualified: in
    sessions that search a schema of look-alikes first, none of them runs."""
    pg.execute(
        PLANTED
        + """
        CREATE TABLE public.wide_rows (id int PRIMARY KEY, pad text);
        INSERT INTO public.wide_rows SELECT g, repeat('w', 400) FROM generate_series(1, 4000) g;
        CREATE PUBLICATION pub FOR TABLE public.wide_rows;
        """
    )
    ensure_slot(pg.dsn, SLOT)
    monkeypatch.setattr(connections, "SEARCH_PATH_SETTINGS", {"search_path": "evil, pg_catalog, public"})
    with pg.connect() as probe:  # the trap works: unqualified, the look-alikes win
        probe.execute("SET search_path = evil, pg_catalog, public")
        with pytest.raises(psycopg.errors.RaiseException, match="planted"):
            probe.execute("SELECT count(*) FROM wide_rows WHERE ctid >= '(1,0)'")
    result = snapshot_table(
        pg.dsn,
        "pub",
        TableName("public", "wide_rows"),
        SparkDeltaDestination(spark, None),
        str(tmp_path / "w"),
        slot=SLOT,
        workers=2,
        chunk_mb=1,
    )
    assert result.chunks >= 2 and result.workers == 2
    with connect(pg.dsn, application_name="test", session_settings=SESSION_SETTINGS) as conn:
        assert compare_table(conn, "public.wide_rows", str(tmp_path / "w")) == 4000
