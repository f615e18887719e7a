"""One MERGE's cost with and without the source keys' range bounding the target, on one engine.

Run ``python -m bench.merge_keys [--rows N] [--source N] [--runs N] [--engine E]``. It writes a
deletion-vector Delta table of ``--rows`` rows (bigint key, text, bigint), then per round and per
variant (the MERGE as pgcdc writes it, and the same MERGE without the ``t.<key> BETWEEN`` conjunct
that ``resources/delta/merge.py`` adds for a source of more keys than its key list takes) two
MERGEs of ``--source`` rows: one of new keys above every key in the table, one of updates of
existing keys. The variants alternate on the same table, so a busy machine slows both alike. At
the end the table must hold every key once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from bench.lakes import open_engine
from resources.delta import merge
from resources.delta.batch_columns import OP_COLUMN
from resources.delta.reads import delta_rs_rows
from resources.delta.snapshot_writes import write_snapshot

WITH_RANGE = merge._key_lists


def without_range(source: pa.Table, key_columns: Sequence[str]) -> list[str]:
    return [conjunct for conjunct in WITH_RANGE(source, key_columns) if " BETWEEN " not in conjunct]


def rows(first: int, end: int, op: str | None, tag: int) -> pa.Table:
    keys = pa.array(range(first, end), pa.int64())
    table = pa.table(
        {"id": keys, "name": pc.cast(keys, pa.string()), "tag": pa.array([tag] * (end - first), pa.int64())}
    )
    return table if op is None else table.append_column(OP_COLUMN, pa.array([op] * (end - first)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--source", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine", default="sail", help="sail, spark or sc://host:port")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-merge-keys-"))
    try:
        with open_engine(args.engine, str(work), {}) as engine:
            path = str(work / "table")
            base = rows(1, args.rows + 1, None, 0)
            write_snapshot(engine.spark, base, base.schema, path, "{}", deletion_vectors=True)
            next_key, tag = args.rows + 1, 0
            for number in range(args.runs):
                for variant, key_lists in (("without the range", without_range), ("with the range", WITH_RANGE)):
                    merge._key_lists = key_lists
                    tag += 1
                    inserts = rows(next_key, next_key + args.source, "I", tag)
                    next_key += args.source
                    began = time.perf_counter()
                    merge.merge_batch(engine.spark, path, inserts, ["id"])
                    insert_s = time.perf_counter() - began
                    first = 1 + (number * args.source) % args.rows
                    updates = rows(first, min(first + args.source, args.rows + 1), "U", tag)
                    began = time.perf_counter()
                    merge.merge_batch(engine.spark, path, updates, ["id"])
                    update_s = time.perf_counter() - began
                    print(
                        f"round {number + 1}, {variant}: MERGE of {args.source:,} new keys {insert_s:.2f} s, "
                        f"of {updates.num_rows:,} updates {update_s:.2f} s (load {os.getloadavg()[0]:.1f})"
                    )
            merge._key_lists = WITH_RANGE
        table = delta_rs_rows(path, ["id"])
        assert table.num_rows == next_key - 1 and pc.count_distinct(table.column("id")).as_py() == next_key - 1
        print(f"check: {table.num_rows:,} rows, each key once")
    finally:
        merge._key_lists = WITH_RANGE
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
