"""The snapshot's COPY in PostgreSQL's text format, parsed back exactly: hostile values against a real server.

The text format escapes a value's backslashes, tabs, newlines and other control characters;
a raw newline always ends a row. These tests copy values built to break that (backslash runs
before escape letters, literal ``\\N``, quotes, delimiters of other formats, control
characters, non-ASCII) through the snapshot's own COPY and parser, in pieces of a few rows, and
compare every value with what PostgreSQL returns for the same rows.
"""

from __future__ import annotations

import psycopg
import pyarrow as pa
from hypothesis import given, HealthCheck, settings, strategies as st

from resources.postgres.catalog import TableName
from resources.postgres.copy import copy_pieces, PARSE_BLOCK_BYTES, PieceParser
from resources.runs.consistent_copy import consistent_copy
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

HOSTILE = [
    "", "\\", "\\\\", "\\\\\\", "\\N", "\\\\N", "N", "\\n", "\\\\n", "\\t", "\\.", "\n", "\r", "\r\n", "\t",
    "\b", "\f", "\v", "\x01", "\x1f", "\x7f", '"', '""', ",", ";", "|", "{", "}", "{}", "NULL", "null",
    " ", "é", "ß", "日本", "😀", "\u2028", "\ufeff",
]  # fmt: skip
"""Pieces of values: escapes and what looks like one, NULL markers, quotes and delimiters, non-ASCII."""

VALUES = st.lists(
    st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"))),
    max_size=6,
).map("".join)
"""A text value (PostgreSQL's text holds anything but NUL)."""

ROWS = st.lists(
    st.tuples(
        st.none() | VALUES,
        st.none() | st.lists(st.none() | VALUES, max_size=4),
        st.none() | st.binary(max_size=8),
        st.none() | st.integers(-(2**31), 2**31 - 1),
    ),
    max_size=12,
)

DDL = (
    "CREATE TABLE hostile (id int PRIMARY KEY, t text, a text[], b bytea, n int, d numeric(12,2));"
    "CREATE PUBLICATION pub FOR TABLE hostile"
)


def copied(dsn: str, table: str, piece_bytes: int, piece_rows: int) -> list[tuple[object, ...]]:
    """The table's rows as the snapshot copies and parses them (in pieces of a few rows), LSN column dropped."""
    with consistent_copy(dsn, "pub", TableName("public", table)) as copy:
        parse = PieceParser(copy.columns, copy.schema, copy.point)
        batches = [
            batch for batch, _ in copy_pieces(copy.conn.pgconn, copy.info.copy_query(), parse, piece_bytes, piece_rows)
        ]
    table_data = pa.Table.from_batches(batches, schema=copy.schema).drop_columns(["_pgcdc_lsn"])
    return sorted((tuple(row.values()) for row in table_data.to_pylist()), key=repr)


def in_postgres(dsn: str, query: str) -> list[tuple[object, ...]]:
    """The query's rows as psycopg reads them, in :func:`copied`'s order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(conn.execute(query).fetchall(), key=repr)


@NEWEST_POSTGRES_ONLY  # the parser's pieces; both versions' escaping: the control-character and one-column tests
def test_hostile_values_come_back_exactly(pg: PgDatabase) -> None:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(DDL)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ROWS, st.integers(1, 200), st.integers(1, 3))
    def check(
        rows: list[tuple[str | None, list[str | None] | None, bytes | None, int | None]],
        piece_bytes: int,
        piece_rows: int,
    ) -> None:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE hostile")
            for number, (text, array, binary, integer) in enumerate(rows):
                amount = None if integer is None else integer / 100
                conn.execute(
                    "INSERT INTO hostile VALUES (%s, %s, %s::text[], %s, %s, %s)",
                    (number, text, array, binary, integer, amount),
                )
        expected = in_postgres(pg.dsn, "SELECT id, t, a, b, n, d FROM hostile")
        assert copied(pg.dsn, "hostile", piece_bytes, piece_rows) == expected

    check()


def test_a_single_text_column_keeps_empty_strings_nulls_and_backslash_n(pg: PgDatabase) -> None:
    """A one-column row of an empty string is an empty line in the text format; NULL is ``\\N``."""
    values = ["", None, "\\N", "\\", "", "\n", None, "\\\\N", "a\tb"]
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE one (t text); CREATE PUBLICATION pub FOR TABLE one")
        for value in values:
            conn.execute("INSERT INTO one VALUES (%s)", (value,))
    for piece_bytes, piece_rows in ((1, 1), (3, 2), (1 << 20, 1 << 20)):
        rows = copied(pg.dsn, "one", piece_bytes, piece_rows)
        assert rows == sorted(((value,) for value in values), key=repr)


def test_every_control_character_comes_back(pg: PgDatabase) -> None:
    """PostgreSQL escapes six control characters with letters and writes the others as themselves."""
    values = ["".join(chr(code) for code in range(1, 32)) + "\x7f", *(f"<{chr(code)}>" for code in range(1, 32))]
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE controls (id int, t text, a text[]); CREATE PUBLICATION pub FOR TABLE controls")
        for number, value in enumerate(values):
            conn.execute("INSERT INTO controls VALUES (%s, %s, %s)", (number, value, [value, None]))
    assert copied(pg.dsn, "controls", 64, 4) == in_postgres(pg.dsn, "SELECT id, t, a FROM controls")


@NEWEST_POSTGRES_ONLY  # the parser's blocks; both versions' escaping: the control-character and one-column tests
def test_pieces_of_many_parse_blocks_and_rows_longer_than_a_block(pg: PgDatabase) -> None:
    """A piece is parsed in blocks of :data:`PARSE_BLOCK_BYTES`; a row longer than a block makes its
    piece one block. Every value comes back as PostgreSQL has it, escapes included."""
    long_text = ("x\\y\tz\n" * PARSE_BLOCK_BYTES)[: PARSE_BLOCK_BYTES * 2 + 17]
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE blocks (id int, t text, d numeric(12,2), at timestamptz);"
            "CREATE PUBLICATION pub FOR TABLE blocks;"
            "INSERT INTO blocks SELECT g, repeat(md5(g::text), 3) || E'\\\\' || g, g / 7.0,"
            " timestamptz '2024-01-01 00:00:00+00' + g * interval '1 minute' FROM generate_series(1, 60000) g"
        )
        conn.execute(
            "INSERT INTO blocks VALUES (60001, %s, NULL, NULL), (60002, %s, 1.5, now())", (long_text, long_text[::-1])
        )
        conn.execute("INSERT INTO blocks SELECT g, md5(g::text), g, now() FROM generate_series(60003, 90000) g")
    expected = in_postgres(pg.dsn, "SELECT id, t, d, at FROM blocks")
    assert len(expected) == 90_000
    for piece_bytes in (PARSE_BLOCK_BYTES * 16, PARSE_BLOCK_BYTES * 3):
        assert copied(pg.dsn, "blocks", piece_bytes, 1_000_000) == expected
