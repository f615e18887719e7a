"""The streaming replication protocol's frames (XLogData 'w', keepalive 'k', standby status 'r') and the PostgreSQL epoch."""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

from resources.lsn import LSN

#: Seconds between 1970-01-01 and 2000-01-01, PostgreSQL's timestamp epoch.
PG_EPOCH_OFFSET = 946_684_800


def pg_epoch_micros(unix_time: float | None = None) -> int:
    """Microseconds since 2000-01-01 UTC, the clock of the replication protocol."""
    return int(((time.time() if unix_time is None else unix_time) - PG_EPOCH_OFFSET) * 1_000_000)


# CopyData payloads of the streaming replication protocol (big-endian):
#   XLogData          'w' Int64 wal_start, Int64 wal_end, Int64 send_time, Byte[n] payload (at offset 25)
#   Primary keepalive 'k' Int64 wal_end, Int64 send_time, Byte1 reply_requested
#   Standby status    'r' Int64 write, Int64 flush, Int64 apply, Int64 client_time, Byte1 reply_requested
XLOG_HEADER = struct.Struct(">QQq")


KEEPALIVE = struct.Struct(">QqB")


STATUS = struct.Struct(">cQQQqB")


U64 = struct.Struct(">Q")


unpack_xlog = XLOG_HEADER.unpack_from


unpack_keepalive = KEEPALIVE.unpack_from


unpack_u64 = U64.unpack_from


PAYLOAD = 25  # offset of the pgoutput message inside an XLogData frame


class XLogData(NamedTuple):
    """One XLogData frame: a single pgoutput message and where it sits in the WAL.

    ``payload`` is a memoryview over libpq's buffer; copy it (``bytes()``) to keep it.
    """

    wal_start: LSN
    wal_end: LSN
    send_time: int  # microseconds since 2000-01-01 UTC
    payload: memoryview


class Keepalive(NamedTuple):
    """A primary keepalive: the walsender has processed the WAL up to ``wal_end``."""

    wal_end: LSN
    send_time: int
    reply_requested: bool


new_lsn = int.__new__  # LSN(x) without the Python-level range check, for values off the wire


new_tuple = tuple.__new__


XLOGDATA, KEEPALIVE_TAG = b"w"[0], b"k"[0]
