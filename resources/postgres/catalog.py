"""What the publisher's catalog says about the published tables.

The snapshot copies exactly what the publication publishes (its column list and
row filter), and incremental runs need each table's replica
identity to know how rows are matched. These queries mirror the ones
PostgreSQL's own table-sync worker runs (see the trace in the seeds).

Every catalog object, function and operator is named with its schema, and parameters are
cast to the exact types the catalog function expects: the sessions already run with an
empty search_path (``resources/postgres/connections.py``), and this keeps the queries immune to
planted look-alikes even in a session whose search_path someone else chose.

Queries use client-side parameter binding (``psycopg.ClientCursor``) because a
``replication=database`` connection only speaks the simple query protocol, and
the snapshot reads the catalog inside its replication transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from resources.errors import ConfigurationError
from resources.names import ColumnNumbers, TableName
from resources.sql import quote_ident


@dataclass(frozen=True, slots=True)
class ColumnInfo:
    name: str
    attnum: int
    type_oid: int
    type_modifier: int
    type_name: str  # format_type(): 'numeric(10,2)', 'integer[]', 'timestamp with time zone', ...
    not_null: bool
    is_identity_key: bool  # part of the replica identity index (or the primary key)


@dataclass(frozen=True, slots=True)
class TableInfo:
    oid: int
    table: TableName
    relkind: str  # 'r' table, 'p' partitioned table
    replica_identity: str  # 'd' default (primary key), 'i' index, 'f' full, 'n' nothing
    columns: tuple[ColumnInfo, ...]  # the published columns, in attnum order
    row_filter: str | None  # the publication's WHERE expression, PostgreSQL 15+
    attribute_count: int | None = None  # pg_class.relnatts: attnums so far, dropped columns included

    @property
    def column_numbers(self) -> ColumnNumbers | None:
        """The published columns' attnums and the attribute count (None: the count was not read)."""
        if self.attribute_count is None:
            return None
        return ColumnNumbers({column.name: column.attnum for column in self.columns}, self.attribute_count, self.oid)

    @property
    def key_columns(self) -> tuple[str, ...]:
        """Columns that identify a row: the identity index, all columns for FULL, none otherwise."""
        if self.replica_identity == "f":
            return tuple(column.name for column in self.columns)
        return tuple(column.name for column in self.columns if column.is_identity_key)

    def copy_query(
        self, blocks: tuple[int, int | None] | None = None, keys: tuple[str, int | None, int | None] | None = None
    ) -> str:
        """The COPY that reads what the publication publishes, as PostgreSQL's own sync does, in the
        text format (``resources/postgres/copy.py`` says why).

        ONLY keeps inheritance children out of a plain table; a partitioned root
        published with publish_via_partition_root is read whole. ``blocks`` = (first, end)
        limits the read to the rows whose ctid lies in heap blocks first .. end - 1 (end None:
        to the end of the heap), a TID Range Scan (PostgreSQL 14+); on a partitioned root the
        range applies to every leaf. ``keys`` = (column, low, high) limits it to the rows whose
        integer ``column`` lies in [low, high) (None: open-ended).
        """
        columns = ", ".join(quote_ident(column.name) for column in self.columns)
        only = "ONLY " if self.relkind == "r" else ""
        conditions = [f"({self.row_filter})"] if self.row_filter else []
        if blocks is not None:
            first, end = blocks
            conditions.append(f"ctid OPERATOR(pg_catalog.>=) '({int(first)},0)'::pg_catalog.tid")
            if end is not None:
                conditions.append(f"ctid OPERATOR(pg_catalog.<) '({int(end)},0)'::pg_catalog.tid")
        if keys is not None:
            column, low, high = keys
            if low is not None:
                conditions.append(f"{quote_ident(column)} OPERATOR(pg_catalog.>=) {int(low)}")
            if high is not None:
                conditions.append(f"{quote_ident(column)} OPERATOR(pg_catalog.<) {int(high)}")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        return f"COPY (SELECT {columns} FROM {only}{self.table.quoted}{where}) TO STDOUT WITH (FORMAT text)"


