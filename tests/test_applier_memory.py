"""The change applier without PostgreSQL or Spark: folding, ordering, chunk boundaries, markers.

Transactions are built byte for byte (tests/support/pgoutput_messages.py), assembled by the real
TransactionAssembler and applied by the real ChangeApplier into the in-memory destination
(resources/testing/memory_destination.py), then compared with a model that applies the
same changes one by one. The live tests (test_incremental.py, test_randomized.py) do the
same against PostgreSQL and Delta; these run in a second and explore many more orders.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from resources.cdc.applier import ChangeApplier
from resources.cdc.tables import TableTarget
from resources.cdc.transactions import CommittedTransaction
from resources.cdc.writer import OrderedWriter
from resources.delta.layout import BUCKET_COLUMN, bucket_values, HASH, RANGE, TableLayout
from resources.delta.markers import LSN_COLUMN
from resources.testing.memory_destination import InMemoryDestination, StaticTypes
from tests.support.memory_applier import (
    destination_with_snapshot,
    keyed_relation,
    OID,
    PATH,
    SNAPSHOT_LSN,
    TABLE,
    transactions,
)
from tests.support.pgoutput_messages import delete, insert, relation, truncate, UNCHANGED, update


def keyless_relation() -> bytes:
    return relation(OID, "t", [("id", 23, False), ("body", 25, False)])


def apply(
    destination: InMemoryDestination,
    txns: list[CommittedTransaction],
    *,
    max_changes: int = 1000,
    durable_seen: list[int] | None = None,
) -> tuple[ChangeApplier, int]:
    """Feed ``txns`` the way cdc/drain.py does; returns the applier and what finish() answered."""
    target = TableTarget(TABLE, PATH)  # its snapshot LSN is read from the destination's log
    applier = ChangeApplier(
        destination, StaticTypes(), {TABLE: target}, max_changes=max_changes, max_bytes=1 << 30, log=lambda _: None
    )
    try:
        for txn in txns:
            if not applier.fits(txn):
                applier.flush()
            applier.add(txn)
            if durable_seen is not None:
                durable_seen.append(int(applier.durable_lsn()))
        applier.flush()
        return applier, int(applier.finish())
    finally:
        applier.close()


def table_of(destination: InMemoryDestination, layout: TableLayout | None = None) -> dict[int, str | None]:
    """The rows by key, after checking each key appears once and sits in its bucket."""
    rows = destination.rows(PATH)
    assert len({row["id"] for row in rows}) == len(rows), "a key appears twice"
    if layout is not None:
        expected = bucket_values(layout, [pa.array([row["id"] for row in rows], pa.int32())]).to_pylist()
        assert [row[BUCKET_COLUMN] for row in rows] == expected, "a row is not in its key's bucket"
    return {row["id"]: row["body"] for row in rows}


def test_truncate_inside_a_transaction_keeps_only_the_rows_after_it(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    txns = transactions([[keyed_relation(), insert(OID, b"2", b"b"), truncate(OID), insert(OID, b"3", b"c")]], tmp_path)
    apply(destination, txns)
    assert table_of(destination) == {3: "c"}


def test_folding_keeps_the_last_image_and_a_key_change_moves_the_row(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a"), (2, "b")])
    txns = transactions(
        [
            [keyed_relation(), insert(OID, b"3", b"c"), update(OID, (b"3", b"c2")), update(OID, (b"3", b"c3"))],
            [
                update(OID, (b"20", UNCHANGED), key=(b"2", None)),
                delete(OID, key=(b"1", None)),
                insert(OID, b"1", b"again"),
            ],
        ],
        tmp_path,
    )
    apply(destination, txns)
    assert table_of(destination) == {1: "again", 3: "c3", 20: "b"}


def test_changes_at_or_below_the_snapshot_lsn_are_skipped(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    txns = transactions(
        [[keyed_relation(), insert(OID, b"5", b"old")], [insert(OID, b"6", b"new")]], tmp_path, first_end=SNAPSHOT_LSN
    )
    applier, _ = apply(destination, txns)
    assert table_of(destination) == {1: "a", 6: "new"}
    assert applier.changes_skipped == 1


def test_the_engine_is_prepared_for_writes_once_and_only_when_changes_come(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    apply(destination, transactions([[keyed_relation()]], tmp_path))
    assert destination.writes_prepared == 0
    txns = transactions([[keyed_relation(), insert(OID, b"2", b"b")], [insert(OID, b"3", b"c")]], tmp_path)
    apply(destination, txns, max_changes=1)
    assert (destination.writes_prepared, table_of(destination)) == (1, {1: "a", 2: "b", 3: "c"})


def test_durable_lsn_only_names_whole_transactions_and_finish_the_last(tmp_path: Path) -> None:
    destination = destination_with_snapshot([])
    bodies = [[keyed_relation(), *(insert(OID, str(i).encode(), b"x") for i in range(7))]]
    bodies += [[insert(OID, str(100 + i).encode(), b"y")] for i in range(5)]
    txns = transactions(bodies, tmp_path)
    ends = {0} | {int(txn.end_lsn) for txn in txns}
    seen: list[int] = []
    _, finished = apply(destination, txns, max_changes=3, durable_seen=seen)
    assert set(seen) <= ends and seen == sorted(seen)
    assert finished == int(txns[-1].end_lsn)
    assert len(table_of(destination)) == 12
    assert len(destination.commits[PATH]) > 3  # the 7-change transaction went out in pieces


def test_keyless_replay_skips_exactly_what_the_marker_covers(tmp_path: Path) -> None:
    destination = destination_with_snapshot([])
    txns = transactions(
        [
            [keyless_relation(), insert(OID, b"1", b"a"), insert(OID, b"1", b"a")],
            [insert(OID, b"2", b"b")],
        ],
        tmp_path,
    )
    apply(destination, txns)
    first = sorted((row["id"], row["body"]) for row in destination.rows(PATH))
    assert first == [(1, "a"), (1, "a"), (2, "b")]
    replay = transactions(
        [
            [keyless_relation(), insert(OID, b"1", b"a"), insert(OID, b"1", b"a")],
            [insert(OID, b"2", b"b")],
            [insert(OID, b"3", b"c")],
        ],
        tmp_path / "replay",
    )
    apply(destination, replay)
    assert sorted((row["id"], row["body"]) for row in destination.rows(PATH)) == [*first, (3, "c")]


OPS = st.lists(st.tuples(st.sampled_from("IUDK"), st.integers(0, 4), st.integers(0, 4), st.booleans()), max_size=40)


LAYOUTS = st.sampled_from([None, TableLayout(RANGE, ("id",), 2), TableLayout(HASH, ("id",), 3)])


# 100 examples: five keys, four operations; faults seeded in the fold were found as often at 100 as at 200.
@settings(max_examples=100, deadline=None)
@given(
    OPS, st.lists(st.integers(1, 6), min_size=1, max_size=10), st.integers(1, 8), st.sets(st.integers(0, 4)), LAYOUTS
)
def test_random_changes_fold_to_what_one_by_one_gives(
    ops: list, sizes: list[int], max_changes: int, initial: set[int], layout: TableLayout | None
) -> None:
    """I/U/D and key changes over five keys, unchanged TOAST included, cut into random transactions and chunks;
    unbucketed, and in range or hash buckets (so key changes move rows between buckets, which the memory
    merge prunes as Delta does)."""
    import tempfile

    model = {key: f"v{key}" for key in initial}
    messages: list[bytes] = [keyed_relation()]
    for number, (op, key, new_key, toast) in enumerate(ops):
        body = f"b{number}".encode()
        if op == "I" and key not in model:
            model[key] = body.decode()
            messages.append(insert(OID, str(key).encode(), body))
        elif op == "U" and key in model:
            if not toast:
                model[key] = body.decode()
            messages.append(update(OID, (str(key).encode(), UNCHANGED if toast else body)))
        elif op == "D" and key in model:
            del model[key]
            messages.append(delete(OID, key=(str(key).encode(), None)))
        elif op == "K" and key in model and new_key not in model:
            value = model.pop(key)
            model[new_key] = value if toast else body.decode()
            messages.append(
                update(OID, (str(new_key).encode(), UNCHANGED if toast else body), key=(str(key).encode(), None))
            )
    bodies, at = [], 0
    for size in sizes * (len(messages) // max(1, sum(sizes)) + 1):
        if at >= len(messages):
            break
        bodies.append(messages[at : at + size])
        at += size
    destination = destination_with_snapshot([(key, f"v{key}") for key in initial], layout)
    with tempfile.TemporaryDirectory() as spill:
        apply(destination, transactions(bodies, Path(spill)), max_changes=max_changes)
    assert table_of(destination, layout) == model


def test_the_memory_merge_refuses_two_changes_for_one_key() -> None:
    destination = destination_with_snapshot([])
    source = pa.table(
        {"id": pa.array([1, 1], pa.int32()), "body": ["a", "b"], LSN_COLUMN: [1, 2], "_pgcdc_op": ["I", "U"]}
    )
    with pytest.raises(ValueError, match="two changes for key"):
        destination.merge_batch(PATH, source, ["id"])


def test_the_writer_calls_the_heartbeat_while_a_write_blocks() -> None:
    """A Delta commit may take minutes; the walsender must hear from the drain meanwhile."""
    release = threading.Event()
    beats: list[float] = []

    def heartbeat() -> None:
        beats.append(time.monotonic())
        if len(beats) == 5:
            release.set()

    writer = OrderedWriter(heartbeat)
    try:
        writer.write(release.wait)
        writer.durable_after_queued(42)
        assert writer.durable == 0
        writer.collect(wait=True)
        assert writer.durable == 42 and len(beats) >= 5
    finally:
        writer.close()
