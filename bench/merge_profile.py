"""``python -m bench.merge_profile``: one small table's MERGE on a warm managed Spark, call by call.

The fixed cost of a drain's table on Delta on Spark, counted: a table of 100 rows created as a snapshot
creates it (the engine's empty create, then delta-rs's rows: ``snapshot_writes``), bucketed and with
deletion vectors as pgcdc's defaults make it, then ``--merges`` MERGEs of a batch of ``--changes``
updates (other keys each time) through the production destination (``SparkDeltaDestination.merge_batch``). The last
``--profiled`` MERGEs are profiled: every Spark Connect round trip from this process
(``bench/engine_calls.py``) and every Spark SQL execution, job and stage the engine ran for them, from
its event log. Counts do not depend on the machine's load; times do (the JVM's CPU time beside them is
less bent by it). ``--spark-conf KEY=VALUE`` adds settings to the engine; ``--variants`` MERGEs into a
table of each variant in turn, round after round (:data:`VARIANTS`: session settings around its MERGEs,
or how its table is created).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from bench.engine_calls import engine_calls, spark_event_log_config, spark_events, summary
from bench.spark_variants import variant_set_up
from resources.delta.batch_columns import OP_COLUMN
from resources.delta.dataframes import session_settings
from resources.delta.layout import BUCKET_COLUMN, RANGE, TableLayout
from resources.delta.markers import LSN_COLUMN
from resources.delta.spark_destination import SparkDeltaDestination
from resources.engines.engine import SparkEngine
from resources.engines.kept_spark import SERVERS_DIR_ENV, stop_all

ROWS = 100
LAYOUT = TableLayout(RANGE, ("id",), 100_000)


def table_rows(
    values: list[int], lsn: int, op: str | None = None, width: int = 0, ids: list[int] | None = None
) -> pa.Table:
    """Rows ``ids`` (1.. by default) with ``n`` = values and ``width`` text columns (a MERGE batch when ``op``)."""
    ids = ids or list(range(1, 1 + len(values)))
    columns: dict[str, pa.Array] = {
        "id": pa.array(ids, pa.int32()),
        "n": pa.array(values, pa.int32()),
        **{f"c{i}": pa.array([f"value {value} {i}" for value in values]) for i in range(width)},
        LSN_COLUMN: pa.array([lsn] * len(ids), pa.int64()),
    }
    if op is not None:
        columns[BUCKET_COLUMN] = pa.array([i // LAYOUT.size for i in ids], pa.int64())
        columns[OP_COLUMN] = pa.array([op] * len(ids))
    return pa.table(columns)


def sql_events(directory: Path, since_ms: int, until_ms: int) -> list[dict]:
    """The event log's SQL executions started in [since_ms, until_ms], with their jobs and stages."""
    executions: dict[int, dict] = {}
    jobs: dict[int, int] = {}
    for event in spark_events(directory):
        name = event.get("Event", "")
        if name.endswith("SQLExecutionStart") and since_ms <= event["time"] <= until_ms:
            executions[event["executionId"]] = {
                    "id": event["executionId"], "root": event.get("rootExecutionId", event["executionId"]),
                    "start": event["time"], "end": event["time"], "jobs": 0, "stages": 0, "tasks": 0,
                    "description": event.get("description", "")[:70], "plan": _top(event.get("physicalPlanDescription", "")),
                }  # fmt: skip
        elif name.endswith("SQLExecutionEnd") and event["executionId"] in executions:
            executions[event["executionId"]]["end"] = event["time"]
        elif name == "SparkListenerJobStart":
            execution = (event.get("Properties") or {}).get("spark.sql.execution.id")
            if execution is not None and int(execution) in executions:
                record = executions[int(execution)]
                record["jobs"] += 1
                record["stages"] += len(event.get("Stage Infos", []))
                record["tasks"] += sum(stage.get("Number of Tasks", 0) for stage in event.get("Stage Infos", []))
                record.setdefault("sites", []).append(_delta_site(event.get("Stage Infos", [])))
                jobs[event["Job ID"]] = int(execution)
    return sorted(executions.values(), key=lambda record: record["start"])


