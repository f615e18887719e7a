"""Where a drain reads pgoutput messages from and confirms positions to: the seam under ``resources/cdc/drain.py``.

In production this is :class:`~resources.postgres.stream.ReplicationStream` on the slot; server-free
tests pass :class:`~resources.testing.recorded_changes.RecordedChanges`, the frames a real server sent,
recorded. The drain calls the source once per yielded item, exactly as before: the protocol adds no
indirection to the stream's own loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from resources.lsn import LSN
from resources.postgres.frames import XLogData

__all__ = ["ChangeSource"]


class ChangeSource(Protocol):
    """What :func:`resources.cdc.drain.drain` and the change applier's heartbeat use of a replication stream."""

    @property
    def streaming(self) -> bool: ...

    @property
    def confirmed_lsn(self) -> LSN: ...

    def drain_batches(
        self, end_lsn: LSN, *, stop: bool = True, max_batch_bytes: int = 1 << 20
    ) -> Iterator[XLogData | list[bytes]]:
        """Frames up to ``end_lsn`` ending on a transaction boundary; consecutive row changes inside a
        transaction as one list of payloads (``ReplicationStream.drain_batches``)."""
        ...

    def confirm(self, lsn: LSN) -> None:
        """Record ``lsn`` as durable downstream (sent with the next status update)."""
        ...

    def send_status(self, reply_requested: bool = False) -> None: ...

    def keepalive(self) -> None: ...

    def stop(self, timeout: float = 60.0) -> None: ...
