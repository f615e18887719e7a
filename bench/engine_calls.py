"""Time every call a Spark Connect client makes to its engine, by kind, for the benchmarks' profiles.

``with engine_calls() as calls:`` records each round trip of any Spark Connect session in this
process (executions, analyses such as schema look-ups, configuration reads and writes, artifact
uploads of large local relations) with its duration; :func:`summary` sums them per statement
kind. It wraps the client's methods for the duration of the block: a profile of what pgcdc asks
the engine, not of the engine itself (Spark's own job timings: :func:`spark_sql_timings`, from the
event log ``bench.cdc --profile`` has a managed Spark write).
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.connect.client.core import SparkConnectClient


@dataclass(frozen=True, slots=True)
class EngineCall:
    kind: str
    seconds: float


def _describe_plan(request: Any) -> str:
    """``command:sql MERGE INTO ...`` / ``command:write_operation`` / ``relation:read`` for an execution."""
    plan = request.plan
    if plan.WhichOneof("op_type") == "command":
        command = plan.command
        kind = command.WhichOneof("command_type") or "?"
        if kind == "sql_command":
            text = command.sql_command.sql or command.sql_command.input.sql.query
            return f"sql {' '.join(text.split()[:2])}{_target(text)}"
        if kind == "write_operation":
            return f"write {command.write_operation.source or 'parquet'} {command.write_operation.mode}"
        return kind
    relation = plan.root
    kind = relation.WhichOneof("rel_type")
    return f"collect {kind}" + (_target(relation.sql.query) if kind == "sql" else "")


def _target(text: str) -> str:
    """`` <name>`` of the first Delta table a statement names (``delta.`<root>/<schema>/<name>```), else ``""``:
    a table's MERGE and its history's are told apart."""
    match = re.search(r"delta\.`([^`]*)`", text)
    return f" {match.group(1).rstrip('/').rsplit('/', 1)[-1]}" if match else ""


@contextmanager
def engine_calls() -> Iterator[list[EngineCall]]:
    calls: list[EngineCall] = []
    originals: dict[str, Callable[..., Any]] = {}

    def timed(name: str, describe: Callable[..., str], iterator: bool = False) -> None:
        original = getattr(SparkConnectClient, name)
        originals[name] = original

        if iterator:

            def wrapper(self: SparkConnectClient, *args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    yield from original(self, *args, **kwargs)
                finally:
                    calls.append(EngineCall(describe(*args, **kwargs), time.perf_counter() - started))
        else:

            def wrapper(self: SparkConnectClient, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                started = time.perf_counter()
                try:
                    return original(self, *args, **kwargs)
                finally:
                    calls.append(EngineCall(describe(*args, **kwargs), time.perf_counter() - started))

        setattr(SparkConnectClient, name, wrapper)

    timed(
        "_execute_and_fetch_as_iterator", lambda request, *a, **k: f"execute {_describe_plan(request)}", iterator=True
    )
    timed("_analyze", lambda method, **k: f"analyze {method}")
    timed("config", lambda operation: f"config {operation.WhichOneof('op_type')}")
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(SparkConnectClient, name, original)


def summary(calls: list[EngineCall]) -> str:
    """One line per kind: count, total and largest seconds, largest total first."""
    totals: dict[str, list[float]] = defaultdict(list)
    for call in calls:
        totals[call.kind].append(call.seconds)
    lines = [f"{'engine call':<48} {'n':>4} {'total s':>8} {'max s':>7}"]
    for kind, seconds in sorted(totals.items(), key=lambda item: -sum(item[1])):
        lines.append(f"{kind:<48} {len(seconds):>4} {sum(seconds):>8.3f} {max(seconds):>7.3f}")
    lines.append(f"{'all':<48} {len(calls):>4} {sum(call.seconds for call in calls):>8.3f}")
    return "\n".join(lines)


def spark_event_log_config(directory: str) -> dict[str, str]:
    """Settings that make a managed Spark write its event log (its own job and SQL timings) under ``directory``."""
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.compress": "false",
        "spark.eventLog.dir": f"file://{directory}",
    }


def spark_events(directory: str | Path) -> Iterator[dict[str, Any]]:
    """Every event of the Spark event logs under ``directory`` (uncompressed: :func:`spark_event_log_config`)."""
    for log in sorted(path for path in Path(directory).rglob("*") if path.is_file()):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                yield json.loads(line)


def spark_sql_timings(directory: str) -> str:
    """Spark's own view from the event logs under ``directory``: every SQL execution in the order it
    started (a statement such as a MERGE, and the executions Delta runs inside it: log replay, file
    skipping, the join, the writes), named by its physical plan's top operators, with its duration,
    its jobs' total time and its tasks' CPU time; then the statements' total against their jobs':
    what is left is the driver's own work (analysis, planning, code generation, the commit).

    Over Spark Connect every job carries the session's description, so the plan names them."""
    executions: dict[int, dict[str, Any]] = {}
    job_execution: dict[int, int] = {}
    job_started: dict[int, int] = {}
    stage_job: dict[int, int] = {}
    for event in spark_events(directory):
        name = event.get("Event", "")
        if name.endswith("SQLExecutionStart"):
            executions[event["executionId"]] = {
                    "start": event["time"], "end": None, "label": _plan_label(event.get("physicalPlanDescription", "")),
                    "root": event.get("rootExecutionId", event["executionId"]), "jobs": 0, "job_ms": 0, "cpu_ns": 0,
                }  # fmt: skip
        elif name.endswith("SQLExecutionEnd") and event["executionId"] in executions:
            executions[event["executionId"]]["end"] = event["time"]
        elif name == "SparkListenerJobStart":
            execution = (event.get("Properties") or {}).get("spark.sql.execution.id")
            if execution is not None and int(execution) in executions:
                job_execution[event["Job ID"]] = int(execution)
                job_started[event["Job ID"]] = event["Submission Time"]
                executions[int(execution)]["jobs"] += 1
                for stage in event.get("Stage Infos", []):
                    stage_job[stage["Stage ID"]] = event["Job ID"]
        elif name == "SparkListenerJobEnd" and event["Job ID"] in job_execution:
            execution = executions[job_execution[event["Job ID"]]]
            execution["job_ms"] += event["Completion Time"] - job_started[event["Job ID"]]
        elif name == "SparkListenerTaskEnd" and stage_job.get(event["Stage ID"]) in job_execution:
            execution = executions[job_execution[stage_job[event["Stage ID"]]]]
            execution["cpu_ns"] += (event.get("Task Metrics") or {}).get("Executor CPU Time", 0)
    if not executions:
        return "Spark SQL executions: none logged"
    first = min(execution["start"] for execution in executions.values())
    lines = [
        f"{'Spark SQL execution (by its plan)':<60} {'at s':>7} {'took s':>7} {'jobs':>4} {'in jobs s':>9} {'task CPU s':>10}"
    ]
    for _, execution in sorted(executions.items(), key=lambda item: item[1]["start"]):
        took = ((execution["end"] or execution["start"]) - execution["start"]) / 1000
        indent = "" if execution["root"] == _ else "  "
        lines.append(
            f"{(indent + execution['label'])[:60]:<60} {(execution['start'] - first) / 1000:>7.2f} {took:>7.2f} "
            f"{execution['jobs']:>4} {execution['job_ms'] / 1000:>9.2f} {execution['cpu_ns'] / 1e9:>10.2f}"
        )
    roots = [execution for key, execution in executions.items() if execution["root"] == key and execution["end"]]
    wall = sum(execution["end"] - execution["start"] for execution in roots) / 1000
    in_jobs = sum(execution["job_ms"] for execution in executions.values()) / 1000
    cpu = sum(execution["cpu_ns"] for execution in executions.values()) / 1e9
    lines.append(
        f"statements {wall:.2f} s, of which in jobs {in_jobs:.2f} s (task CPU {cpu:.2f} s); "
        f"the driver's own work (analysis, planning, code generation, commits) the other {wall - in_jobs:.2f} s"
    )
    return "\n".join(lines)


def _plan_label(plan: str) -> str:
    """What a physical plan scans and its top operators, e.g. ``Execute MergeIntoCommand`` or
    ``[Scan json] AdaptiveSparkPlan > SerializeFromObject > MapPartitions``."""
    import re

    body = plan.split("\n\n")[0].splitlines()[1:]
    operators = [re.sub(r"^[\s:+*-]*|\s*\(\d+\)$", "", line) for line in body]
    scans = sorted({operator.split(" - ")[0].split(" #")[0] for operator in operators if "Scan" in operator})
    top = " > ".join(operators[:3])
    return f"[{', '.join(scans)}] {top}" if scans else top
