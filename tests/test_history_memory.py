"""Changelogs without PostgreSQL or Spark: the real applier writes a table and its changelog into the
in-memory destination; folding the changelog up to each transaction's end must give the table a
one-by-one model of the same changes gives there, and a replay must add no changelog row.

The live tests (test_history.py) do the same against PostgreSQL and Delta; these explore many orders.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from resources.cdc.applier import ChangeApplier
from resources.cdc.tables import TableTarget
from resources.cdc.transactions import CommittedTransaction
from resources.cdc.writer import OrderedWriter
from resources.errors import PgcdcError
from resources.history.as_of import fold_changelog, versions_as_of
from resources.history.changelog import OP_COLUMN
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

HISTORY = PATH + "__changes"
VERSIONS = PATH + "__history"


def apply_with_history(
    destination: InMemoryDestination,
    txns: list[CommittedTransaction],
    *,
    max_changes: int = 1000,
    primary_key: tuple[str, ...] = (),
    types: StaticTypes | None = None,
    scd2: bool = False,
) -> ChangeApplier:
    target = TableTarget(TABLE, PATH, history_path=VERSIONS if scd2 else HISTORY, history_scd2=scd2)
    applier = ChangeApplier(
        destination,
        types or StaticTypes(primary_key=primary_key),
        {TABLE: target},
        max_changes=max_changes,
        max_bytes=1 << 30,
        log=lambda _: None,
    )
    try:
        for txn in txns:
            if not applier.fits(txn):
                applier.flush()
            applier.add(txn)
        applier.flush()
        applier.finish()
        return applier
    finally:
        applier.close()


def as_of(destination: InMemoryDestination, lsn: int | None = None, scd2: bool = False) -> list[tuple]:
    if scd2:
        return sorted(tuple(row.values()) for row in versions_as_of(destination.tables[VERSIONS], lsn).to_pylist())
    return sorted(tuple(row.values()) for row in fold_changelog(destination.tables[HISTORY], lsn).to_pylist())


def table_rows(destination: InMemoryDestination) -> list[tuple]:
    return sorted((row["id"], row["body"]) for row in destination.rows(PATH))


def test_a_transaction_with_every_operation_is_folded_back_at_each_lsn(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a"), (2, "b")])
    txns = transactions([
        [keyed_relation(), insert(OID, b"3", b"c"), update(OID, (b"1", UNCHANGED))],
        [update(OID, (b"4", UNCHANGED), key=(b"1", None)), delete(OID, key=(b"2", None))],
        [truncate(OID), insert(OID, b"5", b"e")],
    ], tmp_path)  # fmt: skip
    apply_with_history(destination, txns)
    assert as_of(destination, SNAPSHOT_LSN) == [(1, "a"), (2, "b")]
    assert as_of(destination, SNAPSHOT_LSN + 10) == [(1, "a"), (2, "b"), (3, "c")]
    assert as_of(destination, SNAPSHOT_LSN + 20) == [(3, "c"), (4, "a")]  # the moved row kept its TOASTed body
    assert as_of(destination) == [(5, "e")] == table_rows(destination)
    ops = destination.tables[HISTORY].column(OP_COLUMN).to_pylist()
    assert ops == ["reset", "snapshot", "snapshot", "insert", "update", "update", "delete", "truncate", "insert"]


def test_a_replay_appends_nothing_and_a_later_drain_only_its_changes(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    txns = transactions(
        [[keyed_relation(), insert(OID, b"2", b"b")], [update(OID, (b"2", UNCHANGED), key=(b"2", None))]], tmp_path
    )
    apply_with_history(destination, txns)
    before = destination.tables[HISTORY]
    apply_with_history(destination, txns)  # a crash before the confirm: the same transactions again
    assert destination.tables[HISTORY].equals(before)
    more = transactions(
        [[keyed_relation(), delete(OID, key=(b"1", None))]], tmp_path / "more", first_end=SNAPSHOT_LSN + 30
    )
    apply_with_history(destination, more)
    assert destination.tables[HISTORY].num_rows == before.num_rows + 1
    assert as_of(destination) == [(2, "b")] == table_rows(destination)


def column_added_with_a_default(tmp_path: Path) -> list[CommittedTransaction]:
    """An insert, then a transaction whose Relation adds ``extra`` (PostgreSQL filled the rows before it
    with 5: ``FILLED_EXTRA``), an insert with it and an update of the snapshot's row."""
    widened = relation(OID, "t", [("id", 23, True), ("body", 25, False), ("extra", 23, False)])
    return transactions([
        [keyed_relation(), insert(OID, b"2", b"b")],
        [widened, insert(OID, b"3", b"c", b"9"), update(OID, (b"1", b"a", None))],
    ], tmp_path)  # fmt: skip


