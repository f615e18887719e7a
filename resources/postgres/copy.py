"""COPY a table out of PostgreSQL into Arrow record batches: pieces read with non-blocking libpq, parsed in a thread, prefetched.

The COPY uses PostgreSQL's text format, not CSV: the server writes it with less work (0.56-0.60
against 0.70-0.74 CPU-s for 2M rows of six columns, measured on its backend), every value's
newline is escaped so a raw newline ends a row, and Arrow's CSV reader parses it (tab-separated,
no quoting) as fast as CSV; the few escapes are undone column-wise (:func:`unescape_text`).

A big table is read as several ctid (heap block) ranges by worker connections that all
import the one exported snapshot (``resources/postgres/ctid_copy.py``), so the parts add up to
exactly the table as that snapshot sees it.
"""

from __future__ import annotations

import queue
import re
import select
import struct
import threading
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from psycopg import pq

from resources.errors import (
    ConfigurationError,
    ConnectionFailure,
    explain_server_error,
    PgcdcError,
    ProtocolError,
    SnapshotError,
)
from resources.lsn import LSN
from resources.pgtypes import (
    column_type_from_catalog,
    csv_direct_type,
    pg_type_catalog_params,
    pg_type_catalog_query,
    PgColumnType,
    to_arrow,
)
from resources.postgres.catalog import TableInfo
from resources.postgres.replication import ReplicationConnection

DEFAULT_CHUNK_ROWS = 1_000_000
"""Rows per parsed piece; the byte bound usually closes a piece first."""


PARSE_BYTES = 16 * 1024 * 1024
"""COPY bytes per parsed piece (unless ``chunk_bytes`` is smaller): small enough to overlap
reading PostgreSQL with writing Spark, large enough that per-piece overhead is noise."""


FIRST_PIECE_BYTES = 1024 * 1024
"""COPY bytes of a COPY's first piece; each next piece may be four times bigger, up to the piece
size. A COPY's pieces pass through a reader, a parser and the writer in turn: with a full-size
first piece the parser and the writer waited for 16 MiB to arrive before starting, and the first
rows reached the writer (and the progress log) after 0.4-1.1 s instead of 0.05-0.15 s. The
whole copy takes the same either way (it is CPU-bound on two cores: docs/engine-notes.md)."""


PARSE_BLOCK_BYTES = 1024 * 1024
"""Bytes per block of Arrow's CSV reader within a piece. Blocks that stay in the CPU's cache, and
buffers the allocator reuses instead of fresh pages from the kernel, parse 2M rows of six columns
in 0.33 CPU-s against 0.38-0.40 for a 16 MiB piece read as one block (docs/engine-notes.md,
"Snapshot start-up"). A row longer than a block makes its piece one block."""


PREFETCH_PIECES = 2
"""Parsed pieces waiting for the writer; with the piece being parsed and the chunk being
written this bounds memory to a few chunks."""


_POLL_SECONDS = 1.0


T = TypeVar("T")


def read_column_types(conn: ReplicationConnection, info: TableInfo) -> list[PgColumnType]:
    if not info.columns:
        raise ConfigurationError(f"table {info.table} has no published columns", "publish at least one column")
    rows = (
        psycopg.ClientCursor(conn.connection)
        .execute(pg_type_catalog_query(), pg_type_catalog_params((c.type_oid, c.type_modifier) for c in info.columns))
        .fetchall()
    )
    return [column_type_from_catalog(column.name, row) for column, row in zip(info.columns, rows, strict=True)]


