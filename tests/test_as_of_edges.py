"""``pgcdc as-of`` at the edges: every value prints (timestamps at ±infinity as PostgreSQL writes them),
in JSON lines or CSV, by LSN and by the server's clock (`--time`); an LSN past what the lake has drained is refused in one line unless the user
accepts the lake's position; any LSN parses; an LSN before the history and a table outside the
pipeline are each named as such. Real PostgreSQL, the embedded engine, the command itself.

The command reaches the suite's embedded Sail server by its address (``spark.remote``), each call in a session
of its own, rather than starting a server per call: a dozen starts were most of the test's time, and the
command starts its engine through the same ``SparkEngine.from_config`` as the runs, whose children start
embedded Sail that way (tests/test_faults.py, tests/test_incremental.py)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta.spark_destination import lake_destination
from resources.engines.spark_connect import engine_address
from resources.runs.cli import main as cli_main
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.fault_runs import write_config
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

DDL = """
    CREATE TABLE t (id int PRIMARY KEY, at timestamptz, v text);
    INSERT INTO t VALUES (1, 'infinity', 'x'), (2, '-infinity', 'x'), (3, '2024-05-01 10:00+00', NULL);
    CREATE PUBLICATION pub FOR TABLE t;
"""


def as_of(capsys: pytest.CaptureFixture[str], config_file: Path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["as-of", "--table", "public.t", "--config", str(config_file), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@NEWEST_POSTGRES_ONLY  # the command's own edges; the versions' streams are covered by the history tests
def test_as_of_prints_every_value_and_refuses_what_it_cannot_answer(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    pg.execute(DDL)
    config = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": "pgcdc_slot",
        "delta": {"root": str(tmp_path / "lake")}, "history": {"tables": {"public.t": "changelog"}},
        "spark": {"remote": engine_address(spark)},
    })  # fmt: skip
    config_file = write_config(config, tmp_path)
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute("UPDATE t SET v = 'y' WHERE id = 1")
    drained = run_incremental(config, lake_destination(spark, config))

    code, out, err = as_of(capsys, config_file)
    assert code == 0, err
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda row: row["id"])
    assert [(row["id"], row["at"], row["v"]) for row in rows] == [
        (1, "infinity", "y"), (2, "-infinity", "x"), (3, "2024-05-01 10:00:00+00:00", None),
    ]  # fmt: skip

    code, out, err = as_of(capsys, config_file, "--format", "csv", "--lsn", str(drained.end_lsn))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == '"id","at","v"'
    assert sorted(lines[1:]) == ['"1","infinity","y"', '"2","-infinity","x"', '"3","2024-05-01 10:00:00+00:00",']
    assert sorted(tuple(row) for row in csv.reader(io.StringIO(out)))[0] == ("1", "infinity", "y")

    # The server's clock after 'y' committed and before 'z' does: --time reads the table there.
    ((between,),) = pg.execute("SELECT clock_timestamp()")
    # Past what the lake has drained: a commit after the drain set v = 'z'; the lake cannot know it.
    pg.execute("UPDATE t SET v = 'z' WHERE id = 1")
    ((after,),) = pg.execute("SELECT pg_current_wal_flush_lsn()::text")
    for past in (after, "FFFFFFFF/FFFFFFFF"):
        code, out, err = as_of(capsys, config_file, "--lsn", past)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert f"{past} is past what the lake knows (the lake has drained up to {drained.confirmed_flush_lsn})" in err
        assert "run a drain first" in err and "--allow-stale" in err
        code, out, err = as_of(capsys, config_file, "--lsn", past, "--allow-stale")
        assert (
            code == 0
            and err == f"pgcdc: {past} is past what the lake has drained: rows as of {drained.confirmed_flush_lsn}\n"
        )
        assert sorted((row["id"], row["v"]) for row in map(json.loads, out.splitlines())) == [
            (1, "y"),
            (2, "x"),
            (3, None),
        ]
    run_incremental(config, lake_destination(spark, config))
    code, out, err = as_of(capsys, config_file, "--lsn", after)
    assert code == 0 and (1, "z") in [(row["id"], row["v"]) for row in map(json.loads, out.splitlines())]

    # --time, from the command line: before the commit of 'z' the table held 'y'; after it, 'z'.
    code, out, err = as_of(capsys, config_file, "--time", between.isoformat())
    assert code == 0, err
    assert sorted((row["id"], row["v"]) for row in map(json.loads, out.splitlines())) == [(1, "y"), (2, "x"), (3, None)]
    ((now,),) = pg.execute("SELECT clock_timestamp()")
    code, out, err = as_of(capsys, config_file, "--format", "csv", "--time", now.isoformat())
    assert code == 0 and '"1","infinity","z"' in out.splitlines(), err
    with pytest.raises(SystemExit) as refused:  # a time without its zone is refused by the parser, naming the fix
        as_of(capsys, config_file, "--time", "2024-05-01T10:00:00")
    assert refused.value.code == 2
    assert "2024-05-01T10:00:00 has no time zone (write e.g. 2024-05-01T10:00:00+00:00)" in capsys.readouterr().err

    # Before the history begins: named as such, with where it begins.
    code, out, err = as_of(capsys, config_file, "--lsn", "0/1")
    assert code == 2 and out == "" and "0/1 is before the history of public.t, which begins at" in err
    assert err.count("\n") == 1

    # A table the pipeline does not replicate.
    code = cli_main(["as-of", "--table", "public.nope", "--config", str(config_file)])
    err = capsys.readouterr().err
    assert code == 2 and "public.nope is not replicated by this pipeline" in err and err.count("\n") == 1
