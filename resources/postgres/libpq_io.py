"""Non-blocking libpq I/O with deadlines: results, flushing and socket waits.

The replication stream drives libpq in non-blocking mode so that no read or write can hang
past its deadline; these are the small loops it needs, over a ``pgconn`` and an optional
``select.poll`` object (None: ``select.select``).
"""

from __future__ import annotations

import select
import time

from psycopg import pq

from resources.errors import ConnectionFailure


def get_result(pgconn: pq.abc.PGconn, poller: select.poll | None, deadline: float) -> pq.abc.PGresult | None:
    """The next result, waiting for input until ``deadline``; None when there are no more."""
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            return pgconn.get_result()
        wait_readable(pgconn, poller, deadline)


def flush(pgconn: pq.abc.PGconn, deadline: float) -> None:
    """Send everything libpq has queued, waiting for the socket until ``deadline``."""
    while pgconn.flush() == 1:
        wait_writable(pgconn, deadline)


def wait_readable(
    pgconn: pq.abc.PGconn, poller: select.poll | None, deadline: float, raise_on_timeout: bool = True
) -> bool:
    """Wait until the socket is readable or ``deadline``; whether it is (a timeout raises unless told not to)."""
    timeout = max(0.0, deadline - time.monotonic())
    if poller is not None:
        ready = bool(poller.poll(timeout * 1000.0))
    else:
        ready = bool(select.select([pgconn.socket], [], [], timeout)[0])
    if not ready and raise_on_timeout and time.monotonic() >= deadline:
        raise ConnectionFailure("timed out waiting for the server", "check the server and the network, then retry")
    return ready


def wait_writable(pgconn: pq.abc.PGconn, deadline: float) -> None:
    """Wait until the socket is writable, reading meanwhile: the server may itself be blocked writing to us."""
    sock = pgconn.socket
    timeout = max(0.0, deadline - time.monotonic())
    readable, writable, _ = select.select([sock], [sock], [], timeout)
    if readable:
        pgconn.consume_input()
    elif not writable:
        raise ConnectionFailure("timed out sending to the server", "check the server and the network, then retry")
