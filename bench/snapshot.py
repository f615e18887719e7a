"""Snapshot throughput: pgcdc's end-to-end copy into Delta against PostgreSQL's raw COPY.

Run ``python -m bench.snapshot [--narrow-rows N] [--wide-rows N] [--runs N] [--engine E] [--lake L]``
(``bench/lakes.py``: the engine and where the lake lives). It starts a
throwaway PostgreSQL 18, loads a narrow and a wide table, then per table measures

* the baseline: ``psql -c "COPY t TO STDOUT" > /dev/null`` with the server's own psql, the
  fastest a client can take the rows out (text format, no parsing);
* pgcdc: ``snapshot_table`` into a fresh Delta table through the embedded Sail engine,
  the whole path: temporary slot, COPY, CSV -> typed Arrow, Delta write, atomic commit;
  once per ``--workers`` count (sessions reading ctid ranges of ``--chunk-mb`` under one
  snapshot; 1 = one COPY) and per ``--writers`` entry: ``delta-rs`` (pgcdc streams the rows into
  delta-rs in its own process, the default: on Delta on Spark into the table Spark created) or ``engine``
  (staged Parquet, then the engine's overwrite).

Each takes the best of ``--runs``, after one warm-up each (page cache, Sail's first write); the
rounds interleave the baseline and every pgcdc variant, so a busy machine slows them alike.
For the best run the CPU seconds of each process are reported too (``/proc``): pgcdc's own
process, the engine's server, PostgreSQL (the postmaster's children, ended ones included) and,
for the baseline, psql: on a machine with few cores, the sum is what bounds the wall time.
With ``--chunked-ranges N`` it measures the snapshot in primary-key ranges instead (each table in
about N ranges, one short transaction and one drain run of the slot each: ``snapshot_tables`` with
``snapshot.key_chunk_mb`` chosen from the table's heap, a fresh lake directory per walk), against
the same baseline, with ranges/s and the memory figures of that mode alone.

A final pgcdc run with tracemalloc on gives the Python heap's peak; it is not timed,
because tracemalloc slows every allocation. For a big table's memory, run e.g.
``--narrow-rows 10000000 --wide-rows 1000 --runs 1 --workers 2``: the RSS figures are the
process's and the Sail server's high-water marks.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import shutil
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
import pyarrow as pa

from bench.lakes import add_arguments, bench_lake, lake_storage, open_engine
from resources.config import parse_config
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.engines.capabilities import engine_capabilities, EngineCapabilities, set_engine_capabilities
from resources.engines.engine import SparkEngine
from resources.locations import join_location
from resources.postgres.catalog import TableName
from resources.postgres.preflight import ensure_slot
from resources.runs.snapshot import snapshot_table, snapshot_tables, SnapshotResult
from resources.testing.local_postgres import LocalPostgres, start_local_postgres

PUBLICATION = "bench_pub"
SLOT = "bench_slot"

NARROW_DDL = "CREATE TABLE narrow (id bigint PRIMARY KEY, n int, label text, at timestamptz)"
NARROW_LOAD = (
    "INSERT INTO narrow SELECT g, g % 100000, substr(md5(g::text), 1, 20),"
    " timestamptz '2024-01-01 00:00:00+00' + g * interval '1.5 second' FROM generate_series(1, %s) g"
)
_WIDE_BLOCK = (
    "i{k} int, b{k} bigint, f{k} float8, d{k} numeric(12,2), t{k} text, ts{k} timestamptz, dt{k} date, ok{k} bool"
)
_WIDE_VALUES = (
    "g % 1000 + {k}, g * 31 + {k}, g / 7.0 + {k}, round((g % 100000) / 3.0, 2), 'text ' || (g + {k}),"
    " timestamptz '2024-01-01 00:00:00+00' + (g + {k}) * interval '1 minute', date '2020-01-01' + (g + {k}) % 3000,"
    " (g + {k}) % 3 = 0"
)
WIDE_DDL = "CREATE TABLE wide (id bigint PRIMARY KEY, " + ", ".join(_WIDE_BLOCK.format(k=k) for k in range(4)) + ")"
WIDE_LOAD = (
    "INSERT INTO wide SELECT g, "
    + ", ".join(_WIDE_VALUES.format(k=k) for k in range(4))
    + " FROM generate_series(1, %s) g"
)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cpu:
    """CPU seconds used by this process, the engine's server, PostgreSQL and psql (children of this process)."""

    pgcdc: float = 0.0
    engine: float = 0.0
    postgres: float = 0.0
    psql: float = 0.0

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(
            self.pgcdc - other.pgcdc, self.engine - other.engine, self.postgres - other.postgres, self.psql - other.psql
        )

    def describe(self) -> str:
        parts = {"pgcdc": self.pgcdc, "engine": self.engine, "PostgreSQL": self.postgres, "psql": self.psql}
        return " + ".join(f"{name} {value:.2f}" for name, value in parts.items() if value > 0.005)


