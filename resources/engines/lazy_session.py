"""A Spark session whose engine starts on its first use, for work that may never need the engine.

A snapshot on an engine whose snapshots are written by delta-rs (embedded Sail) reads the Delta
log with delta-rs, writes the table with delta-rs and records the pgcdc state with delta-rs: the
engine is not used at all unless a table is copied in key ranges (each range is a drain) or a
lost slot makes it read other tables' markers. Starting it anyway cost the snapshot step the
engine's start (0.5 s on a quiet machine, up to 2.6 s under load: a Python process importing Sail)
and the CPU of that start, on the cores the COPY needs (docs/engine-notes.md, "Snapshot start-up").

:func:`deferred_session` gives a stand-in for the session: every attribute asked of it starts the
engine (once) and is answered by the real session. The engine's capabilities, when known without
asking it, are declared for the stand-in, so the capability seam answers without starting it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from pyspark.sql import SparkSession

from resources.engines.capabilities import EngineCapabilities, set_engine_capabilities

__all__ = ["deferred_session", "engine_start_seconds"]


class _DeferredSession:
    """Forwards every attribute to the session ``start`` returns, calling ``start`` on first use."""

    def __init__(self, start: Callable[[], SparkSession]) -> None:
        self._start = start
        self._lock = threading.Lock()
        self._session: SparkSession | None = None
        self.start_seconds: float | None = None  # how long the start took, once it happened

    def _real(self) -> SparkSession:
        with self._lock:  # the snapshot's table threads may all reach for it at once
            if self._session is None:
                began = time.monotonic()
                self._session = self._start()
                self.start_seconds = time.monotonic() - began
            return self._session

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocol probes: never start an engine for them
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __repr__(self) -> str:
        return f"<session started on first use: {'started' if self._session is not None else 'not started'}>"


def deferred_session(start: Callable[[], SparkSession], capabilities: EngineCapabilities | None) -> SparkSession:
    """A session that calls ``start`` on its first use; ``capabilities``: the engine's, when known
    without asking it (an engine pgcdc starts itself), else None (asked on first need, which starts it)."""
    stand_in = _DeferredSession(start)
    session = cast(SparkSession, stand_in)
    if capabilities is not None:
        set_engine_capabilities(session, capabilities)
    return session


def engine_start_seconds(session: SparkSession) -> float | None:
    """How long a :func:`deferred_session`'s engine took to start; None when it has not started
    (or ``session`` is a session of its own)."""
    return session.start_seconds if isinstance(session, _DeferredSession) else None
