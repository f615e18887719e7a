"""REPLICA IDENTITY FULL tables with identical rows, against real PostgreSQL 15 and 18 and Sail.

PostgreSQL lets a table without a key hold the same row several times, and its subscriber
changes exactly one matching row per change. pgcdc applies row occurrences the same way
(``resources/cdc/row_multiset.py``): every test compares Delta with PostgreSQL with multiplicity
(``resources/testing/verify.py``).
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from pathlib import Path

import deltalake
import pytest
from pyspark.sql import SparkSession

from resources.cdc.applier import DEFAULT_REPLACE_VALUES
from resources.config import parse_config, PgcdcConfig
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.runs.snapshot import snapshot_tables
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.incremental_runs import drain, run_child, same, settings, setup, slot_confirmed
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


def rows(pg: PgDatabase, table: str, column: str = "x") -> list:
    return sorted((value for (value,) in pg.execute(f"SELECT {column} FROM {table}")), key=repr)


def delta_values(config: PgcdcConfig, table: str, column: str = "x") -> list:
    values = delta_rs_rows(config.table_path("public", table), [column]).column(column).to_pylist()
    return sorted(values, key=repr)


def test_issue_repro_duplicates_are_separate_rows(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Identical rows of a REPLICA IDENTITY FULL table stay separate rows, a drain after each statement."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE t (x text); ALTER TABLE t REPLICA IDENTITY FULL;
        INSERT INTO t VALUES ('a'), ('b'), ('b'); CREATE PUBLICATION pub FOR TABLE t;
    """,
    )
    assert delta_values(config, "t") == ["a", "b", "b"]
    steps = [
        ("UPDATE t SET x = 'bb' WHERE x = 'b'", ["a", "bb", "bb"]),
        ("INSERT INTO t VALUES ('a')", ["a", "a", "bb", "bb"]),
        ("DELETE FROM t WHERE ctid = (SELECT min(ctid) FROM t WHERE x = 'a')", ["a", "bb", "bb"]),
    ]
    for statement, expected in steps:
        pg.execute(statement)
        drain(config, spark)
        assert rows(pg, "t") == expected
        assert delta_values(config, "t") == expected
        same(pg, config, "public.t", key=())


@pytest.mark.parametrize(
    ("replace_values", "deletion_vectors"),
    [(DEFAULT_REPLACE_VALUES, True), (2, True), (2, False)],
    ids=["one-commit", "commits-of-2-values", "commits-of-2-values-copy-on-write"],
)
def test_many_changes_to_equal_rows_in_one_transaction_and_one_batch(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, replace_values: int, deletion_vectors: bool
) -> None:
    pg.execute("""
        CREATE TABLE d (x text, n int); ALTER TABLE d REPLICA IDENTITY FULL;
        INSERT INTO d VALUES ('a', 1), ('a', 1), ('a', 1), ('b', NULL), ('b', NULL), (NULL, NULL), (NULL, NULL);
        CREATE PUBLICATION pub FOR TABLE d;
    """)
    options = settings(pg, tmp_path / "lake")
    options["delta"]["deletion_vectors"] = deletion_vectors  # False: the copy-on-write opt-out
    config = parse_config(options)
    snapshot_tables(config, lake_destination(spark, config))
    assert_deletion_vectors(config, {"public.d": deletion_vectors})
    with pg.connect() as conn, conn.transaction():
        for statement in [
            "INSERT INTO d VALUES ('a', 1)",
            "UPDATE d SET n = 2 WHERE ctid = (SELECT min(ctid) FROM d WHERE x = 'a')",
            "DELETE FROM d WHERE ctid = (SELECT min(ctid) FROM d WHERE x IS NULL)",
            "INSERT INTO d VALUES (NULL, NULL), (NULL, NULL)",
            "UPDATE d SET x = 'c' WHERE x = 'b'",
            "UPDATE d SET n = 1 WHERE x = 'a' AND n = 2",
            "DELETE FROM d WHERE ctid = (SELECT max(ctid) FROM d WHERE x = 'c')",
            "INSERT INTO d VALUES ('z', 5)",
            "DELETE FROM d WHERE x = 'z'",
            "UPDATE d SET x = x WHERE x = 'a'",
        ]:
            conn.execute(statement)
    result = drain(config, spark, max_replace_values=replace_values)
    assert same(pg, config, "public.d", key=()) == 8
    assert Counter(delta_values(config, "d")) == Counter(rows(pg, "d")) == Counter({"a": 4, "c": 1, None: 3})
    stats = result.tables["public.d"]
    assert (stats.inserted, stats.updated, stats.deleted) == (4, 2 + 1 + 1 + 4, 3)