def client_cursor(conn: psycopg.Connection) -> psycopg.ClientCursor:
    return psycopg.ClientCursor(conn)


def server_version_num(conn: psycopg.Connection) -> int:
    """The server's version as an integer (e.g. 150010), as the server reported it at connect."""
    return conn.info.server_version


def _relation(conn: psycopg.Connection, table: TableName) -> tuple[int, str, str, int]:
    """(oid, relkind, relreplident, relnatts) of ``table``; fails naming the table if it does not exist."""
    row = (
        client_cursor(conn)
        .execute(
            "SELECT c.oid::pg_catalog.int8, c.relkind::pg_catalog.text, c.relreplident::pg_catalog.text,"
            " c.relnatts::pg_catalog.int4"
            " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
            " WHERE n.nspname OPERATOR(pg_catalog.=) %s::pg_catalog.name"
            " AND c.relname OPERATOR(pg_catalog.=) %s::pg_catalog.name",
            (table.schema, table.name),
        )
        .fetchone()
    )
    if row is None:
        raise ConfigurationError(f"table {table} does not exist", "fix the table name in the configuration")
    return int(row[0]), str(row[1]), str(row[2]), int(row[3])


def table_oid(conn: psycopg.Connection, table: TableName) -> int:
    return _relation(conn, table)[0]


def relation_oid(conn: psycopg.Connection, table: TableName) -> int | None:
    """The OID of the relation named ``table`` now; None when no relation has that name."""
    try:
        return table_oid(conn, table)
    except ConfigurationError:
        return None


def relation_name(conn: psycopg.Connection, oid: int) -> TableName | None:
    """The name of the relation with ``oid`` now; None when there is none (dropped)."""
    row = (
        client_cursor(conn)
        .execute(
            "SELECT n.nspname::pg_catalog.text, c.relname::pg_catalog.text FROM pg_catalog.pg_class c"
            " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
            " WHERE c.oid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid",
            {"oid": oid},
        )
        .fetchone()
    )
    return None if row is None else TableName(str(row[0]), str(row[1]))


def read_table(conn: psycopg.Connection, publication: str, table: TableName) -> TableInfo:
    """The relation as the publication publishes it; fails if the table is not published."""
    cursor = client_cursor(conn)
    oid, relkind, replica_identity, attribute_count = _relation(conn, table)

    published = cursor.execute(
        "SELECT attnames, rowfilter FROM pg_catalog.pg_publication_tables"
        " WHERE pubname OPERATOR(pg_catalog.=) %s::pg_catalog.name"
        " AND schemaname OPERATOR(pg_catalog.=) %s::pg_catalog.name"
        " AND tablename OPERATOR(pg_catalog.=) %s::pg_catalog.name",
        (publication, table.schema, table.name),
    ).fetchall()
    if not published:
        raise ConfigurationError(
            f'table {table} is not in publication "{publication}"',
            f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE {table.quoted}, or remove it from 'tables'",
        )
    column_list: list[str] | None = published[0][0]
    row_filter: str | None = published[0][1]

    # Before PostgreSQL 18 pgoutput never sends generated columns, yet pg_publication_tables
    # lists them (on 15-17); from 18 on its attnames follow publish_generated_columns.
    generated = "true" if server_version_num(conn) >= 180000 else "a.attgenerated OPERATOR(pg_catalog.=) ''"
    rows = cursor.execute(
        "SELECT a.attname, a.attnum::pg_catalog.int4, a.atttypid::pg_catalog.int8, a.atttypmod,"
        " pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull,"
        " coalesce(a.attnum OPERATOR(pg_catalog.=) ANY ((i.indkey::pg_catalog.int2[])[0:i.indnkeyatts OPERATOR(pg_catalog.-) 1]), false)"
        " FROM pg_catalog.pg_attribute a LEFT JOIN pg_catalog.pg_index i ON i.indexrelid OPERATOR(pg_catalog.=)"
        " pg_catalog.pg_get_replica_identity_index(%s::pg_catalog.oid::pg_catalog.regclass)::pg_catalog.oid"
        " WHERE a.attrelid OPERATOR(pg_catalog.=) %s::pg_catalog.oid AND a.attnum OPERATOR(pg_catalog.>) 0"
        f" AND NOT a.attisdropped AND {generated} ORDER BY a.attnum",
        (oid, oid),
    ).fetchall()
    columns = tuple(
        ColumnInfo(name, attnum, type_oid, typmod, type_name, not_null, is_key)
        for name, attnum, type_oid, typmod, type_name, not_null, is_key in rows
        if (name in column_list if column_list is not None else True)
    )
    return TableInfo(oid, table, relkind, replica_identity, columns, row_filter, attribute_count)


