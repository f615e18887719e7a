"""Transaction boundaries of a drain (pgoutput/boundaries.py), without a server.

A drain up to an LSN hands out whole transactions (and streamed blocks and standalone
messages) and stops at a boundary; what lies past the end waits for the next drain. The
tracker decides that per message from tag bytes and fixed fields; these tests pin its rules
and check, over generated sessions, that a sequence of drains loses nothing, repeats
nothing and always stops outside a transaction.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings, strategies as st

from resources.pgoutput.boundaries import HAND_OUT, HOLD, LAST, TransactionBoundaries

NO_END = 1 << 64


def begin(final_lsn: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, 0, 7)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, 0)


ROW = b"I" + struct.pack(">I", 16384) + b"N\x00\x00"


def standalone(tag: bytes, lsn: int) -> bytes:
    """A standalone message whose record is [lsn, lsn + 5) (LSN fields where proto.c puts them)."""
    if tag in (b"K", b"p"):
        return tag + struct.pack(">BQQq", 0, lsn, lsn + 5, 0)
    if tag == b"r":
        return tag + struct.pack(">BQQqq", 0, max(0, lsn - 100), lsn + 5, 0, 0)
    if tag == b"c":
        return tag + struct.pack(">IBQQq", 7, 0, lsn, lsn + 5, 0)
    if tag == b"A":
        return tag + struct.pack(">II", 7, 7)
    return b"M" + struct.pack(">BQ", 0, lsn) + b"prefix\x00" + struct.pack(">I", 0)


def test_a_commit_at_or_past_the_end_is_the_last_message() -> None:
    bounds = TransactionBoundaries()
    assert bounds.classify(begin(90), 0, 80, 100) == HAND_OUT and bounds.open
    assert bounds.classify(ROW, 0, 85, 100) == HAND_OUT
    assert bounds.classify(commit(90, 99), 0, 90, 100) == HAND_OUT and not bounds.open
    assert bounds.classify(begin(95), 0, 95, 100) == HAND_OUT
    assert bounds.classify(commit(95, 100), 0, 95, 100) == LAST and not bounds.open


def test_a_transaction_beginning_at_or_past_the_end_is_held_at_its_begin() -> None:
    bounds = TransactionBoundaries()
    assert bounds.classify(begin(100), 0, 90, 100) == HOLD
    assert bounds.held_at == 100 and not bounds.open


def test_streamed_blocks_use_the_frame_position() -> None:
    bounds = TransactionBoundaries()
    assert bounds.classify(b"S" + struct.pack(">IB", 7, 1), 0, 100, 100) == HOLD and bounds.held_at == 100
    assert bounds.classify(b"S" + struct.pack(">IB", 7, 1), 0, 99, 100) == HAND_OUT and bounds.in_block
    assert bounds.classify(commit(1, 500), 0, 99, 100) == HAND_OUT, "a Commit inside a block does not close it"
    assert bounds.classify(b"E", 0, 100, 100) == LAST and not bounds.open


def test_standalone_messages_end_or_are_held_by_their_record() -> None:
    for tag in (b"K", b"p", b"c", b"r", b"A", b"M"):
        bounds = TransactionBoundaries()
        assert bounds.classify(standalone(tag, 50), 0, 50, 100) == HAND_OUT, tag
        # A record [95, 100) ends at the end; 'A' and 'M' are positioned by their frame (95 < 100).
        expected_last = HAND_OUT if tag in (b"A", b"M") else LAST
        assert bounds.classify(standalone(tag, 95), 0, 95, 100) == expected_last, tag
        assert bounds.classify(standalone(tag, 100), 0, 100, 100) == HOLD, tag
        assert bounds.held_at >= 99, tag


def test_without_an_end_nothing_is_last_or_held() -> None:
    bounds = TransactionBoundaries()
    messages = [begin(10), ROW, commit(10, 15), standalone(b"K", 20), b"S" + struct.pack(">IB", 7, 1), ROW, b"E"]
    assert [bounds.classify(m, 0, 10 * i, NO_END) for i, m in enumerate(messages)] == [HAND_OUT] * len(messages)
    assert not bounds.open


ITEMS = st.lists(
    st.one_of(
        st.tuples(st.just("txn"), st.integers(0, 3)),
        st.tuples(st.just("stream"), st.integers(0, 3)),
        st.tuples(st.just("standalone"), st.sampled_from([b"K", b"p", b"c", b"r", b"A", b"M"])),
    ),
    max_size=15,
)


def session(items: list) -> tuple[list[tuple[bytes, int]], list[tuple[int, int, int]]]:
    """Messages with their frame positions, and (first index, last index, commit end) of each transaction."""
    messages: list[tuple[bytes, int]] = []
    transactions = []
    lsn = 100
    for kind, detail in items:
        if kind == "txn":
            first = len(messages)
            commit_lsn = lsn + 10 * (detail + 1)
            messages.append((begin(commit_lsn), lsn))
            messages += [(ROW, lsn + 10 * (i + 1)) for i in range(detail)]
            messages.append((commit(commit_lsn, commit_lsn + 5), commit_lsn))
            transactions.append((first, len(messages) - 1, commit_lsn + 5))
            lsn = commit_lsn + 10
        elif kind == "stream":
            messages.append((b"S" + struct.pack(">IB", 7, 1), lsn))
            messages += [(ROW, lsn + 10 * (i + 1)) for i in range(detail)]
            lsn += 10 * (detail + 1)
            messages.append((b"E", lsn))
            lsn += 10
        else:
            messages.append((standalone(detail, lsn), lsn))
            lsn += 10
    return messages, transactions


@settings(max_examples=150, deadline=None)
@given(ITEMS, st.lists(st.integers(0, 400), max_size=8))
def test_a_sequence_of_drains_hands_out_the_session_once_and_stops_at_boundaries(items: list, ends: list[int]) -> None:
    messages, transactions = session(items)
    bounds = TransactionBoundaries()
    handed: list[int] = []
    at = 0
    held_at: int | None = None
    for end in sorted(set(ends)) + [NO_END]:
        if held_at is not None:  # the drain's pending frame, as ReplicationStream._drain treats it
            if held_at >= end:
                continue
            held_at = None
            payload, wal_start = messages[at]
            record_end = bounds.track(payload, wal_start)
            handed.append(at)
            at += 1
            if record_end >= end:
                assert not bounds.open
                continue
        while at < len(messages):
            payload, wal_start = messages[at]
            verdict = bounds.classify(payload, 0, wal_start, end)
            if verdict == HOLD:
                assert bounds.held_at >= end - 1 and not bounds.open
                held_at = bounds.held_at
                break
            handed.append(at)
            at += 1
            if verdict == LAST:
                assert not bounds.open
                break
        for first, last, commit_end in transactions:  # every transaction that ended before the end is out, whole
            if commit_end < end:
                assert last < at
            assert not first < at <= last, "a drain stopped inside a transaction"
    assert handed == list(range(len(messages)))
    assert not bounds.open
