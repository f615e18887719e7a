"""Memory bounds where they bind: a drain with history, one transaction five chunks long, a snapshot in key
ranges, reconciliation and the parallel ctid snapshot, each stopped from keeping a tenth of its input.

Each run happens in a child process (tests/support/memory_child.py) that reports what it kept once the work was
done (Arrow's pool and Python's heap, after a garbage collection), the most each of them held at once, and its
peak resident memory over its baseline (``held``: Python, Arrow, Rust and libpq alike).

* Kept: every run here keeps 0 bytes of Arrow and under 1 MiB of Python once done (caches that fill on first
  use), so a run that keeps a tenth of what it handled (1.5-4 MiB here) fails, whichever test it is
  (``KEPT_MIB``; docs/testing.md, "Tests that would catch the bug").
* At once: Arrow's pool and Python's heap at their most are measured figures that repeat to a few percent, so
  they bound a run that holds its whole input before writing it.
* Resident memory varies with threads and the machine's load by as much as 20 MiB between two runs of the same
  work, so its bounds sit well above the measurements: they stop a run (or the engine it drives) from holding
  its input, not a tenth of it.

The drains' byte bound (``max_chunk_bytes``) is what cuts their chunks here: a count bound that never binds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.postgres.preflight import ensure_slot
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.incremental_runs import setup, SLOT
from tests.support.memory_child import measured
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase
from tests.support.snapshot_checks import assert_md5_payloads

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = [pytest.mark.slow, NEWEST_POSTGRES_ONLY]  # runs measured in child processes; tiers: docs/testing.md

MIB = 2**20
#: The byte bound of the drains' chunks: every backlog below is many of them.
CHUNK_BYTES = 1 * MIB
NO_COUNT_BOUND = "1000000"
#: A row's payload: 1 KB of md5 text, which PostgreSQL keeps inline (``repeat(md5(g::text), 32)``).
PAYLOAD = "repeat(md5(g::text), 32)"


def config_file(config: PgcdcConfig, tmp_path: Path) -> Path:
    """The configuration the measuring child reads."""
    path = tmp_path / "pgcdc.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()))
    return path


#: What a run may keep once it is done, of Arrow's pool and of Python's heap (measured: 0 and 0.23-0.74 MiB).
KEPT_MIB = (0.5, 1.5)


def held(memory: dict) -> float:
    return memory["peak_mib"] - memory["baseline_mib"]


def assert_kept_nothing(memory: dict) -> None:
    """The run kept nothing of its input once done: no Arrow buffer, no more Python than first-use caches."""
    arrow, python = KEPT_MIB
    assert memory["arrow_kept_mib"] < arrow and memory["python_kept_mib"] < python, memory


def assert_below(memory: dict, bounds: tuple[float, float, float]) -> None:
    """The run kept nothing and held less than ``bounds`` at once: resident memory over the baseline, Arrow's
    pool and Python's heap at their most."""
    assert_kept_nothing(memory)
    resident, arrow, python = bounds
    assert held(memory) < resident and memory["arrow_max_mib"] < arrow and memory["python_peak_mib"] < python, memory


# --------------------------------------------------------------------------- drains

HISTORY_DDL = """
    CREATE TABLE wide (id int PRIMARY KEY, pad text);
    CREATE TABLE feed (entry int, pad text);
    INSERT INTO wide VALUES (-1, 'seed');
    CREATE PUBLICATION pub FOR TABLE wide, feed;
"""


#: (resident, Arrow, Python) bounds of the history drain, a 41 MB backlog: measured 80-84, 8.4 and 3.6 MiB (five runs, 2
#: cores, load 5-14).
HISTORY_DRAIN_MIB = (110.0, 12.0, 6.0)


