"""The crash matrix (tests/test_crash_matrix.py, on embedded Sail): a
drain killed at every drain crash point at its arrivals 1, 2 and 3, each kill over a fresh slice of one workload.

Each step writes a slice (:func:`write_slice`), kills a drain child at ``point:n`` in chunks of :data:`KILL_CHUNK`
changes, and lets a drain in the test's process finish the backlog; the step's check (:func:`assert_step_exact`)
names the step that replayed a change twice or lost one, and :func:`assert_matrix_exact` ends the walk. A slice
starts with its largest window, so arrivals 1-3 of every point fall inside it:

* one streamed transaction of :data:`BIG_CHANGES` changes (three chunks), rounds of inserts into ``ledger``
  (keyless) and ``tally`` (REPLICA IDENTITY FULL, identical rows) and updates of ``acct`` (keyed), so each of its
  pieces writes all three tables and their history: ``after_history_commit:1..3`` and ``after_table_commit:2..3``
  fall between the tables' and histories' commits of its first pieces (``after_table_commit:1`` follows the
  engine's preparation, the drain's first queued write), ``before_merge:n`` before its n-th piece;
* then in later chunks a TRUNCATE of ``journal``, an ADD COLUMN with a default (``acct.a_<k>``, filled into the
  rows before it), a column added and widened (``ledger.w_<k>``, int to bigint), new names in every slice:
  ``after_delta_commit``, ``after_slot_record`` and ``after_confirm`` at arrival 1 follow the whole large
  transaction, at 2 and 3 the chunks of those windows;
* ``before_state_write`` comes once per run: the child of that point drains the slice as three runs, up to the
  slice's two marks (:func:`write_slice`) and then to its end, in one process, so ``before_state_write:n`` kills the n-th
  run after its commits (the marks cut after the large transaction and after the ADD COLUMN).

``ledger``, ``tally`` and ``acct`` are never truncated, so a change applied twice anywhere stays visible; ``acct``
keeps SCD type 2 versions and ``tally`` a changelog (docs/history.md), each change once.
``after_quarantine_record`` is left out: provoking a quarantine three times in one drain needs three tables set
aside and re-snapshotted at every step; tests/test_quarantine.py kills there.
"""

from __future__ import annotations

import psycopg
from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from resources.lsn import LSN
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.history_oracle import assert_as_of_equals, assert_changes_once
from tests.support.postgres import PgDatabase

MATRIX_DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE ledger (entry int, note text);
    CREATE TABLE tally (k int, note text);
    ALTER TABLE tally REPLICA IDENTITY FULL;
    CREATE TABLE journal (entry int, note text);
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, 30) g;
    INSERT INTO ledger VALUES (0, 'seed');
    INSERT INTO tally VALUES (0, 'same'), (0, 'same');
    INSERT INTO journal VALUES (-1, 'seed');
    CREATE PUBLICATION pub FOR TABLE acct, ledger, tally, journal;
