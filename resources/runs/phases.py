"""Named durations of one piece of work (a snapshot step, one table's copy), for its log and metadata.

A user's first look at a job is its whole duration, start-up included; the phases say where the
seconds went (engine start, slot creation, catalog reads, the first rows, the commit) without a
profiler. Recording one is a ``with phases.timed(name):`` block or :meth:`Phases.add`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

PHASE_METADATA_PREFIX = "pgcdc/phase_seconds/"
"""Materialization metadata key of a phase: ``pgcdc/phase_seconds/<phase>``."""


class Phases:
    """Seconds per phase name, in the order the phases were first recorded; safe across threads
    (a table's copy runs on a worker thread while the step records its own phases)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + max(0.0, seconds)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - started)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)


def describe_phases(phases: Mapping[str, float]) -> str:
    """``engine start 0.41 s, slot 0.05 s, ...`` for a log line."""
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in phases.items())


def phase_metadata(phases: Mapping[str, float]) -> dict[str, float]:
    """``{"pgcdc/phase_seconds/<phase>": seconds}``, rounded to milliseconds."""
    return {f"{PHASE_METADATA_PREFIX}{name}": round(seconds, 3) for name, seconds in phases.items()}
