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