"""

#: Each table and its key (none: compared as a multiset).
MATRIX_TABLES = {"public.acct": ("id",), "public.ledger": (), "public.tally": (), "public.journal": ()}
#: SCD type 2 versions of the keyed table, a changelog of the FULL one with identical rows.
MATRIX_HISTORY = {"public.acct": "scd2", "public.tally": "changelog"}

#: The drain points of resources/crash_points.py the matrix kills at, each at arrivals 1, 2 and 3.
MATRIX_POINTS = (
    "before_merge",
    "after_history_commit",
    "after_table_commit",
    "after_delta_commit",
    "after_slot_record",
    "after_confirm",
    "before_state_write",
)
ARRIVALS = (1, 2, 3)

#: Changes per chunk of a killed drain: the large transaction is three of them.
KILL_CHUNK = 15
#: The large transaction's changes: five rounds of 3 inserts into ledger, 3 into tally and 3 updates of acct.
BIG_CHANGES = 45
#: A row of the large transaction: 45 of them are past PostgreSQL's 64 kB logical_decoding_work_mem of the
#: test servers, so the transaction is streamed while in progress (and each stays below TOAST's threshold, so
#: nothing compresses it).
BIG_NOTE = "b" * 1800


def flush_position(conn: psycopg.Connection) -> LSN:
    ((value,),) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchall()
    return LSN.parse(value)


def write_slice(pg: PgDatabase, k: int) -> tuple[LSN, LSN]:
    """Slice ``k`` of the workload: the large streamed transaction first, then small transactions around a TRUNCATE
    of ``journal``, an ADD COLUMN with a default and a column added then widened (their names carry ``k``). Its
    marks: the positions (after a commit) where a three-run child ends its first and second run."""
    with pg.connect() as conn:
        with conn.transaction():
            for r in range(BIG_CHANGES // 9):
                conn.execute(
                    "INSERT INTO ledger (entry, note) SELECT g %% 2, %s FROM generate_series(1, 3) g", (BIG_NOTE,)
                )
                conn.execute("INSERT INTO tally (k, note) SELECT 9, %s FROM generate_series(1, 3) g", (BIG_NOTE,))
                conn.execute("UPDATE acct SET note = %s WHERE id %% 10 = %s AND id <= 30", (f"{BIG_NOTE} {k}.{r}", r))
        first = flush_position(conn)
        small_transaction(conn, k, 0)
        conn.execute("TRUNCATE journal")
        conn.execute(f"ALTER TABLE acct ADD COLUMN a_{k} int DEFAULT {k}")
        conn.execute(f"ALTER TABLE ledger ADD COLUMN w_{k} int")
        small_transaction(conn, k, 1)
        conn.execute(f"INSERT INTO ledger (entry, note, w_{k}) VALUES (1, 'same', {k}), (1, 'same', {k})")
        second = flush_position(conn)
        conn.execute(f"ALTER TABLE ledger ALTER COLUMN w_{k} TYPE bigint")
        conn.execute(f"INSERT INTO ledger (entry, note, w_{k}) VALUES (2, 'wide', 5000000000 + {k})")
        for i in range(2, 5):
            small_transaction(conn, k, i)
    return first, second


def small_transaction(conn: psycopg.Connection, k: int, i: int) -> None:
    """A change to every table; ``tally`` gains an identical copy and loses or changes another."""
    one_copy = "ctid = (SELECT min(ctid) FROM tally WHERE k = %s AND note = 'same')"
    with conn.transaction():
        conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id = %s", (f"t{k}.{i}", (k + i) % 30 + 1))
        conn.execute("INSERT INTO journal (entry, note) VALUES (%s, 'credit'), (%s, 'debit')", (k, k))
        conn.execute("INSERT INTO ledger (entry, note) VALUES (%s, 'same'), (%s, 'same')", (i % 3, i % 3))
        conn.execute("INSERT INTO tally (k, note) VALUES (%s, 'same'), (%s, 'same')", (i % 2, i % 2))
        if i % 2:
            conn.execute(f"UPDATE tally SET note = 'changed' WHERE {one_copy}", (i % 2,))
        else:
            conn.execute(f"DELETE FROM tally WHERE {one_copy}", (i % 2,))


def assert_step_exact(pg: PgDatabase, config: PgcdcConfig, step: str) -> None:
    """After a step's kill and the drain that finished its backlog: the keyless and the FULL table, where a change
    applied twice or lost shows, equal PostgreSQL with multiplicity (the message names the step)."""
    for table in ("public.ledger", "public.tally"):
        try:
            assert_delta_equals_postgres(pg.dsn, table, config.table_path(*table.split(".")))
        except AssertionError as error:
            raise AssertionError(f"after the kill at {step}: {error}") from None


def assert_matrix_exact(pg: PgDatabase, config: PgcdcConfig, spark: SparkSession) -> None:
    """Every table equals PostgreSQL with multiplicity; each history holds each change once and reads as of now
    equal to PostgreSQL."""
    for table, key in MATRIX_TABLES.items():
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(*table.split(".")), key=key)
    for table in MATRIX_HISTORY:
        assert_changes_once(spark, config, table)
        assert_as_of_equals(pg, spark, config, table, None, table)