def _proc_cpu(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime (+ cutime + cstime: children it has waited for) of ``pid`` from /proc, 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLOCK_TICKS


def _postgres_cpu(postmaster: int) -> float:
    """The server's CPU: the postmaster with the backends it reaped, plus the live ones.

    A backend that has exited but is not reaped yet (a zombie) shows no CPU anywhere, so this
    waits (up to a second) until the postmaster has reaped every ended backend.
    """
    for _ in range(100):
        total = _proc_cpu(postmaster, reaped_children=True)
        zombies = False
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", encoding="ascii") as stat:
                        fields = stat.read().rpartition(")")[2].split()
                except OSError:
                    continue
                if int(fields[1]) == postmaster:
                    zombies |= fields[0] == "Z"
                    total += _proc_cpu(int(entry.name))
        if not zombies:
            break
        time.sleep(0.01)
    return total


def cpu_now(postmaster: int, engine_pid: int | None) -> Cpu:
    own = resource.getrusage(resource.RUSAGE_SELF)
    psql = resource.getrusage(resource.RUSAGE_CHILDREN)  # psql runs as this process's child
    return Cpu(
        own.ru_utime + own.ru_stime,
        _proc_cpu(engine_pid) if engine_pid is not None else 0.0,
        _postgres_cpu(postmaster),
        psql.ru_utime + psql.ru_stime,
    )


@dataclass
class Measurement:
    table: str
    rows: int
    columns: int
    csv_bytes: int
    copy_s: float
    copy_cpu: Cpu
    workers: int
    writer: str
    chunks: int
    pgcdc_s: float
    pgcdc_cpu: Cpu

    @property
    def copy_rate(self) -> float:
        return self.rows / self.copy_s

    @property
    def pgcdc_rate(self) -> float:
        return self.rows / self.pgcdc_s


def prepare(server: LocalPostgres, args: argparse.Namespace) -> int:
    """Load the tables and create the slot; the postmaster's pid (the CPU figures count its children)."""
    print(f"PostgreSQL 18 on port {server.port}; loading {args.narrow_rows:,} narrow and {args.wide_rows:,} wide rows")
    load_tables(server, args.narrow_rows, args.wide_rows)
    ensure_slot(server.dsn(), SLOT)
    return int((server.data_dir / "postmaster.pid").read_text().split()[0])


def load_tables(server: LocalPostgres, narrow_rows: int, wide_rows: int) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(NARROW_DDL)
        conn.execute(NARROW_LOAD.replace("%s", str(narrow_rows)))
        conn.execute(WIDE_DDL)
        conn.execute(WIDE_LOAD.replace("%s", str(wide_rows)))
        conn.execute("VACUUM (FREEZE, ANALYZE) narrow, wide")
        conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE narrow, wide")


def psql_copy_seconds(server: LocalPostgres, table: str) -> float:
    """Wall time of psql copying the table to /dev/null, psql's start-up included (~10 ms)."""
    command = [str(server.binary("psql")), "-X", "-q", server.dsn(), "-c", f"COPY {table} TO STDOUT"]
    with open("/dev/null", "wb") as sink:
        started = time.perf_counter()
        subprocess.run(command, stdout=sink, check=True)
        return time.perf_counter() - started


def best_of_each(
    runs: int, actions: dict[str, Callable[[], float]], cpu: Callable[[], Cpu]
) -> dict[str, tuple[float, Cpu]]:
    """Per action, the shortest of ``runs`` timed runs after a warm-up, with the CPU each process
    spent in it; the actions take turns in every round."""
    for action in actions.values():
        action()  # warm-up
    samples: dict[str, list[tuple[float, Cpu]]] = {name: [] for name in actions}
    for _ in range(runs):
        for name, action in actions.items():
            before = cpu()
            seconds = action()
            samples[name].append((seconds, cpu() - before))
    return {name: min(taken, key=lambda sample: sample[0]) for name, taken in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--narrow-rows", type=int, default=1_000_000)
    parser.add_argument("--wide-rows", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4", help="comma-separated session counts to measure")
    parser.add_argument(
        "--writers", default="delta-rs", help="comma-separated snapshot writers to measure: delta-rs, engine"
    )
    parser.add_argument(
        "--chunk-mb",
        type=int,
        default=16,
        help="heap megabytes per ctid range (snapshot.chunk_mb, default 64): 16 splits the default tables into"
        " 5 (narrow) and 4 (wide) ranges, so that 2 and 4 workers have work to share",
    )
    parser.add_argument(
        "--chunked-ranges",
        type=int,
        default=0,
        help="measure the snapshot in key ranges instead, each table in about this many ranges (0: one snapshot)",
    )
    add_arguments(parser)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-lake-"))
    server = start_local_postgres(18)
    if args.chunked_ranges > 0:
        try:
            with bench_lake(args.lake, work) as (root, storage):
                report_chunked(*run_chunked(server, args, root, storage))
        finally:
            server.destroy()
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        with bench_lake(args.lake, work) as (root, storage):
            measurements, rss_mib, server_peak_mib, arrow_peak_mib, heap_peak = run(server, args, root, storage)
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    report(measurements, rss_mib, server_peak_mib, arrow_peak_mib, heap_peak)


def run(server: LocalPostgres, args: argparse.Namespace, root: str, storage: dict) -> tuple:
    """The measurements on the lake at ``root``, and the memory figures."""
    postmaster = prepare(server, args)
    with open_engine(args.engine, root, storage) as engine:
        cpu = lambda: cpu_now(postmaster, engine.server_pid)  # noqa: E731
        measurements = []

        worker_counts = [int(w) for w in args.workers.split(",")]
        writers = args.writers.split(",")
        detected = engine_capabilities(engine.spark)
        results: dict[tuple[str, int], SnapshotResult] = {}

        def pgcdc_seconds(table: str, workers: int, writer: str) -> float:
            set_engine_capabilities(engine.spark, writer_capabilities(detected, writer))
            started = time.perf_counter()
            results[table, workers] = snapshot_table(
                server.dsn(),
                PUBLICATION,
                TableName("public", table),
                SparkDeltaDestination(engine.spark, lake_storage(root, storage)),
                join_location(root, table),
                slot=SLOT,
                workers=workers,
                chunk_mb=args.chunk_mb,
            )
            return time.perf_counter() - started

        for table in ("narrow", "wide"):
            actions: dict[str, Callable[[], float]] = {"COPY": lambda table=table: psql_copy_seconds(server, table)}
            for workers in worker_counts:
                for writer in writers:
                    actions[f"{workers} {writer}"] = lambda table=table, workers=workers, writer=writer: pgcdc_seconds(
                        table, workers, writer
                    )
            best = best_of_each(args.runs, actions, cpu)
            print(
                f"{table}: load average after its runs {' / '.join(f'{load:.1f}' for load in os.getloadavg())} (1 / 5 / 15 min)"
            )
            with psycopg.connect(server.dsn()) as conn:
                (csv_bytes,) = conn.execute(f"SELECT sum(length(t::text)) FROM {table} t").fetchone() or (0,)
            copy_s, copy_cpu = best["COPY"]
            for workers in worker_counts:
                result = results[table, workers]
                for writer in writers:
                    pgcdc_s, pgcdc_cpu = best[f"{workers} {writer}"]
                    measurements.append(
                        Measurement(
                            table, result.rows, len(result.columns), int(csv_bytes), copy_s, copy_cpu,
                            result.workers, writer, result.chunks, pgcdc_s, pgcdc_cpu,
                        )
                    )  # fmt: skip
        set_engine_capabilities(engine.spark, detected)

        memory = memory_peaks(engine, lambda: snapshot_table(
            server.dsn(), PUBLICATION, TableName("public", "narrow"), SparkDeltaDestination(engine.spark, lake_storage(root, storage)), join_location(root, "narrow"),
            slot=SLOT, workers=max(worker_counts), chunk_mb=args.chunk_mb,
        ))  # fmt: skip
    return measurements, *memory


def writer_capabilities(detected: EngineCapabilities, writer: str) -> EngineCapabilities:
    """``detected`` with snapshots written by ``writer``: ``delta-rs`` (on an engine with Delta's commands,
    into the table the engine creates; else delta-rs creates it too) or ``engine`` (staged, the engine's overwrite)."""
    delta_rs = writer == "delta-rs"
    return replace(
        detected,
        delta_rs_snapshots=delta_rs and not detected.delta_commands,
        delta_rs_snapshot_rows=delta_rs and detected.delta_commands,
    )


def report(
    measurements: list[Measurement], rss_mib: float, server_peak_mib: float, arrow_peak_mib: float, heap_peak: float
) -> None:
    print()
    print(
        f"{'table':8} {'rows':>10} {'cols':>5} {'COPY s':>8} {'COPY rows/s':>12} {'workers':>7} {'writer':>8} {'chunks':>6}"
        f" {'pgcdc s':>8} {'pgcdc rows/s':>13} {'ratio':>6}"
    )
    for m in measurements:
        print(
            f"{m.table:8} {m.rows:>10,} {m.columns:>5} {m.copy_s:>8.3f} {m.copy_rate:>12,.0f} {m.workers:>7} {m.writer:>8} {m.chunks:>6}"
            f" {m.pgcdc_s:>8.3f} {m.pgcdc_rate:>13,.0f} {m.pgcdc_rate / m.copy_rate:>6.0%}"
        )
    print()
    print("CPU seconds of the best runs, per process:")
    for m in measurements:
        print(
            f"  {m.table:8} COPY: {m.copy_cpu.describe():48} pgcdc, {m.workers} worker(s), {m.writer}: {m.pgcdc_cpu.describe()}"
        )
    report_memory(rss_mib, server_peak_mib, arrow_peak_mib, heap_peak, "a narrow snapshot")


def memory_peaks(engine: SparkEngine, last_run: Callable[[], object]) -> tuple[float, float, float, float]:
    """Peak RSS of this process and of the engine's server, peak of the Arrow pool (MiB, so far),
    and the Python heap's peak (bytes) during ``last_run`` under tracemalloc (untimed: it slows
    every allocation)."""
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _, server_peak_mib = engine.server_memory_mib()
    arrow_peak_mib = pa.default_memory_pool().max_memory() / 2**20
    tracemalloc.start()
    try:
        last_run()
        _, heap_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return rss_mib, server_peak_mib, arrow_peak_mib, heap_peak


def report_memory(rss_mib: float, server_peak_mib: float, arrow_peak_mib: float, heap_peak: float, during: str) -> None:
    print()
    print(
        f"peak RSS of this process (PostgreSQL client, Arrow): {rss_mib:,.0f} MiB; of the Sail server: {server_peak_mib:,.0f} MiB"
    )
    print(f"peak Arrow memory pool: {arrow_peak_mib:,.0f} MiB")
    print(f"peak Python heap during {during} (tracemalloc): {heap_peak / 2**20:,.1f} MiB")


@dataclass
class ChunkedMeasurement:
    """One table's snapshot in key ranges (the best walk) against its raw COPY."""

    table: str
    rows: int
    ranges: int
    copy_s: float
    walk_s: float
    walk_cpu: Cpu

    @property
    def ratio(self) -> float:
        return self.copy_s / self.walk_s

    @property
    def ranges_per_second(self) -> float:
        return self.ranges / self.walk_s


def run_chunked(server: LocalPostgres, args: argparse.Namespace, root: str, storage: dict) -> tuple:
    """The snapshot in key ranges of each table (about ``--chunked-ranges`` ranges), and the memory figures."""
    postmaster = prepare(server, args)
    walks = itertools.count()
    with open_engine(args.engine, root, storage) as engine:
        cpu = lambda: cpu_now(postmaster, engine.server_pid)  # noqa: E731
        measurements = []
        results: dict[str, SnapshotResult] = {}

        def walk(table: str) -> float:
            """One snapshot of ``table`` in key ranges into a fresh lake directory; its seconds."""
            with psycopg.connect(server.dsn()) as conn:
                (heap,) = conn.execute(f"SELECT pg_catalog.pg_relation_size('{table}')").fetchone() or (0,)
            config = parse_config({
                "postgres": {"dsn": server.dsn()}, "publication": PUBLICATION, "slot": SLOT,
                "tables": [f"public.{table}"],
                "delta": {"root": join_location(root, f"chunked-{next(walks)}"), "storage": storage},
                # ceil(heap / key_chunk_mb) = N ranges
                "snapshot": {"chunked_above_mb": 0, "key_chunk_mb": heap / 2**20 / (args.chunked_ranges - 0.5)},
            })  # fmt: skip
            started = time.perf_counter()
            [results[table]] = snapshot_tables(config, lake_destination(engine.spark, config))
            return time.perf_counter() - started

        for table in ("narrow", "wide"):
            best = best_of_each(
                args.runs,
                {"COPY": lambda table=table: psql_copy_seconds(server, table), "walk": lambda table=table: walk(table)},
                cpu,
            )
            (copy_s, _), (walk_s, walk_cpu) = best["COPY"], best["walk"]
            result = results[table]
            assert result.key_ranges, f"{table} was not copied in key ranges"
            measurements.append(ChunkedMeasurement(table, result.rows, result.chunks, copy_s, walk_s, walk_cpu))
            print(
                f"{table}: load average after its runs {' / '.join(f'{load:.1f}' for load in os.getloadavg())} (1 / 5 / 15 min)"
            )
        memory = memory_peaks(engine, lambda: walk("narrow"))
    return measurements, *memory


def report_chunked(
    measurements: list[ChunkedMeasurement],
    rss_mib: float,
    server_peak_mib: float,
    arrow_peak_mib: float,
    heap_peak: float,
) -> None:
    print()
    print(
        f"{'table':8} {'rows':>10} {'ranges':>6} {'COPY s':>8} {'walk s':>8} {'rows/s':>10} {'ranges/s':>8} {'ratio':>6}"
    )
    for m in measurements:
        print(
            f"{m.table:8} {m.rows:>10,} {m.ranges:>6} {m.copy_s:>8.3f} {m.walk_s:>8.3f} {m.rows / m.walk_s:>10,.0f}"
            f" {m.ranges_per_second:>8.2f} {m.ratio:>6.0%}"
        )
    print()
    print("CPU seconds of the best walks, per process:")
    for m in measurements:
        print(f"  {m.table:8} {m.walk_cpu.describe()}")
    report_memory(rss_mib, server_peak_mib, arrow_peak_mib, heap_peak, "a narrow walk")


if __name__ == "__main__":
    main()