def test_update_of_one_copy_among_several(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE u (k int, v text); ALTER TABLE u REPLICA IDENTITY FULL;
        INSERT INTO u SELECT 1, 'p' FROM generate_series(1, 5);
        CREATE PUBLICATION pub FOR TABLE u;
    """,
    )
    one_copy = "ctid = (SELECT min(ctid) FROM u WHERE v = %s)"
    for statement, value, expected in [
        (f"UPDATE u SET v = 'q' WHERE {one_copy}", "p", {"p": 4, "q": 1}),
        (f"UPDATE u SET v = 'q' WHERE {one_copy}", "p", {"p": 3, "q": 2}),
        (f"DELETE FROM u WHERE {one_copy}", "q", {"p": 3, "q": 1}),
    ]:
        pg.execute(statement, (value,))
        drain(config, spark)
        assert Counter(delta_values(config, "u", "v")) == Counter(rows(pg, "u", "v")) == Counter(expected)
        same(pg, config, "public.u", key=())


def test_nulls_in_duplicate_rows_compare_equal(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE n (a int, b text, c date); ALTER TABLE n REPLICA IDENTITY FULL;
        INSERT INTO n VALUES (NULL, NULL, NULL), (NULL, NULL, NULL), (NULL, NULL, NULL), (1, NULL, NULL), (1, NULL, NULL);
        CREATE PUBLICATION pub FOR TABLE n;
    """,
    )
    pg.execute("DELETE FROM n WHERE ctid = (SELECT min(ctid) FROM n WHERE a IS NULL)")
    pg.execute("UPDATE n SET b = 'x' WHERE ctid = (SELECT max(ctid) FROM n WHERE a IS NULL)")
    pg.execute("UPDATE n SET c = '2024-01-01' WHERE ctid = (SELECT min(ctid) FROM n WHERE a = 1)")
    pg.execute("INSERT INTO n VALUES (NULL, NULL, NULL), (1, NULL, NULL)")
    drain(config, spark)
    assert same(pg, config, "public.n", key=()) == 6
    assert pg.execute("SELECT count(*) FROM n WHERE a IS NULL AND b IS NULL AND c IS NULL") == [(2,)]


def test_toasted_values_in_duplicate_rows(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """An update that leaves the TOASTed column alone sends it as unchanged TOAST; FULL's old image
    holds it whole, so the moved copy keeps it."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE big (id int, body text); ALTER TABLE big REPLICA IDENTITY FULL;
        ALTER TABLE big ALTER COLUMN body SET STORAGE EXTERNAL;
        INSERT INTO big SELECT 1, repeat(md5('one'), 300) FROM generate_series(1, 3);
        INSERT INTO big SELECT 2, repeat(md5('two'), 300) FROM generate_series(1, 2);
        CREATE PUBLICATION pub FOR TABLE big;
    """,
    )
    with pg.connect() as conn, conn.transaction():
        conn.execute("UPDATE big SET id = 10 WHERE ctid = (SELECT min(ctid) FROM big WHERE id = 1)")
        conn.execute("UPDATE big SET id = 20 WHERE id = 2")
        conn.execute("DELETE FROM big WHERE ctid = (SELECT max(ctid) FROM big WHERE id = 1)")
        conn.execute("INSERT INTO big SELECT 1, repeat(md5('one'), 300)")
    pg.execute("UPDATE big SET id = 11 WHERE ctid = (SELECT min(ctid) FROM big WHERE id = 1)")
    drain(config, spark, max_chunk_changes=3)
    assert same(pg, config, "public.big", key=()) == 5
    assert Counter(delta_values(config, "big", "id")) == Counter({1: 1, 10: 1, 11: 1, 20: 2})


