"""Per-column choices of the pipeline's configuration (``columns``): replicate as text, rename in Delta, leave out.

Three problems have one remedy each, and every error that meets one names the exact key to set:
a value Delta's typed column cannot hold (a date's ``infinity``, NaN in ``numeric(p,s)``, a
multi-dimensional array) is kept as PostgreSQL's text (``text``); two columns whose names differ
only in case (``duration`` and ``"Duration"``), which Delta's case-insensitive column names cannot
hold side by side, are told apart by renaming one in Delta (``{rename: duration_2}``) or leaving
one out (``exclude``). A key is ``schema.table.column`` read as PostgreSQL reads identifiers, so a
name with a dot, a space, a capital or a quote is written quoted: ``public."Order Items"."Due.Date"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from resources.errors import ConfigurationError, TableFault
from resources.names import split_identifiers, TableName, written_identifier
from resources.sql import quote_ident


@dataclass(frozen=True, slots=True)
class ColumnChoice:
    """What the configuration says of one column: as PostgreSQL's text, under another Delta name, or left out."""

    as_text: bool = False
    rename: str | None = None
    exclude: bool = False


def parse_column_key(key: str) -> tuple[TableName, str]:
    """``schema.table.column`` as (table, column); ValueError with the fix when it is not one."""
    parts = split_identifiers(key)
    if len(parts) != 3:
        raise ValueError(
            f"{key!r} is not schema.table.column (write public.orders.due_date; quote a name with a dot, space, "
            'capital or quote: public."Order Items"."Due.Date")'
        )
    return TableName(parts[0], parts[1]), parts[2]


def column_key(table: TableName, column: str) -> str:
    """The configuration key naming ``column`` of ``table``, quoted only where PostgreSQL needs it."""
    return f"{written_identifier(table.schema)}.{written_identifier(table.name)}.{written_identifier(column)}"


def column_setting(table: TableName, column: str, value: str) -> str:
    """The ``columns`` entry to write for ``column`` of ``table``, as YAML: ``columns: {"public.t.d": text}``."""
    key = column_key(table, column)
    quoted = "'" + key.replace("'", "''") + "'" if '"' in key else f'"{key}"'  # YAML's quoting of the key
    return f"columns: {{{quoted}: {value}}}"


def as_text_fix(table: TableName, column: str) -> str:
    """The fix of a value the column's Delta type cannot hold."""
    return (
        f"set {column_setting(table, column, 'text')} in the pipeline's configuration, "
        "then re-snapshot the table (or fix the value in PostgreSQL)"
    )


@dataclass(frozen=True, slots=True)
class ColumnOverrides:
    """Every column's choice, by table (empty: every column as its type maps)."""

    choices: Mapping[TableName, Mapping[str, ColumnChoice]]

    @classmethod
    def from_keys(cls, entries: Iterable[tuple[str, ColumnChoice]]) -> ColumnOverrides:
        by_table: dict[TableName, dict[str, ColumnChoice]] = {}
        for key, choice in entries:
            table, column = parse_column_key(key)
            by_table.setdefault(table, {})[column] = choice
        return cls(by_table)

    def for_table(self, table: TableName) -> Mapping[str, ColumnChoice]:
        return self.choices.get(table, {})


NO_OVERRIDES = ColumnOverrides({})


class ColumnClashError(TableFault):
    """Two columns of one table whose Delta names differ only in case: a fault of that table alone."""


def refuse_case_clash(table: TableName, columns: Iterable[tuple[str, str]]) -> None:
    """Refuse two columns whose Delta names differ only in case, given (PostgreSQL name, Delta name) pairs.

    Delta (and Spark) resolve column names without regard to case, so such a pair cannot be written
    into one table (the engine fails once the write has begun); found from the catalog or a Relation
    message, before anything is written."""
    seen: dict[str, str] = {}
    for source, delta in columns:
        folded = delta.casefold()
        if folded in seen:
            other = seen[folded]
            raise ColumnClashError(
                f"{table} has columns {quote_ident(other)} and {quote_ident(source)}, whose names differ only in case, "
                "which Delta cannot hold in one table",
                f"rename one in Delta ({column_setting(table, source, '{rename: ' + delta.lower() + '_2}')}) or leave one out "
                f"({column_setting(table, source, 'exclude')}, or the publication's column list) in the pipeline's "
                "configuration, then snapshot the table",
            )
        seen[folded] = source


def refuse_excluded_keys(table: TableName, keys: Iterable[str]) -> None:
    """Refuse leaving out a column of the replica identity's key: the drain matches rows by it."""
    names = list(keys)
    if names:
        raise ConfigurationError(
            f"{table}: its key column(s) {', '.join(map(quote_ident, names))} are excluded, but the drain matches "
            "rows by them",
            f"remove {', '.join(column_setting(table, name, 'exclude') for name in names)} from the pipeline's "
            "configuration (rename the column instead)",
        )
