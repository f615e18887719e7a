"""Primary-key ranges of a table snapshotted one short transaction per range, and which are done at which point.

A table too big for one snapshot transaction (``snapshot.chunked_above_mb``) is copied as ranges
R_0..R_{n-1} of its single integer primary key, each at its own consistent point C_k
(``resources/runs/key_range_copy.py``). Which ranges are done, and at which C_k, is recorded in the
snapshot marker of every commit that copies a range (``resources/delta/markers.py``), cumulatively,
so the newest such marker is the whole truth, as a plain snapshot marker is. The drain rule that
makes the table exact (docs/contracts.md, "Chunked snapshots in primary-key ranges") is
:meth:`KeyRanges.applies`. A re-snapshot walks the same way with every range still at its previous
point until copied again (``redo``), so readers see a complete table throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from resources.lsn import LSN


@dataclass(frozen=True, slots=True)
class KeyRanges:
    """Ranges of ``key``: range k holds the keys in [bounds[k-1], bounds[k]), the first and last open-ended."""

    key: str
    #: Ascending split points; n - 1 of them for n ranges.
    bounds: tuple[int, ...]
    #: Per range, the consistent point C_k of its copy (an LSN as int); None: not copied yet.
    points: tuple[int | None, ...]
    #: Ranges a re-snapshot has yet to copy again: their point is the previous snapshot's (their rows are
    #: that snapshot's plus every change since, drained as before) until their new copy replaces it.
    redo: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if len(self.points) != len(self.bounds) + 1 or list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"inconsistent key ranges: {len(self.bounds)} bounds, {len(self.points)} points")
        if any(not 0 <= k < len(self.points) or self.points[k] is None for k in self.redo):
            raise ValueError("a range to copy again must have a point")

    @classmethod
    def split(cls, key: str, low: int, high: int, count: int) -> KeyRanges:
        """About ``count`` ranges of equal width between the smallest and largest key (nothing done yet).

        Keys outside [low, high] (inserted later) fall into the first or last range. Equal widths cost
        nothing to compute; a skewed key gives uneven ranges, which costs time, not correctness.
        """
        count = max(1, min(count, high - low + 1))
        bounds = sorted({low + (high - low + 1) * i // count for i in range(1, count)})
        return cls(key, tuple(bounds), (None,) * (len(bounds) + 1))

    def again(self) -> KeyRanges:
        """A re-snapshot of these ranges: every range to be copied again, each keeping its point meanwhile."""
        return KeyRanges(self.key, self.bounds, self.points, frozenset(range(self.count)))

    @property
    def count(self) -> int:
        return len(self.points)

    @property
    def done(self) -> int:
        """Ranges copied by this snapshot (a re-snapshot's ranges still to copy again do not count)."""
        return sum(point is not None for point in self.points) - len(self.redo)

    @property
    def complete(self) -> bool:
        """Every range has a point (a re-snapshot's ranges still to copy again keep their previous one)."""
        return all(point is not None for point in self.points)

    @property
    def snapshot_lsn(self) -> LSN | None:
        """The snapshot LSN once every range is done (the newest C_k); None before."""
        return LSN(max(point for point in self.points if point is not None)) if self.complete else None

    def next_range(self) -> int | None:
        """The first range to copy (not done, or to copy again); None when the walk is over."""
        return next((k for k, point in enumerate(self.points) if point is None or k in self.redo), None)

    def limits(self, k: int) -> tuple[int | None, int | None]:
        """(lowest key, key past the end) of range k; None: open-ended."""
        low = self.bounds[k - 1] if k > 0 else None
        high = self.bounds[k] if k < len(self.bounds) else None
        return low, high

    def span(self, k: int) -> KeySpan:
        """Range k's rows (:meth:`limits`) as a :class:`KeySpan`."""
        return KeySpan(self.key, *self.limits(k))

    def with_point(self, k: int, point: int) -> KeyRanges:
        """Range k done at consistent point ``point``."""
        points = tuple(point if i == k else p for i, p in enumerate(self.points))
        return KeyRanges(self.key, self.bounds, points, self.redo - {k})

    def ranges_of(self, keys: np.ndarray) -> np.ndarray:
        """The range index of each key."""
        return np.searchsorted(np.asarray(self.bounds, np.int64), keys, side="right")

    def applies(self, keys: np.ndarray, lsns: np.ndarray) -> np.ndarray:
        """The drain rule: a row image with key K of a change committed at L applies iff range(K) is
        done and L > C(range(K)). A range not done is skipped (its later copy, at a point beyond
        anything confirmed, holds the change); one at or below C_k is in the copy already."""
        points = np.asarray([-1 if p is None else p for p in self.points], np.int64)[self.ranges_of(keys)]
        return (points >= 0) & (lsns > points)

    def skips_all(self, lsn: int) -> bool:
        """Whether no row image of a change committed at ``lsn`` can apply (no range done after it)."""
        return all(point is None or lsn <= point for point in self.points)

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {
            "key": self.key,
            "bounds": list(self.bounds),
            "points": [None if p is None else str(LSN(p)) for p in self.points],
        }
        if self.redo:
            value["redo"] = sorted(self.redo)
        return value

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> KeyRanges:
        return cls(
            str(value["key"]),
            tuple(int(b) for b in value["bounds"]),
            tuple(None if p is None else int(LSN.parse(p)) for p in value["points"]),
            frozenset(int(k) for k in value.get("redo", ())),
        )


@dataclass(frozen=True, slots=True)
class KeySpan:
    """The rows one key range holds: ``low`` <= ``key`` < ``high`` (None: open on that side); what a
    key range's snapshot commit replaces (:meth:`KeyRanges.span`)."""

    key: str
    low: int | None
    high: int | None

    def holds(self, value: int | None) -> bool:
        """Whether a row whose key is ``value`` lies in the span (a NULL key lies in none)."""
        return (
            value is not None and (self.low is None or value >= self.low) and (self.high is None or value < self.high)
        )

    def predicate(self) -> str:
        """The span as a Delta predicate (``true`` for one span covering all)."""
        column = "`" + self.key.replace("`", "``") + "`"
        low = [f"{column} >= {int(self.low)}"] if self.low is not None else []
        high = [f"{column} < {int(self.high)}"] if self.high is not None else []
        return " AND ".join(low + high) or "true"
