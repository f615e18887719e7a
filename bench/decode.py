"""Decode throughput: pgcdc's replication client and pgoutput decoder against pg_recvlogical.

Run ``python -m bench.decode [--major 18] [--rows 1000000] [--per-txn 10000]``.
It starts a throwaway PostgreSQL, creates two pgoutput slots at the same point,
builds a backlog of narrow single-row inserts in many transactions, then drains the
same backlog twice:

* baseline: ``pg_recvlogical --start -E END -f FILE --no-loop`` (the server's own
  client) writes the raw pgoutput messages to a file;
* pgcdc: ``ReplicationStream.drain_batches`` feeding the transaction assembler, and every
  committed transaction's row images parsed into Arrow columns: the decode path of an
  incremental run, without the Delta write (``bench.cdc`` measures that end to end).

Both are limited by the walsender's decoding on the server; the ratio says how much
of that rate the Python client keeps. Target: at least 0.8.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from resources.cdc.row_batches import RowBatch
from resources.cdc.transactions import TransactionAssembler
from resources.lsn import LSN
from resources.pgoutput.options import highest_proto_version, PgOutputOptions
from resources.pgoutput.tags import INSERT
from resources.pgoutput.tuples import tuple_columns_at
from resources.postgres.replication import ReplicationConnection
from resources.postgres.stream import ReplicationStream
from resources.testing.local_postgres import bin_dir_for, start_local_postgres

PUBLICATION = "bench_pub"
PGCDC_SLOT = "bench_pgcdc"
RECV_SLOT = "bench_recv"


def build_backlog(dsn: str, rows: int, per_txn: int) -> str:
    """Narrow inserts in transactions of ``per_txn`` rows; returns the WAL position after them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(1, rows + 1, per_txn):
            stop = min(start + per_txn, rows + 1) - 1
            conn.execute(
                "INSERT INTO narrow SELECT g, g %% 1000 FROM generate_series(%s::int, %s::int) g", (start, stop)
            )
        (end,) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    return str(end)


def drain_with_recvlogical(major: int, dsn: str, end: str, proto: int, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            str(bin_dir_for(major) / "pg_recvlogical"),
            "-d", dsn, "--slot", RECV_SLOT, "--start", "-E", end, "--no-loop", "-f", str(out),
            "-o", f"proto_version={proto}", "-o", f"publication_names={PUBLICATION}",
        ],
        check=True,
    )  # fmt: skip
    return time.perf_counter() - started


def drain_with_pgcdc(dsn: str, end: str, proto: int) -> tuple[float, int]:
    """Drain and decode as an incremental run does, without the Delta write.

    Each message goes through the transaction assembler (control messages are
    decoded, row changes located); each committed transaction's row images are
    then parsed column-wise into Arrow arrays of the values' text.
    """
    started = time.perf_counter()
    decoded_rows = 0
    with ReplicationConnection(dsn) as conn, TransactionAssembler(proto) as assembler:
        stream = ReplicationStream(conn)
        stream.start(PGCDC_SLOT, options=PgOutputOptions([PUBLICATION], proto_version=proto))
        feed, feed_rows = assembler.feed, assembler.feed_rows
        for item in stream.drain_batches(LSN.parse(end)):
            if type(item) is list:
                feed_rows(item)
                continue
            transaction = feed(item.payload, item.wal_start)
            if transaction is None:
                continue
            for segment in transaction.segments():
                if type(segment) is RowBatch:
                    columns, _unchanged = tuple_columns_at(segment.data, segment.new[segment.ops == INSERT], ncols=2)
                    decoded_rows += len(columns[0])
            transaction.discard()
    return time.perf_counter() - started, decoded_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", type=int, default=18, choices=(15, 18))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--per-txn", type=int, default=10_000)
    args = parser.parse_args()

    server = start_local_postgres(args.major)
    try:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE narrow (id int PRIMARY KEY, v int); CREATE PUBLICATION {PUBLICATION} FOR TABLE narrow"
            )
            conn.execute(f"SELECT pg_create_logical_replication_slot('{PGCDC_SLOT}', 'pgoutput')")
            conn.execute(f"SELECT pg_create_logical_replication_slot('{RECV_SLOT}', 'pgoutput')")
            (version,) = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
        proto = highest_proto_version(version)
        print(f"PostgreSQL {args.major}, pgoutput protocol {proto}: building {args.rows:,} inserts...", flush=True)
        end = build_backlog(dsn, args.rows, args.per_txn)

        with tempfile.TemporaryDirectory() as scratch:
            baseline_s = drain_with_recvlogical(args.major, dsn, end, proto, Path(scratch) / "recv.bin")
        pgcdc_s, decoded = drain_with_pgcdc(dsn, end, proto)
        if decoded != args.rows:
            raise SystemExit(f"decoded {decoded} inserts, expected {args.rows}")

        baseline_rate, pgcdc_rate = args.rows / baseline_s, args.rows / pgcdc_s
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"pg_recvlogical: {baseline_s:6.2f} s  {baseline_rate:12,.0f} changes/s")
        print(f"pgcdc decode:   {pgcdc_s:6.2f} s  {pgcdc_rate:12,.0f} changes/s  (peak RSS {peak_mib:,.0f} MiB)")
        print(f"ratio pgcdc / pg_recvlogical: {pgcdc_rate / baseline_rate:.2f} (target >= 0.80)")
    finally:
        server.destroy()


if __name__ == "__main__":
    main()
