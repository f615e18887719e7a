"""Run one incremental drain in its own process: the crash tests SIGKILL it at a fault point.

Usage: python -m tests.support.incremental_child CONFIG.yaml MAX_CHUNK_CHANGES [MAX_REPLACE_VALUES]
(set PGCDC_FAULT_POINT to make it kill itself; see resources/crash_points.py).
"""

from __future__ import annotations

import sys

from resources.cdc.applier import DEFAULT_REPLACE_VALUES
from resources.config import load_config
from resources.delta.lake_storage import open_lake
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.runs.incremental import run_incremental


def main() -> None:
    config = load_config(sys.argv[1])
    replace_values = int(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_REPLACE_VALUES
    lake = open_lake(config.delta.root, config.delta.storage)
    # an object-store lake reaches embedded Sail through its environment, as the Dagster resource does
    engine_of = (
        SparkEngine.embedded(config.spark.config, lake.engine_environment())
        if lake.is_object_store and not config.spark.remote and config.spark.engine != "spark"
        else SparkEngine.from_config(config.spark)
    )
    with engine_of as engine:
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
