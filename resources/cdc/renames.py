"""Telling a column added since the snapshot from an older column under a new name.

A Relation message lists the published columns by name, in attnum order, without their numbers.
When a name is new to pgcdc, it is either a column added since (ADD COLUMN: its existing rows hold
NULL, or the default the catalog records) or an older column whose existing values never reached
the stream: renamed (RENAME COLUMN keeps the attnum), or newly published by a changed column list.
Taking the second for the first leaves those values NULL in Delta. A new name before a column
pgcdc has is either a renamed column or, with every known column after it dropped and added again
under its name (``ALTER TABLE t DROP b, ADD c ..., ADD b``: :func:`behind_new_columns`), an ADD;
a new name after all of them, with a column gone at the same time, reads exactly as a DROP and an
ADD would. A known name whose type changed may be a column added again too (:func:`added_again`).
Either way the known columns taken for added again count as gone and new at once below, and the
rows Delta has get what PostgreSQL gave them (``SchemaReconciler._added_again``).

The catalog tells them apart, with the numbers the table's snapshot recorded
(:class:`~resources.names.ColumnNumbers`). PostgreSQL never reuses an attnum: a renamed
column keeps its number, a dropped one stays in pg_attribute as dropped, an added one takes a number
above every number the table had. But the catalog is read now, not at the Relation message's position
in the WAL, so a rule may only rely on facts later DDL cannot undo: a number dropped now was either
dropped by then or dropped later; a number live now was live then. A new name is taken as added only
when the catalog proves it:

1. it is a live column now, numbered above the snapshot's attribute count (it did not exist then);
2. every snapshot column gone from the message is dropped now (a live number means it was renamed,
   or taken out of the column list);
3. every other column gone from the message (added since the snapshot) can have left a dropped
   number between the snapshot's count and the first new column's number: at least that many
   dropped numbers lie there.

A known name taken for a column added again (behind a new column, or retyped) passes the same rules:
its snapshot number must be dropped now and its live number lie above the snapshot's count (a column
added since the snapshot and added again: rule 3 counts it). What no catalog read can tell is refused
too: the new column is gone again (renamed or dropped since), or the snapshot recorded no numbers (a
snapshot by an older pgcdc, or its commit left the log). Each refusal fails the drain with the re-snapshot fix; nothing past it is confirmed.

Left undecidable, and taken as DROP and ADD: a rename of the last column followed, before pgcdc reads
the catalog, by dropping the renamed column and adding one of the same name again; a rename of a column
that was dropped and added again under its snapshot name; a rename of a column added since the snapshot
when columns pgcdc never saw (added and dropped with no change of the table in between) fill the gap
rule 3 counts; a snapshot column widened in place at the Relation message, then dropped and added again
under its name and new type before pgcdc reads the catalog (taken as added again at the widening: the rows
Delta has then get NULL or the default, and rows changed before the DROP keep their values where
PostgreSQL has NULL, as for a DROP and ADD that changes nothing in the message). docs/guarantees.md,
"Schema changes".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from resources.names import ColumnNumbers

Attributes = list[tuple[int, str, bool]]
"""(attnum, name, dropped) of every user column of the table, as the catalog holds them now."""


def behind_new_columns(seen: Sequence[str], names: Sequence[str]) -> list[str]:
    """The columns of ``names`` (a Relation message, in attnum order) that pgcdc knows (``seen``) but that
    stand after a column new to it. ADD COLUMN takes a number above every other, so either the new column
    is an older one under a new name (a RENAME COLUMN) or each of these is a column of the same name
    added again since (DROP and ADD): :func:`unproven_addition` asks the catalog which."""
    known = set(seen)
    first_new = next((i for i, name in enumerate(names) if name not in known), len(names))
    return [name for name in names[first_new:] if name in known]


def added_again(
    recorded: ColumnNumbers | None, names: Sequence[str], attributes: Callable[[], Attributes]
) -> list[str]:
    """The columns of ``names`` the catalog proves to be columns of the same name added since the snapshot
    (DROP and ADD): the snapshot's number of the name is dropped now, and the name's live number lies above
    the snapshot's attribute count. A dropped number stays dropped and a live one was live since it was
    added, so no later DDL makes this true of a column the Relation message still held under its snapshot number
    (but a column both retyped at the message and dropped and added again later: module docstring)."""
    if recorded is None or not names:
        return []
    catalog = attributes()
    live = {name: attnum for attnum, name, dropped in catalog if not dropped}
    dropped = {attnum for attnum, _, is_dropped in catalog if is_dropped}
    return [name for name in names if recorded.attnums.get(name) in dropped and live.get(name, 0) > recorded.count]


def unproven_addition(
    recorded: ColumnNumbers | None,
    seen: Sequence[str],
    names: Sequence[str],
    attributes: Callable[[], Attributes],
    again: Sequence[str] = (),
) -> str | None:
    """Why the columns of ``names`` (a Relation message) not in ``seen`` (the previous Relation
    message's columns, or Delta's), and those of ``again`` (in both, but taken for a column of the same
    name added again: DROP and ADD), cannot be taken as added since, or None when the catalog proves
    they were (or none is new). ``attributes`` reads the catalog, called only when a column is new."""
    known = set(seen)
    present = set(names)
    new = [name for name in names if name not in known or name in again]
    gone = [name for name in seen if (name not in present or name in again) and not name.startswith("_pgcdc_")]
    if not new:
        return None
    if recorded is None:
        if again:
            return (
                f"column(s) {', '.join(again)} stand after a column new to pgcdc (a RENAME COLUMN, or DROP and ADD "
                "of a column of the same name), and the table's snapshot recorded no column numbers to tell them apart"
            )
        if not gone:
            return None  # an ADD as pgcdc always took it; a rename needs a column gone
        return (
            f"column(s) {', '.join(new)} appeared as {', '.join(gone)} disappeared, and the table's snapshot "
            "recorded no column numbers to tell a RENAME COLUMN from DROP and ADD"
        )
    catalog = attributes()
    live = {name: attnum for attnum, name, dropped in catalog if not dropped}
    dropped = {attnum for attnum, _, is_dropped in catalog if is_dropped}
    for name in new:
        attnum = live.get(name)
        if attnum is None:
            if gone:
                return (
                    f"column {name!r} appeared as {', '.join(gone)} disappeared and is gone again: "
                    "whether it was a renamed column cannot be told"
                )
            continue  # added and dropped again: SchemaReconciler._fills warns
        if attnum <= recorded.count:
            return (
                f"column {name!r} existed when the table was snapshotted (a RENAME COLUMN, or a column newly "
                "published by a changed column list): its existing values are not in the stream"
            )
    if not gone:
        return None
    for name in gone:
        attnum = recorded.attnums.get(name)
        if attnum is not None and attnum not in dropped:
            return (
                f"column {name!r} disappeared but is not dropped in PostgreSQL (a RENAME COLUMN, or a column "
                f"taken out of the column list): {', '.join(new)} may hold its values, which are not in the stream"
            )
    added_since = [name for name in gone if name not in recorded.attnums]
    first_new = min(live[name] for name in new)
    room = sum(1 for attnum in dropped if recorded.count < attnum < first_new)
    if room < len(added_since):
        return (
            f"column(s) {', '.join(new)} appeared as {', '.join(added_since)} disappeared, and PostgreSQL holds "
            f"{room} column(s) dropped before them since the snapshot: a RENAME COLUMN, whose existing values "
            "are not in the stream"
        )
    return None
