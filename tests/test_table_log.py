"""``resources/delta/table_log.py`` on generated Delta logs: what it answers is what the whole history says.

No engine: a log is a directory of commit files (``_delta_log/<version>.json`` with a ``commitInfo``
line) written here, with pgcdc's markers, other writers' metadata and commits without any, and
optionally cleaned up to a checkpoint the way Delta's log cleanup does. The read from scratch and
the read from every earlier answer (a state row as of that version, as the incremental run hands
it over) must agree with the history; a row that does not describe the log must not change the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from resources.delta.destination import NO_TABLE, TableLog
from resources.delta.markers import APPEND_MARKER, applied_marker, EXPIRED_SNAPSHOT_LSN, snapshot_marker
from resources.delta.table_log import read_table_log
from resources.lsn import LSN

#: One commit: ("snapshot", lsn) | ("append", lsn, seq) | ("merge",) | ("foreign",)
commit_kinds = st.one_of(
    st.tuples(st.just("snapshot"), st.integers(1, 10_000)),
    st.tuples(st.just("append"), st.integers(1, 10_000), st.integers(0, 5)),
    st.tuples(st.just("merge")),
    st.tuples(st.just("foreign")),
)


def user_metadata(commit: tuple) -> str | None:
    if commit[0] == "snapshot":
        return snapshot_marker(LSN(commit[1]), "slot", "public.t")
    if commit[0] == "append":
        return applied_marker(APPEND_MARKER, commit[1], commit[2])
    return "nightly compaction" if commit[0] == "foreign" else None


def write_log(path: Path, history: list[tuple], cleaned_below: int) -> None:
    """The commit files of ``history`` from ``cleaned_below`` on, and a checkpoint there when cleaned."""
    log = path / "_delta_log"
    log.mkdir(parents=True)
    for version, commit in enumerate(history):
        if version < cleaned_below:
            continue
        info = {"timestamp": version, "operation": "WRITE"}
        metadata = user_metadata(commit)
        if metadata is not None:
            info["userMetadata"] = metadata
        actions = [{"commitInfo": info}, {"add": {"path": f"part-{version}.parquet", "size": 1}}]
        (log / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")
    if cleaned_below:
        (log / f"{cleaned_below:020d}.checkpoint.parquet").write_bytes(b"PAR1")
        (log / "_last_checkpoint").write_text(json.dumps({"version": cleaned_below, "size": 1}))


def truth(history: list[tuple], upto: int, cleaned_below: int, markers_from: int) -> TableLog:
    """The TableLog as of version ``upto`` from the history, as far as commits >= ``cleaned_below`` show
    the snapshot, and commits >= ``markers_from`` the applied markers."""
    applied = None
    for version in range(upto, -1, -1):
        commit = history[version]
        if commit[0] == "snapshot":
            if version < cleaned_below:
                break
            return TableLog(LSN(commit[1]), version, upto, applied)
        if commit[0] == "append" and applied is None and version >= markers_from:
            applied = (commit[1], commit[2])
    if cleaned_below > 0:
        return TableLog(EXPIRED_SNAPSHOT_LSN, None, upto, applied)
    return TableLog(None, None, upto, applied)


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(commit_kinds, min_size=1, max_size=25),
    cleanup=st.floats(0, 1),
    data=st.data(),
)
def test_reads_from_scratch_and_from_any_earlier_answer_agree_with_the_history(
    tmp_path_factory, history: list[tuple], cleanup: float, data: st.DataObject
) -> None:
    path = tmp_path_factory.mktemp("table")
    newest = len(history) - 1
    cleaned_below = int(cleanup * newest) if cleanup > 0.5 else 0  # half the logs are cleaned up
    write_log(path, history, cleaned_below)
    from_scratch = read_table_log(str(path))
    assert from_scratch == truth(history, newest, cleaned_below, cleaned_below)

    # A state row written at an earlier version D (what a full read said then, before the cleanup).
    earlier = data.draw(st.integers(0, newest), label="state row version")
    row = truth(history, earlier, 0, 0)
    if row.snapshot_lsn is not None:
        # The row remembers markers the cleanup removed, unless the cleanup removed commits after it
        # too (a gap: read from scratch); a snapshot the cleanup removed counts as expired either way.
        gap = earlier + 1 < cleaned_below
        assert read_table_log(str(path), row) == truth(history, newest, cleaned_below, cleaned_below if gap else 0)

        # A row claiming another snapshot LSN at that version, or a version beyond the log, is not believed.
        if row.snapshot_version is not None and row.snapshot_version >= cleaned_below:
            lying = TableLog(LSN(row.snapshot_lsn + 1), row.snapshot_version, row.version, row.applied_marker)
            assert read_table_log(str(path), lying) == from_scratch
        beyond = TableLog(row.snapshot_lsn, row.snapshot_version, newest + 5, row.applied_marker)
        assert read_table_log(str(path), beyond) == from_scratch


def test_a_path_without_table_has_no_log(tmp_path: Path) -> None:
    assert read_table_log(str(tmp_path / "nothing")) == NO_TABLE
    (tmp_path / "file").write_text("not a directory")
    assert read_table_log(str(tmp_path / "file" / "below")) == NO_TABLE
