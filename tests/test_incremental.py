"""Incremental runs against real PostgreSQL 15 and 18 and the embedded Sail engine.

Every test snapshots its tables with ``resources.runs.snapshot``, changes them in PostgreSQL,
drains the slot with ``run_incremental`` and ends with the oracle: the Delta table, read
with delta-rs, equals the PostgreSQL table value for value.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import deltalake
import psycopg
import pytest
import yaml
from pyspark.sql import SparkSession

from resources.cdc.schema import SchemaChangeError
from resources.config import parse_config, PgcdcConfig
from resources.delta.merge import KEY_LIST_MOST_VALUES
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.delta.state_table import read_state, state_path
from resources.errors import ConfigurationError, SlotError
from resources.lsn import LSN
from resources.pgoutput.options import PgOutputOptions
from resources.postgres.catalog import TableName
from resources.postgres.replication import ReplicationConnection
from resources.postgres.stream import ReplicationStream
from resources.runs.snapshot import snapshot_tables
from tests.support.incremental_runs import (
    assert_refused_with_the_resnapshot_fix,
    drain,
    path_of,
    run_child,
    same,
    settings,
    setup,
    SLOT,
    slot_confirmed,
)
from tests.support.memory_child import measured
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


def delta_version(config: PgcdcConfig, table: str) -> int:
    return deltalake.DeltaTable(path_of(config, table)).version()


# --------------------------------------------------------------------------- DML


def test_inserts_updates_deletes_of_many_types(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(10,2), big bigint, at timestamptz,
                            day date, ok boolean, doc jsonb, tags int[], raw numeric, blob bytea);
        INSERT INTO items SELECT g, 'n' || g, g * 1.25, g * 10000000000, '2024-01-01'::timestamptz + g * interval '1 hour',
                                 '2024-01-01'::date + g, g % 2 = 0, jsonb_build_object('g', g), ARRAY[g, NULL], g / 7.0, '\\x00ff'
                          FROM generate_series(1, 50) g;
        CREATE PUBLICATION pub FOR TABLE items;
    """,
    )
    pg.execute("""
        INSERT INTO items SELECT g, 'new' || g, NULL, NULL, 'infinity', NULL, NULL, '[1, "x"]', '{}', 'NaN', NULL
          FROM generate_series(51, 60) g;
        UPDATE items SET name = 'upd', price = 99.99, tags = ARRAY[7] WHERE id % 5 = 0;
        DELETE FROM items WHERE id % 7 = 0;
    """)
    result = drain(config, spark)
    assert same(pg, config, "public.items") == 60 - 8
    stats = result.tables["public.items"]
    assert (stats.inserted, stats.updated, stats.deleted, stats.truncates) == (10, 12, 8, 0)
    assert result.confirmed_flush_lsn == slot_confirmed(pg) >= result.end_lsn
    assert result.lag_bytes_before > 0 and result.transactions == 1


def test_key_change_and_many_changes_to_one_key_in_one_batch(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 10) g;
        CREATE PUBLICATION pub FOR TABLE t;
    """,
    )
    with pg.connect() as conn:
        conn.execute("UPDATE t SET id = 100 WHERE id = 1")  # key change: row 1 must vanish
        conn.execute("UPDATE t SET id = 2000, v = 'moved' WHERE id = 2")
        conn.execute("INSERT INTO t VALUES (2, 'reused key')")  # old key reused after the move
        for step in range(5):  # one key changed five times, in five transactions
            conn.execute("UPDATE t SET v = %s WHERE id = 3", (f"step {step}",))
        conn.execute("INSERT INTO t VALUES (11, 'a')")
        conn.execute("UPDATE t SET v = 'b' WHERE id = 11")
        conn.execute("DELETE FROM t WHERE id = 11")  # inserted, updated and deleted in one batch
        conn.execute("INSERT INTO t VALUES (12, 'x')")
        conn.execute("DELETE FROM t WHERE id = 12")
        conn.execute("INSERT INTO t VALUES (12, 'back')")  # deleted then re-inserted
        conn.execute("UPDATE t SET id = 13 WHERE id = 12")
        conn.execute("UPDATE t SET id = 12 WHERE id = 13")  # moved away and back
    result = drain(config, spark)
    assert same(pg, config, "public.t") == 12
    assert result.tables["public.t"].updated == 10


def test_unchanged_toast_keeps_the_delta_value(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE docs (id int PRIMARY KEY, body text, n int);
        ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
        INSERT INTO docs SELECT g, repeat(md5(g::text), 400), 0 FROM generate_series(1, 6) g;
        CREATE PUBLICATION pub FOR TABLE docs;
    """,
    )
    # The values exist only in Delta (snapshot): every update below sends body as unchanged TOAST.
    pg.execute("UPDATE docs SET n = 1 WHERE id IN (1, 2)")
    pg.execute("UPDATE docs SET id = 20, n = 2 WHERE id = 3")  # key change: body comes from Delta's row 3
    pg.execute("UPDATE docs SET n = 3 WHERE id = 20")  # ... and again, in the same batch
    pg.execute("INSERT INTO docs VALUES (7, repeat('z', 9000), 0)")
    pg.execute("UPDATE docs SET n = 4 WHERE id = 7")  # folded onto the insert in the same batch
    pg.execute("UPDATE docs SET id = 70 WHERE id = 7")  # key change after an insert in the batch
    drain(config, spark)
    assert same(pg, config, "public.docs") == 7
    pg.execute("UPDATE docs SET n = 5")
    pg.execute("UPDATE docs SET id = id + 100 WHERE id IN (4, 70)")
    drain(config, spark, max_chunk_changes=3)
    assert same(pg, config, "public.docs") == 7
    # A row moved onto a key whose row the same batch deletes keeps its own value, not the deleted one's.
    pg.execute("DELETE FROM docs WHERE id = 1")
    pg.execute("UPDATE docs SET id = 1 WHERE id = 2")
    drain(config, spark)
    assert same(pg, config, "public.docs") == 6


