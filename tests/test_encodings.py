"""Databases in encodings other than UTF-8 (PostgreSQL 15 and 18, the embedded Sail engine).

Delta and Arrow hold UTF-8. PostgreSQL converts text to the session's ``client_encoding`` both in
``COPY TO STDOUT`` and in pgoutput's tuple data, so a LATIN1 database's snapshot and changes land in
Delta exactly. A SQL_ASCII database's bytes are not converted, but PostgreSQL checks them against
the client's encoding: UTF-8 text replicates, any other byte stops the snapshot or drain loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.errors import PgcdcError, SnapshotError
from resources.postgres.connections import connect
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import LocalPostgres
from tests.support.incremental_runs import drain, path_of, same, settings, setup, slot_confirmed
from tests.support.postgres import fresh_database, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

#: Text LATIN1 represents, none of it ASCII.
WORDS = ["café", "Müller", "Straße", "© 2024", "½ Preis", "àéîõü ÀÉÎÕÜ ¿¡ ø æ ÿ"]


@pytest.fixture
def latin1(pg_server: LocalPostgres) -> Iterator[PgDatabase]:
    with fresh_database(pg_server, "LATIN1") as database:
        yield database


class Utf8Client(PgDatabase):
    """The test's own sessions write UTF-8 (psycopg takes a SQL_ASCII session for ASCII only)."""

    def connect(self, **kwargs: object) -> psycopg.Connection:
        return super().connect(**{"client_encoding": "UTF8", **kwargs})


@pytest.fixture
def sql_ascii(pg_server: LocalPostgres) -> Iterator[PgDatabase]:
    with fresh_database(pg_server, "SQL_ASCII") as database:
        yield Utf8Client(database.server, database.name)