def test_a_drain_with_history_holds_chunks_not_its_backlog(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """A backlog of 40 MB into a table with SCD type 2 history and a keyless one with a changelog, cut into
    1 MiB chunks: the drain writes each chunk's changelog and table rows and holds a few chunks at once."""
    config = setup(pg, tmp_path, spark, HISTORY_DDL)
    config = config.model_copy(
        update={
            "history": config.history.model_copy(update={"tables": {"public.wide": "scd2", "public.feed": "changelog"}})
        }
    )
    path = config_file(config, tmp_path)
    rows = 20_000
    with pg.connect() as conn:
        for start in range(0, rows, 2000):
            conn.execute(f"INSERT INTO wide SELECT g, {PAYLOAD} FROM generate_series({start}, {start + 1999}) g")
            conn.execute(f"INSERT INTO feed SELECT g, {PAYLOAD} FROM generate_series({start}, {start + 1999}) g")
    memory = measured("drain", str(path), NO_COUNT_BOUND, str(CHUNK_BYTES))
    assert memory["changes"] == 2 * rows
    assert_below(memory, HISTORY_DRAIN_MIB)
    assert_delta_equals_postgres(pg.dsn, "public.wide", config.table_path("public", "wide"), key=("id",))
    assert_delta_equals_postgres(pg.dsn, "public.feed", config.table_path("public", "feed"))


#: The chunk of the drain of one large transaction (30 MB: five chunks) and its (resident, Arrow, Python) bounds:
#: measured 107-124, 11.8-15 and 20.2 MiB (five runs, load 5-14).
BIG_TRANSACTION_CHUNK = 6 * MIB
BIG_TRANSACTION_MIB = (150.0, 21.0, 26.0)


def test_one_transaction_five_chunks_long_is_written_in_pieces(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """One transaction of 30 MB into a keyless and a REPLICA IDENTITY FULL table, chunks of 6 MiB: the
    transaction is written piece by piece (each with its marker) and held a few pieces at a time."""
    config = setup(
        pg,
        tmp_path,
        spark,
        """
        CREATE TABLE feed (entry int, pad text);
        CREATE TABLE bag (k int, pad text);
        ALTER TABLE bag REPLICA IDENTITY FULL;
        CREATE PUBLICATION pub FOR TABLE feed, bag;
        """,
    )
    path = config_file(config, tmp_path)
    rows = 15_000
    with pg.connect() as conn, conn.transaction():
        conn.execute(f"INSERT INTO feed SELECT g, {PAYLOAD} FROM generate_series(1, {rows}) g")
        conn.execute(f"INSERT INTO bag SELECT g % 100, {PAYLOAD} FROM generate_series(1, {rows}) g")
    memory = measured("drain", str(path), NO_COUNT_BOUND, str(BIG_TRANSACTION_CHUNK))
    assert memory["changes"] == 2 * rows
    assert_below(memory, BIG_TRANSACTION_MIB)
    assert_delta_equals_postgres(pg.dsn, "public.feed", config.table_path("public", "feed"))
    assert_delta_equals_postgres(pg.dsn, "public.bag", config.table_path("public", "bag"))


# --------------------------------------------------------------------------- snapshots and reconcile


def md5_table(pg: PgDatabase, rows: int, name: str = "big") -> float:
    """``name`` (id, payload) of ``rows`` 1 KB rows; its heap in MiB."""
    pg.execute(f"""
        CREATE TABLE {name} (id int PRIMARY KEY, payload text);
        INSERT INTO {name} SELECT g, repeat(md5(g::text), 31) FROM generate_series(1, {rows}) g;
    """)
    ((heap,),) = pg.execute(f"SELECT pg_relation_size('{name}')")
    return heap / MIB


#: (resident, Arrow, Python) bounds of a snapshot of a 40 MB table (heap; 34 MB of values) in eight key ranges:
#: measured 109-124, 10.5 and 5.2 MiB (six runs, load 5-14).
KEY_RANGES_MIB = (150.0, 16.0, 8.0)


def test_a_snapshot_in_key_ranges_holds_a_range_not_the_table(pg: PgDatabase, tmp_path: Path) -> None:
    """A 40 MB table copied in eight key ranges, each its own short transaction and commit."""
    rows = 36_000
    heap = md5_table(pg, rows)
    pg.execute("CREATE PUBLICATION pub FOR TABLE big")
    config = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")},
        "snapshot": {"chunked_above_mb": 0, "key_chunk_mb": heap / 8},
    })  # fmt: skip
    ensure_slot(pg.dsn, SLOT)
    memory = measured("snapshot-tables", str(config_file(config, tmp_path)))
    assert memory["rows"] == {"public.big": rows} and memory["chunks"]["public.big"] >= 8
    assert heap > 40
    assert_below(memory, KEY_RANGES_MIB)
    assert_md5_payloads(config.table_path("public", "big"), rows)


