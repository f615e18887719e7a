"""The attribute numbers of a table's columns, as pgcdc records them with a snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
