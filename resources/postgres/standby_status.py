"""What a replication client tells the walsender and when: the standby status update ('r') with its
positions, sent every ``interval`` seconds and whenever a keepalive asks for one."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
from psycopg import pq

from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.postgres import libpq_io
from resources.postgres.frames import Keepalive, new_lsn, new_tuple, pg_epoch_micros, STATUS, unpack_keepalive


class StandbyStatus:
    """The positions of one replication stream, as plain ints (the drain updates them on its hot
    path), and the status updates that report them: write = received, flush = apply = confirmed.

    Flush/apply positions sent to the server only ever come from :meth:`confirm` (or the slot's own
    ``confirmed_flush_lsn``, see :meth:`begin`), and never go backwards. The ``write`` position
    reported is what has been received, which keeps the walsender from pinging a client that is up
    to date.
    """

    __slots__ = (
        "_pgconn", "_lost", "interval", "timeout", "received", "server_wal_end", "confirmed", "reported_flush",
        "next_due", "updates", "keepalives",
    )  # fmt: skip

    def __init__(
        self, pgconn: pq.abc.PGconn, *, interval: float, timeout: float, lost: Callable[[BaseException], PgcdcError]
    ) -> None:
        self._pgconn = pgconn
        self._lost = lost  # the stream's: a failed send ends it with a one-line error
        self.interval = interval
        self.timeout = timeout
        self.received = 0  # highest wal_end seen in XLogData or keepalives
        self.server_wal_end = 0  # wal_end of the latest keepalive
        self.confirmed = 0  # highest LSN the caller declared durable
        self.reported_flush = 0  # highest flush LSN sent to the server
        self.next_due = 0.0  # time.monotonic() at which the next update is due
        self.updates = 0
        self.keepalives = 0

    def begin(self, slot_confirmed_flush: int, start: int, wal_sender_timeout_ms: int) -> None:
        """Positions at START_REPLICATION: the slot's confirmed position is the floor of what is reported,
        and updates go out at least four times per ``wal_sender_timeout`` (the walsender drops a client
        it has not heard from for that long, also while the client is busy elsewhere)."""
        if wal_sender_timeout_ms > 0:
            self.interval = min(self.interval, wal_sender_timeout_ms / 4000.0)
        self.confirmed = max(self.confirmed, slot_confirmed_flush)
        self.reported_flush = slot_confirmed_flush
        self.received = max(slot_confirmed_flush, start)

    def confirm(self, value: int) -> None:
        """Everything up to ``value`` is durable; lower values than an earlier confirmation are ignored."""
        if value > self.confirmed:
            self.confirmed = value

    def send(self, reply_requested: bool = False) -> None:
        """Send a standby status update now."""
        flush = max(self.confirmed, self.reported_flush)
        write = max(self.received, flush)
        message = STATUS.pack(b"r", write, flush, flush, pg_epoch_micros(), 1 if reply_requested else 0)
        pgconn = self._pgconn
        try:
            while pgconn.put_copy_data(message) == 0:
                libpq_io.wait_writable(pgconn, time.monotonic() + self.timeout)
            libpq_io.flush(pgconn, time.monotonic() + self.timeout)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        self.reported_flush = flush
        self.updates += 1
        self.next_due = time.monotonic() + self.interval

    def send_if_due(self, received: int) -> float:
        """Take ``received`` (the drain's local position) and send an update if one is due; returns the time."""
        if received > self.received:
            self.received = received
        now = time.monotonic()
        if now >= self.next_due:
            self.send()
        return now

    def on_keepalive(self, buf: memoryview) -> Keepalive:
        """A primary keepalive ('k') read: the server's position is received, and answered when it asks."""
        wal_end, sent, reply = unpack_keepalive(buf, 1)
        self.keepalives += 1
        self.server_wal_end = wal_end
        if wal_end > self.received:
            self.received = wal_end
        if reply:
            self.send()
        return new_tuple(Keepalive, (new_lsn(LSN, wal_end), sent, bool(reply)))
