"""The snapshot job step through Dagster against raw COPY: what a user sees the first time.

Run ``python -m bench.snapshot_job [--rows N] [--runs N] [--major 18]``. It starts a throwaway
PostgreSQL, loads one table of six columns (bigint key, int, md5 text, numeric(12,2),
timestamptz, bool), then per round:

* the baseline: ``psql -c "COPY t TO STDOUT" > /dev/null``, as in ``bench.snapshot``;
* the code location's own ``pgcdc_snapshot`` job, ``execute_in_process`` on a SQLite instance
  with the embedded engine, into a fresh lake and a fresh slot each round: the step's time (its
  start to its success in the event log, engine start included) and the run's wall time.

It prints both ratios to the baseline, the phases the step recorded (the materialization's
``pgcdc/phase_seconds/...`` metadata), so the start-up can be read apart from the copy, and the CPU
spent: this process's during the step (sampled every 50 ms) and PostgreSQL's during the round (the
postmaster's own and its finished children's, so the baseline's COPY backend is in it too).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import yaml
from dagster import DagsterEventType

from bench.snapshot import psql_copy_seconds
from pgcdc_assets.builder import build_definitions
from resources.names import SNAPSHOT_JOB
from resources.testing.dagster_instance import sqlite_instance
from resources.testing.local_postgres import LocalPostgres, start_local_postgres

TABLE = "events"
DDL = (
    f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, n int, digest text, amount numeric(12,2), at timestamptz, flag bool)"
)
ROWS = (
    f"INSERT INTO {TABLE} SELECT g, g % 100000, md5(g::text), (g % 1000000) / 100.0,"
    " timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second', g % 2 = 0 FROM generate_series(1, %s) g"
)


def load(server: LocalPostgres, rows: int) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute(ROWS.replace("%s", str(int(rows))))
        conn.execute(f"VACUUM ANALYZE {TABLE}")
        conn.execute(f"CREATE PUBLICATION bench_pub FOR TABLE {TABLE}")


def server_cpu_seconds(server: LocalPostgres) -> float:
    """CPU seconds of the server's postmaster and of its children it has reaped (ended sessions)."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(tick) for tick in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@contextmanager
def cpu_samples(interval_s: float = 0.05) -> Iterator[list[tuple[float, float]]]:
    """(wall clock, this process's CPU seconds) every ``interval_s`` while the block runs."""
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while True:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            samples.append((time.time(), usage.ru_utime + usage.ru_stime))
            if done.wait(interval_s):
                return

    thread = threading.Thread(target=sample, name="bench-cpu-samples", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds between the samples nearest after ``start`` and after ``end``."""
    at_start = next(cpu for when, cpu in samples if when >= start)
    at_end = next((cpu for when, cpu in samples if when >= end), samples[-1][1])
    return at_end - at_start


def job_round(
    server: LocalPostgres, work: Path, round_number: int, workers: int | None = None
) -> tuple[float, float, dict[str, float]]:
    """One run of the snapshot job into a fresh lake and slot: (step seconds, run seconds, phases);
    ``workers``: the configuration's ``snapshot.workers`` (None: its default).

    ``phases`` also holds ``pgcdc_cpu_in_step``: this process's CPU seconds during the step."""
    settings = {
        "postgres": {"dsn": server.dsn()}, "publication": "bench_pub", "slot": f"bench_{round_number}",
        "delta": {"root": str(work / f"lake_{round_number}")},
        **({"snapshot": {"workers": workers}} if workers is not None else {}),
    }  # fmt: skip
    config_file = work / f"pgcdc_{round_number}.yaml"
    config_file.write_text(yaml.safe_dump(settings), encoding="utf-8")
    job = build_definitions(config_file).resolve_job_def(SNAPSHOT_JOB)
    with sqlite_instance(work / f"dagster_{round_number}") as instance:
        began = time.monotonic()
        with cpu_samples() as samples:
            result = job.execute_in_process(instance=instance)
        run_seconds = time.monotonic() - began
        assert result.success
        events = {
            event.dagster_event.event_type: event.timestamp
            for event in instance.all_logs(result.run_id)
            if event.dagster_event is not None
        }
        step_seconds = events[DagsterEventType.STEP_SUCCESS] - events[DagsterEventType.STEP_START]
        (materialization,) = result.get_asset_materialization_events()
        metadata = materialization.materialization.metadata
        assert metadata["dagster/row_count"].value > 0
        phases = {
            key.removeprefix("pgcdc/phase_seconds/"): float(value.value)
            for key, value in metadata.items()
            if key.startswith("pgcdc/phase_seconds/")
        }
        phases["pgcdc_cpu_in_step"] = cpu_between(
            samples, events[DagsterEventType.STEP_START], events[DagsterEventType.STEP_SUCCESS]
        )
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (settings["slot"],))
    shutil.rmtree(work / f"lake_{round_number}", ignore_errors=True)
    return step_seconds, run_seconds, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--workers", type=int, help="snapshot.workers (default: the configuration's default)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-snapshot-job-"))
    server = start_local_postgres(args.major, base_dir=work / "pg")
    try:
        load(server, args.rows)
        psql_copy_seconds(server, TABLE)  # warm-up: page cache
        for number in range(args.runs):
            server_cpu = server_cpu_seconds(server)
            copy_s = psql_copy_seconds(server, TABLE)
            step_s, run_s, phases = job_round(server, work, number, args.workers)
            time.sleep(0.5)  # the postmaster reaps the snapshot's sessions
            server_cpu = server_cpu_seconds(server) - server_cpu
            print(
                f"round {number + 1}: COPY {copy_s:.2f} s; snapshot step {step_s:.2f} s ({copy_s / step_s:.2f}x COPY), "
                f"run {run_s:.2f} s ({copy_s / run_s:.2f}x); CPU: pgcdc in the step "
                f"{phases.pop('pgcdc_cpu_in_step'):.2f} s, PostgreSQL in the round {server_cpu:.2f} s; "
                f"load {os.getloadavg()[0]:.1f}"
            )
            print("  phases: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in phases.items()))
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
