"""A big table read as ctid (heap block) ranges by several sessions that import one exported snapshot.

The ranges are disjoint and cover every tuple id (:func:`block_ranges`), and every session sees
exactly the snapshot the temporary slot's transaction exported (:func:`export_snapshot`,
:func:`snapshot_session`), so the parts add up to exactly the table as one ``COPY`` in that
transaction would read it (:func:`parallel_copy`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Sequence

import psycopg
import pyarrow as pa

from resources.errors import ProtocolError
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.connections import connect
from resources.postgres.copy import (
    BlockRange,
    copy_pieces,
    END_OF_PIECES,
    Handover,
    parse_each,
    prefetched,
    unparsed,
)
from resources.postgres.replication import ReplicationConnection
from resources.sql import quote_literal


def heap_blocks(conn: psycopg.Connection, oid: int) -> tuple[int, int]:
    """(blocks, block size in bytes) of the table's heap now; for a partitioned root, of its largest leaf.

    Read from the file size (``pg_relation_size``), not ``pg_class.relpages``, which is only
    as fresh as the last VACUUM/ANALYZE and is 0 for a table loaded since. The size may move
    afterwards: the last range of :func:`block_ranges` is open-ended.
    """
    row = (
        psycopg.ClientCursor(conn)
        .execute(
            "SELECT pg_catalog.max(size), pg_catalog.current_setting('block_size') FROM ("
            " SELECT pg_catalog.pg_relation_size(%s::pg_catalog.oid) AS size UNION ALL"  # a plain table
            " SELECT pg_catalog.pg_relation_size(tree.relid)"  # the leaves of a partitioned one
            " FROM pg_catalog.pg_partition_tree(%s::pg_catalog.oid) tree WHERE tree.isleaf) sizes",
            (oid, oid),
        )
        .fetchone()
    )
    if row is None:
        raise ProtocolError(f"no size for relation {oid}", "check the server version")
    block_size = int(row[1])
    return (int(row[0]) // block_size if row[0] is not None else 0), block_size


def block_ranges(blocks: int, chunk_blocks: int) -> list[BlockRange]:
    """Split ``blocks`` heap blocks into equal ranges of at most about ``chunk_blocks`` each.

    The ranges are disjoint and cover every tuple id: the first starts at block 0 and the
    last has no end, so rows in blocks added after the size was read are read too. A table
    of at most one chunk is one range, (0, None).
    """
    count = max(1, -(-blocks // max(1, chunk_blocks)))
    step = -(-blocks // count) if blocks else 0
    starts = [i * step for i in range(count)]
    return [(start, starts[i + 1] if i + 1 < count else None) for i, start in enumerate(starts)]


def export_snapshot(conn: ReplicationConnection) -> str:
    """Export the snapshot of ``conn``'s open transaction (the temporary slot's, with SNAPSHOT 'use').

    Importing it gives another session exactly that snapshot, so the slot's consistent point
    stays the exact LSN the parts are consistent at. It can be imported while the exporting
    transaction stays open.
    """
    ((name,),) = conn.execute("SELECT pg_catalog.pg_export_snapshot()")
    return str(name)


def snapshot_session(dsn: str, snapshot_name: str, application_name: str) -> psycopg.Connection:
    """A new session inside a READ ONLY REPEATABLE READ transaction that imported ``snapshot_name``."""
    conn = connect(dsn, application_name=application_name, session_settings=SESSION_SETTINGS)
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(f"SET TRANSACTION SNAPSHOT {quote_literal(snapshot_name)}".encode())
    except BaseException:
        conn.close()
        raise
    return conn


def parallel_copy(
    dsn: str,
    snapshot_name: str,
    queries: Sequence[str],
    make_parser: Callable[[], Callable[[bytearray, int], pa.RecordBatch]],
    workers: int,
    piece_bytes: int,
    piece_rows: int,
    name: str,
    on_query_done: Callable[[], None] | None = None,
) -> Generator[tuple[pa.RecordBatch, int], None, None]:
    """Run ``queries`` (COPYs of disjoint parts of one table) on ``workers`` sessions that import
    ``snapshot_name``; yield their (batch, COPY bytes) pieces in whatever order they finish.

    Each worker takes the next query when it finishes one, so a slow range does not hold the
    others up, and reads the next piece while it parses one (the CSV reader releases the GIL).
    At most one parsed piece per worker waits for the consumer, which bounds memory to a few
    pieces per worker. The first failure stops every worker and is raised; when the consumer
    stops early, the workers stop at their next hand-over and close their sessions.
    ``on_query_done`` runs on a worker's thread after each query's last piece is handed over.
    """
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for query in queries:
        todo.put(query)
    handover = Handover(max(1, workers))
    offer, stop, failure = handover.offer, handover.stop, handover.failures

    def work(index: int) -> None:
        conn: psycopg.Connection | None = None
        try:
            conn = snapshot_session(dsn, snapshot_name, "pgcdc_snapshot")
            parse = make_parser()
            while not stop.is_set():
                try:
                    query = todo.get_nowait()
                except queue.Empty:
                    break
                copied = copy_pieces(conn.pgconn, query, unparsed, piece_bytes, piece_rows)
                pieces = parse_each(prefetched(copied, 1, f"{name}-{index}-copy"), parse)
                try:
                    for item in pieces:
                        if not offer(item):
                            return
                finally:
                    pieces.close()
                if on_query_done is not None:
                    on_query_done()
        except BaseException as exc:  # handed to the consumer, which re-raises it
            failure.append(exc)
        finally:
            if conn is not None:
                conn.close()  # also ends a COPY left half-read
            offer(END_OF_PIECES)

    count = max(1, min(workers, len(queries)))
    threads = [threading.Thread(target=work, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        finished = 0
        while finished < len(threads):
            item = handover.items.get()
            if item is END_OF_PIECES:
                finished += 1
                if failure:
                    raise failure[0]
                continue
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
