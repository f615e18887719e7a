"""PostgreSQL column types (type oid, typmod) resolved to their mapping, cached per session."""

from __future__ import annotations

from typing import Protocol

import psycopg

from resources.config.columns import ColumnOverrides, NO_OVERRIDES, refuse_case_clash
from resources.names import TableName
from resources.pgoutput.messages import Relation
from resources.pgtypes import (
    column_type_from_catalog,
    pg_type_catalog_params,
    pg_type_catalog_query,
    PgColumnType,
    with_choices,
)
from resources.postgres.catalog import primary_key_columns, table_attributes, TableInfo


class ColumnTypes(Protocol):
    """What the change applier asks about a Relation's columns (``StaticTypes`` answers it in fast tests)."""

    def columns(self, relation: Relation) -> list[PgColumnType]: ...

    def primary_key(self, relation: Relation) -> tuple[str, ...]: ...

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]: ...

    def attributes(self, relation: Relation) -> list[tuple[int, str, bool]]: ...


class TypeResolver:
    """Column types for Relation messages, from the catalog, cached per (type oid, typmod).

    The Relation message names types only by oid and typmod; what they mean (domains,
    arrays, numeric precision) is in pg_type, read over a normal connection. The configuration's
    ``overrides`` apply as at the snapshot (as text, renamed); two columns whose Delta names differ
    only in case are refused before any of the table's changes is written.
    """

    def __init__(self, conn: psycopg.Connection, overrides: ColumnOverrides = NO_OVERRIDES) -> None:
        self._conn = conn
        self._overrides = overrides
        self._rows: dict[tuple[int, int], tuple] = {}

    def columns(self, relation: Relation) -> list[PgColumnType]:
        wanted = [(c.type_oid, c.type_modifier) for c in relation.columns]
        missing = list(dict.fromkeys(key for key in wanted if key not in self._rows))
        if missing:
            rows = self._conn.execute(
                pg_type_catalog_query(),
                {"type_oids": [oid for oid, _ in missing], "typmods": [mod for _, mod in missing]},
            ).fetchall()
            self._rows.update(zip(missing, rows))
        table = TableName(relation.namespace, relation.name)
        columns = with_choices(
            [column_type_from_catalog(c.name, self._rows[key]) for c, key in zip(relation.columns, wanted)],
            self._overrides.for_table(table),
        )
        refuse_case_clash(table, [(c.source_name, c.column) for c in columns if not c.excluded])
        return columns

    def primary_key(self, relation: Relation) -> tuple[str, ...]:
        """The relation's primary-key columns, empty without one.

        Under REPLICA IDENTITY FULL the Relation message flags every column as identity; a
        table that also has a primary key holds no duplicate rows, so it can be matched per
        key (a MERGE) instead of per row value.
        """
        return primary_key_columns(self._conn, relation.oid)

    def attributes(self, relation: Relation) -> list[tuple[int, str, bool]]:
        """(attnum, name, dropped) of every user column of the relation, dropped ones included, as of now
        (``resources/cdc/renames.py`` tells a renamed column from an added one with them)."""
        return table_attributes(self._conn, relation.oid)

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]:
        """What PostgreSQL gave the existing rows of the named columns, per column: the set over
        the table's storage (the table, or every leaf partition) of (type oid, has a missing
        value, that value as text output, has a default). A column that is gone (dropped or
        renamed since) is absent."""
        rows = self._conn.execute(
            "SELECT a.attname, a.atttypid::pg_catalog.int8, a.atthasmissing,"
            " pg_catalog.array_to_string(a.attmissingval, ''::pg_catalog.text), a.atthasdef"
            " FROM pg_catalog.pg_attribute a WHERE a.attrelid OPERATOR(pg_catalog.=) ANY ("
            "   SELECT relid FROM pg_catalog.pg_partition_tree(%(oid)s::pg_catalog.oid::pg_catalog.regclass)"
            "   WHERE isleaf UNION SELECT oid FROM pg_catalog.pg_class"
            "   WHERE oid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid AND relkind OPERATOR(pg_catalog.<>) 'p')"
            " AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped"
            " AND a.attname OPERATOR(pg_catalog.=) ANY (%(names)s::pg_catalog.name[])",
            {"oid": relation.oid, "names": names},
        ).fetchall()
        found: dict[str, set[tuple]] = {}
        for name, type_oid, has_missing, missing, has_default in rows:
            found.setdefault(name, set()).add((type_oid, has_missing, missing if has_missing else None, has_default))
        return found


def published_column_types(
    conn: psycopg.Connection, info: TableInfo, overrides: ColumnOverrides = NO_OVERRIDES
) -> list[PgColumnType]:
    """The mapping of the columns the publication publishes, in order, read on ``conn`` (under its snapshot),
    as the configuration's ``overrides`` want them in Delta (excluded columns left out)."""
    rows = (
        psycopg.ClientCursor(conn)
        .execute(pg_type_catalog_query(), pg_type_catalog_params((c.type_oid, c.type_modifier) for c in info.columns))
        .fetchall()
    )
    columns = [column_type_from_catalog(column.name, row) for column, row in zip(info.columns, rows, strict=True)]
    return [c for c in with_choices(columns, overrides.for_table(info.table)) if not c.excluded]
