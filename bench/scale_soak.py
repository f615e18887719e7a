"""bench.scale part (c), the soak: many drains on a busy table with maintenance every N drains.

Run ``python -m bench.scale soak [--drains 2000] [--maintain-every 50] ...`` or
``python -m bench.scale_soak`` alone.

A throwaway PostgreSQL holds ``busy`` (bigint key, ``--rows`` rows); before each drain one
transaction updates ``--changes`` random keys, inserts a tenth as many new keys and deletes a
few (``--updates-only``: the random updates alone, the common OLTP pattern that deletion vectors
serve: balances, statuses, counters spread over the whole key space); then ``run_incremental``
drains it into Delta on embedded Sail. Every ``--maintain-every`` drains the table gets what the
``pgcdc_maintenance`` job does (``maintain_table``: compaction, the purge of files whose deletion
vectors delete more than ``maintenance.max_deleted_rows_ratio``, vacuum after
``--retention-hours``, log checkpoint and clean-up). The engine is restarted every
``--engine-runs`` drains (each Dagster run gets a fresh one; Sail keeps memory per operation).
Maintenance covers pgcdc's state table too (``<root>/_pgcdc/state/<slot>``, rewritten by every
drain), as the job does.

Reported, as the ratio of the end to the start (the goal is flat): the median drain time of
the first and the last ``--window`` drains, the data files of the table's newest version,
the fraction of their rows that deletion vectors delete (per mille), the data files on storage, the log (files and bytes) and the tombstones in its newest
checkpoint; and per quarter of the soak the median drain time and the median and largest of
those figures (sampled every ``--sample-every`` drains). Storage, log and tombstones are
bounded once the retention has passed (maintenance sets both Delta retention properties to
it), so a soak shows them level off only when the retention is a fraction of its length:
``--retention-hours`` takes fractions (0.1 is six minutes) to compress a week into the run.
The oracle compares Delta with PostgreSQL at the end.

The first and last drains run minutes apart, on a machine whose load may change meanwhile, so
the soak ends with a same-run baseline: a second slot and lake (``fresh``) snapshot the table
as it is then, and ``--baseline-drains`` rounds each write one transaction and drain the soaked
lake and the fresh one, alternately, with the same changes. The median ratio of the two drain
times is what the soaked history costs each drain, whatever the machine's load (1.0: nothing).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from resources.config import parse_config
from resources.delta.deletion_vectors import deleted_rows
from resources.delta.lake_storage import LakeStorage
from resources.delta.maintenance import maintain_table
from resources.delta.spark_destination import lake_destination
from resources.delta.state_table import state_path
from resources.engines.engine import SparkEngine
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres

SLOT = "scale_soak"
FRESH_SLOT = "scale_soak_fresh"


FIGURES = ("table_files", "dv_per_mille", "storage_files", "log_files", "log_bytes", "tombstones")
QUARTERS = 4


def table_figures(path: str) -> dict[str, int]:
    """Data files of the newest version, the rows their deletion vectors delete (per mille of
    their rows), data files on storage, log files and log bytes, and the tombstones (``remove``
    actions) in the newest checkpoint: what each engine operation reads."""
    import deltalake
    import pyarrow.parquet as pq

    log = Path(path) / "_delta_log"
    log_entries = [entry for entry in log.iterdir() if entry.is_file()]
    checkpoints = sorted(log.glob("*.checkpoint.parquet"))
    tombstones = pq.read_table(checkpoints[-1], columns=["remove"]).column("remove").drop_null() if checkpoints else []
    return {
        "table_files": deltalake.DeltaTable(path).get_add_actions(flatten=True).num_rows,
        "dv_per_mille": round(1000 * deleted_rows(LakeStorage(str(Path(path).parent)), path).fraction),
        "storage_files": sum(1 for entry in Path(path).rglob("*.parquet") if "_delta_log" not in entry.parts),
        "log_files": len(log_entries),
        "log_bytes": sum(entry.stat().st_size for entry in log_entries),
        "tombstones": len(tombstones),
    }


def quarter_report(durations: list[float], written: list[int], samples: list[tuple[int, dict[str, int]]]) -> list[str]:
    """Per quarter of the soak: the median drain time and bytes written (what the drain's commits added,
    ``pgcdc/bytes_written``), and the median (and largest) of each figure sampled in it; flat when the
    last quarters match. ``samples`` are (drain number, figures)."""
    size = len(durations) // QUARTERS
    lines = [
        f"{'quarter':<14}{'median drain s':>15}{'median KB written':>19}" + "".join(f"{name:>24}" for name in FIGURES)
    ]
    for quarter in range(QUARTERS):
        first, last = quarter * size + 1, len(durations) if quarter == QUARTERS - 1 else (quarter + 1) * size
        inside = [figures for drain, figures in samples if first <= drain <= last]
        cells = "".join(
            f"{statistics.median(f[name] for f in inside):,.0f} ({max(f[name] for f in inside):,})".rjust(24)
            for name in FIGURES
        )
        kilobytes = statistics.median(written[first - 1 : last]) / 1024
        lines.append(
            f"{first:>5}-{last:<8}{statistics.median(durations[first - 1 : last]):>15.3f}{kilobytes:>19,.1f}{cells}"
        )
    return lines


def write_changes(
    conn: psycopg.Connection, rows: int, changes: int, next_key: int, *, updates_only: bool = False
) -> int:
    """One transaction: ``changes`` random updates, and unless ``updates_only`` ``changes // 10``
    inserts and a few deletes; the next new key."""
    inserts = max(1, changes // 10)
    with conn.transaction():
        conn.execute(
            "UPDATE busy SET v = v + 1, note = md5(pg_catalog.random()::text)"
            " WHERE id IN (SELECT (pg_catalog.random() * %s)::bigint + 1 FROM pg_catalog.generate_series(1, %s))",
            (rows - 1, changes),
        )
        if updates_only:
            return next_key
        conn.execute(
            "INSERT INTO busy SELECT g, 0, 'new' FROM pg_catalog.generate_series(%s::bigint, %s::bigint) g",
            (next_key, next_key + inserts - 1),
        )
        conn.execute(
            "DELETE FROM busy WHERE id IN (SELECT (pg_catalog.random() * %s)::bigint + 1 FROM pg_catalog.generate_series(1, 3))",
            (rows - 1,),
        )
    return next_key + inserts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drains", type=int, default=2000, help="drains in the soak (default 2000)")
    parser.add_argument("--maintain-every", type=int, default=50, help="maintenance every N drains (default 50)")
    parser.add_argument("--retention-hours", type=float, default=168,
                        help="maintenance.retention_hours (default 168; fractional compresses time: 0.1 is six minutes)")  # fmt: skip
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the busy table (default 100,000)")
    parser.add_argument("--changes", type=int, default=100, help="random updates per drain (default 100)")
    parser.add_argument("--updates-only", action="store_true", help="random updates only, no inserts or deletes")
    parser.add_argument("--engine-runs", type=int, default=100, help="drains per engine start (default 100)")
    parser.add_argument("--window", type=int, default=50, help="drains per start / end median (default 50)")
    parser.add_argument("--sample-every", type=int, default=10, help="figures sampled every N drains (default 10)")
    parser.add_argument("--baseline-drains", type=int, default=50,
                        help="rounds of soaked-lake against fresh-lake drains at the end (default 50)")  # fmt: skip
    parser.add_argument("--major", type=int, default=18, help="PostgreSQL major version (15 or 18)")
    parser.add_argument("--keep", action="store_true", help="keep the lake and the server's directory")
    args = parser.parse_args(argv)
    if args.drains < 2 * args.window or args.drains < QUARTERS * args.sample_every:
        parser.error("--drains must be at least twice --window and four times --sample-every")
    if not args.retention_hours > 0:
        parser.error("--retention-hours must be more than 0")

    work = Path(tempfile.mkdtemp(prefix="pgcdc-scale-soak-"))
    server = start_local_postgres(args.major, {"max_wal_size": "1GB"}, base_dir=work / "pg")
    engine: SparkEngine | None = None
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE soak")
        dsn = server.dsn("soak")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE busy (id bigint PRIMARY KEY, v int NOT NULL, note text)")
            conn.execute("INSERT INTO busy SELECT g, 0, md5(g::text) FROM generate_series(1, %s) g", (args.rows,))
            conn.execute("CREATE PUBLICATION soak_pub FOR TABLE busy")
        config = parse_config({"postgres": {"dsn": dsn}, "publication": "soak_pub", "slot": SLOT,
                               "delta": {"root": str(work / "lake")}})  # fmt: skip
        path = config.table_path("public", "busy")
        state = state_path(config.delta.root, SLOT)
        lake = LakeStorage(config.delta.root)
        engine = SparkEngine.embedded()
        snapshot_tables(config, lake_destination(engine.spark, config))
        start = table_figures(path)
        mix = "" if args.updates_only else f" + {max(1, args.changes // 10)} inserts + 3 deletes"
        print(f"PostgreSQL {args.major}, busy: {args.rows:,} rows; {args.drains} drains of {args.changes} random updates"
              f"{mix}; deletion vectors {config.delta.deletion_vectors}; maintenance every {args.maintain_every}"
              f" (retention {args.retention_hours} h); start: {start}", flush=True)  # fmt: skip
        durations: list[float] = []
        written: list[int] = []
        samples: list[tuple[int, dict[str, int]]] = []
        maintenance: list[float] = []
        peak_table_files = start["table_files"]
        next_key = args.rows + 1
        began = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for drain in range(1, args.drains + 1):
                next_key = write_changes(conn, args.rows, args.changes, next_key, updates_only=args.updates_only)
                if drain % args.engine_runs == 0:
                    engine.close()
                    engine = SparkEngine.embedded()
                result = run_incremental(config, lake_destination(engine.spark, config))
                durations.append(result.duration_s)
                written.append(result.tables["public.busy"].bytes_written)
                if drain % args.sample_every == 0:
                    samples.append((drain, table_figures(path)))
                if drain % args.maintain_every == 0:
                    peak_table_files = max(peak_table_files, table_figures(path)["table_files"])
                    maintenance.append(sum(
                        maintain_table(table, lake, retention_hours=args.retention_hours,
                                       target_file_bytes=config.maintenance.target_file_bytes,
                                       max_deleted_rows_ratio=config.maintenance.max_deleted_rows_ratio).duration_s
                        for table in (path, state)
                    ))  # fmt: skip
                if drain % 100 == 0:
                    print(f"drain {drain}: {time.monotonic() - began:.0f} s, median drain of the last 100"
                          f" {statistics.median(durations[-100:]):.2f} s, {table_figures(path)}", flush=True)  # fmt: skip
            end = table_figures(path)
            state_end = table_figures(state)
            fresh = parse_config({"postgres": {"dsn": dsn}, "publication": "soak_pub", "slot": FRESH_SLOT,
                                  "delta": {"root": str(work / "fresh")}})  # fmt: skip
            snapshot_tables(fresh, lake_destination(engine.spark, fresh))
            soaked_s: list[float] = []
            fresh_s: list[float] = []
            for round_ in range(args.baseline_drains):
                next_key = write_changes(conn, args.rows, args.changes, next_key, updates_only=args.updates_only)
                for lake_config in (config, fresh) if round_ % 2 == 0 else (fresh, config):  # neither always first
                    duration = run_incremental(lake_config, lake_destination(engine.spark, lake_config)).duration_s
                    (soaked_s if lake_config is config else fresh_s).append(duration)
        rows = assert_delta_equals_postgres(dsn, "public.busy", path, key=("id",))
        assert_delta_equals_postgres(dsn, "public.busy", fresh.table_path("public", "busy"), key=("id",))
        first, last = statistics.median(durations[: args.window]), statistics.median(durations[-args.window :])
        print(f"\n{args.drains} drains in {time.monotonic() - began:.0f} s; oracle: {rows:,} rows equal")
        print(
            f"median drain s: first {args.window} {first:.3f}, last {args.window} {last:.3f}, ratio {last / first:.2f}"
        )
        for name in FIGURES:
            print(f"{name}: start {start[name]:,}, end {end[name]:,}")
        print(f"per quarter (figures sampled every {args.sample_every} drains, median and largest):")
        print("\n".join(quarter_report(durations, written, samples)))
        print(f"state table at the end: {state_end}")
        if soaked_s:
            ratios = [old / new for old, new in zip(soaked_s, fresh_s, strict=True)]
            print(f"same-run baseline, {len(ratios)} rounds: median drain soaked lake {statistics.median(soaked_s):.3f} s,"
                  f" fresh lake {statistics.median(fresh_s):.3f} s, median ratio {statistics.median(ratios):.2f}")  # fmt: skip
        print(f"table files at most {peak_table_files} just before a maintenance run; maintenance median"
              f" {statistics.median(maintenance) if maintenance else 0:.2f} s over {len(maintenance)} runs")  # fmt: skip
        return 0
    finally:
        if engine is not None:
            engine.close()
        server.destroy()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
