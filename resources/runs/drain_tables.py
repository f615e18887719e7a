"""The tables one drain writes: the published ones, and those that left the publication with changes still in the slot.

A published table can leave while its changes are still in the slot: dropped, renamed, or removed from
the publication (``ALTER PUBLICATION ... DROP TABLE``). pgoutput decodes each change with the catalog
as it was when the change was made, so the slot still sends every change committed while the table
was published, under its name then, and nothing after. PostgreSQL's own subscriber applies those
changes to its table of that name and keeps the table. A drain does the same: every table the pgcdc
state lists for the slot (snapshotted and drained by this pipeline) that the publication no longer
publishes under that name is *departed*: it keeps its target, so its drained changes land in its
Delta table, and the run reports it in one line (why it left, read from the catalog, and the fix),
drain after drain, until its Delta table is removed (then the state forgets it).

Why a rename is reported rather than followed: pgcdc maps tables by name, in Delta paths and Dagster
asset keys, as the subscriber does (which stops at the first change under the new name). Following
a rename would move a Delta table (not atomic on an object store) or keep the new name's rows under
the old name's path and asset. So the old name keeps the changes made before the rename, and the
new name is a new table to pgcdc: its changes are skipped, as any table's without a snapshot, until
it is snapshotted (the new-tables sensor, or the snapshot job), which starts past them.

A table created again under a departed or replicated name is another relation (another OID): the
change applier refuses to mix it into the old rows (``resources/cdc/apply_relations.py: _adopt``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import psycopg

from resources.cdc.tables import TableTarget
from resources.config import PgcdcConfig
from resources.delta.destination import Destination, TableLog
from resources.delta.state_table import known_log, StateRow
from resources.errors import ConfigurationError, explain, PgcdcError
from resources.lsn import LSN
from resources.names import SNAPSHOT_JOB
from resources.postgres.catalog import relation_name, relation_oid, TableName
from resources.postgres.publication import published_tables, unpublished_error
from resources.sql import quote_ident


def wanted_tables(conn: psycopg.Connection, config: PgcdcConfig) -> tuple[list[TableName], list[TableName]]:
    """(the published tables to replicate, the configured ones the publication does not publish now)."""
    try:
        published = published_tables(conn, config.publication, allow_empty=True)
    except psycopg.Error as exc:
        raise explain(exc, config.postgres.dsn) from None
    if not config.tables:
        return published, []
    wanted = [TableName.parse(name) for name in config.tables]
    return [t for t in wanted if t in published], [t for t in wanted if t not in published]


def drain_targets(
    conn: psycopg.Connection,
    config: PgcdcConfig,
    destination: Destination,
    tables: tuple[list[TableName], list[TableName]],
    state: dict[str, StateRow],
    start_lsn: LSN,
    logs: tuple[Callable[[str], None], Callable[[str], None]],
) -> tuple[dict[TableName, TableTarget], dict[str, str]]:
    """The drain's targets (``tables``: :func:`wanted_tables`) and the departed tables' lines, each said
    as a warning (``logs``: say, warn)."""
    say, warn = logs
    departed = departed_tables(config, *tables, state)
    targets = run_targets(config, destination, (tables[0], departed), state, start_lsn, say)
    lines = departures(conn, config, targets)
    for line in lines.values():
        warn(line)
    return targets, lines


def departed_tables(
    config: PgcdcConfig, published: Sequence[TableName], unpublished: Sequence[TableName], state: dict[str, StateRow]
) -> list[TableName]:
    """The tables the state lists that are not published now (of the configured ones, when ``tables`` is set).

    A configured table neither published nor drained before is still the configuration error it
    always was (a typo, or a table never published), and so is a publication with no table at all
    and nothing departed from it."""
    listed = {row.table for row in state.values()}
    if config.tables:
        departed = [t for t in unpublished if str(t) in listed]
        never = [t for t in unpublished if str(t) not in listed]
        if never:
            raise unpublished_error(config.publication, never)
    else:
        departed = sorted((config.table_at(row.table, row.path) for row in state.values()), key=str)
        departed = [t for t in departed if t not in published]
    if not published and not departed:
        published_tables_refusal(config.publication)
    return departed


def published_tables_refusal(publication: str) -> None:
    """Draining an empty publication would confirm the slot past every change for nothing."""
    raise ConfigurationError(
        f'publication "{publication}" publishes no tables',
        f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE ...",
    )


def run_targets(
    config: PgcdcConfig,
    destination: Destination,
    tables: tuple[list[TableName], list[TableName]],
    state: dict[str, StateRow],
    start_lsn: LSN,
    say: Callable[[str], None],
) -> dict[TableName, TableTarget]:
    """The run's tables (``tables``: the published ones, the departed ones); refuses when none has a
    snapshot. A table snapshotted after ``start_lsn`` (since the previous drain) has its schema check due.

    A published table the state lists as snapshotted is not read here: its own log is read when the
    drain meets a change for it. Any other table's log is read now (through the lake's storage client,
    no engine round trip), so a table snapshotted since the state was last written, or a lake written
    before the state existed, is seen as it is; so is a departed table, whose removed Delta table the
    state then forgets.
    """
    published, departed = tables
    targets: dict[TableName, TableTarget] = {}
    for table in [*published, *departed]:
        path = config.table_path(table.schema, table.name)
        known = known_log(state, str(table), path)
        if known is not None and table not in departed:
            targets[table] = TableTarget(table, path, known=known)
        else:
            targets[table] = TableTarget(table, path, log=read_log(destination, path, config, known))
            targets[table].stats.version_read = targets[table].log.version  # type: ignore[union-attr]
        targets[table].departed = table in departed
        targets[table].history_path = config.history_path(table.schema, table.name)
        targets[table].history_scd2 = config.history.mode(table) == "scd2"
        targets[table].history_deletion_vectors = config.delta.deletion_vectors_for(table)
        recorded = targets[table].log or targets[table].known
        if recorded is not None and recorded.snapshot_lsn is not None and recorded.snapshot_lsn > start_lsn:
            targets[table].stats.schema_changed = True
    without_snapshot = [
        str(t.table) for t in targets.values() if t.log is not None and not t.log.being_snapshotted and not t.departed
    ]
    if published and len(without_snapshot) == len(published):
        # Every change would be skipped and the slot confirmed past it: with a mistyped or
        # unmounted delta.root the real lake would never get those changes.
        raise ConfigurationError(
            f"no replicated table has a snapshot under delta.root {config.delta.root}",
            f"run the {SNAPSHOT_JOB} job first, or fix delta.root if it points to the wrong place",
        )
    if without_snapshot:
        say(
            f"no snapshot yet for {', '.join(without_snapshot)}: their changes are skipped "
            "(their snapshot will start after this run's position)"
        )
    return targets


def departures(conn: psycopg.Connection, config: PgcdcConfig, targets: dict[TableName, TableTarget]) -> dict[str, str]:
    """One line per departed table that still has its Delta table: why it left (from the catalog now)
    and the fix. The copied relation's OID, recorded with its snapshot, tells a rename from a drop."""
    lines = {}
    for table, target in targets.items():
        if not target.departed or target.log is None or not target.log.being_snapshotted:
            continue
        copied = target.log.columns.relid if target.log.columns is not None else None
        now = relation_oid(conn, table)
        renamed = relation_name(conn, copied) if copied is not None and copied != now else None
        publication = quote_ident(config.publication)
        forget = f"remove its Delta table ({target.path}) once no longer needed, and pgcdc forgets it"
        if renamed is not None:
            why = f"renamed to {renamed}"
            fix = (
                f"{renamed} is a new table to pgcdc: snapshot it (the new-tables sensor or the {SNAPSHOT_JOB} job) "
                f"to replicate it under its new name; {forget}"
            )
        elif now is not None and (copied is None or copied == now):
            why = "removed from the publication"
            fix = (
                f"ALTER PUBLICATION {publication} ADD TABLE {table.quoted}, then re-snapshot it, to replicate it "
                f"again; or {forget}"
            )
        else:
            why = "dropped" if now is None else "dropped; the table created again under its name is not published"
            fix = forget
        lines[str(table)] = (
            f'{table} is no longer published by "{config.publication}" ({why}): its Delta table holds every '
            f"change committed before that and no later one; {fix}"
        )
    return lines


def read_log(destination: Destination, path: str, config: PgcdcConfig, known: TableLog | None = None) -> TableLog:
    """The table's log, with a failure to read the location as one line naming delta.root."""
    try:
        return destination.read_table_log(path, known)
    except PgcdcError:
        raise
    except Exception as exc:  # noqa: BLE001 - storage errors are multi-line and name no fix
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
        raise ConfigurationError(
            f"cannot read the Delta table at {path} ({first_line})",
            f"check delta.root ({config.delta.root}) and delta.storage: it must be a writable location holding the snapshots",
        ) from None
