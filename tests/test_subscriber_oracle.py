"""pgcdc against PostgreSQL's own subscriber on the same publication (``tests/support/subscriber_oracle.py``).

A seeded random workload runs on the publisher; pgcdc snapshots, then drains several times, and
after every drain the subscriber is waited for up to the drain's end LSN and each Delta table
must equal the subscriber's table. The tables are the cases where "equal to the publisher" is the
wrong expectation: row filters (rows moving in and out of them), column lists, a partitioned table
published through its root and through its leaves, REPLICA IDENTITY FULL with many identical rows
(NULLs, TOASTed values), plus a keyed table with TOAST and TRUNCATE. Values come from
``tests/support/workload.py``'s makers, so the types are those of the randomized suite.

On failure the message names the seed and lists the SQL since the previous drain.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import LocalPostgres
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.postgres import PgDatabase
from tests.support.subscriber_oracle import Subscriber, SubscriberError
from tests.support.workload import value

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.subscriber_oracle"]
pytestmark = pytest.mark.slow  # PostgreSQL subscribers beside each workload; tiers: docs/testing.md

#: Transactions between two drains, and drains per test: a few seconds of Sail per drain.
TRANSACTIONS_PER_DRAIN = 25
DRAINS = 3


# --------------------------------------------------------------------------- the workloads


class MixedWorkload:
    """Filters, column lists, a partitioned table, a keyed table with TOAST, a keyless table, TRUNCATE.

    Every statement is built so it cannot fail: conflicts are skipped or guarded by NOT EXISTS.
    """

    def __init__(self, seed: int, via_root: bool) -> None:
        self.rng = random.Random(seed)
        self.via_root = via_root
        self.next_a = 40  # filtered_full.a is unique: its rows stay distinct

    def ddl(self) -> str:
        # Through its root the partitioned table gets a row filter; through its leaves PostgreSQL
        # refuses a filter on the root (15) or ignores it (16+), so a leaf carries one instead.
        parted = "parted WHERE (id % 5 <> 0)" if self.via_root else "parted, parted_high WHERE (id % 5 <> 0)"
        return f"""
            CREATE TABLE keyed (id int PRIMARY KEY, name text, n bigint, amt numeric(12,3), ts timestamptz,
                                doc jsonb, tags int[], body text);
            ALTER TABLE keyed ALTER COLUMN body SET STORAGE EXTERNAL;
            CREATE TABLE filtered_key (id int PRIMARY KEY, grp int, note text);
            CREATE TABLE filtered_full (a int NOT NULL, grp int, note text, body text);
            ALTER TABLE filtered_full REPLICA IDENTITY FULL;
            ALTER TABLE filtered_full ALTER COLUMN body SET STORAGE EXTERNAL;
            CREATE TABLE narrow (id int PRIMARY KEY, visible text, n int, secret text NOT NULL, body text);
            ALTER TABLE narrow ALTER COLUMN body SET STORAGE EXTERNAL;
            CREATE TABLE parted (id int PRIMARY KEY, grp int, note text, body text) PARTITION BY RANGE (id);
            CREATE TABLE parted_low PARTITION OF parted FOR VALUES FROM (0) TO (100);
            CREATE TABLE parted_high PARTITION OF parted FOR VALUES FROM (100) TO (200);
            CREATE TABLE parted_rest PARTITION OF parted DEFAULT;
            ALTER TABLE parted_low ALTER COLUMN body SET STORAGE EXTERNAL;
            CREATE TABLE appended (kind text, n int);
            INSERT INTO keyed SELECT g, 'seed' || g, g, g / 7.0, '2024-01-01'::timestamptz + g * interval '1 hour',
                                     jsonb_build_object('g', g), ARRAY[g], repeat(md5(g::text), 100 + g)
              FROM generate_series(0, 59) g;
            INSERT INTO filtered_key SELECT g, g % 10, 'seed' FROM generate_series(0, 59) g;
            INSERT INTO filtered_full SELECT g, g % 10, 'seed', CASE WHEN g % 2 = 0 THEN repeat(md5(g::text), 90) END
              FROM generate_series(0, 39) g;
            INSERT INTO narrow SELECT g, 'v' || g, g, 'secret' || g, repeat('s', 3000) FROM generate_series(0, 39) g;
            INSERT INTO parted SELECT g, g % 10, 'seed', repeat(md5(g::text), 80) FROM generate_series(0, 299, 3) g;
            INSERT INTO appended VALUES ('seed', 1), ('seed', 1);
            CREATE PUBLICATION pub FOR TABLE keyed, filtered_key WHERE (id % 3 <> 0), filtered_full WHERE (grp < 5),
                narrow (id, visible, n), {parted}, appended
              WITH (publish_via_partition_root = {str(self.via_root).lower()});
        """

    def statement(self) -> str:
        r = self.rng
        table = r.choices(
            ["keyed", "filtered_key", "filtered_full", "narrow", "parted", "appended", "truncate"],
            weights=[5, 3, 3, 3, 4, 1, 0.1],
        )[0]
        return getattr(self, f"_{table}")(r)

    def _keyed(self, r: random.Random) -> str:
        x, k = r.random(), r.randint(0, 79)
        if x < 0.3:
            return (
                f"INSERT INTO keyed VALUES ({k}, {value(r, 'text')}, {value(r, 'bigint')}, {value(r, 'numeric')},"
                f" {value(r, 'ts')}, {value(r, 'jsonb')}, {value(r, 'intarr')}, {value(r, 'toast')})"
                f" ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name, n = EXCLUDED.n"
            )
        if x < 0.6:  # body untouched: it arrives as unchanged TOAST
            return (
                f"UPDATE keyed SET n = {value(r, 'bigint')}, doc = {value(r, 'jsonb')} WHERE id BETWEEN {k} AND {k + 5}"
            )
        if x < 0.7:
            return f"UPDATE keyed SET body = {value(r, 'toast')} WHERE id = {k}"
        if x < 0.85:
            new = r.randint(0, 79)
            return f"UPDATE keyed SET id = {new} WHERE id = {k} AND NOT EXISTS (SELECT 1 FROM keyed WHERE id = {new})"
        return f"DELETE FROM keyed WHERE id BETWEEN {k} AND {k + 3}"

    def _filtered_key(self, r: random.Random) -> str:
        x, k = r.random(), r.randint(0, 89)
        if x < 0.3:
            return (
                f"INSERT INTO filtered_key VALUES ({k}, {r.randint(0, 9)}, {value(r, 'text')})"
                " ON CONFLICT (id) DO UPDATE SET note = EXCLUDED.note"
            )
        if x < 0.55:
            return f"UPDATE filtered_key SET note = {value(r, 'text')} WHERE id BETWEEN {k} AND {k + 4}"
        if x < 0.85:  # the key decides the filter: rows move into and out of the publication
            new = r.randint(0, 89)
            return (
                f"UPDATE filtered_key SET id = {new}, grp = {r.randint(0, 9)} WHERE id = {k}"
                f" AND NOT EXISTS (SELECT 1 FROM filtered_key WHERE id = {new})"
            )
        return f"DELETE FROM filtered_key WHERE id BETWEEN {k} AND {k + 2}"

    def _filtered_full(self, r: random.Random) -> str:
        x, a = r.random(), r.randint(0, self.next_a)
        if x < 0.3:
            self.next_a += 1
            grp = value(r, "int") if r.random() < 0.1 else r.randint(0, 9)  # now and then NULL or far out
            return f"INSERT INTO filtered_full VALUES ({self.next_a}, {grp}, {value(r, 'text')}, {value(r, 'toast')})"
        if x < 0.7:  # grp decides the filter; body stays as it is (the FULL old image carries it)
            return f"UPDATE filtered_full SET grp = {r.randint(0, 9)} WHERE a BETWEEN {a} AND {a + 3}"
        if x < 0.8:
            return f"UPDATE filtered_full SET note = {value(r, 'text')}, body = {value(r, 'toast')} WHERE a = {a}"
        return f"DELETE FROM filtered_full WHERE a BETWEEN {a} AND {a + 2}"

    def _narrow(self, r: random.Random) -> str:
        x, k = r.random(), r.randint(0, 59)
        if x < 0.3:
            return (
                f"INSERT INTO narrow VALUES ({k}, {value(r, 'text')}, {value(r, 'int')}, 'secret',"
                f" {value(r, 'toast')}) ON CONFLICT (id) DO UPDATE SET visible = EXCLUDED.visible,"
                " secret = 'changed'"
            )
        if x < 0.5:  # only unpublished columns change: an update with nothing new to publish
            return (
                f"UPDATE narrow SET secret = {value(r, 'text', nullable=False)}, body = {value(r, 'toast')}"
                f" WHERE id = {k}"
            )
        if x < 0.7:
            return f"UPDATE narrow SET n = {value(r, 'int')} WHERE id BETWEEN {k} AND {k + 4}"
        if x < 0.85:
            new = r.randint(0, 59)
            return f"UPDATE narrow SET id = {new} WHERE id = {k} AND NOT EXISTS (SELECT 1 FROM narrow WHERE id = {new})"
        return f"DELETE FROM narrow WHERE id BETWEEN {k} AND {k + 2}"

    def _parted(self, r: random.Random) -> str:
        x, k = r.random(), r.randint(0, 299)
        if x < 0.3:
            return (
                f"INSERT INTO parted VALUES ({k}, {r.randint(0, 9)}, {value(r, 'text')}, {value(r, 'toast')})"
                " ON CONFLICT (id) DO NOTHING"
            )
        if x < 0.5:
            return f"UPDATE parted SET grp = {r.randint(0, 9)} WHERE id BETWEEN {k} AND {k + 6}"
        if x < 0.8:  # to another partition or within one, into or out of the root's filter
            new = r.choice([k + 1, (k + 100) % 300, r.randint(0, 299)])
            return f"UPDATE parted SET id = {new} WHERE id = {k} AND NOT EXISTS (SELECT 1 FROM parted WHERE id = {new})"
        return f"DELETE FROM parted WHERE id BETWEEN {k} AND {k + 4}"

    def _appended(self, r: random.Random) -> str:
        row = f"({value(r, 'text')}, {value(r, 'int')})"
        return f"INSERT INTO appended VALUES {', '.join([row] * r.randint(1, 3))}"

    def _truncate(self, r: random.Random) -> str:
        tables = r.sample(["keyed", "filtered_key", "filtered_full", "narrow", "parted", "appended"], k=r.randint(1, 2))
        return f"TRUNCATE {', '.join(tables)}"

    #: Committed TRUNCATEs of the tables a row filter, a column list or partitioning shapes (random
    #: ones are rare and the fixed seeds roll theirs back), by burst, between other changes of their
    #: transaction; what the burst writes after them refills the tables. None in the first burst, so
    #: that its comparison still sees rows the filters hold back.
    SCHEDULED_TRUNCATES = {1: "filtered_key, narrow", 2: "parted, filtered_full"}

    def scheduled(self, drain: int) -> list[str] | None:
        """The transaction run a third into burst ``drain``: changes, the burst's TRUNCATE, changes, COMMIT."""
        if drain not in self.SCHEDULED_TRUNCATES:
            return None
        return ["BEGIN", self.statement(), f"TRUNCATE {self.SCHEDULED_TRUNCATES[drain]}", self.statement(), "COMMIT"]


