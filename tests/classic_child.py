"""Snapshot and one drain on an in-process classic Spark session with Delta's jars (Dagster's ``classic`` mode).

Usage: python -m tests.classic_child CONFIG.yaml

Its own process: PySpark cannot build a classic session in a process that has had a Spark
Connect session (``CONNECT_URL_NOT_SET``), and every other test session is Spark Connect.
"""

from __future__ import annotations

import sys

from dagster import build_init_resource_context

from resources.config import load_config
from pgcdc_assets.dagster_resources import SparkDeltaResource
from resources.delta.capabilities import engine_capabilities
from resources.incremental import run_incremental
from resources.snapshot import snapshot_tables


def main() -> None:
    config = load_config(sys.argv[1])
    resource = SparkDeltaResource(mode="classic", spark_config={"spark.master": "local[1]"})
    with resource.yield_for_execution(build_init_resource_context()) as ready:
        spark = ready.spark_session
        assert ".connect." not in type(spark).__module__, "not a classic session"
        print(f"delta commands: {engine_capabilities(spark).delta_commands}", flush=True)
        snapshot_tables(config, spark)
        print("snapshot done", flush=True)
        sys.stdin.readline()  # the parent writes changes, then asks for the drain
        result = run_incremental(config, spark)
    print(f"confirmed {result.confirmed_flush_lsn} changes {result.changes}", flush=True)


if __name__ == "__main__":
    main()