#: (resident, Arrow, Python) bounds of reconciling a 40 MB table: measured 189-215, 42.6 and 49 MiB (six runs, load
#: 5-14). Reconciliation reads both sides in pieces of 16 MiB (``PARSE_BYTES``; the engine's batches) and turns each
#: into Python rows to compare, so at this size it holds about the table; the bounds stop it from holding more.
RECONCILE_MIB = (260.0, 46.0, 55.0)


def test_reconcile_holds_no_more_than_its_pieces(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Reconciliation of a 40 MB table in ranges of 4000 rows."""
    rows = 36_000
    heap = md5_table(pg, rows)
    config = setup(pg, tmp_path, spark, "CREATE PUBLICATION pub FOR TABLE big")
    memory = measured("reconcile", str(config_file(config, tmp_path)), "4000")
    assert memory["passed"] == {"public.big": True} and heap > 40
    assert_below(memory, RECONCILE_MIB)


#: How much more Arrow's pool may hold in the parallel snapshot of a table twice as large (28 MB more heap, 25 MB
#: more values). One copy's resident peak varies with its three workers' timing and the machine's load (134-168
#: MiB for the smaller table, 148-198 for the larger, load 6-14; the lower of two copies grew by 51 MiB once on a
#: quiet machine), more than the table grows, so resident memory is reported, not bounded. Arrow's pool grew 0 to
#: +4.6 MiB (16.5-21 MiB); with every fourth batch the writer took kept, +40 to +41; with a quarter of each
#: batch's rows kept (lower of two copies), +7.9. Every copy also keeps nothing once done (``KEPT_MIB``).
PARALLEL_ARROW_GROWTH_MIB = 7.0


def test_the_parallel_ctid_snapshot_holds_pieces_not_the_table(pg: PgDatabase, tmp_path: Path) -> None:
    """Three ctid-range workers over a table, then over one twice its size (each twice): Arrow's peak grows less
    than the table did (the fixed part, delta-rs's writer and the workers' pieces, is above either table: a
    bound of its own would say nothing about the table, the growth does)."""
    lowest: dict[str, tuple[float, float]] = {}
    for name, rows in (("small", 25_000), ("large", 50_000)):
        md5_table(pg, rows, name)
        pg.execute(f"CREATE PUBLICATION pub_{name} FOR TABLE {name}")
        ensure_slot(pg.dsn, SLOT)
        copies = []
        for copy in range(2):
            path = str(tmp_path / f"{name}_{copy}")
            memory = measured("snapshot", pg.dsn, f"pub_{name}", f"public.{name}", path, SLOT, str(MIB), "3", "2")
            assert memory["rows"] == rows and memory["workers"] == 3
            assert_kept_nothing(memory)
            assert_md5_payloads(path, rows)
            copies.append((held(memory), memory["arrow_max_mib"]))
        lowest[name] = (min(c[0] for c in copies), min(c[1] for c in copies))
    assert lowest["large"][1] - lowest["small"][1] < PARALLEL_ARROW_GROWTH_MIB, lowest