#: The few values of dup's columns: every row has many identical copies.
V = ["'a'", "'b'", "NULL"]
N = ["1", "2", "NULL"]
BODIES = ["NULL", "'short'", "repeat(md5('t'), 150)", "repeat(md5('u'), 150)"]


class DuplicateWorkload:
    """REPLICA IDENTITY FULL with few distinct rows and many copies of each: every change hits
    one copy among several (by ctid) or all of them; NULLs and TOASTed values among the copies."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def ddl(self) -> str:
        return """
            CREATE TABLE dup (v text, n int, body text);
            ALTER TABLE dup REPLICA IDENTITY FULL;
            ALTER TABLE dup ALTER COLUMN body SET STORAGE EXTERNAL;
            INSERT INTO dup SELECT v, n, body FROM (VALUES ('a'), ('b'), (NULL)) AS vs (v),
                (VALUES (1), (NULL)) AS ns (n), (VALUES (NULL), ('short'), (repeat(md5('t'), 150))) AS bodies (body),
                generate_series(1, 3);
            CREATE PUBLICATION pub FOR TABLE dup;
        """

    def _match(self, r: random.Random) -> str:
        return f"v IS NOT DISTINCT FROM {r.choice(V)} AND n IS NOT DISTINCT FROM {r.choice(N)}"

    def _one_copy(self, r: random.Random) -> str:
        return f"ctid = (SELECT ctid FROM dup WHERE {self._match(r)} LIMIT 1)"

    def statement(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.3:
            row = f"({r.choice(V)}, {r.choice(N)}, {r.choice(BODIES)})"
            return f"INSERT INTO dup VALUES {', '.join([row] * r.randint(1, 3))}"
        if x < 0.5:  # one copy; body stays as it is (unchanged TOAST in the new image)
            return f"UPDATE dup SET n = {r.choice(N)} WHERE {self._one_copy(r)}"
        if x < 0.6:
            return f"UPDATE dup SET body = {r.choice(BODIES)} WHERE {self._one_copy(r)}"
        if x < 0.8:
            return f"DELETE FROM dup WHERE {self._one_copy(r)}"
        if x < 0.9:  # every copy at once
            return f"UPDATE dup SET v = {r.choice(V)} WHERE {self._match(r)}"
        if x < 0.99:
            return f"DELETE FROM dup WHERE {self._match(r)}"
        return "TRUNCATE dup"


# --------------------------------------------------------------------------- the harness run


def _transaction(rng: random.Random, statement: Callable[[], str]) -> list[str]:
    """One to four statements: autocommit, committed, rolled back, or with a rolled-back savepoint."""
    body = [statement() for _ in range(rng.randint(1, 4))]
    x = rng.random()
    if x < 0.4:
        return body[:1]
    if x < 0.75:
        return ["BEGIN", *body, "COMMIT"]
    if x < 0.85:
        return ["BEGIN", *body, "ROLLBACK"]
    return ["BEGIN", body[0], "SAVEPOINT s", *body[1:], "ROLLBACK TO SAVEPOINT s", "COMMIT"]


def _config(pg: PgDatabase, tmp_path: Path, deletion_vectors: bool = True) -> PgcdcConfig:
    """pgcdc on publication ``pub`` with its own slot; ``deletion_vectors=False``: the copy-on-write opt-out."""
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": f"pgcdc_{pg.name}",
            "tables": [],
            "delta": {"root": str(tmp_path / "lake"), "deletion_vectors": deletion_vectors},
        }
    )


def _snapshot(pg: PgDatabase, tmp_path: Path, spark: SparkSession, deletion_vectors: bool = True) -> PgcdcConfig:
    """:func:`_config`, every table snapshotted."""
    config = _config(pg, tmp_path, deletion_vectors)
    snapshot_tables(config, lake_destination(spark, config))
    return config


def _with_publisher_counts(pg: PgDatabase, counts: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """Each table's compared row count beside its rows and distinct rows on the publisher, so a test
    can show its workload reached the case it is about (rows filtered out, duplicate rows)."""
    return {
        name: (rows, *pg.execute(f"SELECT count(*), count(DISTINCT t) FROM {name} t")[0])
        for name, rows in counts.items()
    }


def committed_statements(transactions: list[list[str]]) -> list[str]:
    """The statements of ``transactions`` (as :func:`_transaction` builds them) that committed."""
    committed: list[str] = []
    for statements in transactions:
        if statements[0] != "BEGIN":
            committed += statements
        elif statements[-1] == "COMMIT":
            body = statements[1:-1]
            if "ROLLBACK TO SAVEPOINT s" in body:
                body = body[: body.index("SAVEPOINT s")]
            committed += body
    return committed


def run_against_subscriber(
    pg: PgDatabase,
    tmp_path: Path,
    spark: SparkSession,
    subscribe: Callable[[str], Subscriber],
    seed: int,
    ddl: str,
    statement: Callable[[], str],
    scheduled: Callable[[int], list[str] | None] | None = None,
    deletion_vectors: bool = True,
) -> tuple[list[dict[str, tuple[int, int, int]]], list[str]]:
    """Snapshot, then ``DRAINS`` times: a burst of random transactions (with ``scheduled(drain)``'s
    transaction a third into it), a drain, the subscriber caught up to the drain's end LSN, every
    Delta table == the subscriber's (``deletion_vectors=False``: on the copy-on-write opt-out). Returns, per comparison, each table's row count in Delta
    (= the subscriber), and its rows and distinct rows on the publisher; and every committed statement."""
    rng = random.Random(seed)
    pg.execute(ddl)
    subscriber = subscribe("pub")
    config = _snapshot(pg, tmp_path, spark, deletion_vectors)
    counts = [_with_publisher_counts(pg, subscriber.assert_matches_delta(config))]  # nothing written since the copies
    executed: list[list[str]] = []
    with pg.connect() as conn:
        for drain in range(DRAINS):
            sql: list[str] = []
            for i in range(TRANSACTIONS_PER_DRAIN):
                transaction = scheduled(drain) if scheduled is not None and i == TRANSACTIONS_PER_DRAIN // 3 else None
                transaction = transaction or _transaction(rng, statement)
                executed.append(transaction)
                for text in transaction:
                    sql.append(text)
                    conn.execute(text)
            chunk = rng.choice([25, 200_000])
            result = run_incremental(config, lake_destination(spark, config), max_chunk_changes=chunk)
            subscriber.wait_for(result.end_lsn)
            try:
                counts.append(_with_publisher_counts(pg, subscriber.assert_matches_delta(config)))
            except AssertionError as error:
                listing = "\n".join(f"  {text};" for text in sql)
                raise AssertionError(
                    f"seed {seed}, PostgreSQL {pg.major}, drain {drain + 1} of {DRAINS}"
                    f" (max_chunk_changes={chunk}): {error}\nSQL since the previous drain:\n{listing}"
                ) from error
    return counts, committed_statements(executed)


@pytest.mark.parametrize("via_root", [True, False], ids=["via_root", "via_leaves"])
def test_filters_column_lists_and_partitions_match_the_subscriber(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber], via_root: bool
) -> None:
    seed = 20251 + via_root
    workload = MixedWorkload(seed, via_root)
    # Through the root on deletion-vector tables (the default), through the leaves on the copy-on-write opt-out.
    counts, committed = run_against_subscriber(
        pg,
        tmp_path,
        spark,
        subscribe,
        seed,
        workload.ddl(),
        workload.statement,
        workload.scheduled,
        deletion_vectors=via_root,
    )
    assert_deletion_vectors(_config(pg, tmp_path), {"public.keyed": via_root, "public.filtered_full": via_root})
    # Committed TRUNCATEs of a row-filtered keyed and FULL table, a column-listed one and the
    # partitioned one (through its root, or its leaves) ran and were compared.
    truncated = {name for text in committed if text.startswith("TRUNCATE ") for name in text[9:].split(", ")}
    assert {"filtered_key", "filtered_full", "narrow", "parted"} <= truncated, committed
    partitions = {"public.parted"} if via_root else {"public.parted_low", "public.parted_high", "public.parted_rest"}
    assert (
        set(counts[0])
        == {"public.keyed", "public.filtered_key", "public.filtered_full", "public.narrow", "public.appended"}
        | partitions
    )
    # The row filters held rows back, in the snapshot and in some drain: the expected state was not the publisher's.
    for name in ("public.filtered_key", "public.filtered_full", "public.parted" if via_root else "public.parted_high"):
        held_back = [delta < publisher for delta, publisher, _ in (c[name] for c in counts)]
        assert held_back[0] and any(held_back[1:]), (name, counts)


def test_duplicate_rows_under_replica_identity_full_match_the_subscriber(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber]
) -> None:
    seed = 4711
    workload = DuplicateWorkload(seed)
    counts, _ = run_against_subscriber(pg, tmp_path, spark, subscribe, seed, workload.ddl(), workload.statement)
    # Delta was compared while the table held many identical rows, in the snapshot and after drains.
    with_duplicates = [rows > distinct for _, rows, distinct in (c["public.dup"] for c in counts)]
    assert with_duplicates[0] and sum(with_duplicates[1:]) >= 2, counts


def test_a_row_moved_into_a_row_filter_with_unchanged_toast_matches_the_subscriber(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber]
) -> None:
    """A key change that moves a row into a filter on a keyed table arrives as an INSERT whose
    unchanged TOASTed value is NULL: pgoutput takes it from the old image, which holds only the key.
    The subscriber and pgcdc both hold NULL where the publisher holds the value."""
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, body text);
        ALTER TABLE t ALTER COLUMN body SET STORAGE EXTERNAL;
        INSERT INTO t VALUES (1, repeat('x', 5000)), (3, 'inline');
        CREATE PUBLICATION pub FOR TABLE t WHERE (id % 2 = 0);
    """)
    subscriber = subscribe("pub")
    config = _snapshot(pg, tmp_path, spark)
    pg.execute("UPDATE t SET id = 2 WHERE id = 1; UPDATE t SET id = 4 WHERE id = 3")
    result = run_incremental(config, lake_destination(spark, config))
    subscriber.wait_for(result.end_lsn)
    assert subscriber.assert_matches_delta(config) == {"public.t": 2}
    with subscriber.connect() as conn:
        assert conn.execute("SELECT id, length(body) FROM t ORDER BY id").fetchall() == [(2, None), (4, 6)]
    assert pg.execute("SELECT id, length(body) FROM t ORDER BY id") == [(2, 5000), (4, 6)]