class PieceParser:
    """Rows of COPY's text format -> one typed Arrow batch with the snapshot LSN column.

    In the text format a NULL is ``\\N``, an empty string an empty field, a tab separates
    fields and a newline ends each row: a value's tab, newline and other control escapes and its
    backslashes are written as backslash escapes, so no value holds a raw delimiter or newline
    and the parse needs no quote state. Empty lines are rows (the empty string of a one-column
    table). A piece is parsed in blocks of :data:`PARSE_BLOCK_BYTES`; one holding a row longer than
    a block (TOASTed values up to 1 GB) is parsed again as a single block sized to it.

    Columns whose PostgreSQL text Arrow's CSV converter parses exactly like ``to_arrow``
    (integers, floats, numeric(p,s), bool, date, timestamps: ``pgtypes.csv_direct_type``)
    are typed by the reader itself, with no string column in between; their text never
    holds a backslash. A value it refuses (timestamp ``infinity``, numeric ``NaN``, a BC date)
    makes that column, from then on, text converted by ``to_arrow``, which maps the value or
    raises the mapping's error; the piece is parsed again. Everything else is read as text,
    unescaped (when the piece holds a backslash at all) and handed to ``to_arrow``.
    """

    def __init__(self, columns: Sequence[PgColumnType], schema: pa.Schema, snapshot_lsn: LSN) -> None:
        self._columns = list(columns)
        self._schema = schema
        self._names = [f"c{i}" for i in range(len(columns))]
        self._direct: list[pa.DataType | None] = [csv_direct_type(col) for col in self._columns]
        self._parse_options = pa_csv.ParseOptions(
            delimiter="\t", quote_char=False, double_quote=False, escape_char=False, ignore_empty_lines=False
        )
        self._lsn_bytes = struct.pack("<q", int(snapshot_lsn))

    def _convert_options(self) -> pa_csv.ConvertOptions:
        return pa_csv.ConvertOptions(
            column_types={
                name: pa.string() if direct is None else direct for name, direct in zip(self._names, self._direct)
            },
            null_values=[TEXT_NULL],
            true_values=["t"],
            false_values=["f"],
            strings_can_be_null=True,
        )

    def _read(self, data: bytearray) -> pa.Table:
        block_size = min(len(data) + 1, PARSE_BLOCK_BYTES)
        while True:
            read_options = pa_csv.ReadOptions(column_names=self._names, block_size=block_size, use_threads=False)
            try:
                return pa_csv.read_csv(pa.py_buffer(data), read_options, self._parse_options, self._convert_options())
            except pa.ArrowInvalid as exc:
                if _STRADDLING in str(exc) and block_size <= len(data):
                    block_size = len(data) + 1  # a row longer than a block: the piece as one block
                    continue
                failed = _failed_csv_column(str(exc))
                if failed is None or failed >= len(self._direct) or self._direct[failed] is None:
                    if not any(direct is not None for direct in self._direct):
                        raise
                    self._direct = [None] * len(self._direct)  # not a conversion error: all as text
                else:
                    self._direct[failed] = None

    def __call__(self, data: bytearray, rows: int) -> pa.RecordBatch:
        if rows == 0:  # Arrow's reader refuses an empty document
            return pa.RecordBatch.from_pylist([], schema=self._schema)
        parsed = self._read(data)
        if parsed.num_rows != rows:
            raise ProtocolError(
                f"COPY sent {rows} rows but {parsed.num_rows} parsed", "report this with the table definition"
            )
        escaped = b"\\" in data  # memchr over the piece: most pieces hold no escape at all
        arrays = [
            _single_chunk(parsed.column(i))
            if direct is not None
            else to_arrow(unescape_text(parsed.column(i)) if escaped else parsed.column(i), col)
            for i, (col, direct) in enumerate(zip(self._columns, self._direct, strict=True))
        ]
        arrays.append(pa.Array.from_buffers(pa.int64(), rows, [None, pa.py_buffer(self._lsn_bytes * rows)]))
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema)


TEXT_NULL = "\\N"
"""A NULL in COPY's text format (a value \\N is written ``\\\\N``)."""


_TEXT_ESCAPES = (("\\b", "\b"), ("\\f", "\f"), ("\\n", "\n"), ("\\r", "\r"), ("\\t", "\t"), ("\\v", "\v"))
"""The letter escapes COPY's text format writes (PostgreSQL's ``CopyAttributeOutText``): every other
control character is written as itself, and a backslash as two."""


