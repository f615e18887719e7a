"""A table's pending changes written in order: the changelog first, then, piece by piece (the key-range
rule decides the pieces), the keyed fold, the append or the FULL rewrite its write mode calls for."""

from __future__ import annotations

from resources.cdc.apply_key_ranges import KeyRangeRule
from resources.cdc.apply_keyed import KeyedFold
from resources.cdc.apply_marked import MarkedWrites
from resources.cdc.row_batches import gather
from resources.cdc.tables import APPEND, FULL, TableTarget
from resources.crash_points import fault_point
from resources.history.apply import HistoryHandOff
from resources.lsn import LSN


class TableFlush(HistoryHandOff, KeyRangeRule, KeyedFold, MarkedWrites):
    """Writes a table's pending changes through the part its write mode needs."""

    def _flush_target(self, target: TableTarget) -> None:
        pending, target.pending = target.pending, []
        self.pending_changes -= sum(len(taken) for _, taken, _, _ in pending)
        self.pending_bytes -= target.pending_bytes
        target.pending_bytes = 0
        groups = gather(pending)
        del pending  # the batches' payloads, copied into the groups: freed before the groups are parsed
        for gathered in groups:
            assert target.log is not None, "the table's log is read before its changes are queued"
            pieces = self._key_range_pieces(target, gathered) if target.log.chunks is not None else (gathered,)
            for rows in pieces:
                if target.quarantined:  # a failed write of an earlier piece set the table aside
                    return
                fault_point("before_merge")
                if target.history_path is not None:
                    self._write_history(target, rows)
                if target.mode == APPEND:
                    self._append(target, rows)
                elif target.mode == FULL:
                    self._replace_full(target, rows)
                elif not self._merge_columnar(target, rows):
                    self._merge_by_row(target, rows)
                self._writer.next_behind(False)  # spent by the table's write, if the batch needed one
                self.changes_applied += len(rows)
                target.stats.applied_lsn = LSN(max(int(rows.lsns.max()), target.stats.applied_lsn or 0))
