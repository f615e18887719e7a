"""Soak: incremental runs back to back while pgbench writes at a steady rate; exact at the end.

Run ``make soak`` or ``python -m bench.soak [--seconds 120] [--rate 200] [--clients 4] [--major 18]``.

It starts a throwaway PostgreSQL, loads pgbench's TPC-B-like schema (``pgbench -i``),
publishes the four pgbench tables and snapshots them into Delta (which creates the slot).
Then ``pgbench -c CLIENTS -R RATE -T SECONDS`` (the server's own binary) runs while
``run_incremental`` fires back to back in this process, each run on its own embedded Sail
engine as a Dagster run would have (Sail 0.7.2 keeps ~100 KB per operation until its process
exits; see docs/engine-notes.md). After each run it records the slot's lag after the run, the
memory in use (this process's RSS plus the Sail server's) and the run's changes/s. When
pgbench stops, a final drain runs and the oracle compares all four tables with PostgreSQL
value for value; ``pgbench_history`` has no primary key, so it is insert-only and every row
must be appended exactly once.

Printed at the end: sustained changes/s over the load phase, worst lag seen, the RSS trend
(first, last, peak, least-squares slope per run over the second half), and the oracle result.
Exit status 1 if the oracle fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import process_memory_mib, SparkEngine
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import bin_dir_for, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres, delta_rows

PUBLICATION = "soak_pub"
SLOT = "soak_slot"
DATABASE = "soak"
TABLES = {
    "public.pgbench_accounts": ("aid",),
    "public.pgbench_branches": ("bid",),
    "public.pgbench_tellers": ("tid",),
    "public.pgbench_history": (),  # no primary key: insert-only, appended exactly once
}


@dataclass(frozen=True)
class RunRecord:
    index: int
    at_s: float
    duration_s: float
    changes: int
    transactions: int
    lag_before: int
    lag_after: int
    rss_mib: float

    @property
    def changes_per_second(self) -> float:
        return self.changes / self.duration_s if self.duration_s > 0 else 0.0


def drain_once(config: PgcdcConfig, chunk: int) -> tuple[IncrementalResult, float]:
    """One incremental run on its own embedded engine, as each Dagster run gets one; returns the
    result and the memory in use at its end: this process's RSS plus the Sail server's."""
    with SparkEngine.embedded() as engine:
        result = run_incremental(config, lake_destination(engine.spark, config), max_chunk_changes=chunk)
        server_rss, _ = engine.server_memory_mib()
    return result, process_memory_mib()[0] + server_rss


def slot_lag(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((lag,),) = conn.execute(
            "SELECT pg_current_wal_flush_lsn() - confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
            (SLOT,),
        ).fetchall()
    return int(lag)


def equal_with_padding(dsn: str, table: str, path: str) -> bool:
    """Delta vs PostgreSQL with values as psycopg loads them (char(n) keeps its blank padding).

    resources/testing/verify.py compares string columns as ``column::text``, and PostgreSQL's cast of
    char(n) to text strips the padding pgcdc keeps (docs/type-mapping.md), so pgbench's
    ``filler char(n)`` columns differ there although Delta holds PostgreSQL's value. Enough for
    the pgbench tables, whose columns are integers and char(n).
    """
    from collections import Counter

    schema, rows = delta_rows(path)
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(f"SELECT * FROM {table}")
        names = [column.name for column in cursor.description or []]
        pg_rows = Counter(tuple(row) for row in cursor.fetchall())
    return Counter(tuple(row[name] for name in names) for row in rows) == pg_rows


def slope(values: list[float]) -> float:
    """Least-squares slope per step; 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=120, help="how long pgbench writes (default 120)")
    parser.add_argument("--rate", type=int, default=200, help="pgbench -R: transactions per second (default 200)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench -c (default 4)")
    parser.add_argument("--scale", type=int, default=1, help="pgbench -i -s (default 1: 100,000 accounts)")
    parser.add_argument("--major", type=int, default=18, help="PostgreSQL major version (15 or 18)")
    parser.add_argument("--chunk", type=int, default=200_000, help="max changes per chunk")
    parser.add_argument("--keep", action="store_true", help="keep the lake and the server's directory")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="pgcdc-soak-"))
    server = start_local_postgres(args.major, {"max_wal_size": "1GB"}, base_dir=work / "pg")
    pgbench = str(bin_dir_for(args.major) / "pgbench")
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DATABASE}")
        dsn = server.dsn(DATABASE)
        conn_args = ["-h", "127.0.0.1", "-p", str(server.port), "-U", server.superuser]
        subprocess.run(
            [pgbench, "-i", "-q", "-s", str(args.scale), *conn_args, DATABASE], check=True, capture_output=True
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(TABLES)}")
        config = parse_config(
            {"postgres": {"dsn": dsn}, "publication": PUBLICATION, "slot": SLOT, "delta": {"root": str(work / "lake")}}
        )
        with SparkEngine.embedded() as engine:
            began = time.monotonic()
            snapshot_tables(config, lake_destination(engine.spark, config), None)
            print(f"PostgreSQL {args.major}, pgbench scale {args.scale}: snapshot in {time.monotonic() - began:.1f} s")
        print(f"pgbench -c {args.clients} -R {args.rate} -T {args.seconds}; incremental runs back to back")
        print(
            f"{'run':>4} {'at s':>6} {'dur s':>6} {'changes':>8} {'chg/s':>8} {'lag before':>11} {'lag after':>10} {'RSS MiB':>8}"
        )
        load = subprocess.Popen(
            [pgbench, "-n", "-c", str(args.clients), "-j", str(min(args.clients, 2)), "-R", str(args.rate),
             "-T", str(args.seconds), *conn_args, DATABASE],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        records: list[RunRecord] = []
        load_began = time.monotonic()
        try:
            while load.poll() is None:
                result, memory = drain_once(config, args.chunk)
                records.append(
                    RunRecord(
                        len(records) + 1,
                        time.monotonic() - load_began,
                        result.duration_s,
                        result.changes,
                        result.transactions,
                        result.lag_bytes_before,
                        result.lag_bytes_after,
                        memory,
                    )  # fmt: skip
                )
                r = records[-1]
                print(
                    f"{r.index:>4} {r.at_s:>6.1f} {r.duration_s:>6.2f} {r.changes:>8} {r.changes_per_second:>8.0f}"
                    f" {r.lag_before:>11} {r.lag_after:>10} {r.rss_mib:>8.0f}",
                    flush=True,
                )
        finally:
            if load.poll() is None:
                load.terminate()
            pgbench_output = load.communicate()[0]
        load_seconds = time.monotonic() - load_began
        lag_at_stop = slot_lag(dsn)
        final, _ = drain_once(config, args.chunk)
        total_seconds = time.monotonic() - load_began
        lag_after_final = slot_lag(dsn)

        print("\npgbench:", " ".join(line for line in pgbench_output.splitlines() if line.startswith("tps")))
        failures: list[str] = []
        padding: list[str] = []
        for table, key in TABLES.items():
            schema, _, name = table.partition(".")
            try:
                rows = assert_delta_equals_postgres(dsn, table, config.table_path(schema, name), key=key)
                print(f"oracle {table}: {rows} rows equal")
            except AssertionError as error:
                first_lines = "\n".join(str(error).splitlines()[:3])
                if equal_with_padding(dsn, table, config.table_path(schema, name)):
                    padding.append(table)
                    print(
                        f"oracle {table}: differs only in char(n) blank padding (verify.py casts to text):\n{first_lines}"
                    )
                else:
                    failures.append(table)
                    print(f"oracle {table}: DIFFERS\n{error}")

        total_changes = sum(r.changes for r in records) + final.changes
        rss = [r.rss_mib for r in records]
        half = rss[len(rss) // 2 :]
        print(
            f"\nruns: {len(records)} during load + final drain ({final.changes} changes, {final.duration_s:.2f} s)\n"
            f"sustained: {total_changes} changes in {total_seconds:.1f} s = {total_changes / total_seconds:,.0f} changes/s"
            f" (load phase {load_seconds:.1f} s)\n"
            f"per run: median {sorted(r.changes_per_second for r in records)[len(records) // 2] if records else 0:,.0f} changes/s,"
            f" median duration {sorted(r.duration_s for r in records)[len(records) // 2] if records else 0:.2f} s\n"
            f"worst lag: {max((r.lag_before for r in records), default=0):,} bytes before a run,"
            f" {max((r.lag_after for r in records), default=0):,} bytes right after one;"
            f" at pgbench stop {lag_at_stop:,}, after the final drain {lag_after_final:,}\n"
            f"RSS MiB: first {rss[0] if rss else 0:.0f}, last {rss[-1] if rss else 0:.0f}, peak {max(rss, default=0):.0f},"
            f" slope over the second half {slope(half):+.2f} MiB/run\n"
            f"RSS MiB by quarter: {', '.join(f'{rss[i]:.0f}' for i in sorted({0, len(rss) // 4, len(rss) // 2, 3 * len(rss) // 4, len(rss) - 1}) if rss)}\n"
            f"oracle: {'PASS' if not failures else 'FAIL ' + ', '.join(failures)}"
            f"{' (equal with char(n) padding kept: ' + ', '.join(padding) + ')' if padding else ''}"
        )
        return 1 if failures else 0
    finally:
        server.destroy()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