def unescape_text(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A string column of COPY's text format as the values PostgreSQL's output functions gave.

    Literal replacements, each left to right, decode exactly. First each escaped backslash
    (two backslashes) becomes NUL: a run of backslashes always starts an escape, so matching
    pairs from its left pairs them as COPY wrote them, an odd last one staying with the letter
    after it; and no PostgreSQL text value holds a NUL, so the placeholder cannot be confused
    with a value's character. Then each letter escape becomes its control character, last NUL
    becomes a backslash. Values without a backslash pass unchanged.
    """
    column = pc.replace_substring(column, "\\\\", "\x00")
    for escape, character in _TEXT_ESCAPES:
        column = pc.replace_substring(column, escape, character)
    return pc.replace_substring(column, "\x00", "\\")


_STRADDLING = "straddling object straddles two block boundaries"
"""Arrow's CSV reader refusing a row longer than its block."""


_CSV_COLUMN_ERROR = re.compile(r"In CSV column #(\d+): CSV conversion error")


def _failed_csv_column(message: str) -> int | None:
    match = _CSV_COLUMN_ERROR.search(message)
    return int(match.group(1)) if match else None


def _single_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def unparsed(data: bytearray, rows: int) -> tuple[bytearray, int]:
    return data, rows


def parse_each(
    pieces: Generator[tuple[tuple[bytearray, int], int], None, None], parse: Callable[[bytearray, int], pa.RecordBatch]
) -> Generator[tuple[pa.RecordBatch, int], None, None]:
    """Parse the pieces of another thread's COPY: the CSV reader releases the GIL, so
    reading PostgreSQL, parsing and the Spark transfer proceed side by side."""
    try:
        for (data, rows), nbytes in pieces:
            yield parse(data, rows), nbytes
    finally:
        pieces.close()


def copy_pieces(
    pgconn: pq.abc.PGconn,
    query: str,
    parse: Callable[[bytearray, int], T],
    piece_bytes: int,
    piece_rows: int,
) -> Generator[tuple[T, int], None, None]:
    """Run the COPY and yield (batch, COPY bytes) pieces; at least one, possibly empty.

    Straight on libpq: psycopg's Copy costs microseconds per row, which is most of the
    budget for narrow rows. The protocol guarantees that each CopyData message the server
    sends is one whole row, so pieces always end on row boundaries. Non-blocking reads
    wait in select(), releasing the GIL for the writer thread.
    """
    pgconn.send_query(query.encode())
    result = _next_result(pgconn)
    if result is None or result.status != pq.ExecStatus.COPY_OUT:
        error = _result_error(result, query, pgconn.user)
        _drain_results(pgconn)
        raise error
    get_copy_data = pgconn.get_copy_data
    buffer = bytearray()
    rows = size = 0
    yielded = False
    limit = min(piece_bytes, FIRST_PIECE_BYTES)  # growing to piece_bytes: see FIRST_PIECE_BYTES
    try:
        while True:
            nbytes, data = get_copy_data(1)
            if nbytes > 0:
                buffer += data
                rows += 1
                size += nbytes
                if size >= limit or rows >= piece_rows:
                    yield parse(buffer, rows), size
                    yielded = True
                    buffer = bytearray()
                    rows = size = 0
                    limit = min(piece_bytes, limit * 4)
            elif nbytes == 0:
                select.select([pgconn.socket], [], [], _POLL_SECONDS)
                pgconn.consume_input()
            else:
                break
    except psycopg.OperationalError as exc:
        raise ConnectionFailure(f"COPY interrupted: {exc}", "check the server, then run the snapshot again") from None
    failure = _drain_results(pgconn)
    if failure is not None:
        raise failure
    if rows or not yielded:
        yield parse(buffer, rows), size


def _next_result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            return pgconn.get_result()
        select.select([pgconn.socket], [], [], _POLL_SECONDS)


def _drain_results(pgconn: pq.abc.PGconn) -> PgcdcError | None:
    """Read the results after COPY (leaving the connection usable); the first error, if any."""
    error: PgcdcError | None = None
    while (result := _next_result(pgconn)) is not None:
        if result.status == pq.ExecStatus.FATAL_ERROR and error is None:
            error = _result_error(result, "COPY", pgconn.user)
    return error


def _result_error(result: pq.abc.PGresult | None, query: str, user: bytes | None = None) -> PgcdcError:
    if result is None:
        return ProtocolError(f"no result for {query[:80]}", "check the server log")
    if result.status != pq.ExecStatus.FATAL_ERROR:
        return ProtocolError(
            f"unexpected {pq.ExecStatus(result.status).name} answer to {query[:80]}", "check the server version"
        )
    primary = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or result.error_message or b""
    if result.error_field(pq.DiagnosticField.SQLSTATE) == b"42501":  # no SELECT on the table: the grant to run
        role = None if user is None else user.decode("utf-8", "replace")
        return explain_server_error("42501", primary.decode("utf-8", "replace"), user=role)
    if result.error_field(pq.DiagnosticField.SQLSTATE) == b"22021":  # only a SQL_ASCII database's bytes get here
        return SnapshotError(
            f"COPY failed: {primary.decode('utf-8', 'replace')}: text in the database is not UTF-8"
            " (PostgreSQL stores a SQL_ASCII database's bytes unchecked)",
            "fix that value in PostgreSQL, or re-create the database with the ENCODING its text is really in",
        )
    return SnapshotError(
        f"COPY failed: {primary.decode('utf-8', 'replace')}",
        "fix the cause named by PostgreSQL, then run the snapshot again",
    )


END_OF_PIECES = object()


class Handover:
    """A bounded queue from producer threads to one consumer, which the consumer can abandon.

    A producer's ``offer`` gives up once ``stop`` is set (the consumer stopped early), so no
    producer blocks forever on a full queue; a producer's exception goes to ``failures`` for
    the consumer to raise.
    """

    def __init__(self, depth: int) -> None:
        self.items: queue.Queue[object] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.failures: list[BaseException] = []

    def offer(self, item: object) -> bool:
        """Hand ``item`` over; False when the consumer has stopped."""
        while not self.stop.is_set():
            try:
                self.items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def prefetched(source: Generator[T, None, None], depth: int, name: str) -> Generator[T, None, None]:
    """Run ``source`` in a thread, ``depth`` items ahead of the consumer.

    When the consumer stops early (the write failed), the producer notices at its next
    hand-over and closes ``source``; the caller then closes the connection it was reading.
    """
    handover = Handover(depth)
    offer, stop, failure = handover.offer, handover.stop, handover.failures

    def produce() -> None:
        try:
            for item in source:
                if not offer(item):
                    break
        except BaseException as exc:  # handed to the consumer, which re-raises it
            failure.append(exc)
        finally:
            source.close()
            offer(END_OF_PIECES)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := handover.items.get()) is not END_OF_PIECES:
            yield item  # type: ignore[misc]
        thread.join()
        if failure:
            raise failure[0]
    finally:
        stop.set()
        thread.join()


BlockRange = tuple[int, int | None]
"""Heap blocks first .. end - 1 of a table (end None: to the end of the heap; ``resources/postgres/ctid_copy.py``)."""


def copied_batches(
    pgconn: pq.abc.PGconn, query: str, parse: PieceParser, piece_bytes: int, chunk_rows: int, name: str
) -> Generator[tuple[pa.RecordBatch, int], None, None]:
    """One COPY as parsed (batch, COPY bytes) pairs: read in one thread, parsed in another, each
    :data:`PREFETCH_PIECES` ahead, so reading, parsing and writing overlap in bounded memory."""
    source = copy_pieces(pgconn, query, unparsed, piece_bytes, chunk_rows)
    return prefetched(
        parse_each(prefetched(source, PREFETCH_PIECES, f"pgcdc-copy-{name}"), parse),
        PREFETCH_PIECES,
        f"pgcdc-parse-{name}",
    )
