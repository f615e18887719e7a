"""Driving Dagster for the demo: in-process job runs on a persistent instance, their summaries, and ``dagster dev``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from pgcdc_assets.demo.console import DemoFailure, install_signal_handlers, REPO_ROOT, say

QUIET_RUN_CONFIG: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


class DagsterDriver:
    """Runs the code location's jobs in this process on the persistent instance at DAGSTER_HOME.

    The code location is the demo's dg project (``project``, on ``sys.path`` as an installed
    project would be), loaded the way ``dagster dev`` loads it.
    """

    def __init__(self, project: Path, dagster_home: Path) -> None:
        from dagster import DagsterInstance, load_from_defs_folder

        if str(project) not in sys.path:
            sys.path.insert(0, str(project))
        self.defs = load_from_defs_folder(path_within_project=project)
        self.instance = DagsterInstance.from_config(str(dagster_home))

    def run(self, job: str) -> Any:
        try:
            result = self.defs.resolve_job_def(job).execute_in_process(
                run_config=QUIET_RUN_CONFIG, instance=self.instance, raise_on_error=False, tags={"pgcdc/demo": "true"}
            )
        finally:
            install_signal_handlers()
        if not result.success:
            failures = [
                event.step_failure_data.error.message.strip()
                for event in result.all_events
                if event.is_step_failure and event.step_failure_data.error is not None
            ]
            raise DemoFailure(
                f"Dagster run {result.run_id} of {job} failed: {' | '.join(failures) or 'see the run log'}"
            )
        return result

    def close(self) -> None:
        self.instance.dispose()


def materialized(result: Any) -> dict[str, dict[str, Any]]:
    """Per asset (``schema.table``, or ``slot`` for the pipeline's slot asset; history assets left out): its
    materialization metadata as plain values."""
    found = {}
    for event in result.get_asset_materialization_events():
        materialization = event.materialization
        path = materialization.asset_key.path
        if len(path) == 5 and path[2] == "history":  # a table's history asset: shown with its table
            continue
        name = "slot" if path[-1] == "slot" and len(path) == 3 else f"{path[-2]}.{path[-1]}"
        found[name] = {key: value.value for key, value in materialization.metadata.items()}
    return found


def check_summary(result: Any) -> str:
    evaluations = result.get_asset_check_evaluations()
    failed: dict[str, list[str]] = {}
    for evaluation in evaluations:
        if not evaluation.passed:
            failed.setdefault(evaluation.check_name, []).append(evaluation.asset_key.path[-1])
    text = f"checks {len(evaluations) - sum(map(len, failed.values()))}/{len(evaluations)} passed"
    for check, tables in failed.items():
        text += f"; {check} failed for {', '.join(tables)}"
    return text


def reconcile_under_load(driver: DagsterDriver, job: str) -> str:
    """Run the reconcile ``job`` (the load keeps writing) and describe it; a failed check fails the demo."""
    result = driver.run(job)
    evaluations = result.get_asset_check_evaluations()
    summary = check_summary(result)
    if not evaluations or not all(evaluation.passed for evaluation in evaluations):
        raise DemoFailure(f"{job} found Delta different from PostgreSQL: {summary}")
    lsn = evaluations[0].metadata["pgcdc/reconcile_lsn"].value
    return f"reconciled at LSN {lsn} while the load wrote on: {summary} (row counts and per-key-range hashes)"


def describe_run(label: str, assets: dict[str, dict[str, Any]], wall_s: float) -> str:
    """One drain: the slot asset's record of it, and the tables it changed (the only ones it materialized)."""
    slot = assets["slot"]
    parts = [
        f"{name.split('.')[-1]} +{meta['pgcdc/inserted']}/~{meta['pgcdc/updated']}/-{meta['pgcdc/deleted']}"
        for name, meta in assets.items()
        if name != "slot"
    ]
    return (
        f"{label}: {slot['pgcdc/transactions_applied']} transactions, {slot['pgcdc/changes_applied']} changes"
        f" applied to {slot['pgcdc/tables_changed']} table(s), slot asset confirmed_flush_lsn"
        f" {slot['pgcdc/confirmed_flush_lsn']} (drain {slot['pgcdc/duration_s']:.1f} s, Dagster run {wall_s:.1f} s)"
        f"\n  {'  '.join(parts) or 'no table changed: no table materialized'}"
    )


def dagster_dev_command(module: str, port: int) -> list[str]:
    dagster = Path(sys.executable).parent / "dagster"
    return [str(dagster), "dev", "-m", module, "-h", "127.0.0.1", "-p", str(port)]


def _get(url: str, timeout: float = 2.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except OSError:
        return None


def listed_jobs(port: int) -> list[str]:
    query = json.dumps(
        {"query": "{ repositoriesOrError { ... on RepositoryConnection { nodes { jobs { name } } } } }"}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", data=query, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            data = json.load(response)
    except OSError:
        return []
    nodes = data.get("data", {}).get("repositoriesOrError", {}).get("nodes", [])
    return sorted(job["name"] for node in nodes for job in node["jobs"] if not job["name"].startswith("__"))


def serve_dagster(env: dict[str, str], module: str, port: int, stop_after: float | None) -> int:
    """Run ``dagster dev`` on ``module`` until Ctrl-C (or ``stop_after`` seconds once it answers); its exit status."""
    command = dagster_dev_command(module, port)
    log_path = Path(env["DAGSTER_HOME"]) / "dagster-dev.log"
    try:
        with socket.create_server(("127.0.0.1", port)):
            pass
    except OSError:
        raise DemoFailure(
            f"port {port} on 127.0.0.1 is in use: pass --port N (make demo DEMO_ARGS='--port N')"
        ) from None
    say(f"$ {shlex.join(command)}   (output in {log_path})")
    with open(log_path, "wb") as log:
        # Its own session: Ctrl-C reaches only us, and we stop it once, cleanly.
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 180
            while _get(f"http://127.0.0.1:{port}/server_info") is None:
                if process.poll() is not None:
                    raise DemoFailure(f"dagster dev exited with status {process.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise DemoFailure(f"dagster dev did not answer on port {port} within 180 s; see {log_path}")
                time.sleep(0.5)
            jobs = []
            for _ in range(60):  # the code location loads after the webserver answers
                jobs = listed_jobs(port)
                if jobs:
                    break
                time.sleep(1)
            say(f"Dagster UI: http://127.0.0.1:{port}  (jobs: {', '.join(jobs) or 'still loading'})")
            say(
                "  Assets > pgcdc > shop|inventory > slot: every drain (confirmed_flush_lsn, lag, the tables it changed),"
            )
            say(
                "  the lag check and freshness; > <schema> > <table>: a materialization per drain that changed the table;"
            )
            say("  Runs: the snapshot and incremental runs above. Press Ctrl-C to stop.")
            if stop_after is not None:
                time.sleep(stop_after)
            else:
                process.wait()
        except KeyboardInterrupt:
            say("\nstopping dagster dev ...")
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # dagster dev then stops its webserver, daemon and code server
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)  # its own session: the group is dagster dev's
                    process.wait()
    return 0
