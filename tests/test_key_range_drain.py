"""The drain rule of a snapshot in primary-key ranges, in the real ChangeApplier, without PostgreSQL or Spark.

A model PostgreSQL table (integer key, a text body that is sometimes an unchanged-TOAST 'u' in an
update) receives random transactions: inserts, updates, key-moving updates across ranges (some
keeping the TOASTed body), deletes and the odd TRUNCATE. Ranges are copied one at a time at the
current point (a commit carrying the cumulative marker, as ``resources/key_range_snapshot.py``
writes it) and drains run between them through the real TransactionAssembler and ChangeApplier
into the in-memory destination, some of them crashing before they confirm. The applier re-copies a
range when a moved row keeps TOAST values of a row not in Delta (the known hole). Once every range
is done and the last drain ran, the lake equals the model, key for key and value for value; then a
re-snapshot in place copies every range again the same way, the table exact after every drain.
"""

from __future__ import annotations

import random
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from resources.cdc.applier import ChangeApplier
from resources.cdc.tables import TableTarget
from resources.cdc.transactions import TransactionAssembler
from resources.delta.destination import TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.markers import LSN_COLUMN, snapshot_marker
from resources.errors import ConfigurationError, explain_server_error, TableFault
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.testing.memory_destination import InMemoryDestination, StaticTypes
from tests.support.pgoutput_messages import begin, commit, delete, insert, relation, truncate, UNCHANGED, update

OID = 16384
TABLE = TableName("public", "t")
PATH = "lake/public/t"
SCHEMA = pa.schema([("id", pa.int32()), ("body", pa.string()), (LSN_COLUMN, pa.int64())])
KEYS = 80


@dataclass
class World:
    """The model PostgreSQL table and its WAL; the lake is the in-memory destination."""

    rng: random.Random
    tmp: Path
    rows: dict[int, str] = field(default_factory=dict)
    wal: list[tuple[int, list[bytes]]] = field(default_factory=list)  # (commit end LSN, messages)
    lsn: int = 100
    confirmed: int = 100
    lake: InMemoryDestination = field(default_factory=InMemoryDestination)
    recopies: int = 0
    hole_moves: int = 0

    def commit(self) -> None:
        rng = self.rng
        messages = [relation(OID, "t", [("id", 23, True), ("body", 25, False)])]
        if rng.random() < 0.02 and self.rows:
            messages.append(truncate(OID))
            self.rows.clear()
        for _ in range(rng.randint(1, 4)):
            key = rng.randrange(KEYS)
            if key not in self.rows:
                body = f"v{rng.randrange(10**6)}"
                messages.append(insert(OID, str(key).encode(), body.encode()))
                self.rows[key] = body
            elif rng.random() < 0.25:
                messages.append(delete(OID, key=(str(key).encode(), None)))
                del self.rows[key]
            else:
                target = rng.randrange(KEYS) if rng.random() < 0.5 else key
                if target != key and target in self.rows:
                    continue
                keep = rng.random() < 0.4  # the body is TOASTed and unchanged: sent as 'u'
                body = self.rows[key] if keep else f"v{rng.randrange(10**6)}"
                image = (str(target).encode(), UNCHANGED if keep else body.encode())
                moved = {"key": (str(key).encode(), None)} if target != key else {}
                messages.append(update(OID, image, **moved))
                self.hole_moves += keep and target != key
                del self.rows[key]
                self.rows[target] = body
        self.lsn += self.rng.randint(1, 3) * 10
        self.wal.append((self.lsn, messages))

    def ranges(self) -> KeyRanges | None:
        return self.lake.read_table_log(PATH, None).chunks if PATH in self.lake.tables else None

    def copy_range(self, ranges: KeyRanges, k: int) -> None:
        """Copy range k at the current point (every transaction so far is committed), as the snapshot does."""
        span = ranges.span(k)
        copied = [{"id": key, "body": body, LSN_COLUMN: self.lsn} for key, body in self.rows.items() if span.holds(key)]
        done = ranges.with_point(k, self.lsn)
        marker = snapshot_marker(done.snapshot_lsn, "slot", str(TABLE), None, done, k)
        self.lake.write_snapshot(pa.Table.from_pylist(copied, schema=SCHEMA), SCHEMA, PATH, marker, span=span)

    def recopy(self, table: TableName, path: str, log: TableLog, k: int) -> None:
        self.recopies += 1
        assert log.chunks is not None
        self.copy_range(self.ranges() or log.chunks, k)

    def drain(self, crash: bool) -> None:
        """Apply the WAL after the confirmed position; a crash stops part-way and confirms nothing."""
        todo = [(end, messages) for end, messages in self.wal if end > self.confirmed]
        if crash:
            todo = todo[: self.rng.randrange(len(todo) + 1)]
        target = TableTarget(TABLE, PATH)
        applier = ChangeApplier(
            self.lake,
            StaticTypes(),
            {TABLE: target},
            max_changes=self.rng.randint(1, 12),
            max_bytes=1 << 30,
            log=lambda _: None,
            recopy_range=self.recopy,
        )
        try:
            with TransactionAssembler(1, self.tmp) as assembler:
                for end, messages in todo:
                    txn = None
                    for message in [begin(end - 1, 1000), *messages, commit(end - 1, end)]:
                        txn = assembler.feed(memoryview(message), end - 5) or txn
                    assert txn is not None
                    if not applier.fits(txn):
                        applier.flush()
                    applier.add(txn)
            applier.flush()
            applier.finish()
        finally:
            applier.close()
        if not crash:
            self.confirmed = self.lsn