# --------------------------------------------------------------------------- the harness itself


def _current_lsn(pg: PgDatabase) -> LSN:
    ((lsn,),) = pg.execute("SELECT pg_current_wal_lsn()::text")
    return LSN.parse(lsn)


def test_wait_for_returns_once_the_subscriber_has_applied_up_to_the_position(
    pg: PgDatabase, subscribe: Callable[[str], Subscriber]
) -> None:
    """No sleep makes this pass: each commit is visible on the subscriber as soon as wait_for returns,
    also a commit followed by WAL the publication does not send (another table's rows)."""
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, v text);
        CREATE TABLE unpublished (id int);
        INSERT INTO t VALUES (0, 'seed');
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    subscriber = subscribe("pub")
    with subscriber.connect() as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchall() == [(1,)]  # the initial copy
        for i in range(1, 11):
            pg.execute("INSERT INTO t VALUES (%s, 'v')", (i,))
            if i % 2:
                pg.execute("INSERT INTO unpublished SELECT generate_series(1, 100)")
            subscriber.wait_for(_current_lsn(pg))
            assert conn.execute("SELECT count(*) FROM t").fetchall() == [(i + 1,)]
            if i % 5 == 0:
                pg.execute("UPDATE t SET v = 'changed' WHERE id = %s", (i,))
                subscriber.wait_for(_current_lsn(pg))
                assert conn.execute("SELECT v FROM t WHERE id = %s", (i,)).fetchall() == [("changed",)]


def test_an_apply_error_on_the_subscriber_fails_the_wait_at_once_with_its_log(
    pg: PgDatabase, subscribe: Callable[[str], Subscriber]
) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    subscriber = subscribe("pub")
    with subscriber.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1)")  # the publisher's next row collides with it
    pg.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(SubscriberError, match=r"(?s)failed before publisher position .*Key \(id\)=\(1\)"):
        subscriber.wait_for(_current_lsn(pg), timeout=30)
    ((slots,),) = pg.execute(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (subscriber.subscription,)
    )
    assert slots == 1  # its own slot, dropped with the subscription at teardown


def test_teardown_drops_the_subscription_and_its_slot_on_the_publisher(
    pg: PgDatabase, subscriber_server: LocalPostgres
) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    subscriber = Subscriber(pg, subscriber_server, "oracle_teardown", "pub", "oracle_teardown")
    subscriber.create()
    assert pg.execute("SELECT slot_name FROM pg_replication_slots") == [("oracle_teardown",)]
    subscriber.drop()
    assert pg.execute("SELECT slot_name FROM pg_replication_slots") == []
    with psycopg.connect(subscriber_server.dsn(), autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pg_database WHERE datname = 'oracle_teardown'").fetchall() == [(0,)]
