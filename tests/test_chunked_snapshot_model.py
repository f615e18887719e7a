"""A model check of the chunked, resumable snapshot design in docs/contracts.md ("Chunked snapshots in primary-key ranges").

Pure Python, no PostgreSQL: a keyed table, a stream of transactions (inserts, updates, key-moving
updates, deletes) with increasing commit end LSNs, primary-key ranges copied one at a time at their
own consistent points, drains between them, and crashes of both at random moments. It checks the
design's drain rule and its serialisation condition: after every drain the ranges already copied
equal PostgreSQL's rows, and once every range is done the whole table does. The broken variants at
the end show the check can fail where the design's argument says it must. The rule itself is the
code's (``resources/delta/key_ranges.py``); tests/test_key_range_drain.py runs it inside the real
ChangeApplier, tests/test_key_range_snapshot.py against PostgreSQL and Delta.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from resources.delta.key_ranges import KeyRanges

KEYS = 60
RANGES = [(0, 15), (15, 30), (30, 45), (45, KEYS)]

# One row image change: (old key or None, new key or None, new value); insert (None, k, v),
# delete (k, None, None), update in place (k, k, v), key-moving update (k, k2, v).
Change = tuple[int | None, int | None, int | None]


def range_of(key: int) -> int:
    return next(i for i, (lo, hi) in enumerate(RANGES) if lo <= key < hi)


@dataclass
class World:
    """PostgreSQL (``rows``, the WAL of committed transactions) and the lake (``delta``, markers, confirmed)."""

    rows: dict[int, int] = field(default_factory=dict)
    wal: list[tuple[int, list[Change]]] = field(default_factory=list)  # (commit end LSN, changes)
    lsn: int = 0
    delta: dict[int, int] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)  # range -> its consistent point C_k
    confirmed: int = 0

    def commit(self, rng: random.Random) -> None:
        changes: list[Change] = []
        for _ in range(rng.randint(1, 4)):
            key = rng.randrange(KEYS)
            if key not in self.rows:
                changes.append((None, key, rng.randrange(1000)))
                self.rows[key] = changes[-1][2]  # type: ignore[assignment]
            elif rng.random() < 0.3:
                changes.append((key, None, None))
                del self.rows[key]
            else:
                target = rng.randrange(KEYS) if rng.random() < 0.4 else key
                if target != key and target in self.rows:
                    continue
                value = rng.randrange(1000)
                changes.append((key, target, value))
                del self.rows[key]
                self.rows[target] = value
        self.lsn += rng.randint(1, 3)
        self.wal.append((self.lsn, changes))


Rule = Callable[[World, int, int], bool]  # (world, key, commit LSN) -> apply this half?


def design_rule(world: World, key: int, lsn: int) -> bool:
    """The design: apply a half iff its key's range is done and the change is newer than that range's copy,
    decided by the code's own rule (``KeyRanges.applies``, which the ChangeApplier runs per row image)."""
    return bool(
        key_ranges(tuple(world.done.get(i) for i in range(len(RANGES)))).applies(np.array([key]), np.array([lsn]))[0]
    )


@functools.cache
def key_ranges(points: tuple[int | None, ...]) -> KeyRanges:
    return KeyRanges("k", tuple(high for _, high in RANGES[:-1]), points)


def copy_chunk(world: World, rng: random.Random, crash: bool, race: Rule | None = None, split: bool = True) -> None:
    """One chunk: consistent point = now, delete the range, then append its rows with the marker (C_k).

    ``race`` (a broken variant) lets a drain with that rule run between the copy and its commit,
    which the design forbids by running chunks inside the drain run.
    """
    pending = [k for k in range(len(RANGES)) if k not in world.done]
    if not pending:
        return
    chunk = pending[0]
    point = world.lsn  # a temporary slot created now: every committed transaction is in its snapshot
    lo, hi = RANGES[chunk]
    copied = {k: v for k, v in world.rows.items() if lo <= k < hi}
    if race is not None:
        for _ in range(rng.randint(1, 5)):
            world.commit(rng)
        drain(world, rng, race, crash=False, split=split)
    for key in [k for k in world.delta if lo <= k < hi]:
        del world.delta[key]
    if crash:  # killed between the delete and the append: the range stays not done
        return
    world.delta.update(copied)
    world.done[chunk] = point


def drain(world: World, rng: random.Random, rule: Rule, crash: bool, split: bool = True) -> None:
    """Apply the WAL after the confirmed position, in commit order; a crash stops before confirming.

    ``split`` False (a broken variant) decides a key-moving update as a whole, by its new key.
    """
    end = world.lsn
    todo = [(lsn, changes) for lsn, changes in world.wal if world.confirmed < lsn <= end]
    stop_at = rng.randrange(len(todo) + 1) if crash else len(todo)
    for lsn, changes in todo[:stop_at]:
        for old, new, value in changes:
            if split:
                apply_old = old is not None and rule(world, old, lsn)
                apply_new = new is not None and rule(world, new, lsn)
            else:
                apply_old = apply_new = rule(world, new if new is not None else old, lsn)  # type: ignore[arg-type]
            if old is not None and apply_old:
                world.delta.pop(old, None)
            if new is not None and apply_new:
                world.delta[new] = value  # type: ignore[assignment]
    if not crash:
        world.confirmed = end


def run(seed: int, rule: Rule = design_rule, race: bool = False, split: bool = True) -> World:
    """Chunks and drains interleaved with writes until every range is done, then a last drain;
    after each drain the ranges done equal PostgreSQL's rows in them."""
    rng = random.Random(seed)
    world = World()
    for _ in range(40):
        world.commit(rng)
    drain(world, rng, rule, crash=False)
    while len(world.done) < len(RANGES):
        for _ in range(rng.randint(0, 8)):
            world.commit(rng)
        copy_chunk(world, rng, crash=rng.random() < 0.2, race=rule if race else None, split=split)
        for _ in range(rng.randint(0, 8)):
            world.commit(rng)
        drain(world, rng, rule, crash=rng.random() < 0.2, split=split)
        if world.confirmed == world.lsn and not race and split and rule is design_rule:
            for chunk in world.done:
                lo, hi = RANGES[chunk]
                assert {k: v for k, v in world.delta.items() if lo <= k < hi} == {
                    k: v for k, v in world.rows.items() if lo <= k < hi
                }
    drain(world, rng, rule, crash=False, split=split)
    return world


def test_the_design_converges_exactly() -> None:
    for seed in range(300):
        world = run(seed)
        assert world.delta == world.rows, seed


def test_skipping_more_than_the_design_allows_loses_changes() -> None:
    """The check can fail: a drain between a chunk's copy and its commit, skipping changes just past
    C_k, or placing a key-moving update by its new key alone each breaks some runs."""

    def beyond_point(world: World, key: int, lsn: int) -> bool:
        point = world.done.get(range_of(key))
        return point is not None and lsn > point + 1

    def diverges(rule: Rule, race: bool = False, split: bool = True) -> bool:
        for seed in range(300):
            world = run(seed, rule, race, split)
            if world.delta != world.rows:
                return True
        return False

    assert diverges(design_rule, race=True)
    assert diverges(beyond_point)
    assert diverges(design_rule, split=False)
