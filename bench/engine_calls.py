"""Time every call a Spark Connect client makes to its engine, by kind, for the benchmarks' profiles.

``with engine_calls() as calls:`` records each round trip of any Spark Connect session in this
process (executions, analyses such as schema look-ups, configuration reads and writes, artifact
uploads of large local relations) with its duration; :func:`summary` sums them per statement
kind. It wraps the client's methods for the duration of the block: a profile of what pgcdc asks
the engine, not of the engine itself (Spark's own job timings: ``--event-log`` of ``bench.cdc``).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


def spark_sql_timings(directory: str) -> str:
    """Spark's own view from the event logs under ``directory``: each SQL execution's duration and
    jobs, summed per description (the statement's first words), largest total first."""
    import json
    import re
    from pathlib import Path

    started: dict[int, tuple[str, int]] = {}
    jobs: dict[int, int] = defaultdict(int)
    totals: dict[str, list[float]] = defaultdict(list)
    job_count: dict[str, int] = defaultdict(int)
    for log in sorted(path for path in Path(directory).rglob("*") if path.is_file()):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            name = event.get("Event", "")
            if name.endswith("SQLExecutionStart"):
                text = " ".join((event.get("description") or event.get("details") or "?").split())
                text = text.removeprefix("Spark Connect - ").removeprefix("Delta: Spark Connect - ")
                started[event["executionId"]] = (re.sub(r"\d+", "N", text)[:60], event["time"])
            elif name == "SparkListenerJobStart":
                execution = (event.get("Properties") or {}).get("spark.sql.execution.id")
                if execution is not None:
                    jobs[int(execution)] += 1
            elif name.endswith("SQLExecutionEnd") and event["executionId"] in started:
                text, start = started.pop(event["executionId"])
                totals[text].append((event["time"] - start) / 1000)
                job_count[text] += jobs.pop(event["executionId"], 0)
    lines = [f"{'Spark SQL execution':<60} {'n':>4} {'jobs':>5} {'total s':>8} {'max s':>7}"]
    for text, seconds in sorted(totals.items(), key=lambda item: -sum(item[1])):
        lines.append(f"{text:<60} {len(seconds):>4} {job_count[text]:>5} {sum(seconds):>8.3f} {max(seconds):>7.3f}")
    return "\n".join(lines)
