"""The columns of a change batch besides the table's own: what the change applier builds and every
Destination reads (the operation, unchanged-TOAST flags, the old key of a key-changing update). Pure
names, no engine."""

from __future__ import annotations

OP_COLUMN = "_pgcdc_op"
"""Merge source column holding 'I', 'U' or 'D' for each change."""


UNCHANGED_PREFIX = "_pgcdc_unchanged_"
"""Merge source columns ``_pgcdc_unchanged_<col>``: True keeps the target's value (unchanged TOAST)."""


OLD_KEY_PREFIX = "_pgcdc_oldkey_"
"""Merge source columns ``_pgcdc_oldkey_<key>``: the row's key before a key-changing update, whose
target row supplies unchanged-TOAST values when the new key has no target row yet."""


def unchanged_flag_column(column: str) -> str:
    return f"{UNCHANGED_PREFIX}{column}"


# The columns of an SCD type 2 table's MERGE source and rows besides the table's own (resources/history/scd2_merge.py).

CURRENT_COLUMN = "_pgcdc_is_current"
"""Whether a version is its key's current one."""
VALID_TO_LSN_COLUMN = "_pgcdc_valid_to_lsn"
"""The commit end LSN of the change that closed a version (NULL while current)."""
MARKER_COLUMN = "_pgcdc_marker"
"""The marker row's marker (the changelog's marker JSON); NULL in every version."""
CLOSE_COLUMN = "_pgcdc_close"
"""MERGE source only: the row closes the current version of its key (or is the marker row); else it is a new version."""
CLOSED_SET = ("_pgcdc_valid_to_lsn", "_pgcdc_valid_to", CURRENT_COLUMN, "_pgcdc_is_deleted", MARKER_COLUMN)
"""The columns a close row (or the marker row) sets on the row it matches."""