def test_every_pgcdc_session_speaks_utf8(latin1: PgDatabase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over ALTER DATABASE, the DSN's client_encoding and options, PGOPTIONS and PGCLIENTENCODING;
    normal and walsender sessions alike."""
    latin1.execute(f'ALTER DATABASE "{latin1.name}" SET client_encoding = LATIN1')
    dsn_asking_latin1 = f"{latin1.dsn}?client_encoding=LATIN1&options=-c%20client_encoding%3DLATIN1"
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    for dsn in (latin1.dsn, dsn_asking_latin1):
        for replication in (False, True):
            with connect(dsn, application_name="pgcdc-test", replication=replication) as conn:
                assert conn.execute("SHOW client_encoding").fetchall() == [("UTF8",)]
                assert conn.execute("SELECT 'Straße ½'").fetchall() == [("Straße ½",)]
    monkeypatch.setenv("PGOPTIONS", "-c client_encoding=LATIN1")
    with connect(latin1.dsn, application_name="pgcdc-test") as conn:
        assert conn.execute("SHOW client_encoding").fetchall() == [("UTF8",)]


def test_latin1_database_snapshots_and_drains_exactly(latin1: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    assert latin1.execute("SHOW server_encoding") == [("LATIN1",)]
    words = ", ".join(f"'{word}'" for word in WORDS)
    config = setup(
        latin1,
        tmp_path,
        spark,
        f"""
        CREATE TABLE words (id int PRIMARY KEY, word text, note varchar(40), code char(6), tags text[]);
        INSERT INTO words SELECT i, w, w || ' ½', left(w, 6), ARRAY[w, 'ß']
                            FROM unnest(ARRAY[{words}]) WITH ORDINALITY AS t(w, i);
        CREATE TABLE "größen" (name text PRIMARY KEY, "maß" int);
        INSERT INTO "größen" SELECT w, length(w) FROM unnest(ARRAY[{words}]) AS t(w);
        CREATE PUBLICATION pub FOR TABLE words, "größen";
    """,
    )
    assert same(latin1, config, "public.words") == len(WORDS)
    assert same(latin1, config, "public.größen", key=("name",)) == len(WORDS)
    latin1.execute("""
        INSERT INTO words VALUES (100, 'naïve façade', 'über ©', 'ßßß', ARRAY['é', NULL, '½']);
        UPDATE words SET word = word || ' ©', note = 'geändert' WHERE id IN (1, 2);
        UPDATE words SET word = 'Grüße' WHERE id = 3;
        DELETE FROM words WHERE id = 4;
        INSERT INTO "größen" VALUES ('Fußgänger', 1);
        UPDATE "größen" SET "maß" = 99 WHERE name = 'café';
        UPDATE "größen" SET name = 'Käse' WHERE name = 'Müller';
        DELETE FROM "größen" WHERE name = '½ Preis';
    """)
    result = drain(config, spark)
    assert (result.tables["public.words"].inserted, result.tables["public.words"].deleted) == (1, 1)
    assert same(latin1, config, "public.words") == len(WORDS)
    assert same(latin1, config, "public.größen", key=("name",)) == len(WORDS)
    # Independent of the comparison's own reading of PostgreSQL: the exact Python strings.
    delta = {row["id"]: row["word"] for row in delta_rs_rows(path_of(config, "public.words")).to_pylist()}
    assert delta == {1: "café ©", 2: "Müller ©", 3: "Grüße", 5: "½ Preis", 6: WORDS[5], 100: "naïve façade"}
    names = {row["name"]: row["maß"] for row in delta_rs_rows(path_of(config, "public.größen")).to_pylist()}
    assert names == {"café": 99, "Käse": 6, "Straße": 6, "© 2024": 6, WORDS[5]: len(WORDS[5]), "Fußgänger": 1}


def test_sql_ascii_database_replicates_utf8_text_exactly(
    sql_ascii: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Its bytes are not converted, but checked as UTF-8 on the way out; text stored as UTF-8 passes."""
    config = setup(
        sql_ascii,
        tmp_path,
        spark,
        """
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t VALUES (1, 'café'), (2, 'Straße'), (3, '½');
        CREATE PUBLICATION pub FOR TABLE t;
    """,
    )
    sql_ascii.execute(
        "INSERT INTO t VALUES (4, 'Grüße ©'); UPDATE t SET v = 'Käse' WHERE id = 1; DELETE FROM t WHERE id = 2"
    )
    drain(config, spark)
    assert same(sql_ascii, config, "public.t") == 3
    delta = {row["id"]: row["v"] for row in delta_rs_rows(path_of(config, "public.t")).to_pylist()}
    assert delta == {1: "Käse", 3: "½", 4: "Grüße ©"}


def test_sql_ascii_bytes_that_are_not_utf8_fail_the_snapshot(
    sql_ascii: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Stored by a LATIN1 client, unconverted: the snapshot fails in one line naming the byte and writes nothing."""
    with sql_ascii.connect(client_encoding="LATIN1") as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'plain'), (2, 'café')")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
    config = parse_config(settings(sql_ascii, tmp_path / "lake"))
    with pytest.raises(SnapshotError) as refused:
        snapshot_tables(config, lake_destination(spark, config))
    message = str(refused.value)
    assert 'invalid byte sequence for encoding "UTF8": 0xe9' in message and "\n" not in message
    assert "SQL_ASCII" in message and "re-create the database with the ENCODING" in message
    assert not any((tmp_path / "lake").rglob("*.parquet"))


def test_sql_ascii_bytes_that_are_not_utf8_stop_the_drain(
    sql_ascii: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The same in a change: the drain fails in one line naming the fix and confirms nothing past it."""
    config = setup(
        sql_ascii,
        tmp_path,
        spark,
        """
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t VALUES (1, 'café');
        CREATE PUBLICATION pub FOR TABLE t;
    """,
    )
    start = slot_confirmed(sql_ascii)
    with sql_ascii.connect(client_encoding="LATIN1") as conn:
        conn.execute("INSERT INTO t VALUES (2, 'Müller')")
    with pytest.raises(PgcdcError) as refused:
        drain(config, spark)
    message = str(refused.value)
    assert 'invalid byte sequence for encoding "UTF8": 0xfc' in message and "\n" not in message
    assert "SQL_ASCII" in message
    assert slot_confirmed(sql_ascii) == start
    delta = {row["id"]: row["v"] for row in delta_rs_rows(path_of(config, "public.t")).to_pylist()}
    assert delta == {1: "café"}
