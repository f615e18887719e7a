"""pgoutput tag bytes: the one place that names them.

Message type bytes (the first byte of every pgoutput message), TupleData column kinds and
tuple markers, as ints so a byte read off the wire (``payload[0]``) compares directly. The
replication-protocol frame tags ('w', 'k') are not pgoutput's and live in postgres/frames.py.
"""

from __future__ import annotations

from typing import Final

# Message types (src/backend/replication/logical/proto.c).
BEGIN, COMMIT, ORIGIN, RELATION, TYPE = b"B"[0], b"C"[0], b"O"[0], b"R"[0], b"Y"[0]
INSERT, UPDATE, DELETE, TRUNCATE, MESSAGE = b"I"[0], b"U"[0], b"D"[0], b"T"[0], b"M"[0]
STREAM_START, STREAM_STOP, STREAM_COMMIT, STREAM_ABORT = b"S"[0], b"E"[0], b"c"[0], b"A"[0]
BEGIN_PREPARE, PREPARE, COMMIT_PREPARED = b"b"[0], b"P"[0], b"K"[0]
ROLLBACK_PREPARED, STREAM_PREPARE = b"r"[0], b"p"[0]

# TupleData column kinds.
NULL, UNCHANGED, TEXT, BINARY = b"n"[0], b"u"[0], b"t"[0], b"b"[0]

# Tuple markers in Update/Delete: the new image, the old key image, the old full row (REPLICA IDENTITY FULL).
NEW, KEY, OLD = b"N"[0], b"K"[0], b"O"[0]

# pgoutput message layouts the drain peeks at (offsets inside the payload; src/backend/
# replication/logical/proto.c). Only these fixed fields are read, nothing is decoded:
#   'B' Begin            Int64 final_lsn @1 (start of the commit record), Int64 commit_time, Int32 xid -> opens
#   'C' Commit           Int8 flags, Int64 commit_lsn @2, Int64 end_lsn @10, Int64 commit_time      -> closes
#   'b' Begin Prepare    Int64 prepare_lsn @1, Int64 end_lsn, Int64 prepare_time, Int32 xid, gid    -> opens
#   'P' Prepare          Int8 flags, Int64 prepare_lsn @2, Int64 end_lsn @10, ...                   -> closes
#   'K' Commit Prepared  Int8 flags, Int64 commit_lsn @2, Int64 end_lsn @10, ...                    standalone
#   'r' Rollback Prep.   Int8 flags, Int64 prepare_end_lsn @2, Int64 rollback_end_lsn @10, ...      standalone
#   'S' Stream Start     Int32 xid, Int8 first_segment                     -> opens a block (LSN: frame wal_start)
#   'E' Stream Stop      (empty)                                           -> closes it (LSN: frame wal_start)
#   'c' Stream Commit    Int32 xid, Int8 flags, Int64 commit_lsn @6, Int64 end_lsn @14, ...         standalone
#   'p' Stream Prepare   Int8 flags, Int64 prepare_lsn @2, Int64 end_lsn @10, ...                   standalone
#   'A' Stream Abort     Int32 xid, Int32 subxid [, Int64 abort_lsn, Int64 abort_time]  standalone (frame wal_start)
# Everything else ('R', 'Y', 'O', 'I', 'U', 'D', 'T', 'M') sits inside a transaction or block,
# except non-transactional 'M' messages, which are positioned by the frame's wal_start.
#: Standalone messages: tag -> (offset of the record's start LSN or None, offset of its end LSN or None).
#: None means "use the frame's wal_start" (the walsender sets it to the change's position).
STANDALONE: dict[int, tuple[int | None, int | None]] = {
    COMMIT_PREPARED: (2, 10),
    ROLLBACK_PREPARED: (None, 10),
    STREAM_COMMIT: (6, 14),
    STREAM_PREPARE: (2, 10),
    STREAM_ABORT: (None, None),
}


#: Type byte -> human name, for errors.
MESSAGE_NAMES: Final[dict[int, str]] = {
    BEGIN: "Begin",
    MESSAGE: "Message",
    COMMIT: "Commit",
    ORIGIN: "Origin",
    RELATION: "Relation",
    TYPE: "Type",
    INSERT: "Insert",
    UPDATE: "Update",
    DELETE: "Delete",
    TRUNCATE: "Truncate",
    STREAM_START: "Stream Start",
    STREAM_STOP: "Stream Stop",
    STREAM_COMMIT: "Stream Commit",
    STREAM_ABORT: "Stream Abort",
    BEGIN_PREPARE: "Begin Prepare",
    PREPARE: "Prepare",
    COMMIT_PREPARED: "Commit Prepared",
    ROLLBACK_PREPARED: "Rollback Prepared",
    STREAM_PREPARE: "Stream Prepare",
}


#: Lowest protocol version that may send each message type.
SINCE_VERSION: Final[dict[int, int]] = {
    STREAM_START: 2,
    STREAM_STOP: 2,
    STREAM_COMMIT: 2,
    STREAM_ABORT: 2,
    BEGIN_PREPARE: 3,
    PREPARE: 3,
    COMMIT_PREPARED: 3,
    ROLLBACK_PREPARED: 3,
    STREAM_PREPARE: 3,
}
