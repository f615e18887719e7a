"""Names: pgcdc's Dagster jobs, schedule, sensors, checks and pools (plain strings, no Dagster
import), PostgreSQL table names as PostgreSQL reads them, the Dagster names derived from them
(``dagster_name``), what a slot name may be, and the attribute numbers that identify a table's columns
through renames (``ColumnNumbers``).

Both pgcdc_assets/ and sensors/ define or target these, and the engines' error messages name
the jobs in their fixes, so they live below all three.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from resources.errors import ConfigurationError
from resources.sql import quote_ident

SNAPSHOT_JOB = "pgcdc_snapshot"
RESNAPSHOT_JOB = "pgcdc_resnapshot"
INCREMENTAL_JOB = "pgcdc_incremental"
INCREMENTAL_SCHEDULE = "pgcdc_incremental_schedule"
RECONCILE_JOB = "pgcdc_reconcile"
MAINTENANCE_JOB = "pgcdc_maintenance"
MAINTENANCE_SCHEDULE = "pgcdc_maintenance_schedule"


def slot_pool(slot: str) -> str:
    """The Dagster concurrency pool of every step that drains ``slot``, and of the maintenance
    of its tables (compaction must not race a drain's MERGE on the same files).

    With a limit of 1 on it (``dagster instance concurrency set pgcdc_slot_<slot> 1``, or
    ``concurrency: pools: default_limit: 1`` in dagster.yaml) a second drain waits for the
    first instead of failing on the busy slot.
    """
    return f"pgcdc_slot_{slot}"


LAG_SENSOR = "pgcdc_slot_lag_sensor"
NEW_TABLES_SENSOR = "pgcdc_new_tables_sensor"
SLOT_HEALTH_SENSOR = "pgcdc_slot_health_sensor"
QUARANTINE_SENSOR = "pgcdc_quarantine_sensor"


SCHEMA_CHECK = "schema_matches_postgres"
QUARANTINE_CHECK = "table_not_quarantined"
SLOT_LAG_CHECK = "slot_lag_within_bound"
# Evaluated by the pgcdc_reconcile job, at one fixed LSN:
ROW_COUNT_CHECK = "row_count_matches_postgres"
ROWS_MATCH_CHECK = "rows_match_postgres"


@dataclass(frozen=True, slots=True)
class PipelineNames:
    """The Dagster names of one pipeline's definitions, so several pipelines share a code location.

    ``pipeline`` None is the single-file (``PGCDC_CONFIG``) path and keeps every name as it
    always was (``pgcdc_snapshot``, resource keys ``postgres``/``spark``, op ``drain_slot``),
    so existing run configs, schedules' histories and asset keys stay valid. A named pipeline
    puts its name after the ``pgcdc_`` prefix of each: ``pgcdc_shop_snapshot``,
    ``pgcdc_shop_postgres``, ``pgcdc_shop_drain_slot``. Pools stay per slot (``slot_pool``):
    two pipelines drain at the same time exactly when their slots differ.
    """

    pipeline: str | None = None

    def scoped(self, name: str) -> str:
        """``name`` (a ``pgcdc_*`` job, schedule or sensor name, or a bare op/resource name) for this pipeline."""
        if self.pipeline is None:
            return name
        bare = name.removeprefix("pgcdc_")
        return f"pgcdc_{self.pipeline}_{bare}"

    @property
    def postgres_key(self) -> str:
        return self.scoped("postgres")

    @property
    def spark_key(self) -> str:
        return self.scoped("spark")


SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
"""What PostgreSQL accepts as a replication slot name."""


#: A part ``dagster_name`` keeps as itself: ASCII letters and digits, single ``_`` between them.
_PLAIN_PART = re.compile(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*")
_SEPARATOR = "__"
#: Ends every name with an escaped part (a plain name ends with a letter or digit).
_ESCAPED_MARK = "_"


def dagster_name(*parts: str) -> str:
    """A Dagster name (``^[A-Za-z0-9_]+$``: ops, outputs, inputs) for ``parts``, e.g. a role and a table's schema and name.

    Dagster derives output and input names from asset keys by joining their parts with ``__``
    and replacing only ``-`` and ``.``, so ``"Order Items"`` fails the load and ``order-items``
    meets ``order_items``; pgcdc names them itself, with this one rule. Plain parts (letters,
    digits, single ``_`` between them) are joined with ``__``: ``asset__pgcdc__public__orders``.
    Otherwise every part is escaped, joined with ``__`` and the name ends with ``_``: each
    character but an ASCII letter or digit, ``_`` included, becomes ``_`` and 2 hex digits
    (code points below 256), ``_u`` and 4, or ``_U`` and 6: ``asset__pgcdc__public__Order_20Items_``,
    ``caf_e9``, ``order_2ditems``, ``order_5fitems``. An escaped part holds no ``__`` and ends
    with a letter or digit, so ``dagster_name_parts`` reads the parts back: the name is
    injective (twins by case, ``-``/``_``, dots or quotes never share one) and the same at every
    load, whatever names PostgreSQL accepted.
    """
    if not parts:
        raise ValueError("a Dagster name needs at least one part")
    if all(_PLAIN_PART.fullmatch(part) for part in parts):
        return _SEPARATOR.join(parts)
    return _SEPARATOR.join(map(_escaped, parts)) + _ESCAPED_MARK


def _escaped(part: str) -> str:
    return "".join(char if char.isascii() and char.isalnum() else _escape(ord(char)) for char in part)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"_{code:02x}"
    return f"_u{code:04x}" if code < 0x10000 else f"_U{code:06x}"


_ESCAPE = re.compile(r"_(?:([0-9a-f]{2})|u([0-9a-f]{4})|U([0-9a-f]{6}))")


def dagster_name_parts(name: str) -> tuple[str, ...]:
    """The parts ``dagster_name`` was given for ``name`` (its inverse; ValueError for a name it cannot give)."""
    if not name.endswith(_ESCAPED_MARK):
        parts = tuple(name.split(_SEPARATOR))
    else:
        parts = tuple(_ESCAPE.sub(_unescaped, part) for part in _escaped_parts(name.removesuffix(_ESCAPED_MARK)))
    if dagster_name(*parts) != name:
        raise ValueError(f"{name!r} is not a name dagster_name gives")
    return parts


def _escaped_parts(body: str) -> list[str]:
    """Split at each ``__`` that ends a part: a part never holds ``__`` and never ends with ``_``,
    though the next may begin with an escape (``a___20b``: ``a`` then `` b``)."""
    parts, start = [], 0
    while (end := body.find(_SEPARATOR, start)) >= 0:
        parts.append(body[start:end])
        start = end + len(_SEPARATOR)
    parts.append(body[start:])
    return parts


def _unescaped(match: re.Match[str]) -> str:
    return chr(int(next(group for group in match.groups() if group is not None), 16))


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def split_identifiers(qualified: str) -> list[str]:
    """The dot-separated parts of ``qualified`` as PostgreSQL reads them: a double-quoted part keeps its
    case, dots and spaces (``""`` inside stands for one quote); an unquoted one is folded to lower case
    (ASCII letters only, as PostgreSQL does in UTF-8 databases). Whitespace around the parts is ignored.
    ValueError names what is wrong."""
    parts: list[str] = []
    position, length = 0, len(qualified)
    while True:
        while position < length and qualified[position].isspace():
            position += 1
        if position < length and qualified[position] == '"':
            part, position = _quoted_part(qualified, position + 1)
        else:
            end = position
            while end < length and qualified[end] not in '."' and not qualified[end].isspace():
                end += 1
            part, position = qualified[position:end].translate(_ASCII_LOWER), end
        if not part:
            raise ValueError(f"{qualified!r} has an empty part")
        parts.append(part)
        while position < length and qualified[position].isspace():
            position += 1
        if position == length:
            return parts
        if qualified[position] != ".":
            raise ValueError(f"{qualified!r} is not dot-separated names (unexpected {qualified[position]!r})")
        position += 1


def _quoted_part(qualified: str, position: int) -> tuple[str, int]:
    """The double-quoted part whose text starts at ``position``, and where the text after it starts."""
    chars: list[str] = []
    while True:
        end = qualified.find('"', position)
        if end < 0:
            raise ValueError(f'{qualified!r} has an unterminated quote (close it: "Odd Name")')
        chars.append(qualified[position:end])
        position = end + 1
        if not qualified.startswith('"', position):  # "" is a quote inside the name
            return "".join(chars), position
        chars.append('"')
        position += 1


@dataclass(frozen=True, slots=True)
class TableName:
    schema: str
    name: str

    @classmethod
    def parse(cls, qualified: str) -> TableName:
        """``schema.table`` read as PostgreSQL reads it (:func:`split_identifiers`)."""
        try:
            parts = split_identifiers(qualified)
        except ValueError as error:
            raise ConfigurationError(
                f"table name {error}",
                'write schema.table, quoting names with spaces, dots or capitals: "My Schema"."My Table"',
            ) from None
        if len(parts) != 2:
            raise ConfigurationError(
                f"table name {qualified!r} is not schema.table", "write schema.table, e.g. public.orders"
            )
        return cls(parts[0], parts[1])

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def quoted(self) -> str:
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"

    @property
    def written(self) -> str:
        """``schema.table`` as a person writes it, which ``parse`` reads back exactly: a part is
        double-quoted only when it needs it (``public.orders``, ``public."Order Items"``)."""
        return f"{written_identifier(self.schema)}.{written_identifier(self.name)}"


def written_identifier(name: str) -> str:
    """One name as a person writes it, which :func:`split_identifiers` reads back exactly: double-quoted
    only when PostgreSQL (and pgcdc) would not read it as itself unquoted."""
    return name if _UNQUOTED.fullmatch(name) else quote_ident(name)


#: A name ``written_identifier`` leaves unquoted: what PostgreSQL and ``split_identifiers`` read as itself.
_UNQUOTED = re.compile(r"[a-z_][a-z0-9_$]*")


@dataclass(frozen=True, slots=True)
class ColumnNumbers:
    """The published columns' attribute numbers (attnum) and the table's attribute count, dropped
    columns included (pg_class.relnatts), as of one consistent point.

    A Relation message names columns but not their numbers. PostgreSQL never reuses an attnum:
    RENAME COLUMN keeps it, DROP COLUMN leaves it dropped, ADD COLUMN takes ``count + 1``. So numbers
    recorded at a snapshot tell a renamed column from a dropped one and an added one
    (``resources/cdc/renames.py``)."""

    attnums: dict[str, int]
    count: int
    #: The copied relation's OID (pg_class.oid): a Relation message of another OID under the table's name
    #: is another table (dropped and created again, or renamed to this name). None: not recorded.
    relid: int | None = None

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"attnums": dict(self.attnums), "count": self.count}
        if self.relid is not None:
            value["relid"] = self.relid
        return value

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ColumnNumbers:
        relid = value.get("relid")
        return cls(
            {str(name): int(attnum) for name, attnum in value["attnums"].items()},
            int(value["count"]),
            None if relid is None else int(relid),
        )
