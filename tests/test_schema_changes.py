"""RENAME COLUMN of the last published column against DROP COLUMN and ADD COLUMN, on PostgreSQL 15 and 18.

The pgoutput stream shows both the same way (a column gone, a new one last); the catalog numbers the
snapshot recorded tell them apart (``resources/cdc/renames.py``). A rename fails the drain with the
re-snapshot fix and confirms nothing; DROP and ADD drain exactly; a re-snapshot after a rename is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.cdc.renames import unproven_addition
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.postgres.catalog import read_table, table_attributes, TableName
from resources.runs.snapshot import snapshot_tables
from tests.support.incremental_runs import assert_refused_with_the_resnapshot_fix, drain, path_of, same, setup
from tests.support.postgres import one_version_each, PgDatabase
from tests.support.subscriber_oracle import Subscriber

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.subscriber_oracle"]


def test_drop_and_add_of_the_last_column_drain_exactly(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """DROP + ADD of the last snapshot column, then of a column added since the snapshot: the new
    columns are NULL in the rows that existed before them, as in PostgreSQL; the dropped ones stay."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE d (id int PRIMARY KEY, v int, note text);
        INSERT INTO d VALUES (1, 10, 'a'), (2, 20, 'b');
        CREATE PUBLICATION pub FOR TABLE d;
    """,
    )
    with pg.connect() as conn:
        conn.execute("ALTER TABLE d DROP COLUMN note")
        conn.execute("ALTER TABLE d ADD COLUMN memo text")
        conn.execute("INSERT INTO d VALUES (3, 30, 'm3')")
        conn.execute("UPDATE d SET memo = 'm1' WHERE id = 1")
    drain(config, spark)
    assert same(pg, config, "public.d", extra_delta_columns=["note"]) == 3
    table = delta_rs_rows(path_of(config, "public.d")).sort_by("id")
    assert table.column("memo").to_pylist() == ["m1", None, "m3"]
    assert table.column("note").to_pylist() == [None, "b", None]
    with pg.connect() as conn:
        conn.execute("ALTER TABLE d DROP COLUMN memo, ADD COLUMN z int")
        conn.execute("INSERT INTO d VALUES (4, 40, 4)")
    drain(config, spark)
    assert same(pg, config, "public.d", extra_delta_columns=["note", "memo"]) == 4
    table = delta_rs_rows(path_of(config, "public.d")).sort_by("id")
    assert table.column("z").to_pylist() == [None, None, None, 4]


def test_a_rename_of_the_last_column_fails_with_the_resnapshot_fix_and_a_resnapshot_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """RENAME of the last snapshot column: refused, nothing confirmed; after a re-snapshot the renamed
    column holds its values in Delta. Then a column added since that snapshot, renamed while last: refused."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE r (id int PRIMARY KEY, v int, note text);
        INSERT INTO r VALUES (1, 10, 'a'), (2, 20, 'b');
        CREATE PUBLICATION pub FOR TABLE r;
    """,
    )
    assert_refused_with_the_resnapshot_fix(
        pg,
        config,
        spark,
        ["ALTER TABLE r RENAME COLUMN note TO memo", "INSERT INTO r VALUES (3, 30, 'c')"],
        "public.r: column 'memo' existed when the table was snapshotted (a RENAME COLUMN",
    )
    snapshot_tables(config, lake_destination(spark, config), [TableName.parse("public.r")])
    with pg.connect() as conn:
        conn.execute("UPDATE r SET v = 11 WHERE id = 1")
        conn.execute("ALTER TABLE r ADD COLUMN z int")
        conn.execute("INSERT INTO r VALUES (4, 40, 'd', 4)")
    drain(config, spark)
    assert same(pg, config, "public.r") == 4
    table = delta_rs_rows(path_of(config, "public.r")).sort_by("id")
    assert table.column("memo").to_pylist() == ["a", "b", "c", "d"]
    assert_refused_with_the_resnapshot_fix(
        pg,
        config,
        spark,
        ["ALTER TABLE r RENAME COLUMN z TO zz", "INSERT INTO r VALUES (5, 50, 'e', 5)"],
        "public.r: column(s) zz appeared as z disappeared, and PostgreSQL holds 0 column(s) dropped before them",
    )


# --------------------------------------------------------------------------- DROP and ADD of a name in one ALTER

LAYOUTS = {
    "plain": ("CREATE TABLE tab2 (id int PRIMARY KEY, a int, b text)", "", ["public.tab2"]),
    "partitioned-via-root": (
        "CREATE TABLE tab2 (id int PRIMARY KEY, a int, b text) PARTITION BY RANGE (id);"
        " CREATE TABLE tab2_low PARTITION OF tab2 FOR VALUES FROM (0) TO (100);"
        " CREATE TABLE tab2_high PARTITION OF tab2 FOR VALUES FROM (100) TO (200)",
        " WITH (publish_via_partition_root = true)",
        ["public.tab2"],
    ),
    "partitioned-via-leaves": (
        "CREATE TABLE tab2 (id int PRIMARY KEY, a int, b text) PARTITION BY RANGE (id);"
        " CREATE TABLE tab2_low PARTITION OF tab2 FOR VALUES FROM (0) TO (100);"
        " CREATE TABLE tab2_high PARTITION OF tab2 FOR VALUES FROM (100) TO (200)",
        "",
        ["public.tab2_low", "public.tab2_high"],
    ),
}


#: Each layout with b re-added as text and as int, on one PostgreSQL version each (``one_version_each``,
#: alternating): every layout and every type of b meets both versions.
DROP_AND_ADD_CASES = [
    "plain-text", "plain-int", "partitioned-via-root-int", "partitioned-via-root-text",
    "partitioned-via-leaves-text", "partitioned-via-leaves-int",
]  # fmt: skip


@one_version_each("case", DROP_AND_ADD_CASES)
def test_drop_and_add_of_a_name_behind_a_new_column_drains_as_the_subscriber_applies_it(
    pg: PgDatabase,
    tmp_path: Path,
    spark: SparkSession,
    subscribe: Callable[[str], Subscriber],
    case: str,
) -> None:
    """``ALTER TABLE tab2 DROP b, ADD c ... DEFAULT 'x', ADD b`` lists b after the new c: the catalog proves
    b a new column (its snapshot number dropped, its new one above the snapshot's count), so the rows
    Delta has get NULL in b and 'x' in c, as PostgreSQL's subscriber gives them (b's type may change)."""
    layout, b_type = case.rsplit("-", 1)
    create, options, tables = LAYOUTS[layout]
    config = setup(
        pg,
        tmp_path,
        spark,
        f"""
        {create};
        INSERT INTO tab2 VALUES (1, 10, 'one'), (2, 20, 'two'), (101, 30, 'three'), (102, 40, 'four');
        CREATE PUBLICATION pub FOR TABLE tab2{options};
    """,
    )
    subscriber = subscribe("pub")
    pg.execute("UPDATE tab2 SET b = 'before', a = 11 WHERE id IN (1, 101)")
    ((position,),) = pg.execute("SELECT pg_current_wal_lsn()::text")
    subscriber.wait_for(LSN.parse(position))  # the subscriber applies the old b before its own ALTER
    alter = f"ALTER TABLE tab2 DROP b, ADD COLUMN c text DEFAULT 'x', ADD b {b_type}"
    with subscriber.connect() as conn:
        conn.execute(alter)
    pg.execute(alter)
    pg.execute("""
        INSERT INTO tab2 VALUES (3, 50, 'new', '5'), (103, 60, NULL, '6');
        UPDATE tab2 SET b = '7' WHERE id IN (2, 102);
        UPDATE tab2 SET a = 12 WHERE id = 1;
    """)
    result = drain(config, spark)
    subscriber.wait_for(result.end_lsn)
    counts = subscriber.assert_matches_delta(config)
    assert sum(counts.values()) == 6 and sorted(counts) == sorted(tables)
    rows = sorted(
        (row["id"], row["a"], row["b"], row["c"])
        for table in tables
        for row in delta_rs_rows(path_of(config, table)).select(["id", "a", "b", "c"]).to_pylist()
    )
    number = int if b_type == "int" else str
    assert rows == [
        (1, 12, None, "x"),
        (2, 20, number("7"), "x"),
        (3, 50, number("5"), "new"),
        (101, 11, None, "x"),
        (102, 40, number("7"), "x"),
        (103, 60, number("6"), None),
    ]


def test_a_name_dropped_and_added_again_with_another_type_is_a_new_column(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber]
) -> None:
    """``DROP b, ADD b int DEFAULT 7``: no new name, but b's Delta type differs and the catalog proves b a
    new column: the rows Delta has get the default, in the new type, as the subscriber's do."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE tab4 (id int PRIMARY KEY, a int, b text);
        INSERT INTO tab4 VALUES (1, 10, 'one'), (2, 20, 'two');
        CREATE PUBLICATION pub FOR TABLE tab4;
    """,
    )
    subscriber = subscribe("pub")
    alter = "ALTER TABLE tab4 DROP b, ADD b int DEFAULT 7"
    with subscriber.connect() as conn:
        conn.execute(alter)
    pg.execute(alter)
    pg.execute("INSERT INTO tab4 VALUES (3, 30, 3); UPDATE tab4 SET a = 21 WHERE id = 2")
    result = drain(config, spark)
    subscriber.wait_for(result.end_lsn)
    assert subscriber.assert_matches_delta(config) == {"public.tab4": 3}
    table = delta_rs_rows(path_of(config, "public.tab4")).sort_by("id")
    assert table.select(["id", "a", "b"]).to_pylist() == [
        {"id": 1, "a": 10, "b": 7},
        {"id": 2, "a": 21, "b": 7},
        {"id": 3, "a": 30, "b": 3},
    ]


def test_a_rename_behind_which_the_name_is_added_again_is_refused(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """RENAME b TO c, then ADD b: c stands before b like a new column would, but its number is b's old one."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE tab3 (id int PRIMARY KEY, a int, b text);
        INSERT INTO tab3 VALUES (1, 10, 'one');
        CREATE PUBLICATION pub FOR TABLE tab3;
    """,
    )
    assert_refused_with_the_resnapshot_fix(
        pg,
        config,
        spark,
        ["ALTER TABLE tab3 RENAME b TO c", "ALTER TABLE tab3 ADD b text", "INSERT INTO tab3 VALUES (2, 20, 'c', 'b')"],
        "public.tab3: column 'c' existed when the table was snapshotted (a RENAME COLUMN",
    )


# --------------------------------------------------------------------------- the rule on real catalogs

TABLE = TableName("public", "x")


def judge(
    pg: PgDatabase,
    before: list[str],
    at_relation: list[str],
    after: list[str],
    columns: str = "id int PRIMARY KEY, v int, note text",
    published: str = "",
) -> tuple[str | None, list[tuple[int, str, bool]]]:
    """Snapshot-time numbers of x (after ``before``, DDL that precedes the snapshot), the columns pgcdc
    knows (those published then), the Relation message's columns after ``at_relation``, then the verdict
    with the catalog as it is after ``after`` (DDL later in the WAL, run before pgcdc reads the catalog).
    Returns the verdict and the catalog it was given."""
    pg.execute(f"DROP TABLE IF EXISTS x; CREATE TABLE x ({columns}); DROP PUBLICATION IF EXISTS p")
    for statement in before:
        pg.execute(statement)
    pg.execute(f"CREATE PUBLICATION p FOR TABLE x {published}")
    with pg.connect() as conn:
        info = read_table(conn, "p", TABLE)
        recorded, seen = info.column_numbers, [c.name for c in info.columns]
        for statement in at_relation:
            conn.execute(statement)
        names = [c.name for c in read_table(conn, "p", TABLE).columns]
        for statement in after:
            conn.execute(statement)
        catalog = table_attributes(conn, info.oid)
        return unproven_addition(recorded, seen, names, lambda: catalog), catalog


@pytest.mark.parametrize(
    ("at_relation", "after", "refused"),
    [
        (["ALTER TABLE x RENAME note TO memo"], [], "'memo' existed when the table was snapshotted"),
        (["ALTER TABLE x DROP note", "ALTER TABLE x ADD memo text"], [], None),
        (["ALTER TABLE x DROP note, ADD memo text"], ["ALTER TABLE x ADD y int"], None),
        (["ALTER TABLE x RENAME note TO memo"], ["ALTER TABLE x ADD y int"], "'memo' existed when"),
        (
            ["ALTER TABLE x RENAME note TO memo"],
            ["ALTER TABLE x DROP memo"],
            "'memo' appeared as note disappeared and is gone again",
        ),
        (["ALTER TABLE x DROP note, ADD memo text"], ["ALTER TABLE x RENAME memo TO z"], "is gone again"),
        (
            ["ALTER TABLE x RENAME note TO memo"],
            ["ALTER TABLE x RENAME memo TO z", "ALTER TABLE x ADD memo text"],
            "'note' disappeared but is not dropped in PostgreSQL",
        ),
        (["ALTER TABLE x DROP note", "ALTER TABLE x ADD note text"], [], None),  # no new name: not a rename
    ],
    ids=[
        "rename",
        "drop-add",
        "drop-add-then-add",
        "rename-then-add",
        "rename-then-drop",
        "drop-add-then-rename",
        "rename-away-and-add-the-name-again",
        "drop-and-add-the-same-name",
    ],
)
def test_rename_or_drop_and_add_decided_from_the_catalog_read_after_later_ddl(
    pg: PgDatabase, at_relation: list[str], after: list[str], refused: str | None
) -> None:
    why, _ = judge(pg, [], at_relation, after)
    assert why is None if refused is None else why is not None and refused in why


def test_columns_dropped_before_the_snapshot_and_column_lists(pg: PgDatabase) -> None:
    """A column dropped before the snapshot fills no gap; a column newly published by a changed column
    list is an old column whose values are not in the stream."""
    before = ["ALTER TABLE x DROP gap"]
    columns = "id int PRIMARY KEY, v int, gap int, note text"
    assert "existed when" in judge(pg, before, ["ALTER TABLE x RENAME note TO memo"], [], columns)[0]  # type: ignore[operator]
    assert judge(pg, before, ["ALTER TABLE x DROP note, ADD memo text"], [], columns)[0] is None
    newly_published = judge(pg, [], ["ALTER PUBLICATION p SET TABLE x (id, v, note)"], [], published="(id, v)")[0]
    assert newly_published is not None and "'note' existed when the table was snapshotted" in newly_published


def test_columns_added_since_the_snapshot(pg: PgDatabase) -> None:
    """A column added since the snapshot and known to pgcdc: renamed while last, refused; dropped with
    another added, taken as DROP and ADD (its dropped number lies before the new column's)."""
    pg.execute("DROP TABLE IF EXISTS x; CREATE TABLE x (id int PRIMARY KEY, v int); DROP PUBLICATION IF EXISTS p")
    pg.execute("CREATE PUBLICATION p FOR TABLE x")
    with pg.connect() as conn:
        recorded = read_table(conn, "p", TABLE).column_numbers
        conn.execute("ALTER TABLE x ADD memo text")
        seen = [c.name for c in read_table(conn, "p", TABLE).columns]
        oid = read_table(conn, "p", TABLE).oid
        with conn.transaction(force_rollback=True):
            conn.execute("ALTER TABLE x RENAME memo TO z")
            names = [c.name for c in read_table(conn, "p", TABLE).columns]
            renamed = unproven_addition(recorded, seen, names, lambda: table_attributes(conn, oid))
        conn.execute("ALTER TABLE x DROP memo, ADD z int")
        names = [c.name for c in read_table(conn, "p", TABLE).columns]
        dropped_and_added = unproven_addition(recorded, seen, names, lambda: table_attributes(conn, oid))
    assert renamed is not None and "holds 0 column(s) dropped before them since the snapshot" in renamed
    assert dropped_and_added is None


def test_what_the_catalog_cannot_tell(pg: PgDatabase) -> None:
    """RENAME, then DROP of the renamed column and ADD of one of the same name, leaves the catalog exactly as
    DROP and ADD do: taken as DROP and ADD (documented in docs/guarantees.md)."""
    renamed = judge(
        pg, [], ["ALTER TABLE x RENAME note TO memo"], ["ALTER TABLE x DROP memo", "ALTER TABLE x ADD memo text"]
    )
    dropped_and_added = judge(pg, [], ["ALTER TABLE x DROP note", "ALTER TABLE x ADD memo text"], [])
    assert renamed == dropped_and_added and renamed[0] is None


def test_without_recorded_numbers_a_column_gone_and_one_new_fails(pg: PgDatabase) -> None:
    """A snapshot by an older pgcdc recorded no numbers: DROP and ADD cannot be told from a rename, so
    both fail with the re-snapshot fix; an ADD alone is taken as one, as before."""
    pg.execute("DROP TABLE IF EXISTS x; CREATE TABLE x (id int PRIMARY KEY, v int, note text)")
    with pg.connect() as conn:
        oid = int(conn.execute("SELECT 'x'::regclass::oid").fetchone()[0])  # type: ignore[index]
        conn.execute("ALTER TABLE x DROP note, ADD memo text")
        dropped_and_added = unproven_addition(
            None, ["id", "v", "note"], ["id", "v", "memo"], lambda: table_attributes(conn, oid)
        )
        conn.execute("ALTER TABLE x ADD z int")
        added = unproven_addition(
            None, ["id", "v", "memo"], ["id", "v", "memo", "z"], lambda: table_attributes(conn, oid)
        )
    assert dropped_and_added is not None and "recorded no column numbers" in dropped_and_added
    assert added is None