def jvm_cpu_s(pid: int | None) -> float:
    """The JVM's CPU seconds so far (user + system, from /proc): less bent by the machine's load than wall time."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delta_site(stages: list[dict]) -> str:
    """The innermost Delta frames of the job's call site (its last stage's details): what in Delta ran it."""
    details = (stages[-1].get("Details", "") if stages else "").splitlines()
    frames = [line.strip() for line in details if "sql.delta." in line]
    return " < ".join(
        frame.split("(")[0].rsplit(".", 2)[-2] + "." + frame.split("(")[0].rsplit(".", 1)[-1] for frame in frames[:4]
    )


def _top(plan: str) -> str:
    body = plan.split("\n\n")[0].splitlines()[1:4]
    return " > ".join(line.strip(" :+*-").split(" (")[0] for line in body)


VARIANTS: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "base": ({}, {}),
    "with-aqe": ({"spark.sql.adaptive.enabled": "true"}, {}),
    "all-stats": ({}, {"all_stats": True}),
    "no-dv": ({}, {"deletion_vectors": False}),
    "no-repartition": ({"spark.databricks.delta.merge.repartitionBeforeWrite.enabled": "false"}, {}),
    "inset": ({"spark.sql.optimizer.inSetConversionThreshold": "0"}, {}),
    "no-stats-skipping": ({"spark.databricks.delta.stats.skipping": "false"}, {}),
    "no-checksum": ({"spark.databricks.delta.writeChecksumFile.enabled": "false"}, {}),
    "snapshot-1": ({"spark.databricks.delta.snapshotPartitions": "1"}, {}),
    "no-wholestage": ({"spark.sql.codegen.wholeStage": "false"}, {}),
    "no-codegen": ({"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}, {}),
}
"""name -> (session settings around its MERGEs, how its table is created): each variant MERGEs into a table of
its own. ``base`` is pgcdc as built; ``with-aqe`` and ``all-stats`` undo its choices (docs/engine-notes.md,
"A small table's MERGE on Delta on Spark"); the others are settings that were tried."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.merge_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--merges", type=int, default=6, help="MERGEs into each table (the first ones warm up)")
    parser.add_argument("--profiled", type=int, default=1, help="the last MERGEs profiled")
    parser.add_argument("--changes", type=int, default=10, help="rows per MERGE batch, other keys each time")
    parser.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="the engine's")
    parser.add_argument("--variants", default="base", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--width", type=int, default=0, help="text columns besides id and n")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows in each table (buckets of 100,000 keys)")
    parser.add_argument("--sites", action="store_true", help="print each job's Delta call site")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pgcdc-merge-profile-"))
    os.environ[SERVERS_DIR_ENV] = str(work / "spark-servers")
    events = work / "events"
    events.mkdir()
    config = dict(setting.split("=", 1) for setting in args.spark_conf) | spark_event_log_config(str(events))
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    try:
        with SparkEngine.managed_spark(config, keep_alive_s=600) as engine:
            destination = SparkDeltaDestination(engine.spark, None)
            destination.prepare_writes()
            marker = json.dumps({"pgcdc": {"kind": "snapshot", "lsn": 1, "layout": LAYOUT.to_json()}})
            for name in variants:
                settings, options = VARIANTS[name]
                with (
                    session_settings(engine.spark, settings),
                    variant_set_up("all-stats" if options.get("all_stats") else name),
                ):
                    destination.write_snapshot(
                        table_rows([0] * args.rows, 1, width=args.width), table_rows([0], 1, width=args.width).schema, str(work / "lake" / name),
                        marker, layout=LAYOUT, deletion_vectors=bool(options.get("deletion_vectors", True)),
                    )  # fmt: skip
            for merge in range(args.merges):
                for name in variants:
                    settings, _ = VARIANTS[name]
                    changes = min(args.rows, args.changes)  # other keys in every MERGE, spread, as drains bring
                    stride = args.rows // changes
                    ids = [1 + (merge % stride) + i * stride for i in range(changes)]
                    batch = table_rows([merge + 1] * changes, 100 + merge, "U", args.width, ids)
                    with session_settings(engine.spark, settings):
                        since = int(time.time() * 1000)
                        began, cpu_began = time.perf_counter(), jvm_cpu_s(engine.server_pid)
                        with engine_calls() as calls:
                            destination.merge_batch(str(work / "lake" / name), batch, ["id"])
                        took = time.perf_counter() - began
                        cpu[name].append(jvm_cpu_s(engine.server_pid) - cpu_began)
                        until = int(time.time() * 1000)
                    times[name].append(took)
                    print(
                        f"{name}: MERGE {merge + 1}: {took:.3f} s, JVM CPU {cpu[name][-1]:.2f} s, "
                        f"{len(calls)} Spark Connect calls",
                        flush=True,
                    )
                    if merge >= args.merges - args.profiled:
                        time.sleep(1.0)  # the event log's last lines
                        print(summary(calls))
                        _print_executions(sql_events(events, since, until), args.sites)
            print(f"load {os.getloadavg()[0]:.1f}; after the first MERGE, medians:")
            for name in variants:
                print(
                    f"  {name:<24} {statistics.median(times[name][1:] or times[name]):.3f} s, "
                    f"JVM CPU {statistics.median(cpu[name][1:] or cpu[name]):.2f} s"
                )
    finally:
        stop_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _print_executions(listed: list[dict], sites: bool) -> None:
    roots = [record for record in listed if record["root"] == record["id"]]
    print(
        f"  {len(listed)} SQL executions ({len(roots)} statements), "
        f"{sum(r['jobs'] for r in listed)} jobs, {sum(r['stages'] for r in listed)} stages, "
        f"{sum(r['tasks'] for r in listed)} tasks"
    )
    for record in listed:
        indent = "" if record["root"] == record["id"] else "  "
        print(
            f"  {indent}{record['end'] - record['start']:>6} ms  jobs {record['jobs']} "
            f"stages {record['stages']} tasks {record['tasks']:>3}  {record['plan'][:90]}"
        )
        for site in record.get("sites", []) if sites else []:
            print(f"        job: {site}")


if __name__ == "__main__":
    raise SystemExit(main())
