"""CDC throughput: pgcdc's incremental run against pg_recvlogical on the same backlog.

Run ``python -m bench.cdc [--major 18] [--inserts N] [--updates N] [--deletes N] [--chunk N] [--merge-rows N]
[--engine E] [--lake L] [--profile] [--spark-conf KEY=VALUE] [--drains N]`` (``bench/lakes.py``: the engine and where
the lake lives; ``--drains N``: then N drains as scheduled runs see them on the managed Spark with its JVM kept,
each against a Sail drain of the same changes, ``bench/kept_drains.py``).
It starts a throwaway PostgreSQL, snapshots a table into Delta (which creates pgcdc's slot),
creates two more slots at the same point for pg_recvlogical, then builds the backlog in many
transactions: inserts of new rows, updates of existing ones, deletes. Then:

* baseline: ``pg_recvlogical --start -E END -f FILE --no-loop`` (the server's own binary, same
  pgoutput protocol and publication) drains one of those slots to a file: the server-side
  decoding plus the cheapest possible client. It runs twice, once before and once after
  pgcdc, each on its own slot, and the faster run is the baseline (right
  after the backlog is written the server is still busy flushing and checkpointing);
* pgcdc: ``run_incremental`` drains pgcdc's slot end to end (decode, assemble, fold,
  convert to Arrow, MERGE into Delta through the embedded Sail engine, confirm).

With ``--profile`` it also prints every engine call of the drain, timed in the client
(``bench/engine_calls.py``), and on the managed Spark Spark's own SQL timings from its event log;
``--spark-conf KEY=VALUE`` adds settings to the managed Spark, to compare them.

It prints changes/s for both, the ratio, where the CPU went in each drain (``bench/cpu_split.py``:
the walsender, pgcdc's main thread and its other threads, the Sail server, pg_recvlogical), and the peak memory of the run: this process's peak RSS
(ru_maxrss) plus the peak RSS (VmHWM) of the embedded Sail server process the run used, then
checks Delta against PostgreSQL by row count and a checksum.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import psycopg
import pyarrow.compute as pc

from bench.cpu_split import cpu_split, describe
from bench.engine_calls import engine_calls, spark_event_log_config, spark_sql_timings, summary
from bench.kept_drains import kept_jvm_rounds
from bench.lakes import add_arguments, bench_lake, lake_storage, open_engine
from resources.cdc.applier import DEFAULT_MERGE_ROWS
from resources.config import parse_config
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.pgoutput.options import highest_proto_version
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import bin_dir_for, LocalPostgres, start_local_postgres

PUBLICATION = "bench_pub"
SLOT = "bench_slot"
RECV_SLOTS = ("bench_recv_before", "bench_recv_after")
BASE_ROWS = 100_000

DDL = (
    "CREATE TABLE orders (id bigint PRIMARY KEY, customer int, status text, amount numeric(12,2),"
    " created timestamptz, note text)"
)
ROWS = (
    "SELECT g, g %% 10000, 'new', (g %% 100000) / 100.0, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',"
    " 'order ' || g FROM generate_series(%s::bigint, %s::bigint) g"
)


def build_backlog(dsn: str, inserts: int, updates: int, deletes: int, per_txn: int, round_: int = 0) -> int:
    """Inserts, updates and deletes in transactions of ``per_txn`` rows; returns the change count.

    Round ``round_`` (0: the first) inserts keys above every earlier round's, updates the first
    ``updates`` keys and deletes keys no earlier round deleted."""
    base = BASE_ROWS + round_ * inserts
    gone = updates + round_ * deletes
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(base + 1, base + inserts + 1, per_txn):
            conn.execute(f"INSERT INTO orders {ROWS}", (start, min(start + per_txn, base + inserts + 1) - 1))
        for start in range(1, updates + 1, per_txn):
            conn.execute(
                "UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id BETWEEN %s AND %s",
                (start, min(start + per_txn, updates + 1) - 1),
            )
        for start in range(gone + 1, gone + deletes + 1, per_txn):
            conn.execute(
                "DELETE FROM orders WHERE id BETWEEN %s AND %s", (start, min(start + per_txn, gone + deletes + 1) - 1)
            )
    return inserts + updates + deletes


def postmaster_pid(server: LocalPostgres) -> int:
    return int((server.data_dir / "postmaster.pid").read_text().split()[0])


def recvlogical(server: LocalPostgres, dsn: str, slot: str, end: str, proto: int, out: Path) -> float:
    binary = bin_dir_for(server.major) / "pg_recvlogical"
    with cpu_split(postmaster_pid(server), None) as split:
        subprocess.run(
            [
                str(binary),
                "-d",
                dsn,
                "--slot",
                slot,
                "--start",
                "-E",
                end,
                "-o",
                f"proto_version={proto}",
                "-o",
                f"publication_names={PUBLICATION}",
                "-f",
                str(out),
                "--no-loop",
            ],
            check=True,
        )
    print(describe("pg_recvlogical", split))
    return split.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--inserts", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=500_000)
    parser.add_argument("--deletes", type=int, default=100_000)
    parser.add_argument("--per-txn", type=int, default=1_000)
    parser.add_argument("--chunk", type=int, default=200_000)
    parser.add_argument("--merge-rows", type=int, default=DEFAULT_MERGE_ROWS, help="most source rows per MERGE")
    parser.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the managed Spark engine (repeatable), to compare settings in one session",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time each engine call of the drain (and Spark's own SQL executions, managed Spark only)",
    )
    parser.add_argument(
        "--drains", type=int, default=0, help="then N drains on a kept managed Spark JVM, each beside one on Sail"
    )
    add_arguments(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-cdc-"))
    server = start_local_postgres(args.major, base_dir=work / "pg")
    try:
        with bench_lake(args.lake, work) as (root, storage):
            run(server, args, root, storage, work)
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)


def run(server: LocalPostgres, args: argparse.Namespace, root: str, storage: dict, work: Path) -> None:
    """Snapshot, backlog, both drains and the check, on the lake at ``root``."""
    dsn = server.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        conn.execute(f"INSERT INTO orders {ROWS}", (1, BASE_ROWS))
        conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE orders")
    config = parse_config(
        {
            "postgres": {"dsn": dsn},
            "publication": PUBLICATION,
            "slot": SLOT,
            "delta": {"root": root, "storage": storage},
        }
    )
    with open_engine(args.engine, root, storage) as engine:
        snapshot_tables(
            config, lake_destination(engine.spark, config)
        )  # creates SLOT; no change to orders follows before RECV_SLOTS
    with psycopg.connect(dsn, autocommit=True) as conn:
        for recv_slot in RECV_SLOTS:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (recv_slot,))
    started = time.perf_counter()
    changes = build_backlog(dsn, args.inserts, args.updates, args.deletes, args.per_txn)
    print(f"backlog: {changes:,} changes in {time.perf_counter() - started:.1f} s")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((end,),) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchall()
        proto = highest_proto_version(conn.info.server_version)
    out = work / "recvlogical.bin"
    before_run = recvlogical(server, dsn, RECV_SLOTS[0], end, proto, out)
    print(
        f"pg_recvlogical: {before_run:.2f} s, {changes / before_run:,.0f} changes/s, {out.stat().st_size / 2**20:.0f} MiB"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process before the incremental run (snapshot client, backlog): {before:,.0f} MiB")
    event_log = work / "spark-events"
    event_log.mkdir()
    profiled = args.profile and args.engine == "spark"
    extra = dict(setting.split("=", 1) for setting in args.spark_conf)
    if profiled:
        extra.update(spark_event_log_config(str(event_log)))
    started = time.perf_counter()
    with open_engine(
        args.engine, root, storage, extra
    ) as engine:  # a fresh engine, as a Dagster run gets: its peak is the run's
        engine_start = time.perf_counter() - started
        with (
            engine_calls() if args.profile else nullcontext([]) as calls,
            cpu_split(postmaster_pid(server), engine.server_pid) as split,  # Sail's server, a managed JVM
        ):
            result = run_incremental(
                config,
                lake_destination(engine.spark, config),
                log=print,
                max_chunk_changes=args.chunk,
                max_merge_rows=args.merge_rows,
            )
        _, server_peak = engine.server_memory_mib()
    print(describe("pgcdc", split))
    if args.profile:
        print(summary(calls))
    if profiled:
        print(spark_sql_timings(str(event_log)))
    ours = result.duration_s
    client_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = client_peak + server_peak
    after_run = recvlogical(server, dsn, RECV_SLOTS[1], end, proto, out)
    print(f"pg_recvlogical again, after pgcdc: {after_run:.2f} s, {changes / after_run:,.0f} changes/s")
    baseline = min(before_run, after_run)  # the faster of the two: WAL is warm for one of them
    print(
        f"pgcdc incremental: {ours:.2f} s, {changes / ours:,.0f} changes/s "
        f"({result.transactions} transactions, {result.changes:,} changes applied); "
        f"the engine's start before it (a run's too): {engine_start:.2f} s"
    )
    print(
        f"ratio pgcdc / pg_recvlogical: {baseline / ours:.0%}; peak RSS {peak:,.0f} MiB "
        f"= pgcdc {client_peak:,.0f} + Sail server {server_peak:,.0f} "
        f"(chunks of {args.chunk:,} changes, MERGEs of at most {args.merge_rows:,} rows)"
    )
    options = lake_storage(root, storage).object_store_options() or None
    table = delta_rs_rows(config.table_path("public", "orders"), ["id", "amount"], storage_options=options)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((count, amount),) = conn.execute("SELECT count(*), sum(amount) FROM orders").fetchall()
    delta_amount = pc.sum(table.column("amount")).as_py()
    assert (table.num_rows, delta_amount) == (count, amount), (table.num_rows, delta_amount, count, amount)
    print(f"check: Delta and PostgreSQL both hold {count:,} rows, amount total {amount}")
    if args.drains:
        sizes = (args.inserts, args.updates, args.deletes, args.per_txn)
        kept_jvm_rounds(
            config,
            lambda round_: build_backlog(dsn, *sizes, round_=round_),
            args.drains,
            args.chunk,
            args.merge_rows,
            work,
        )


if __name__ == "__main__":
    main()
