"""Checks of a snapshot's Delta table that read every row back."""

from __future__ import annotations

import hashlib

from resources.delta.reads import delta_rs_rows


def assert_md5_payloads(path: str, rows: int) -> None:
    """Every row of the Delta table at ``path`` is ``(g, repeat(md5(g::text), 31))`` for g in 1..rows,
    each exactly once: payloads compared value by value (swapped payloads differ), batch by batch."""
    seen = 0
    ids: set[int] = set()
    for batch in delta_rs_rows(path, ["id", "payload"]).to_batches():
        for key, payload in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
            assert payload == hashlib.md5(str(key).encode()).hexdigest() * 31, key
            ids.add(key)
            seen += 1
    assert seen == len(ids) == rows and min(ids) == 1 and max(ids) == rows
