"""Snapshot, drains and table maintenance with Delta's own commands on an in-process classic
Spark session with Delta's jars (Dagster's ``classic`` mode).

Usage: python -m tests.support.classic_child CONFIG.yaml MAINTAINED_TABLE_PATH[,PATH...] RETENTION_HOURS

After the snapshot it reads commands from stdin, one a line, so the parent can write changes and
look at the lake in between: ``drain`` (an incremental run), ``maintain`` (the maintained tables, one JSON list),
``quit``. Each answers with one line on stdout.

Its own process: PySpark cannot build a classic session in a process that has had a Spark
Connect session (``CONNECT_URL_NOT_SET``), and every other test session is Spark Connect.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from dagster import build_init_resource_context

from pgcdc_assets.dagster_resources import SparkDeltaResource
from resources.config import load_config
from resources.delta.lake_storage import LakeStorage
from resources.delta.maintenance import maintain_table
from resources.delta.spark_destination import lake_destination
from resources.engines.capabilities import engine_capabilities
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.engine_fixtures import SUITE_SPARK_CONFIG


def main() -> None:
    config = load_config(sys.argv[1])
    resource = SparkDeltaResource(mode="classic", spark_config={"spark.master": "local[1]", **SUITE_SPARK_CONFIG})
    with resource.yield_for_execution(build_init_resource_context()) as ready:
        spark = ready.spark_session
        assert ".connect." not in type(spark).__module__, "not a classic session"
        print(f"delta commands: {engine_capabilities(spark).delta_commands}", flush=True)
        snapshot_tables(config, lake_destination(spark, config))
        print("snapshot done", flush=True)
        for command in sys.stdin:
            if command.strip() == "drain":
                result = run_incremental(config, lake_destination(spark, config))
                print(f"confirmed {result.confirmed_flush_lsn} changes {result.changes}", flush=True)
            elif command.strip() == "maintain":
                done = [
                    dataclasses.asdict(
                        maintain_table(
                            path,
                            LakeStorage(config.delta.root, config.delta.storage),
                            retention_hours=float(sys.argv[3]),
                            target_file_bytes=1 << 27,
                            spark=spark,
                        )
                    )  # fmt: skip
                    for path in sys.argv[2].split(",")
                ]
                print(f"maintained {json.dumps(done)}", flush=True)
            else:
                return


if __name__ == "__main__":
    main()
