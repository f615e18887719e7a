"""One snapshot or drain in a fresh process, reporting the memory it took where that memory lives.

tracemalloc sees only Python objects, and sampling ``pa.total_allocated_bytes()`` from a thread misses
peaks and everything outside Arrow's pool (delta-rs writes the default engine's snapshots from Rust).
So the memory tests run the work here and read the operating system's account of the process:

* ``baseline_mib``: resident memory (VmRSS) with every module imported and the engine up, right
  before the work; the peak is then reset (``/proc/self/clear_refs``);
* ``peak_mib``: the peak resident memory (VmHWM) during the work, so ``peak_mib - baseline_mib``
  is what the work itself held at its worst, in Python, Arrow, Rust and libpq alike;
* ``arrow_max_mib``: ``pa.default_memory_pool().max_memory()``, the most Arrow's pool held at once;
* ``python_peak_mib``: the most Python's heap held at once during the work (tracemalloc);
* ``arrow_kept_mib``, ``python_kept_mib``: what Arrow's pool and Python's heap still hold once the work is done
  and garbage collected, over what they held before it: a leak, which resident memory is too noisy to see;
* ``engine_peak_mib``: the embedded Sail server's own peak (VmHWM), for drains, whose MERGEs run there.

Usage: python -m tests.support.memory_child snapshot DSN PUBLICATION SCHEMA.TABLE PATH SLOT CHUNK_BYTES WORKERS CHUNK_MB
       python -m tests.support.memory_child drain CONFIG.yaml MAX_CHUNK_CHANGES [MAX_CHUNK_BYTES]
       python -m tests.support.memory_child snapshot-tables CONFIG.yaml   (the configured run: key ranges, say)
       python -m tests.support.memory_child reconcile CONFIG.yaml RANGE_ROWS
Prints one JSON line with the figures above and what the work did: ``rows``, ``chunks``, ``workers``,
``mode`` and the progress reports (snapshot), ``changes`` and the drain's own reading of its peak,
``run_peak_mib`` (drain), each table's ``rows`` and ``chunks`` (snapshot-tables), or whether every table
``passed`` (reconcile).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import deltalake  # noqa: F401 - imported before the baseline: the work must not count module loading
import pyarrow as pa

from resources.config import load_config
from resources.delta.spark_destination import SparkDeltaDestination
from resources.engines.engine import process_memory_mib, SparkEngine
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.reconcile import reconcile
from resources.runs.snapshot import snapshot_table, snapshot_tables, SnapshotProgress

RESET_PEAK = "5"
"""Written to /proc/self/clear_refs: resets VmHWM to the current resident memory (Linux 4.0+)."""


def measured(*arguments: str) -> dict[str, Any]:
    """Run this module with ``arguments`` in a child process; its report (see the module docstring)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.memory_child", *arguments],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2], check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"memory: {report}")
    return report


def _snapshot(engine: SparkEngine, arguments: list[str]) -> dict[str, Any]:
    dsn, publication, table, path, slot, chunk_bytes, workers, chunk_mb = arguments
    progress: list[SnapshotProgress] = []
    result = snapshot_table(
        dsn, publication, TableName.parse(table), SparkDeltaDestination(engine.spark, None), path,
        slot=slot, chunk_bytes=int(chunk_bytes), workers=int(workers), chunk_mb=int(chunk_mb),
        on_progress=progress.append,
    )  # fmt: skip
    return {
        "rows": result.rows, "chunks": result.chunks, "workers": result.workers, "mode": result.mode,
        "progress_chunks": [p.chunks for p in progress],
        "last_chunks_done": progress[-1].chunks_done if progress else None,
        "last_eta_s": progress[-1].eta_s if progress else None,
        "last_progress": progress[-1].describe() if progress else None,
    }  # fmt: skip


def _drain(engine: SparkEngine, arguments: list[str]) -> dict[str, Any]:
    bytes_bound = {"max_chunk_bytes": int(arguments[2])} if len(arguments) > 2 else {}
    drained = run_incremental(
        load_config(arguments[0]), SparkDeltaDestination(engine.spark, None), max_chunk_changes=int(arguments[1]),
        **bytes_bound,
    )  # fmt: skip
    return {"changes": drained.changes, "run_peak_mib": drained.peak_memory_mib}


def _snapshot_tables(engine: SparkEngine, arguments: list[str]) -> dict[str, Any]:
    results = snapshot_tables(load_config(arguments[0]), SparkDeltaDestination(engine.spark, None))
    return {"rows": {str(r.table): r.rows for r in results}, "chunks": {str(r.table): r.chunks for r in results}}


def _reconcile(engine: SparkEngine, arguments: list[str]) -> dict[str, Any]:
    checked = reconcile(
        load_config(arguments[0]), SparkDeltaDestination(engine.spark, None), range_rows=int(arguments[1])
    )
    return {"passed": {name: outcome.passed for name, outcome in checked.tables.items()}, "skipped": checked.skipped}


WORK = {"snapshot": _snapshot, "drain": _drain, "snapshot-tables": _snapshot_tables, "reconcile": _reconcile}


def main() -> None:
    work = WORK[sys.argv[1]]
    with SparkEngine.embedded() as engine:
        gc.collect()
        baseline, _ = process_memory_mib()
        arrow_before = pa.total_allocated_bytes()
        tracemalloc.start()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write(RESET_PEAK)
        done = work(engine, sys.argv[2:])
        _, peak = process_memory_mib()
        gc.collect()
        arrow_kept = pa.total_allocated_bytes() - arrow_before
        python_kept, python_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        _, engine_peak = engine.server_memory_mib()
    report = {
        "baseline_mib": baseline,
        "peak_mib": peak,
        "arrow_max_mib": pa.default_memory_pool().max_memory() / 2**20,
        "arrow_kept_mib": arrow_kept / 2**20,
        "python_kept_mib": python_kept / 2**20,
        "python_peak_mib": python_peak / 2**20,
        "engine_peak_mib": engine_peak,
        **done,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
