"""pgcdc's tables registered by name in the engine's catalog (``catalog:``, docs/configuration.md).

Every table pgcdc creates gets a name: a table ``shop.orders`` at ``<root>/shop/orders`` becomes
``<catalog.name>.<catalog.schema with shop>.orders``, its changelog ``...orders__changes``, its SCD
type 2 table ``...orders__history`` (``resources/config/catalog.py``). The snapshot registers each
table it copies right after its commit; each drain registers the tables it finds without a recorded
registration (a history table its first write created, a table whose snapshot crashed between its
commit and its registration). A registration done is recorded below ``<root>/_pgcdc/catalog/<slot>/``
(``resources/delta/lake_records.py``, one record per location), so a drain that finds every table
registered lists one directory and asks the engine nothing.

A name that cannot be registered (``CatalogRefusal``: characters the catalog refuses, the name held by
another table) never stops a run: the table is written and confirmed as always, the refusal is said in
one line as a warning by every run until it is fixed (no record is written, so each run tries again),
and the drain's slot materialization lists such tables (``pgcdc/unregistered_tables``). A data
pipeline that stops replicating because of a name in a catalog would lose the slot's retention for a
reader's convenience; the name is the reader's, the data is everyone's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from resources.config import HISTORY_SUFFIX, PgcdcConfig, SCD2_SUFFIX
from resources.config.catalog import CatalogName
from resources.delta.destination import Destination
from resources.delta.lake_records import read_records, records_location, write_record
from resources.errors import CatalogRefusal
from resources.names import TableName

logger = logging.getLogger(__name__)

CATALOG_RECORDS = "catalog"
"""The kind of lake record holding the registrations done (``_pgcdc/catalog/<slot>/``)."""


@dataclass(frozen=True, slots=True)
class CatalogTarget:
    """One Delta table pgcdc writes for ``table`` (the table itself or its history) and its catalog name."""

    table: TableName
    path: str
    name: CatalogName
    #: The table as a refusal names it: ``shop.orders``, ``shop.orders (changelog)``.
    what: str


def catalog_targets(config: PgcdcConfig, table: TableName) -> list[CatalogTarget]:
    """The Delta tables of ``table`` with their names: the table, and its changelog or SCD type 2 table when it
    keeps one; none without ``catalog:``."""
    if config.catalog is None:
        return []
    targets = [
        CatalogTarget(table, config.table_path(table.schema, table.name), config.catalog.name_of(table.schema, table.name), str(table))
    ]  # fmt: skip
    history = config.history_path(table.schema, table.name)
    if history is not None:
        scd2 = config.history.mode(table) == "scd2"
        name = config.catalog.name_of(table.schema, table.name, SCD2_SUFFIX if scd2 else HISTORY_SUFFIX)
        targets.append(CatalogTarget(table, history, name, f"{table} ({'SCD type 2 table' if scd2 else 'changelog'})"))
    return targets


class Registrations:
    """The registrations of one pipeline's tables: the records read once, the missing ones done through the
    run's destination (its engine session)."""

    def __init__(self, config: PgcdcConfig, destination: Destination) -> None:
        self._config = config
        self._destination = destination
        self._location = records_location(config.delta.root, CATALOG_RECORDS, config.slot)
        self._records = {} if config.catalog is None else read_records(self._location, destination.lake)

    def register(self, tables: Iterable[TableName], *, again: bool = False) -> dict[CatalogTarget, str | None]:
        """Register the Delta tables of ``tables`` that exist and have no record of their name (``again``: every
        one that exists, as a snapshot does after its commit). Returns what became of each table tried: None,
        registered; else the refusal's one line (said as a warning)."""
        outcomes: dict[CatalogTarget, str | None] = {}
        for table in tables:
            for target in catalog_targets(self._config, table):
                if again or self._records.get(target.path) != _record(target):
                    exists, refusal = self._register(target)
                    if exists:
                        outcomes[target] = refusal
        return outcomes

    def _register(self, target: CatalogTarget) -> tuple[bool, str | None]:
        """(whether a table is at the target's path, the refusal's line or None: registered)."""
        try:
            if not self._destination.register_table(target.name, target.path, target.what):
                return False, None  # not created yet: a history table before its table's first change
        except CatalogRefusal as refusal:
            logger.warning("%s", refusal)
            return True, str(refusal)
        if self._records.get(target.path) != _record(target):
            write_record(self._location, target.path, _record(target), self._destination.lake)
            self._records[target.path] = _record(target)
            logger.info("registered %s as %s", target.what, target.name)
        return True, None


def register_unnamed(
    config: PgcdcConfig,
    destination: Destination,
    tables: Iterable[TableName],
    warn: Callable[[str], None],
    held: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """A drain's part: register the tables of ``tables`` found without a record of their name (none without
    ``catalog:``), each refusal said through ``warn``; returns the refusals by table. A failure of the engine
    here is said the same way: the drain's changes are confirmed already, and the next drain tries again.
    A table at a path of ``held``, whose snapshot in key ranges the drain is a step of, is left to that
    snapshot, which names it when every range is copied, not part-way."""
    if config.catalog is None:
        return {}
    unheld = [table for table in tables if config.table_path(table.schema, table.name) not in held]
    try:
        refused = refusals(Registrations(config, destination).register(unheld))
    except Exception as error:  # noqa: BLE001 - the data is confirmed; a name is retried by the next run
        line = f"registering tables in catalog {config.catalog.name} failed ({error}): the next drain tries again"
        warn(line)
        return {"every table": line}
    for line in refused.values():
        warn(line)
    return refused


def refusals(outcomes: dict[CatalogTarget, str | None]) -> dict[str, str]:
    """The refused registrations by table (``str(TableName)``), one line each (a table and its history joined)."""
    lines: dict[str, list[str]] = {}
    for target, outcome in outcomes.items():
        if outcome is not None:
            lines.setdefault(str(target.table), []).append(outcome)
    return {table: "; ".join(found) for table, found in lines.items()}


def _record(target: CatalogTarget) -> dict[str, str]:
    """What the record of a registration done holds: the name, as SQL writes it, and the location."""
    return {"name": target.name.sql, "location": target.path}