FILLED_EXTRA = StaticTypes(added={"extra": {(23, True, "5", True)}})


def test_a_column_added_with_a_default_is_filled_in_the_rows_before_it(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    txns = column_added_with_a_default(tmp_path)
    apply_with_history(destination, txns, types=FILLED_EXTRA)
    assert as_of(destination, SNAPSHOT_LSN + 10) == [(1, "a", None), (2, "b", None)]  # before the column existed
    assert as_of(destination) == [(1, "a", None), (2, "b", 5), (3, "c", 9)]
    assert as_of(destination) == sorted((row["id"], row["body"], row["extra"]) for row in destination.rows(PATH))


def test_a_column_added_mid_transaction_after_a_change_of_the_table_is_filled(tmp_path: Path) -> None:
    """The fill comes between two changes of one transaction whose positions are consecutive (a Relation
    message has no position of its own): it must neither be taken for the first change nor hide the second."""
    destination = destination_with_snapshot([(1, "a")])
    widened = relation(OID, "t", [("id", 23, True), ("body", 25, False), ("extra", 23, False)])
    txns = transactions([[keyed_relation(), insert(OID, b"2", b"b"), widened, insert(OID, b"3", b"c", b"9")]], tmp_path)
    types = StaticTypes(added={"extra": {(23, True, "5", True)}})
    for replays in range(2):  # the second time: a replay appends nothing
        apply_with_history(destination, txns, types=types)
        assert as_of(destination) == [(1, "a", 5), (2, "b", 5), (3, "c", 9)]
        assert as_of(destination) == sorted((row["id"], row["body"], row["extra"]) for row in destination.rows(PATH))
        ops = destination.tables[HISTORY].column(OP_COLUMN).to_pylist()
        assert ops == ["reset", "snapshot", "insert", "fill", "insert"], (replays, ops)


def test_history_on_a_table_changed_since_its_snapshot_is_refused(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    first = transactions([[keyed_relation(), insert(OID, b"2", b"b")]], tmp_path)
    target = TableTarget(TABLE, PATH)
    applier = ChangeApplier(
        destination, StaticTypes(), {TABLE: target}, max_changes=100, max_bytes=1 << 30, log=lambda _: None
    )
    applier.add(first[0])
    applier.flush()
    applier.finish()
    applier.close()
    later = transactions([[keyed_relation(), insert(OID, b"3", b"c")]], tmp_path / "later", first_end=SNAPSHOT_LSN + 20)
    with pytest.raises(PgcdcError, match="snapshot the table again"):
        apply_with_history(destination, later)


def test_a_table_write_queued_behind_a_failed_changelog_write_does_not_run() -> None:
    """A table's write waits for nothing but runs only after its changelog's write succeeded: a batch in
    the table without its changelog rows could not be recorded again (its unchanged TOAST values are
    read from the table as it was before the batch)."""
    writer = OrderedWriter()
    ran: list[str] = []
    queued = threading.Event()

    def changelog_append() -> None:
        queued.wait()  # still running when the table's write is queued behind it
        raise RuntimeError("the changelog append failed")

    writer.write(changelog_append)
    writer.next_behind()
    writer.write(ran.append, "the table's MERGE")
    queued.set()
    with pytest.raises(RuntimeError, match="the changelog append failed"):
        writer.collect(wait=True)
    writer.close()
    assert ran == []


KEYS = st.integers(1, 6)
BODIES = st.sampled_from([b"x", b"y", b"z", UNCHANGED])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("I"), KEYS, BODIES.filter(lambda body: body is not UNCHANGED)),
        st.tuples(st.just("U"), KEYS, BODIES),
        st.tuples(st.just("M"), KEYS, BODIES),  # an update that moves the row to another key
        st.tuples(st.just("D"), KEYS, st.just(None)),
        st.tuples(st.just("T"), st.just(0), st.just(None)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS,
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    max_changes=st.integers(1, 12),
    full=st.booleans(),
    scd2=st.booleans(),
)
def test_random_changes_fold_back_to_the_model_at_every_lsn(
    tmp_path_factory: pytest.TempPathFactory, ops: list, sizes: list[int], max_changes: int, full: bool, scd2: bool
) -> None:
    """Keyed or REPLICA IDENTITY FULL (with a primary key, so still matched per key), with a changelog or
    SCD type 2 versions; every transaction's end is checked, then a replay of everything must change no
    history row."""
    tmp_path = tmp_path_factory.mktemp("history")
    destination = destination_with_snapshot([(1, "a"), (2, "b")])
    model: dict[int, str] = {1: "a", 2: "b"}
    states: list[list[tuple]] = []
    bodies: list[list[bytes]] = []
    ops = list(ops)
    rel = relation(OID, "t", [("id", 23, True), ("body", 25, False)], replident=b"f" if full else b"d")
    for size in sizes:
        body: list[bytes] = [rel, insert(OID, b"9", b"n")] if not bodies else []  # the drain meets the table
        if not bodies:
            model[9] = "n"
        for op, key, value in ops[:size]:
            encoded = str(key).encode()
            if op == "I" and key not in model:
                model[key] = value.decode()
                body.append(insert(OID, encoded, value))
            elif op in "UM" and key in model:
                new_key = key if op == "U" else next((k for k in range(1, 8) if k not in model), None)
                if new_key is None:
                    continue
                old_body = model.pop(key)
                model[new_key] = old_body if value is UNCHANGED else value.decode()
                old = (encoded, old_body.encode()) if full else (encoded, None) if new_key != key else None
                new = (str(new_key).encode(), value)
                body.append(update(OID, new, old=old) if full else update(OID, new, key=old))
            elif op == "D" and key in model:
                old_body = model.pop(key).encode()
                body.append(delete(OID, old=(encoded, old_body)) if full else delete(OID, key=(encoded, None)))
            elif op == "T":
                model.clear()
                body.append(truncate(OID))
        ops = ops[size:]
        bodies.append(body)
        states.append(sorted(model.items()))
    txns = transactions(bodies, tmp_path)
    apply_with_history(destination, txns, max_changes=max_changes, primary_key=("id",) if full else (), scd2=scd2)
    assert as_of(destination, SNAPSHOT_LSN, scd2) == [(1, "a"), (2, "b")]
    for index, state in enumerate(states):
        assert as_of(destination, SNAPSHOT_LSN + 10 + 10 * index, scd2) == state
    assert as_of(destination, None, scd2) == table_rows(destination) == states[-1]
    if scd2:
        assert_versions_chain(destination)
    written = destination.tables[VERSIONS if scd2 else HISTORY]
    apply_with_history(
        destination,
        transactions(bodies, tmp_path / "replay"),
        max_changes=max_changes,
        primary_key=("id",) if full else (),
        scd2=scd2,
    )
    assert destination.tables[VERSIONS if scd2 else HISTORY].equals(written)


def assert_versions_chain(destination: InMemoryDestination) -> None:
    """Each key's versions, in order, each closed where or after it opened; only the last may be current,
    and a version closed without its key being deleted is followed by one opened at that very position."""
    by_key: dict[int, list[dict]] = {}
    rows = destination.rows(VERSIONS)
    markers = [row for row in rows if row["_pgcdc_marker"] is not None]
    assert len(markers) == 1 and all(value is None for name, value in markers[0].items() if name != "_pgcdc_marker")
    for row in rows:
        if row["_pgcdc_marker"] is None:
            by_key.setdefault(row["id"], []).append(row)
    for key, versions in by_key.items():
        versions.sort(key=lambda v: (v["_pgcdc_valid_from_lsn"], v["_pgcdc_seq"]))
        for version, following in zip(versions, versions[1:] + [None]):
            if following is None:
                assert version["_pgcdc_is_current"] == (version["_pgcdc_valid_to_lsn"] is None), (key, version)
                continue
            assert not version["_pgcdc_is_current"] and version["_pgcdc_valid_to_lsn"] is not None, (key, versions)
            assert (
                version["_pgcdc_valid_from_lsn"] <= version["_pgcdc_valid_to_lsn"] <= following["_pgcdc_valid_from_lsn"]
            )
            if not version["_pgcdc_is_deleted"]:
                assert version["_pgcdc_valid_to_lsn"] == following["_pgcdc_valid_from_lsn"], (key, versions)


def test_scd2_keeps_every_version_of_each_key_with_its_validity(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a"), (2, "b")])
    txns = transactions([
        [keyed_relation(), insert(OID, b"3", b"c"), update(OID, (b"1", UNCHANGED)), update(OID, (b"1", b"a2"))],
        [update(OID, (b"4", UNCHANGED), key=(b"1", None)), delete(OID, key=(b"2", None))],
        [truncate(OID), insert(OID, b"5", b"e")],
    ], tmp_path)  # fmt: skip
    for replay in range(2):  # the second time: a replay changes nothing
        apply_with_history(destination, txns, max_changes=2, scd2=True)
        versions = sorted(
            (row["id"], row["body"], row["_pgcdc_valid_from_lsn"], row["_pgcdc_valid_to_lsn"], row["_pgcdc_is_current"],
             row["_pgcdc_is_deleted"])
            for row in destination.rows(VERSIONS)
            if row["_pgcdc_marker"] is None
        )  # fmt: skip
        start, first, second, third = SNAPSHOT_LSN, SNAPSHOT_LSN + 10, SNAPSHOT_LSN + 20, SNAPSHOT_LSN + 30
        assert versions == [
            (1, "a", start, first, False, False),
            (1, "a", first, first, False, False),  # the intermediate version of the same transaction
            (1, "a2", first, second, False, True),  # moved away to 4
            (2, "b", start, second, False, True),
            (3, "c", first, third, False, True),  # truncated
            (4, "a2", second, third, False, True),  # the moved row kept its TOASTed body
            (5, "e", third, None, True, False),
        ], replay
        assert as_of(destination, second, scd2=True) == [(3, "c"), (4, "a2")]
        assert as_of(destination, scd2=True) == table_rows(destination) == [(5, "e")]
    times = destination.tables[VERSIONS].column("_pgcdc_valid_from").to_pylist()
    assert (
        sum(time is None for time in times) == 2 + 1
    )  # the snapshot's versions have no commit time, nor the marker row


def test_scd2_opens_every_version_again_when_a_column_is_filled(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    txns = column_added_with_a_default(tmp_path)
    for _ in range(2):
        apply_with_history(destination, txns, types=FILLED_EXTRA, scd2=True)
        assert as_of(destination, SNAPSHOT_LSN + 10, scd2=True) == [(1, "a", None), (2, "b", None)]
        assert as_of(destination, scd2=True) == [(1, "a", None), (2, "b", 5), (3, "c", 9)]
        assert as_of(destination, scd2=True) == sorted(
            (row["id"], row["body"], row["extra"]) for row in destination.rows(PATH)
        )
        assert (
            destination.tables[VERSIONS].num_rows == 6 + 1
        )  # 1 and 2, their filled versions, 3, 1's update; the marker row


def test_scd2_refuses_a_table_without_a_key(tmp_path: Path) -> None:
    destination = destination_with_snapshot([(1, "a")])
    rel = relation(OID, "t", [("id", 23, True), ("body", 25, False)], replident=b"f")
    txns = transactions([[rel, insert(OID, b"2", b"b")]], tmp_path)
    with pytest.raises(PgcdcError, match="set history.tables.public.t: changelog"):
        apply_with_history(destination, txns, scd2=True)
    assert VERSIONS not in destination.tables
