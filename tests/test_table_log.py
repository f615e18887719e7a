"""``resources/delta/table_log.py`` on generated Delta logs: what it answers is what the whole history says.

No engine: a log is a directory of commit files (``_delta_log/<version>.json`` with a ``commitInfo``
line) written here, with pgcdc's markers, other writers' metadata and commits without any, and
optionally cleaned up to a checkpoint (a real parquet file holding the table's metadata: its id, its
partition columns and, as Sail records it, the ``delta.pgcdc.layout`` property) the way Delta's log
cleanup does. The read from scratch and the read from every earlier answer (a state row as of that
version, as the incremental run hands it over) must agree with the history; once the snapshot marker is
gone, the layout is the property's, else the row's for the same table id (Delta on Spark records no
property); a row that does not describe the log must not change the answer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings, strategies as st

from resources.delta.destination import NO_TABLE, TableLog
from resources.delta.layout import BUCKET_COLUMN, HASH, RANGE, TableLayout
from resources.delta.markers import (
    APPEND_MARKER,
    applied_marker,
    EXPIRED_SNAPSHOT_LSN,
    LAYOUT_PROPERTY,
    layout_property,
    snapshot_marker,
)
from resources.delta.table_log import read_table_log
from resources.lsn import LSN
from resources.names import ColumnNumbers

#: One commit: ("snapshot", lsn) | ("append", lsn, seq) | ("merge",) | ("foreign",) | ("schema",) (a metaData action)
commit_kinds = st.one_of(
    st.tuples(st.just("snapshot"), st.integers(1, 10_000)),
    st.tuples(st.just("append"), st.integers(1, 10_000), st.integers(0, 5)),
    st.tuples(st.just("merge")),
    st.tuples(st.just("foreign")),
    st.tuples(st.just("schema")),
)

#: The table's lifelong layout (every snapshot marker and the table property record it).
layouts = st.sampled_from([None, TableLayout(RANGE, ("id",), 1000), TableLayout(HASH, ("id", "k"), 8)])
OTHER_LAYOUT = TableLayout(HASH, ("id",), 3)

METADATA_TYPE = pa.struct(
    [
        ("id", pa.string()),
        ("partitionColumns", pa.list_(pa.string())),
        ("configuration", pa.map_(pa.string(), pa.string())),
    ]
)
TABLE_ID = "5f1c7a0e-table"


def numbers(lsn: int) -> ColumnNumbers:
    """The column numbers the snapshot at ``lsn`` recorded (one per snapshot, told apart by the LSN)."""
    return ColumnNumbers({"id": 1, "v": 2 + lsn % 5}, 7 + lsn % 11)


def user_metadata(commit: tuple, layout: TableLayout | None) -> str | None:
    if commit[0] == "snapshot":
        return snapshot_marker(LSN(commit[1]), "slot", "public.t", layout, columns=numbers(commit[1]))
    if commit[0] == "append":
        return applied_marker(APPEND_MARKER, commit[1], commit[2])
    return "nightly compaction" if commit[0] == "foreign" else None


def write_log(path: Path, history: list[tuple], cleaned_below: int, layout: TableLayout | None, recorded: bool) -> None:
    """The commit files of ``history`` from ``cleaned_below`` on, and a checkpoint there when cleaned;
    the first commit and "schema" commits carry the table's metadata, with its layout property when
    ``recorded`` (as Sail writes it; Delta on Spark refuses it)."""
    log = path / "_delta_log"
    log.mkdir(parents=True)
    configuration = {"delta.appendOnly": "false"}
    if recorded:
        configuration[LAYOUT_PROPERTY] = layout_property(layout)
    table_metadata = {
        "id": TABLE_ID,
        "partitionColumns": [BUCKET_COLUMN] if layout is not None else [],
        "configuration": configuration,
    }
    for version, commit in enumerate(history):
        if version < cleaned_below:
            continue
        info = {"timestamp": version, "operation": "WRITE"}
        metadata = user_metadata(commit, layout)
        if metadata is not None:
            info["userMetadata"] = metadata
        actions = [{"commitInfo": info}, {"add": {"path": f"part-{version}.parquet", "size": 1}}]
        if version == 0 or commit[0] == "schema":
            actions.insert(1, {"metaData": table_metadata})
        (log / f"{version:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")
    if cleaned_below:
        configuration = list(configuration.items())
        checkpoint = pa.table(
            {"metaData": pa.array([None, {**table_metadata, "configuration": configuration}], METADATA_TYPE)}
        )
        pq.write_table(checkpoint, log / f"{cleaned_below:020d}.checkpoint.parquet")
        (log / "_last_checkpoint").write_text(json.dumps({"version": cleaned_below, "size": 1}))


def truth(
    history: list[tuple],
    upto: int,
    cleaned_below: int,
    markers_from: int,
    layout: TableLayout | None,
    expired_layout: TableLayout | None = None,
    expired_columns: ColumnNumbers | None = None,
) -> TableLog:
    """The TableLog as of version ``upto`` from the history, as far as commits >= ``cleaned_below`` show
    the snapshot, and commits >= ``markers_from`` the applied markers (``layout``: the table's;
    ``expired_layout``, ``expired_columns``: what is known of them once its snapshot commit is gone)."""
    applied = None
    for version in range(upto, -1, -1):
        commit = history[version]
        if commit[0] == "snapshot":
            if version < cleaned_below:
                break
            return TableLog(LSN(commit[1]), version, upto, applied, layout, TABLE_ID, None, numbers(commit[1]))
        if commit[0] == "append" and applied is None and version >= markers_from:
            applied = (commit[1], commit[2])
    if cleaned_below > 0:
        return TableLog(EXPIRED_SNAPSHOT_LSN, None, upto, applied, expired_layout, TABLE_ID, None, expired_columns)
    return TableLog(None, None, upto, applied, None, TABLE_ID)


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(commit_kinds, min_size=1, max_size=25),
    cleanup=st.floats(0, 1),
    layout=layouts,
    recorded=st.booleans(),
    data=st.data(),
)
def test_reads_from_scratch_and_from_any_earlier_answer_agree_with_the_history(
    tmp_path_factory,
    history: list[tuple],
    cleanup: float,
    layout: TableLayout | None,
    recorded: bool,
    data: st.DataObject,
) -> None:
    path = tmp_path_factory.mktemp("table")
    newest = len(history) - 1
    cleaned_below = int(cleanup * newest) if cleanup > 0.5 else 0  # half the logs are cleaned up
    write_log(path, history, cleaned_below, layout, recorded)
    from_scratch = read_table_log(str(path))
    # without a row, only the property names the layout of a table whose snapshot commit is gone
    assert from_scratch == truth(history, newest, cleaned_below, cleaned_below, layout, layout if recorded else None)

    # A state row written at an earlier version D (what a full read said then, before the cleanup).
    earlier = data.draw(st.integers(0, newest), label="state row version")
    row = truth(history, earlier, 0, 0, layout)
    if row.snapshot_lsn is not None:
        # The row remembers markers the cleanup removed, unless the cleanup removed commits after it
        # too (a gap: read from scratch); a snapshot the cleanup removed counts as expired either way,
        # with the layout the row recorded for this table id, and the row's column numbers unless commits
        # after it are gone (a newer snapshot could have been among them).
        gap = earlier + 1 < cleaned_below
        expected = truth(
            history, newest, cleaned_below, cleaned_below if gap else 0, layout, layout, None if gap else row.columns
        )
        assert read_table_log(str(path), row) == expected
        # A row of a state written before table ids were recorded: learns the id while the marker is there.
        assert read_table_log(str(path), replace(row, table_id=None)).table_id == TABLE_ID
        if row.snapshot_version is not None and row.snapshot_version < cleaned_below:
            assert read_table_log(str(path), replace(row, table_id=None)).layout == from_scratch.layout

        # A row claiming another snapshot LSN, or describing another table (another id, any layout),
        # or a version beyond the log, is not believed.
        lying_lsn = replace(row, snapshot_lsn=LSN(row.snapshot_lsn + 1))
        answer = read_table_log(str(path), lying_lsn)
        assert answer == (expected if row.snapshot_version < cleaned_below else from_scratch)  # type: ignore[operator]
        other_table = replace(row, layout=OTHER_LAYOUT, table_id="another-table")
        assert read_table_log(str(path), other_table) == from_scratch
        beyond = replace(row, version=newest + 5)
        assert read_table_log(str(path), beyond) == replace(from_scratch, layout=layout)


def test_a_path_without_table_has_no_log(tmp_path: Path) -> None:
    assert read_table_log(str(tmp_path / "nothing")) == NO_TABLE
    (tmp_path / "file").write_text("not a directory")
    assert read_table_log(str(tmp_path / "file" / "below")) == NO_TABLE


def test_a_row_keeps_the_column_numbers_once_the_snapshot_commit_is_gone(tmp_path: Path) -> None:
    """The state row's column numbers stand in for the removed snapshot marker's while every commit after
    the row is there; after a gap, or for another table, nothing is known of them."""
    history = [("snapshot", 40), ("merge",), ("merge",), ("merge",), ("merge",)]
    row = truth(history, 2, 0, 0, None)
    assert row.columns == numbers(40)
    cleaned = tmp_path / "cleaned"
    write_log(cleaned, history, 2, None, False)
    assert read_table_log(str(cleaned), row).columns == numbers(40)
    assert read_table_log(str(cleaned), replace(row, table_id="another-table")).columns is None
    assert read_table_log(str(cleaned)).columns is None
    gap = tmp_path / "gap"
    write_log(gap, history, 4, None, False)
    assert read_table_log(str(gap), row).columns is None
