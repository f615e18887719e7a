"""Entering and leaving COPY BOTH on a replication connection in non-blocking mode: START_REPLICATION's
result, CopyDone both ways, and the results the server sends once the copy has ended."""

from __future__ import annotations

import select
import time

import psycopg
from psycopg import pq

from resources.errors import ConnectionFailure, PgcdcError, ProtocolError
from resources.postgres import libpq_io
from resources.postgres.connections import from_result, one_line


def connection_lost(exc: BaseException) -> ConnectionFailure:
    """The one-line error for a replication connection libpq reports broken."""
    message = one_line(str(exc)) or "connection lost"
    return ConnectionFailure(f"replication connection lost: {message}", "check the server, then retry")


def enter_copy_both(pgconn: pq.abc.PGconn, command: str, slot: str, timeout: float) -> None:
    """Send ``command`` (START_REPLICATION) and wait for COPY BOTH; raises the server's error otherwise,
    after reading its remaining results. ``pgconn`` is in non-blocking mode; raises
    ``psycopg.OperationalError`` when the connection breaks."""
    pgconn.send_query(command.encode())
    libpq_io.flush(pgconn, time.monotonic() + timeout)
    res = libpq_io.get_result(pgconn, None, time.monotonic() + timeout)
    if res is None or res.status != pq.ExecStatus.COPY_BOTH:
        error = (
            from_result(res, slot=slot)
            if res is not None
            else ProtocolError("START_REPLICATION returned no result", "check the server log")
        )
        finish_results(pgconn, None, time.monotonic() + timeout, slot)
        raise error


def leave_copy_both(
    pgconn: pq.abc.PGconn, poller: select.poll | None, deadline: float, slot: str | None
) -> tuple[int, PgcdcError | None]:
    """Send CopyDone, discard what is still in flight until the server's CopyDone, read the results.

    Returns the number of frames discarded and the first error among the results. Raises
    ``psycopg.OperationalError`` when the connection breaks.
    """
    while pgconn.put_copy_end() == 0:
        libpq_io.wait_writable(pgconn, deadline)
    libpq_io.flush(pgconn, deadline)
    discarded = 0
    while True:
        nbytes, _ = pgconn.get_copy_data(1)
        if nbytes > 0:
            discarded += 1
            continue
        if nbytes == 0:
            libpq_io.wait_readable(pgconn, poller, deadline)
            pgconn.consume_input()
            continue
        break  # -1: the server answered with CopyDone
    return discarded, finish_results(pgconn, poller, deadline, slot)


def finish_results(
    pgconn: pq.abc.PGconn, poller: select.poll | None, deadline: float, slot: str | None
) -> PgcdcError | None:
    """Read results until None; return the first error among them."""
    error: PgcdcError | None = None
    while True:
        try:
            res = libpq_io.get_result(pgconn, poller, deadline)
        except psycopg.OperationalError as exc:
            return error or connection_lost(exc)
        if res is None:
            return error
        if res.status == pq.ExecStatus.FATAL_ERROR and error is None:
            error = from_result(res, slot=slot)
        elif res.status in (pq.ExecStatus.COPY_BOTH, pq.ExecStatus.COPY_OUT):
            return error or ProtocolError("unexpected COPY state after the stream ended", "reconnect")
        if pgconn.status == pq.ConnStatus.BAD:
            return error or ConnectionFailure("replication connection lost", "check the server, then retry")