def test_values_equal_in_postgresql_or_spark_but_printed_apart_stay_apart(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """-0 and 0 (equal for PostgreSQL's float8 = and for Spark's GROUP BY), NaNs, 1.0 and 1.00 as
    unconstrained numeric, infinite timestamps, arrays, bytea, jsonb: PostgreSQL changes the row
    whose text the old image carries, and so does pgcdc."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE v (f float8, r real, num numeric, ts timestamptz, arr float8[], words text[], raw bytea, doc jsonb);
        ALTER TABLE v REPLICA IDENTITY FULL;
        INSERT INTO v VALUES ('-0', '-0', '1.0', 'infinity', '{-0,NaN}', '{"a, b"}', '\\x00', '{"k": 1}'),
                             ('-0', '-0', '1.0', 'infinity', '{-0,NaN}', '{"a, b"}', '\\x00', '{"k": 1}'),
                             ('0', '0', '1.00', 'infinity', '{0,NaN}', '{a,b}', '\\x00', '{"k": 1}'),
                             ('0', '0', '1.00', 'infinity', '{0,NaN}', '{a,b}', '\\x00', '{"k": 1}'),
                             ('NaN', 'NaN', 'NaN', '-infinity', NULL, '{}', NULL, 'null'),
                             ('NaN', 'NaN', 'NaN', '-infinity', NULL, '{}', NULL, 'null');
        CREATE PUBLICATION pub FOR TABLE v;
    """,
    )
    pg.execute("DELETE FROM v WHERE ctid = (SELECT min(ctid) FROM v WHERE num::text = '1.0')")
    pg.execute("UPDATE v SET raw = '\\x01' WHERE ctid = (SELECT max(ctid) FROM v WHERE num::text = '1.00')")
    pg.execute("DELETE FROM v WHERE ctid = (SELECT min(ctid) FROM v WHERE f = 'NaN')")
    drain(config, spark)
    assert same(pg, config, "public.v", key=()) == 4
    # The oracle compares floats as Python does (-0.0 == 0.0): count the signs separately.
    table = delta_rs_rows(config.table_path("public", "v"))
    signs = Counter(
        (math.copysign(1, f), num) for f, num in zip(table["f"].to_pylist(), table["num"].to_pylist()) if f == 0
    )
    assert signs == Counter({(-1.0, "1.0"): 1, (1.0, "1.00"): 2})


