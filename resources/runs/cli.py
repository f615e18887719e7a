"""The ``pgcdc`` console script.

``pgcdc changes`` is how a user looks into a slot: like ``pg_recvlogical``, but
decoded, one JSON object per pgoutput message. Looking must be safe, so the slot
only moves with ``--advance``, which warns first on stderr: a pgcdc pipeline draining the slot
refuses its next drain after it. ``pgcdc as-of`` prints a table as it was at an LSN,
folded from its changelog (docs/history.md). ``pgcdc spark-server`` runs the managed
Spark with Delta until stopped, for runs that reach it through ``spark.remote``
(docs/deployment.md); ``--stop`` stops the JVMs ``spark.engine: spark`` keeps between
runs. Every failure is one line on stderr naming the fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

import psycopg

from resources.errors import ConfigurationError, explain, PgcdcError
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB
from resources.pgoutput.decoder import PgOutputDecoder
from resources.pgoutput.messages import Commit, CommitPrepared, Prepare, RollbackPrepared, StreamCommit, StreamPrepare
from resources.pgoutput.options import PgOutputOptions
from resources.pgoutput.to_json import message_to_json
from resources.pgtypes import SESSION_SETTINGS
from resources.pgtypes.mapping import TIMESTAMP_NEGATIVE_INFINITY, TIMESTAMP_POSITIVE_INFINITY
from resources.postgres.preflight import check_server, check_slot
from resources.postgres.publication import check_publications
from resources.postgres.replication import ReplicationConnection
from resources.postgres.stream import ReplicationStream

EXIT_USAGE_OR_SETUP = 2

#: Messages after which no transaction of the stream is open; their end LSN is safe to confirm.
_ENDS_OF_TRANSACTIONS = (Commit, Prepare, CommitPrepared, RollbackPrepared, StreamCommit, StreamPrepare)


def _end_of(message: object) -> LSN:
    if isinstance(message, RollbackPrepared):
        return message.rollback_end_lsn
    return message.end_lsn  # type: ignore[attr-defined]


def _lsn(text: str) -> LSN:
    try:
        return LSN.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _time(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text} has no time zone (write e.g. {text}+00:00)")
    return moment


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgcdc", description="PostgreSQL change data capture into Delta Lake")
    commands = parser.add_subparsers(dest="command", required=True)
    changes = commands.add_parser(
        "changes", help="print a slot's changes, decoded, as JSON lines (the slot moves only with --advance)"
    )
    changes.add_argument("--dsn", required=True, help="libpq DSN or postgresql:// URL of the source database")
    changes.add_argument("--slot", required=True, help="the logical replication slot (pgoutput) to read")
    changes.add_argument(
        "--publication", action="append", required=True, help="publication to decode (repeat for several)"
    )
    changes.add_argument("--create-slot", action="store_true", help="create the slot (pgoutput) when it is missing")
    changes.add_argument("--proto-version", type=int, choices=(1, 2, 3, 4), help="default: the highest the server has")
    changes.add_argument("--streaming", action="store_true", help="stream large in-progress transactions")
    changes.add_argument("--messages", action="store_true", help="include logical decoding messages")
    changes.add_argument("--binary", action="store_true", help="values in binary send format (printed as \\x hex)")
    changes.add_argument(
        "--two-phase", action="store_true", help="decode prepared transactions at PREPARE (slot created with TWO_PHASE)"
    )
    changes.add_argument("--end-lsn", type=_lsn, help="stop at this X/Y (default: the WAL position at start)")
    changes.add_argument("--advance", action="store_true", help="confirm what was printed, moving the slot")
    as_of = commands.add_parser(
        "as-of", help="print a table as it was at an LSN, from its history, as JSON lines (docs/history.md)"
    )
    as_of.add_argument(
        "--table", required=True, help="schema.table, with history: changelog or scd2 in the configuration"
    )
    moment = as_of.add_mutually_exclusive_group()
    moment.add_argument(
        "--lsn",
        type=_lsn,
        help="X/Y: the table once every transaction ending at or before it applied "
        "(default: now, as its Delta table holds it)",
    )
    moment.add_argument(
        "--time",
        type=_time,
        help="an ISO 8601 time with its zone: the table before the first transaction committed after it",
    )
    as_of.add_argument("--config", help="the pgcdc configuration file (default: $PGCDC_CONFIG)")
    as_of.add_argument(
        "--allow-stale", action="store_true",
        help="an --lsn past what the lake has drained reads the lake as of its drained position (said on stderr)",
    )  # fmt: skip
    as_of.add_argument(
        "--format", choices=("jsonl", "csv"), default="jsonl",
        help="JSON lines (default), or CSV with a header (NULL empty, every other value quoted)",
    )  # fmt: skip
    spark_server = commands.add_parser(
        "spark-server",
        help="run the managed Spark with Delta until stopped, for runs with spark.remote (docs/deployment.md)",
    )
    spark_server.add_argument(
        "--config", help="the pgcdc configuration file: its lake and spark.config (default: $PGCDC_CONFIG)"
    )
    spark_server.add_argument("--port", type=int, default=15002, help="the loopback port to listen on (default: 15002)")
    spark_server.add_argument(
        "--stop",
        action="store_true",
        help="instead: stop every Spark JVM that spark.engine: spark keeps between runs (spark.keep_alive_s), now",
    )
    return parser


def print_as_of(args: argparse.Namespace, out: TextIO) -> int:
    """Read the table as of ``--lsn`` (or ``--time``) from its history and print its rows; returns the number printed.

    The engine and the lake are imported here: ``pgcdc changes`` needs neither."""
    from resources.config import load_config
    from resources.delta.lake_storage import open_lake
    from resources.engines.engine import SparkEngine
    from resources.history.as_of import drained_position, read_as_of
    from resources.postgres.catalog import TableName

    config = load_config(args.config)
    lake = open_lake(config.delta.root, config.delta.storage)
    drained = drained_position(config, lake)
    if args.lsn is not None and args.allow_stale and drained is not None and args.lsn > drained:
        print(f"pgcdc: {args.lsn} is past what the lake has drained: rows as of {drained}", file=sys.stderr)
    with SparkEngine.from_config(config.spark) as engine:
        rows = read_as_of(
            engine.spark, config, TableName.parse(args.table), args.lsn, args.time, lake, args.allow_stale
        )
    records = printable_rows(rows)
    if args.format == "csv":
        out.write(",".join(_csv_field(name) for name in rows.column_names) + "\n")
        for record in records:
            out.write(",".join(_csv_field(value) for value in record.values()) + "\n")
    else:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    out.flush()
    return rows.num_rows


def printable_rows(rows: Any) -> list[dict[str, Any]]:
    """``rows`` (an Arrow table) as Python values, timestamps at Delta's limits as PostgreSQL writes its
    ``infinity`` and ``-infinity`` (pgcdc stores them at the int64 microsecond limits; Python's datetime
    cannot hold them)."""
    import pyarrow as pa

    columns = {
        name: _timestamps(column) if pa.types.is_timestamp(column.type) else column.to_pylist()
        for name, column in zip(rows.column_names, rows.columns)
    }
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def _timestamps(column: Any) -> list[Any]:
    import pyarrow as pa
    import pyarrow.compute as pc

    micros = column.cast(pa.int64())
    infinite = pc.is_in(micros, value_set=pa.array(list(INFINITIES), pa.int64()))
    finite = pc.if_else(infinite, pa.scalar(None, column.type), column).to_pylist()
    return [INFINITIES.get(m, value) for value, m in zip(finite, micros.to_pylist())]


INFINITIES = {TIMESTAMP_POSITIVE_INFINITY: "infinity", TIMESTAMP_NEGATIVE_INFINITY: "-infinity"}
"""A timestamp's stored microseconds that stand for PostgreSQL's infinities, and how PostgreSQL writes them."""


def _csv_field(value: Any) -> str:
    """One CSV field: NULL empty, anything else quoted (booleans as PostgreSQL's t and f)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        text = "t" if value else "f"
    elif isinstance(value, list | dict):
        text = json.dumps(value, ensure_ascii=False, default=str)
    else:
        text = str(value)
    return '"' + text.replace('"', '""') + '"'


def serve_spark(args: argparse.Namespace, out: TextIO) -> int:
    """``pgcdc spark-server``: the managed Spark with Delta until SIGTERM or Ctrl-C (``resources/engines/spark_service.py``)."""
    from resources.config import load_config
    from resources.engines.spark_service import serve

    if args.stop:
        from resources.engines.kept_spark import stop_all

        stopped = stop_all()
        out.write(f"pgcdc: stopped {len(stopped)} kept Spark JVM(s){''.join(f' (pid {pid})' for pid in stopped)}\n")
        return 0
    try:
        return serve(load_config(args.config), args.port, out)
    except RuntimeError as error:  # the JVM did not start: spark_server says why, in one line
        raise ConfigurationError(
            f"the Spark server did not start ({error})",
            "check Java 17, the port, and access to Maven Central (or a filled $PGCDC_JAR_CACHE)",
        ) from None


def advance_warning(slot: str, start: LSN | None, end: LSN) -> str:
    """What ``--advance`` tells before it moves a slot: if a pgcdc pipeline drains it, the changes
    skipped never reach Delta, and its next drain refuses (resources/runs/slot_guard.py)."""
    return (
        f'pgcdc: warning: moving replication slot "{slot}" from {start} to {end}: if a pgcdc pipeline drains'
        " this slot, these changes never reach its Delta tables and its next drain refuses until every table"
        f" is re-snapshotted (the {RESNAPSHOT_JOB} job with no table list)"
    )


def print_changes(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """Stream the slot to ``end`` and print every message; returns the number printed. ``err`` hears
    the warning ``--advance`` gives before it moves the slot."""
    with ReplicationConnection(args.dsn, application_name="pgcdc changes", session_settings=SESSION_SETTINGS) as conn:
        check_server(conn)
        check_publications(conn, args.publication)
        if args.create_slot and conn.read_slot(args.slot) is None:
            conn.create_slot(args.slot, two_phase=args.two_phase)
        slot_state = check_slot(conn, args.slot)
        end = args.end_lsn if args.end_lsn is not None else conn.identify_system().xlogpos

        options = PgOutputOptions(
            publication_names=args.publication,
            proto_version=args.proto_version,
            binary=args.binary,
            messages=args.messages,
            streaming="on" if args.streaming else "off",
            two_phase=args.two_phase,
        )
        stream = ReplicationStream(conn)
        stream.start(args.slot, options=options)
        decoder_version = options.validate(conn.server_version_num)
        decoder = PgOutputDecoder(decoder_version)
        printed = 0
        last_end = slot_state.confirmed_flush_lsn or LSN(0)
        for frame in stream.drain(end, stop=False):
            message = decoder.decode(frame.payload, frame.wal_start)
            out.write(json.dumps(message_to_json(message, decoder), ensure_ascii=False))
            out.write("\n")
            printed += 1
            if isinstance(message, _ENDS_OF_TRANSACTIONS):
                last_end = max(last_end, _end_of(message))
        if args.advance:
            # The drain stopped at a transaction boundary at or past `end`: every
            # transaction committed before `end` has been printed, so `end` (or the
            # last printed commit beyond it) is safe to confirm.
            target = max(end, last_end)
            if target > (slot_state.confirmed_flush_lsn or LSN(0)):
                warnings = err or sys.stderr
                warnings.write(advance_warning(args.slot, slot_state.confirmed_flush_lsn, target) + "\n")
                warnings.flush()
            stream.confirm(target)
        stream.stop()
        out.flush()
        return printed


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "changes":
            print_changes(args, sys.stdout)
        elif args.command == "as-of":
            print_as_of(args, sys.stdout)
        elif args.command == "spark-server":
            return serve_spark(args, sys.stdout)
        return 0
    except (PgcdcError, psycopg.Error) as error:
        slot = getattr(args, "slot", None)
        print(f"pgcdc: {explain(error, getattr(args, 'dsn', None), slot=slot)}", file=sys.stderr)
        return EXIT_USAGE_OR_SETUP
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