def test_a_batch_of_more_keys_than_the_key_list_leaves_the_rows_between_them_alone(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A MERGE source with more keys than the key list takes bounds the target by the keys' range: the
    rows inside that range the batch does not name (every other key here, on both sides of each
    change, and negative keys below a batch's lowest) stay as they are, exactly."""
    config = setup(
        pg,
        tmp_path,
        spark,
        f"""
        CREATE TABLE spread (id bigint PRIMARY KEY, v text);
        INSERT INTO spread SELECT g, 'seed ' || g FROM generate_series(-50, {4 * KEY_LIST_MOST_VALUES}) g;
        CREATE PUBLICATION pub FOR TABLE spread;
    """,
    )
    with pg.connect() as conn:
        conn.execute(f"UPDATE spread SET v = 'odd' WHERE id % 2 = 1 AND id BETWEEN 1 AND {3 * KEY_LIST_MOST_VALUES}")
        conn.execute(f"DELETE FROM spread WHERE id % 6 = 0 AND id BETWEEN 300 AND {4 * KEY_LIST_MOST_VALUES}")
        conn.execute(
            f"INSERT INTO spread SELECT g, 'new' FROM generate_series({10 * KEY_LIST_MOST_VALUES}, {12 * KEY_LIST_MOST_VALUES}, 3) g"
        )
        conn.execute("UPDATE spread SET id = -id - 1000 WHERE id BETWEEN 700 AND 703")
    drain(config, spark)
    assert same(pg, config, "public.spread") == pg.execute("SELECT count(*) FROM spread")[0][0]
    ((odd, seeds),) = pg.execute(
        "SELECT count(*) FILTER (WHERE v = 'odd'), count(*) FILTER (WHERE v LIKE 'seed %') FROM spread"
    )
    assert odd > KEY_LIST_MOST_VALUES and seeds > KEY_LIST_MOST_VALUES  # both kinds of row in the range


def test_truncate_applies_in_order(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE a (id int PRIMARY KEY, v text);
        CREATE TABLE b (id int PRIMARY KEY);
        INSERT INTO a SELECT g, 'old' FROM generate_series(1, 5) g;
        INSERT INTO b VALUES (1), (2);
        CREATE PUBLICATION pub FOR TABLE a, b;
    """,
    )
    with pg.connect() as conn:
        conn.execute("INSERT INTO a VALUES (6, 'before')")
        conn.execute("TRUNCATE a, b")
        conn.execute("INSERT INTO a VALUES (1, 'after'), (7, 'after')")
        conn.execute("INSERT INTO b VALUES (3)")
    result = drain(config, spark)
    assert same(pg, config, "public.a") == 2 and same(pg, config, "public.b") == 1
    assert result.tables["public.a"].truncates == 1 and result.tables["public.b"].truncates == 1


# --------------------------------------------------------------------------- schema changes


def test_added_dropped_and_widened_columns(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE s (id int PRIMARY KEY, small int2, name varchar(5), gone text, amount numeric(6,2));
        INSERT INTO s VALUES (1, 1, 'a', 'g1', 1.50), (2, 2, 'b', 'g2', 2.50);
        CREATE PUBLICATION pub FOR TABLE s;
    """,
    )
    with pg.connect() as conn:
        conn.execute("INSERT INTO s VALUES (3, 3, 'c', 'g3', 3.50)")
        conn.execute("ALTER TABLE s ADD COLUMN extra text")
        conn.execute("INSERT INTO s VALUES (4, 4, 'd', 'g4', 4.50, 'e4')")
        conn.execute("ALTER TABLE s DROP COLUMN gone")
        conn.execute("UPDATE s SET extra = 'e1' WHERE id = 1")
        conn.execute("INSERT INTO s VALUES (5, 5, 'e', 5.50, 'e5')")
        conn.execute("ALTER TABLE s ALTER COLUMN small TYPE int8, ALTER COLUMN name TYPE text")
        conn.execute("ALTER TABLE s ALTER COLUMN amount TYPE numeric(12,2)")
        conn.execute("INSERT INTO s VALUES (6, 9000000000, 'longer than five', 1234567890.12, 'e6')")
    drain(config, spark)
    assert same(pg, config, "public.s", extra_delta_columns=["gone"]) == 6
    table = delta_rs_rows(path_of(config, "public.s")).sort_by("id")
    # Dropped: kept in Delta; rows untouched since keep their value, rows written after the drop (1, 5, 6) hold NULL.
    assert table.column("gone").to_pylist() == [None, "g2", "g3", "g4", None, None]
    assert str(table.schema.field("small").type) == "int64"
    assert str(table.schema.field("amount").type) == "decimal128(12, 2)"


def test_added_columns_give_existing_delta_rows_what_postgres_gave_its_rows(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Fast defaults (pg_attribute.attmissingval) reach the rows already in Delta, typed through
    pgtypes, also for rows written earlier in the transaction that adds the column and for keyless
    tables; rows written after the ADD keep their own values; a column added again under the name
    of a dropped one (kept in Delta) is NULL in the old rows, as in PostgreSQL."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 3) g;
        CREATE TABLE k (body text);
        INSERT INTO k VALUES ('old');
        CREATE PUBLICATION pub FOR TABLE t, k;
    """,
    )
    with pg.connect() as conn:
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (4, 'v4')")
            conn.execute(
                "ALTER TABLE t ADD COLUMN n numeric(8,2) NOT NULL DEFAULT 1.5,"
                " ADD COLUMN ts timestamptz DEFAULT '2024-01-02 03:04:05+02', ADD COLUMN tags text[] DEFAULT '{a,\"b c\"}',"
                " ADD COLUMN plain int"
            )
            conn.execute("INSERT INTO t VALUES (5, 'v5', 2.25, NULL, '{z}', 7)")
        conn.execute("UPDATE t SET v = 'changed' WHERE id = 1")
        conn.execute("ALTER TABLE k ADD COLUMN flag bool DEFAULT true")
        conn.execute("INSERT INTO k VALUES ('new', false)")
        conn.execute("ALTER TABLE t DROP COLUMN v")
        conn.execute("UPDATE t SET plain = 1 WHERE id = 2")
        conn.execute("ALTER TABLE t ADD COLUMN v text")
        conn.execute("UPDATE t SET plain = 3 WHERE id = 3")
    drain(config, spark)
    assert same(pg, config, "public.t") == 5
    assert same(pg, config, "public.k", key=()) == 2
    table = delta_rs_rows(path_of(config, "public.t")).sort_by("id")
    assert [str(n) for n in table.column("n").to_pylist()] == ["1.50", "1.50", "1.50", "1.50", "2.25"]
    assert table.column("tags").to_pylist() == [["a", "b c"]] * 4 + [["z"]]
    assert table.column("v").to_pylist() == [None] * 5


def test_added_column_with_a_default_not_in_the_catalog_fails_with_the_resnapshot_fix(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A volatile default rewrites the table (no WAL row changes, no missing value): refuse, move nothing."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE r (id int PRIMARY KEY);
        INSERT INTO r VALUES (1);
        CREATE PUBLICATION pub FOR TABLE r;
    """,
    )
    start = slot_confirmed(pg)
    version = delta_version(config, "public.r")
    with pg.connect() as conn:
        conn.execute("ALTER TABLE r ADD COLUMN x float8 DEFAULT random()")
        conn.execute("INSERT INTO r VALUES (2, 0.5)")
    with pytest.raises(SchemaChangeError) as failure:
        drain(config.model_copy(update={"on_table_error": "stop"}), spark)
    message = str(failure.value)
    assert message.startswith(
        "column 'x' of public.r was added with a default that PostgreSQL wrote into the existing rows"
    )
    assert "pgcdc_resnapshot" in message and "\n" not in message
    assert slot_confirmed(pg) == start and delta_version(config, "public.r") == version
    quarantined = drain(config, spark)  # by default the table is set aside and the slot moves on
    assert quarantined.newly_quarantined == ["public.r"] and delta_version(config, "public.r") == version
    assert message in quarantined.quarantined["public.r"].describe()


def test_type_change_that_is_not_a_widening_fails_with_the_resnapshot_fix(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE c (id int PRIMARY KEY, code int);
        INSERT INTO c VALUES (1, 1);
        CREATE PUBLICATION pub FOR TABLE c;
    """,
    )
    assert_refused_with_the_resnapshot_fix(
        pg,
        config,
        spark,
        ["ALTER TABLE c ALTER COLUMN code TYPE text", "INSERT INTO c VALUES (2, 'two')"],
        "'code' of public.c changed type from int to text",
    )


def test_a_renamed_column_fails_with_the_resnapshot_fix_instead_of_losing_its_values(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """RENAME COLUMN keeps the column's attnum, so the renamed column stands where it stood, before
    columns Delta has: its existing values never reach the stream, and taking it for an added column
    would leave them NULL in Delta."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE r2 (id int PRIMARY KEY, v int, note text);
        INSERT INTO r2 VALUES (1, 10, 'a'), (2, 20, 'b');
        CREATE PUBLICATION pub FOR TABLE r2;
    """,
    )
    assert_refused_with_the_resnapshot_fix(
        pg,
        config,
        spark,
        ["ALTER TABLE r2 RENAME COLUMN v TO w", "INSERT INTO r2 VALUES (3, 30, 'c')"],
        "public.r2: column 'w' existed when the table was snapshotted (a RENAME COLUMN",
    )


# --------------------------------------------------------------------------- identities


def test_replica_identity_full_without_key(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE f (a int, b text, c numeric(8,3));
        ALTER TABLE f REPLICA IDENTITY FULL;
        ALTER TABLE f ALTER COLUMN b SET STORAGE EXTERNAL;
        INSERT INTO f VALUES (1, 'x', 1.5), (2, NULL, NULL), (3, repeat('big', 3000), 3);
        CREATE PUBLICATION pub FOR TABLE f;
    """,
    )
    with pg.connect() as conn:
        conn.execute("UPDATE f SET c = 2.25 WHERE a = 2")  # NULLs in the old row: matched null-safe
        conn.execute("UPDATE f SET a = 30 WHERE a = 3")  # b is unchanged TOAST: taken from the old row
        conn.execute("DELETE FROM f WHERE a = 1")
        conn.execute("INSERT INTO f VALUES (4, 'y', NULL)")
        conn.execute("UPDATE f SET b = 'z' WHERE a = 4")
    drain(config, spark)
    assert same(pg, config, "public.f", key=()) == 3


def test_keyless_table_appends_inserts_and_truncates(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE events (kind text, n int);
        INSERT INTO events VALUES ('old', 1);
        CREATE PUBLICATION pub FOR TABLE events;
    """,
    )
    with pg.connect() as conn:
        conn.execute("INSERT INTO events VALUES ('dup', 1), ('dup', 1)")
        conn.execute("TRUNCATE events")
        conn.execute("INSERT INTO events VALUES ('dup', 1), ('dup', 1), ('new', 2)")
    result = drain(config, spark)
    assert same(pg, config, "public.events", key=()) == 3
    assert result.tables["public.events"].inserted == 5 and result.tables["public.events"].truncates == 1


# --------------------------------------------------------------------------- streamed transactions


def test_streamed_transactions_committed_aborted_and_with_rolled_back_savepoint(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE big (id int PRIMARY KEY, pad text);
        INSERT INTO big VALUES (0, 'seed');
        CREATE PUBLICATION pub FOR TABLE big;
    """,
    )
    with pg.connect() as large, pg.connect() as small:
        with large.transaction():
            large.execute("INSERT INTO big SELECT g, repeat('p', 100) FROM generate_series(1, 4000) g")
            small.execute("INSERT INTO big VALUES (-1, 'interleaved, committed first')")
            large.execute("SAVEPOINT s1")
            large.execute("INSERT INTO big SELECT g, 'rolled back' FROM generate_series(4001, 7000) g")
            large.execute("UPDATE big SET pad = 'rolled back too' WHERE id <= 100")
            large.execute("ROLLBACK TO SAVEPOINT s1")
            large.execute("SAVEPOINT s2")
            large.execute("UPDATE big SET pad = 'kept' WHERE id <= 10")
            large.execute("RELEASE SAVEPOINT s2")
            large.execute("DELETE FROM big WHERE id BETWEEN 11 AND 20")
        with pytest.raises(psycopg.errors.RaiseException):
            with large.transaction():
                large.execute("INSERT INTO big SELECT g, repeat('a', 100) FROM generate_series(10001, 15000) g")
                large.execute("DO $$ BEGIN RAISE 'abort the streamed transaction'; END $$")
    result = drain(config, spark, max_chunk_changes=1500)
    assert same(pg, config, "public.big") == 3992
    assert result.tables["public.big"].inserted == 4001
    ((streamed_after,),) = pg.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (SLOT,))
    # The committed one was streamed. PostgreSQL 16+ does not stream a transaction it already
    # knows aborted when decoding it (here: decoded after the fact), 15 streams it and then aborts it.
    assert streamed_after >= (2 if pg.major < 16 else 1)


# --------------------------------------------------------------------------- snapshot boundaries


def test_changes_up_to_the_snapshot_lsn_are_skipped(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE first (id int PRIMARY KEY);
        INSERT INTO first VALUES (1);
        CREATE TABLE log (line text);
        CREATE PUBLICATION pub FOR TABLE first, log;
    """,
        snapshot=["public.first"],
    )  # creates the slot: the stream starts here
    pg.execute("INSERT INTO log VALUES ('before the snapshot of log')")  # in the stream and in the snapshot
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "log")])
    pg.execute("INSERT INTO log VALUES ('after')")
    result = drain(config, spark)
    assert same(pg, config, "public.log", key=()) == 2  # appended once, not twice
    assert result.tables["public.log"].inserted == 1 and result.changes_skipped == 1


def test_table_without_snapshot_is_untouched_and_reported(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE done (id int PRIMARY KEY);
        INSERT INTO done VALUES (0);
        CREATE TABLE later (id int PRIMARY KEY);
        CREATE PUBLICATION pub FOR TABLE done, later;
    """,
        snapshot=["public.done"],
    )
    pg.execute("INSERT INTO done VALUES (1); INSERT INTO later VALUES (1)")
    result = drain(config, spark)
    assert result.tables_without_snapshot == ["public.later"]
    assert not os.path.exists(path_of(config, "public.later"))
    assert result.tables["public.later"].inserted == 0 and result.tables["public.later"].delta_version is None
    assert result.confirmed_flush_lsn >= result.end_lsn  # not blocked by the table without snapshot
    assert same(pg, config, "public.done") == 2


def test_table_whose_snapshot_commit_left_the_delta_log_keeps_replicating(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Delta's log cleanup (delta.logRetentionDuration, 30 days by default) deletes the commits
    a newer checkpoint covers, the snapshot commit and its marker among them."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE kept (id int PRIMARY KEY, n int);
        INSERT INTO kept VALUES (0, 0);
        CREATE PUBLICATION pub FOR TABLE kept;
    """,
    )
    log = Path(path_of(config, "public.kept")) / "_delta_log"
    for n in range(1, 12):  # one MERGE commit per run; the engine checkpoints every 10 versions
        pg.execute("UPDATE kept SET n = %s", (n,))
        drain(config, spark)
    checkpoints = sorted(int(p.name.split(".")[0]) for p in log.glob("*.checkpoint.parquet"))
    assert checkpoints, "the engine wrote no checkpoint to clean up to"
    for expired in log.iterdir():  # what the cleanup deletes: everything before that checkpoint
        if expired.name[:20].isdigit() and int(expired.name[:20]) < checkpoints[-1]:
            expired.unlink()
    assert not (log / f"{0:020d}.json").exists()
    pg.execute("UPDATE kept SET n = 100; INSERT INTO kept VALUES (1, 1)")
    result = drain(config, spark)
    assert result.tables_without_snapshot == [] and result.tables["public.kept"].inserted == 1
    assert same(pg, config, "public.kept") == 2


# --------------------------------------------------------------------------- slot position


def test_idle_slot_advances_and_a_second_run_changes_nothing(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE p (id int PRIMARY KEY);
        INSERT INTO p VALUES (0);
        CREATE TABLE unpublished (id int);
        CREATE PUBLICATION pub FOR TABLE p;
    """,
    )
    pg.execute("INSERT INTO unpublished SELECT generate_series(1, 1000)")  # WAL, but nothing for the slot
    first = drain(config, spark)
    assert first.changes == 0 and first.tables["public.p"].applied_lsn is None
    assert first.confirmed_flush_lsn == first.end_lsn > first.start_lsn
    version = delta_version(config, "public.p")
    second = drain(config, spark)
    assert second.start_lsn == first.confirmed_flush_lsn
    assert second.confirmed_flush_lsn == second.end_lsn and second.changes == 0
    assert second.tables["public.p"].delta_version == version == delta_version(config, "public.p")
    assert same(pg, config, "public.p") == 1


def test_preflight_refuses_missing_publication_missing_slot_and_busy_slot(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute("CREATE TABLE q (id int PRIMARY KEY); INSERT INTO q VALUES (1)")
    no_publication = parse_config(settings(pg, tmp_path / "lake"))
    with pytest.raises(ConfigurationError, match='publication "pub" does not exist'):
        drain(no_publication, spark)
    pg.execute("CREATE PUBLICATION pub FOR TABLE q")
    with pytest.raises(SlotError, match=f'replication slot "{SLOT}" does not exist'):
        drain(no_publication, spark)
    config = setup(pg, tmp_path, spark, "SELECT 1")
    with ReplicationConnection(pg.dsn) as other:
        stream = ReplicationStream(other)
        stream.start(SLOT, options=PgOutputOptions(["pub"]))
        ((pid,),) = pg.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
        with pytest.raises(SlotError) as busy:
            drain(config, spark)
        stream.stop()
    # The line names the reader (its application name, address and start) beside its PID.
    assert str(busy.value).startswith(f'replication slot "{SLOT}" is in use by PID {pid} (')
    assert str(busy.value).endswith(
        ": another run or consumer is reading it (a second drain of one slot cannot run beside the first):"
        " wait for it to finish and retry, or stop the other consumer"
    )


# --------------------------------------------------------------------------- crashes


CRASH_DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE journal (entry int, note text);
    CREATE TABLE ledger (entry int, note text);
    CREATE TABLE tally (k int, note text);
    ALTER TABLE tally REPLICA IDENTITY FULL;
    INSERT INTO journal VALUES (-1, 'seed');
    INSERT INTO tally VALUES (0, 'seed'), (0, 'seed');
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, 20) g;
    CREATE PUBLICATION pub FOR TABLE acct, journal, ledger, tally;
"""
"""``journal`` is truncated halfway through the workload; ``ledger`` (keyless) and ``tally``
(REPLICA IDENTITY FULL, identical rows) never are, so a change inside the crash window that is
applied twice stays visible to the oracle instead of being wiped by a later TRUNCATE."""


def crash_workload(pg: PgDatabase) -> None:
    """30 small transactions; after the TRUNCATE of ``journal`` (transaction 14), one transaction far larger
    than a chunk into the keyed, keyless and FULL tables (17), an ADD COLUMN with a default (19) and a
    widening (23) of tables never truncated: each lands in a later chunk, in pieces between commits."""
    with pg.connect() as conn:
        for i in range(30):
            if i == 19:
                conn.execute("ALTER TABLE acct ADD COLUMN extra int DEFAULT 7")
            if i == 23:
                conn.execute("ALTER TABLE ledger ALTER COLUMN entry TYPE bigint")
            with conn.transaction():
                if i == 17:
                    conn.execute("INSERT INTO ledger SELECT g % 3, 'big' FROM generate_series(1, 25) g")
                    conn.execute("INSERT INTO tally SELECT 9, 'big' FROM generate_series(1, 12) g")
                    conn.execute("UPDATE acct SET note = 'big' WHERE id <= 15")
                conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id = %s", (f"t{i}", i % 20 + 1))
                conn.execute("INSERT INTO journal VALUES (%s, 'credit'), (%s, 'debit')", (i, i))
                conn.execute("INSERT INTO ledger VALUES (%s, 'same'), (%s, 'same')", (i % 4, i % 4))
                tally_changes(conn, i)
                if i % 10 == 9:
                    conn.execute("DELETE FROM acct WHERE id = %s", (i,))
                    conn.execute("INSERT INTO acct VALUES (%s, 100, 'reborn')", (100 + i,))
            if i == 14:
                conn.execute("TRUNCATE journal")


def tally_changes(conn: psycopg.Connection, i: int) -> None:
    """Transaction ``i``'s changes to ``tally``: an identical copy added, then (alternately) one copy
    changed or one deleted, so every transaction holds a change whose replay would show."""
    conn.execute("INSERT INTO tally VALUES (%s, 'same')", (i % 3,))
    one_copy = "ctid = (SELECT min(ctid) FROM tally WHERE k = %s AND note = 'same')"
    if i % 2:
        conn.execute(f"UPDATE tally SET note = 'changed' WHERE {one_copy}", (i % 3,))
    elif i % 4 == 2:
        conn.execute(f"DELETE FROM tally WHERE {one_copy}", (i % 3,))


#: Kills between two of the drain's Delta writes (``after_table_commit:n``, chunks of 10 changes), chosen from
#: the drain's order of writes: after the TRUNCATE, between the pieces of the large
#: transaction in the keyless (71) and the FULL table (74), after the ADD COLUMN's fill (79), after the widening (95).
BETWEEN_COMMITS = [56, 71, 74, 79, 95]


@pytest.mark.parametrize("fault", ["after_delta_commit", "before_merge", "after_confirm"])
@pytest.mark.slow  # a child SIGKILLed at each crash point
def test_sigkill_at_each_fault_point_then_rerun_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, fault: str
) -> None:
    kill_and_rerun(pg, tmp_path, spark, fault)


@NEWEST_POSTGRES_ONLY  # the windows are pgcdc's own; both versions' streams run the test above
@pytest.mark.parametrize("arrival", BETWEEN_COMMITS)
@pytest.mark.slow  # a child SIGKILLed between two of its Delta writes
def test_sigkill_between_two_delta_writes_then_rerun_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, arrival: int
) -> None:
    kill_and_rerun(pg, tmp_path, spark, f"after_table_commit:{arrival}")


def kill_and_rerun(pg: PgDatabase, tmp_path: Path, spark: SparkSession, fault: str) -> None:
    """The crash workload drained in chunks of 10 by a child killed at ``fault``, then by a drain in the test's
    process (only the kill needs a process of its own): Delta equals PostgreSQL, keyless and FULL rows exactly
    once, and the state records what Delta holds."""
    config = setup(pg, tmp_path, spark, CRASH_DDL)
    start = slot_confirmed(pg)
    crash_workload(pg)
    killed = run_child(config, tmp_path, fault, chunk=10)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    after_crash = slot_confirmed(pg)
    if fault == "after_confirm":
        assert after_crash > start
    elif ":" not in fault:
        assert after_crash == start  # the first chunk was never confirmed
    ((before_rerun,),) = pg.execute("SELECT pg_current_wal_flush_lsn()::text")
    drain(config, spark, max_chunk_changes=10)
    ((after_rerun,),) = pg.execute("SELECT pg_current_wal_flush_lsn()::text")
    # The rerun confirms its end position: the flush LSN when it started, which background
    # WAL (checkpoints, autovacuum) may have moved past the workload's end.
    assert LSN.parse(before_rerun) <= slot_confirmed(pg) <= LSN.parse(after_rerun)
    assert same(pg, config, "public.acct") == 21
    assert same(pg, config, "public.journal", key=()) == 30  # keyless: exactly once across the crash
    assert same(pg, config, "public.ledger", key=()) == 60 + 25  # keyless, never truncated: a replay would show
    assert same(pg, config, "public.tally", key=()) == 2 + 30 - 7 + 12  # FULL identity, identical rows
    state = read_state(state_path(config.delta.root, SLOT))  # the rerun recorded what Delta holds
    assert {table: row.log.version for table, row in state.items()} == {
        table: delta_version(config, table)
        for table in ("public.acct", "public.journal", "public.ledger", "public.tally")
    }


# --------------------------------------------------------------------------- memory


#: What a drain's process may add to its resident memory at its worst, whatever the backlog: chunks, here
#: of 2000 changes of 2 KB (3.9 MiB as received), as received, as Arrow columns and as the Parquet staged
#: for the engine, one chunk written while the next is built; and a fixed part (delta-rs's runtime, the
#: threads' heaps) that grows with the machine's cores. Measured on 2 cores, 20k and 80k changes: 72-76 MiB
#: (chunks of 5000 changes: 103; docs/deployment.md has a drain's figure in default chunks).
DRAIN_PEAK_MIB = 150
#: How much more that peak may be for a backlog four times larger (117 MiB more).
DRAIN_GROWTH_MIB = 32
#: The embedded Sail server's own peak resident memory over such a drain (its MERGEs run there), and how much
#: more for the backlog four times larger. Measured on 2 cores: 176 and 197 MiB.
ENGINE_PEAK_MIB = 320
ENGINE_GROWTH_MIB = 64


def wide_table(pg: PgDatabase, tmp_path: Path, spark: SparkSession, storage: str = "") -> tuple[PgcdcConfig, Path]:
    """The memory drains' published table ``wide`` (one seed row, snapshotted; ``storage``: its column's
    storage DDL) and the pipeline's configuration file, which the measuring child reads."""
    config = setup(
        pg,
        tmp_path,
        spark,
        f"""
        CREATE TABLE wide (id int PRIMARY KEY, pad text);
        {storage}
        INSERT INTO wide VALUES (-1, 'seed');
        CREATE PUBLICATION pub FOR TABLE wide;
    """,
    )
    config_file = tmp_path / "pgcdc.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()))
    return config, config_file