@NEWEST_POSTGRES_ONLY  # the replay is pgcdc's; both versions: test_incremental.py's kill at after_delta_commit
def test_replayed_commits_add_and_remove_no_copy_twice(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Killed between the Delta commits of a chunk and the slot confirm (``after_delta_commit``), then
    the same chunk replayed twice over: as committed, and as if the crash had come after only some of
    its commits (the newest commits taken out of the Delta log). Every copy counts once."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE c (x text, n int); ALTER TABLE c REPLICA IDENTITY FULL;
        INSERT INTO c VALUES ('a', 1), ('a', 1), ('a', 1), ('b', NULL), ('b', NULL), (NULL, NULL);
        CREATE PUBLICATION pub FOR TABLE c;
    """,
    )
    start = slot_confirmed(pg)
    with pg.connect() as conn:
        conn.execute("INSERT INTO c VALUES ('a', 1)")
        conn.execute("DELETE FROM c WHERE ctid = (SELECT min(ctid) FROM c WHERE x = 'b')")
        conn.execute("UPDATE c SET n = 2 WHERE ctid = (SELECT min(ctid) FROM c WHERE x = 'a')")
        conn.execute("INSERT INTO c VALUES (NULL, NULL), ('b', NULL)")
        conn.execute("DELETE FROM c WHERE ctid = (SELECT max(ctid) FROM c WHERE x = 'a' AND n = 1)")
    log = Path(config.table_path("public", "c")) / "_delta_log"
    killed = run_child(config, tmp_path, "after_delta_commit", chunk=1000, replace_values=2)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert slot_confirmed(pg) == start  # every commit made, none confirmed
    commits = sorted(log.glob("*.json"))
    assert len(commits) >= 4 and not list(log.glob("*.checkpoint.parquet"))  # several commits, no checkpoint
    before = Counter(delta_values(config, "c"))
    assert before == Counter(rows(pg, "c"))

    rerun = run_child(config, tmp_path, "after_delta_commit", chunk=1000, replace_values=2)
    assert rerun.returncode == -signal.SIGKILL, rerun.stdout + rerun.stderr
    assert sorted(log.glob("*.json")) == commits  # every change skipped: nothing written again
    for newest in commits[-2:]:  # as if the first run had died after its earlier commits
        for file in log.glob(f"{newest.stem}.*"):  # the commit and its checksum file
            file.unlink()
    assert Counter(delta_values(config, "c")) != before

    # the replay needs no process of its own, only the kills do
    drain(config, spark, max_chunk_changes=1000, max_replace_values=2)
    assert slot_confirmed(pg) > start
    assert same(pg, config, "public.c", key=()) == 7


def test_a_full_table_with_a_primary_key_is_merged_per_key(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """A primary key rules out duplicates: REPLICA IDENTITY FULL with one takes the keyed MERGE
    (no row-value rewrite, no replace marker), key changes and unchanged TOAST included."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE docs (id int PRIMARY KEY, body text, n int); ALTER TABLE docs REPLICA IDENTITY FULL;
        ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
        INSERT INTO docs SELECT g, repeat(md5(g::text), 300), 0 FROM generate_series(1, 5) g;
        CREATE PUBLICATION pub FOR TABLE docs;
    """,
    )
    with pg.connect() as conn, conn.transaction():
        conn.execute("UPDATE docs SET n = 1 WHERE id IN (1, 2)")
        conn.execute("UPDATE docs SET id = 20 WHERE id = 3")
        conn.execute("DELETE FROM docs WHERE id = 4")
        conn.execute("INSERT INTO docs VALUES (6, 'six', 6)")
    drain(config, spark)
    assert same(pg, config, "public.docs") == 5
    operations = [entry["operation"] for entry in deltalake.DeltaTable(config.table_path("public", "docs")).history()]
    assert operations[0] == "MERGE" and operations.count("WRITE") == 1  # the snapshot's, and no rewrite after it


def test_nan_beside_one_other_value_in_a_file_survives_every_rewrite(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """A file whose float column holds NaN and one other value: Sail 0.7.2 reads such a column as that value
    when the log's statistics say minimum = maximum (NaN is in neither), so the FULL table's replacement, the
    copy-on-write MERGE and the changelog read it back wrong unless floats stay out of the statistics."""
    pg.execute("""
        CREATE TABLE full_t (a int, f real, g float8);
        ALTER TABLE full_t REPLICA IDENTITY FULL;
        CREATE TABLE keyed (id int PRIMARY KEY, f real, g float8);
        INSERT INTO full_t VALUES (1, 'NaN', 'NaN'), (2, 8632.4, 2.5), (3, 'NaN', 'NaN');
        INSERT INTO keyed VALUES (1, 'NaN', 'NaN'), (2, 8632.4, 2.5), (3, 'NaN', 'NaN');
        CREATE PUBLICATION pub FOR TABLE full_t, keyed;
    """)
    config = parse_config({
        **settings(pg, tmp_path / "lake"),
        "delta": {"root": str(tmp_path / "lake"), "deletion_vectors_tables": {"public.keyed": False}},
        "history": {"tables": {"public.keyed": "changelog"}},
    })  # fmt: skip
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute(
        "INSERT INTO full_t VALUES (4, 'NaN', 1.5), (5, 7.5, 'NaN'); INSERT INTO keyed VALUES (4, 'NaN', 1.5), (5, 7.5, 'NaN')"
    )
    drain(config, spark)
    pg.execute("DELETE FROM full_t WHERE a IN (3, 5); UPDATE keyed SET g = 0 WHERE id IN (3, 5)")
    drain(config, spark)
    same(pg, config, "public.full_t", key=())
    same(pg, config, "public.keyed")
    for path in (
        config.table_path("public", "full_t"),
        config.table_path("public", "keyed"),
        config.history_path("public", "keyed"),
    ):
        statistics = deltalake.DeltaTable(path).get_add_actions(flatten=True).column_names
        assert "min.a" in statistics or "min.id" in statistics
        assert not [name for name in statistics if name.split(".")[-1] in ("f", "g")], statistics