def walk_ranges(world: World, start: KeyRanges, create: bool) -> None:
    """Copy the ranges ``start`` names one at a time (reading the rest from the log), with writes and
    drains between; a re-snapshot (``start.redo``) checks after every drain that confirmed everything
    that the whole table is exact: readers see a complete, current table throughout."""
    first = True
    while True:
        current = start if first else world.ranges()
        assert current is not None
        k = current.next_range()
        if k is None:
            break
        if first and create:
            world.lake.write_snapshot(SCHEMA.empty_table(), SCHEMA, PATH, "{}")  # a table to copy into
        world.copy_range(current, k)
        first = False
        for _ in range(world.rng.randint(0, 6)):
            world.commit()
        crash = world.rng.random() < 0.25
        world.drain(crash=crash)
        if start.redo and not crash:
            assert {row["id"]: row["body"] for row in world.lake.rows(PATH)} == world.rows
    world.drain(crash=False)


def walk(seed: int, tmp: Path) -> World:
    """A snapshot in key ranges, then a re-snapshot in place, under writes, drains and crashes."""
    world = World(random.Random(seed), tmp)
    for _ in range(30):
        world.commit()
    walk_ranges(world, KeyRanges.split("id", 0, KEYS - 1, 5), create=True)
    assert {row["id"]: row["body"] for row in world.lake.rows(PATH)} == world.rows, "after the snapshot"
    ranges = world.ranges()
    assert ranges is not None
    walk_ranges(world, ranges.again(), create=False)
    return world


def test_a_walk_of_key_ranges_with_drains_crashes_and_toast_moves_is_exact(tmp_path: Path) -> None:
    recopies = hole_moves = 0
    for seed in range(12):
        world = walk(seed, tmp_path)
        lake = {row["id"]: row["body"] for row in world.lake.rows(PATH)}
        assert len(lake) == len(world.lake.rows(PATH)), f"seed {seed}: a key twice"
        assert lake == world.rows, f"seed {seed}"
        assert None not in lake.values()
        assert (world.ranges() or KeyRanges("id", (), (None,))).snapshot_lsn is not None
        recopies += world.recopies
        hole_moves += world.hole_moves
    assert hole_moves and recopies  # the hole was met, and answered by copying a range again


def test_a_change_is_applied_per_row_image_by_its_ranges_point() -> None:
    ranges = KeyRanges("id", (10, 20), (100, None, 300))
    keys = pa.array([5, 5, 15, 25, 25]).to_numpy()
    lsns = pa.array([100, 101, 500, 300, 301]).to_numpy()
    assert ranges.applies(keys, lsns).tolist() == [False, True, False, False, True]
    assert not ranges.complete and ranges.snapshot_lsn is None and ranges.next_range() == 1
    assert ranges.with_point(1, 200).snapshot_lsn == LSN(300)
    assert KeyRanges.from_json(ranges.to_json()) == ranges
    again = ranges.with_point(1, 200).again().with_point(0, 400)
    assert again.next_range() == 1 and again.done == 1 and again.redo == {1, 2}
    assert again.applies(keys, lsns).tolist() == [False, False, True, False, True]
    assert KeyRanges.from_json(again.to_json()) == again


def test_a_range_that_cannot_be_copied_again_for_want_of_a_grant_sets_only_its_table_aside(tmp_path: Path) -> None:
    """A drain needs no SELECT, a range's re-copy does: a grant missing when a TOAST-keeping move needs the
    copy is the table's own fault (set aside, the fix naming the grant and the re-snapshot), not the run's."""
    world = World(random.Random(0), tmp_path)
    world.rows = {5: "kept"}
    ranges = KeyRanges.split("id", 0, KEYS - 1, 5)
    world.lake.write_snapshot(SCHEMA.empty_table(), SCHEMA, PATH, "{}")
    world.copy_range(ranges, 1)  # keys 16-31 done; key 5's range not yet copied
    world.lsn += 10
    world.wal.append((world.lsn, [relation(OID, "t", [("id", 23, True), ("body", 25, False)]),
                                  update(OID, (b"20", UNCHANGED), key=(b"5", None))]))  # fmt: skip
    denied = explain_server_error("42501", "permission denied for table t", user="pgcdc")
    assert isinstance(denied, ConfigurationError)
    set_aside: list[tuple[TableName, int, Exception]] = []

    def refused(*_: object) -> None:
        raise denied

    target = TableTarget(TABLE, PATH)
    applier = ChangeApplier(
        world.lake, StaticTypes(), {TABLE: target}, max_changes=10, max_bytes=1 << 20, log=lambda _: None,
        recopy_range=refused, set_aside=lambda *fault: set_aside.append(fault) or True,
    )  # fmt: skip
    with TransactionAssembler(1, tmp_path) as assembler, closing(applier):
        end, messages = world.wal[-1]
        txn = None
        for message in [begin(end - 1, 1000), *messages, commit(end - 1, end)]:
            txn = assembler.feed(memoryview(message), end - 5) or txn
        assert txn is not None
        applier.add(txn)
        applier.flush()
        applier.finish()
    ((table, lsn, error),) = set_aside
    assert table == TABLE and lsn == end and target.quarantined
    assert isinstance(error, TableFault) and "\n" not in str(error)
    assert "key range 2 of public.t must be copied again" in error.cause
    assert "GRANT SELECT ON t TO pgcdc" in error.fix and "re-snapshot the table" in error.fix
    assert world.lake.rows(PATH) == []  # nothing of the move was written
