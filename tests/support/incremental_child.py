"""Run one incremental drain in its own process: the crash tests SIGKILL it at a fault point.

Usage: python -m tests.support.incremental_child CONFIG.yaml MAX_CHUNK_CHANGES [MAX_REPLACE_VALUES]
(set PGCDC_FAULT_POINT to make it kill itself; see resources/crash_points.py).
"""

from __future__ import annotations

import sys

from resources.cdc.applier import DEFAULT_REPLACE_VALUES
from resources.config import load_config
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.runs.incremental import run_incremental


def main() -> None:
    config = load_config(sys.argv[1])
    replace_values = int(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_REPLACE_VALUES
    with SparkEngine.from_config(config.spark) as engine:
        result = run_incremental(
            config,
            lake_destination(engine.spark, config),
            log=print,
            max_chunk_changes=int(sys.argv[2]),
            max_replace_values=replace_values,
        )
    print(f"confirmed {result.confirmed_flush_lsn}")


if __name__ == "__main__":
    main()
