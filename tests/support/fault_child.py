"""One incremental drain in its own process, for the fault tests (tests/test_faults.py).

Usage: python -m tests.support.fault_child CONFIG.yaml MAX_CHUNK_CHANGES [LSN,LSN...]   (runs ending at each LSN, then one to the end)
       python -m tests.support.fault_child CONFIG.yaml snapshot[:schema.table]   (snapshot_tables instead, of that table only)

``FAULT_CHILD_SNAPSHOT_WRITER`` = ``engine`` | ``delta-rs`` picks the snapshot writer instead of the
engine's capabilities (``engine``: the staged write of Delta on Spark, here on Sail).

Like ``tests.support.incremental_child``, but a ``PgcdcError`` ends the process the way a user
would see it: one line ``pgcdc: <ErrorClass>: <cause>: <fix>`` on stderr and exit status 2
(any other exception keeps its traceback and exits 1). Progress lines go to stdout
unbuffered so the parent can tell when the drain is under way.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from resources.config import load_config
from resources.delta.spark_destination import lake_destination
from resources.engines.capabilities import engine_capabilities, EngineCapabilities, set_engine_capabilities
from resources.engines.engine import SparkEngine
from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables

EXIT_PGCDC_ERROR = 2
SNAPSHOT_WRITER_ENV = "FAULT_CHILD_SNAPSHOT_WRITER"


def use_snapshot_writer(spark: SparkSession, writer: str | None) -> None:
    """Write snapshots with ``writer`` (``engine`` or ``delta-rs``; None: as detected) on ``spark``."""
    if writer is not None:
        detected = engine_capabilities(spark)
        set_engine_capabilities(spark, EngineCapabilities(detected.delta_commands, writer == "delta-rs"))


def main() -> int:
    config = load_config(sys.argv[1])
    with SparkEngine.from_config(config.spark) as engine:
        print(f"engine up {engine.server_pid}", flush=True)  # the engine process pgcdc started, if any
        use_snapshot_writer(engine.spark, os.environ.get(SNAPSHOT_WRITER_ENV))
        try:
            if sys.argv[2].startswith("snapshot"):
                only = [TableName.parse(sys.argv[2].split(":", 1)[1])] if ":" in sys.argv[2] else None
                for done in snapshot_tables(config, lake_destination(engine.spark, config), only):
                    print(f"snapshot {done.table} {done.mode} at {done.snapshot_lsn}", flush=True)
                return 0
            ends = [LSN.parse(mark) for mark in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
            for end in [*ends, None]:  # one process, several runs: a crash point's arrivals count across them
                result = run_incremental(
                    config,
                    lake_destination(engine.spark, config),
                    log=lambda line: print(line, flush=True),
                    max_chunk_changes=int(sys.argv[2]),
                    end_lsn=end,
                )
        except PgcdcError as error:
            print(f"pgcdc: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return EXIT_PGCDC_ERROR
    print(f"confirmed {result.confirmed_flush_lsn} changes {result.changes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