def table_attributes(conn: psycopg.Connection, oid: int) -> list[tuple[int, str, bool]]:
    """(attnum, name, dropped) of every user column of the table, dropped ones included, as of now."""
    rows = (
        client_cursor(conn)
        .execute(
            "SELECT a.attnum::pg_catalog.int4, a.attname::pg_catalog.text, a.attisdropped FROM pg_catalog.pg_attribute a"
            " WHERE a.attrelid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid AND a.attnum OPERATOR(pg_catalog.>) 0"
            " ORDER BY a.attnum",
            {"oid": oid},
        )
        .fetchall()
    )
    return [(int(attnum), str(name), bool(dropped)) for attnum, name, dropped in rows]


def primary_key_columns(conn: psycopg.Connection, oid: int) -> tuple[str, ...]:
    """The table's primary-key columns in the key's order (its first ``indnkeyatts`` index columns:
    ``INCLUDE`` columns are payload, not key); empty without one. (Client-side
    parameters, as every query here: a replication connection has no extended protocol.)"""
    rows = (
        client_cursor(conn)
        .execute(
            "SELECT a.attname FROM pg_catalog.pg_index i"
            " CROSS JOIN LATERAL pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(attnum, position)"
            " JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) i.indrelid"
            " AND a.attnum OPERATOR(pg_catalog.=) k.attnum"
            " WHERE i.indrelid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid AND i.indisprimary"
            " AND k.position OPERATOR(pg_catalog.<=) i.indnkeyatts ORDER BY k.position",
            {"oid": oid},
        )
        .fetchall()
    )
    return tuple(name for (name,) in rows)


def size_estimate(conn: psycopg.Connection, oid: int) -> tuple[float, int]:
    """PostgreSQL's estimate of the table's rows (negative: never counted) and its heap pages,
    summed over its leaf partitions (a partitioned table's own entry holds neither). An ordinary table is
    its own entry: ``pg_partition_tree`` lists nothing for a table outside any partition tree."""
    row = (
        client_cursor(conn)
        .execute(
            "SELECT pg_catalog.sum(c.reltuples::pg_catalog.float8), pg_catalog.sum(c.relpages)::pg_catalog.int8,"
            " pg_catalog.bool_or(c.reltuples OPERATOR(pg_catalog.<) 0)"
            " FROM pg_catalog.pg_class c WHERE (c.oid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid"
            " AND c.relkind OPERATOR(pg_catalog.<>) 'p') OR c.oid OPERATOR(pg_catalog.=) ANY (SELECT p.relid"
            " FROM pg_catalog.pg_partition_tree(%(oid)s::pg_catalog.oid::pg_catalog.regclass) p WHERE p.isleaf)",
            {"oid": oid},
        )
        .fetchone()
    )
    if row is None or row[0] is None:
        return 0.0, 0
    return (-1.0 if row[2] else float(row[0])), int(row[1])


def key_range(conn: psycopg.Connection, table: TableName, column: str) -> tuple[int, int] | None:
    """Smallest and largest value of an integer key column (two index probes); None for an empty table."""
    quoted = quote_ident(column)
    row = (
        client_cursor(conn)
        .execute(f"SELECT pg_catalog.min({quoted}), pg_catalog.max({quoted}) FROM {table.quoted}")
        .fetchone()
    )
    return None if row is None or row[0] is None else (int(row[0]), int(row[1]))