@pytest.mark.slow  # two backlogs drained in children to measure memory
def test_memory_stays_bounded_with_a_backlog_larger_than_a_chunk(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Two drains, of 20k and then 80k changes, each in a child process that reports its peak resident
    memory over its baseline and Arrow's pool maximum (tests/support/memory_child.py): below a stated bound
    smaller than the larger backlog, and about the same for both, so chunks, not backlogs, are held."""
    config, config_file = wide_table(pg, tmp_path, spark, "ALTER TABLE wide ALTER COLUMN pad SET STORAGE MAIN;")
    held: dict[int, float] = {}
    engine: dict[int, float] = {}
    written = 0
    for changes in (20_000, 80_000):
        with pg.connect() as conn:
            for start in range(written, written + changes, 1000):
                conn.execute(
                    "INSERT INTO wide SELECT g, repeat(md5(g::text), 64) FROM generate_series(%s::int, %s::int) g",
                    (start, start + 999),
                )
        written += changes
        memory = measured("drain", str(config_file), "2000")
        assert memory["changes"] == changes
        assert memory["arrow_max_mib"] < DRAIN_PEAK_MIB, memory
        # the peak the run reports (its log line, Dagster's pgcdc/peak_memory_mib) is the work's: nothing runs after
        assert memory["peak_mib"] - 1 <= memory["run_peak_mib"] <= memory["peak_mib"], memory
        held[changes] = memory["peak_mib"] - memory["baseline_mib"]
        engine[changes] = memory["engine_peak_mib"]
    assert DRAIN_PEAK_MIB < 80_000 * 2048 / 2**20
    assert held[80_000] < DRAIN_PEAK_MIB, held
    assert held[80_000] - held[20_000] < DRAIN_GROWTH_MIB, held
    assert engine[80_000] < ENGINE_PEAK_MIB and engine[80_000] - engine[20_000] < ENGINE_GROWTH_MIB, engine
    assert same(pg, config, "public.wide") == written + 1


#: The byte bound of the wide-row drain below, and what a drain of such chunks may hold at its worst: a few
#: chunks (as received, as Arrow, as staged Parquet, one written while the next is built) over the fixed
#: part of DRAIN_PEAK_MIB. Measured on 2 cores: 84 MiB with the bound, 146 MiB with the 40 MB backlog in one chunk.
WIDE_CHUNK_BYTES = 2 << 20
WIDE_PEAK_MIB = 110
#: How much more the embedded Sail server's peak is when the same drain's MERGE sources are one 40 MB chunk
#: instead of 2 MiB ones: measured 109-127 MiB more (178-235 MiB against 294-345, the higher ones with the
#: suite's other worker busy); the server's own baseline moves with the load, the difference does not.
WIDE_ENGINE_GROWTH_MIB = 50


@pytest.mark.slow  # two backlogs drained in children to measure memory
def test_a_drain_of_wide_rows_is_cut_by_bytes_and_holds_about_one_chunk(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Rows of 10 KB, a change count that never binds: the byte bound cuts the chunks, and the drain's peak
    stays within a chunk's worth over the fixed part; the same backlog drained in one chunk (the bound
    lifted) holds several times more, so the bound is what keeps the first one small."""
    config, config_file = wide_table(pg, tmp_path, spark)
    held: dict[str, float] = {}
    engine: dict[str, float] = {}
    for bound, start in (("bytes", 0), ("lifted", 4000)):
        pg.execute(
            f"INSERT INTO wide SELECT g, repeat(md5(g::text), 320) FROM generate_series({start}, {start + 3999}) g"
        )
        chunk_bytes = WIDE_CHUNK_BYTES if bound == "bytes" else 1 << 40
        memory = measured("drain", str(config_file), "1000000", str(chunk_bytes))
        assert memory["changes"] == 4000
        held[bound] = memory["peak_mib"] - memory["baseline_mib"]
        engine[bound] = memory["engine_peak_mib"]
    assert 4000 * 10240 > 4 * WIDE_CHUNK_BYTES  # the backlog is several chunks
    assert held["bytes"] < WIDE_PEAK_MIB < held["lifted"], held
    assert engine["lifted"] - engine["bytes"] > WIDE_ENGINE_GROWTH_MIB, engine
    assert same(pg, config, "public.wide") == 8001


def test_float4_widened_to_float8_keeps_every_value(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """float4 -> float8 is a documented widening: Delta's column becomes double, the rows written as
    float keep their values (1.5, NaN, -0.1 as float4's nearest value), later rows carry float8's."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE r (id int PRIMARY KEY, f float4);
        INSERT INTO r VALUES (1, 1.5), (2, -0.1), (3, 'NaN'), (4, '-Infinity');
        CREATE PUBLICATION pub FOR TABLE r;
    """,
    )
    with pg.connect() as conn:
        conn.execute("INSERT INTO r VALUES (5, 3.25)")
        conn.execute("ALTER TABLE r ALTER COLUMN f TYPE float8")
        conn.execute("UPDATE r SET f = 0.1 WHERE id = 5")
        conn.execute("INSERT INTO r VALUES (6, 1e300)")
    drain(config, spark)
    assert same(pg, config, "public.r") == 6  # the oracle also checks the column is double now
    table = delta_rs_rows(path_of(config, "public.r")).sort_by("id")
    assert str(table.schema.field("f").type) == "double"
    assert table.column("f").to_pylist()[4:] == [0.1, 1e300]
