"""Where transactions (and streamed blocks) begin and end, from tag bytes and fixed fields only.

A drain up to an LSN must stop at a transaction boundary: after the Commit (or Stream Stop,
or standalone message) that reaches the end, and in front of a Begin that lies past it, so
the next drain starts exactly there. :class:`TransactionBoundaries` decides that for one
message at a time without a server, a clock or a socket; the replication stream
(postgres/stream.py) asks it about every message that is not a row change, and keeps a
held message for the next drain. The field offsets are documented in pgoutput/tags.py.
"""

from __future__ import annotations

import struct

from resources.pgoutput.tags import BEGIN, BEGIN_PREPARE, COMMIT, PREPARE, STANDALONE, STREAM_START, STREAM_STOP

HAND_OUT, LAST, HOLD = 0, 1, 2
"""What the drain does with a message: hand it out; hand it out and stop; stop in front of it
(keep it for the next drain, whose start is :attr:`TransactionBoundaries.held_at`)."""

_u64 = struct.Struct(">Q").unpack_from


class TransactionBoundaries:
    """The open transaction / streamed block state of one replication session."""

    __slots__ = ("in_transaction", "in_block", "held_at")

    def __init__(self) -> None:
        self.in_transaction = False
        self.in_block = False
        #: After HOLD: the position the held message's record starts at (any position inside it serves).
        self.held_at = 0

    @property
    def open(self) -> bool:
        """Inside a transaction or a streamed block: the drain may not stop here."""
        return self.in_transaction or self.in_block

    def classify(self, buf: bytes | memoryview, at: int, wal_start: int, end: int) -> int:
        """HAND_OUT, LAST or HOLD for the pgoutput message at ``buf[at:]`` in a frame starting at
        ``wal_start``, draining up to ``end``; follows the message's effect on the state."""
        tag = buf[at]
        if self.in_transaction:
            if tag == COMMIT or tag == PREPARE:
                self.in_transaction = False
                return LAST if _u64(buf, at + 10)[0] >= end else HAND_OUT
            return HAND_OUT
        if self.in_block:
            if tag == STREAM_STOP:
                self.in_block = False
                return LAST if wal_start >= end else HAND_OUT
            return HAND_OUT
        if tag == BEGIN or tag == BEGIN_PREPARE:
            begin_at = _u64(buf, at + 1)[0]
            if begin_at >= end:
                self.held_at = begin_at
                return HOLD
            self.in_transaction = True
            return HAND_OUT
        if tag == STREAM_START:
            if wal_start >= end:
                self.held_at = wal_start
                return HOLD
            self.in_block = True
            return HAND_OUT
        offsets = STANDALONE.get(tag)
        if offsets is None:  # e.g. a non-transactional logical message, positioned by its frame
            if wal_start >= end:
                self.held_at = wal_start
                return HOLD
            return HAND_OUT
        begin_at, end_at = offsets
        record_end = wal_start if end_at is None else _u64(buf, at + end_at)[0]
        if begin_at is not None:
            past_end = _u64(buf, at + begin_at)[0] >= end
        elif end_at is not None:
            # Only the record's end is known ('r'): records never straddle the flush position,
            # so it started before `end` unless it ends past it.
            past_end = record_end > end
        else:
            past_end = wal_start >= end
        if past_end:
            self.held_at = record_end - 1
            return HOLD
        return LAST if record_end >= end else HAND_OUT

    def track(self, payload: bytes | memoryview, wal_start: int) -> int:
        """Follow a message handed out without an end (``read()``, a held message); returns the
        LSN its record ends at, or -1 inside a transaction or block."""
        tag = payload[0]
        if tag == BEGIN or tag == BEGIN_PREPARE:
            self.in_transaction = True
        elif tag == COMMIT or tag == PREPARE:
            self.in_transaction = False
            return _u64(payload, 10)[0]
        elif tag == STREAM_START:
            self.in_block = True
        elif tag == STREAM_STOP:
            self.in_block = False
        elif not self.open and tag in STANDALONE:
            end_at = STANDALONE[tag][1]
            return wal_start if end_at is None else _u64(payload, end_at)[0]
        return -1 if self.open else wal_start
