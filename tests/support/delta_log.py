"""A Delta table's ``_delta_log`` read and aged directly: what the commits after a version wrote,
and a log cleaned the way Delta's log clean-up leaves it."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

import deltalake
import pyarrow as pa

from resources.delta.lake_storage import LakeStorage
from resources.delta.table_files import storage_files


def commits_after(path: str, version: int) -> list[list[dict]]:
    """The actions of every commit after ``version``."""
    log = Path(path) / "_delta_log"
    return [
        [json.loads(line) for line in commit.read_text().splitlines()]
        for commit in sorted(log.glob("*.json"))
        if int(commit.name[:20]) > version
    ]


def commit_bytes(path: str, version: int) -> int:
    """What the drain's commits after ``version`` wrote, summed from their ``add`` actions: the size of
    every file added that the same commit did not remove, and the size of every deletion vector not inlined."""
    total = 0
    for commit in commits_after(path, version):
        removed = {action["remove"]["path"] for action in commit if "remove" in action}
        for add in (action["add"] for action in commit if "add" in action):
            total += 0 if add["path"] in removed else add["size"]
            vector = add.get("deletionVector") or {}
            total += vector.get("sizeInBytes", 0) if vector.get("storageType") in ("u", "p") else 0
    return total


def clean_log(path: str) -> None:
    """What Delta's log cleanup leaves once the commits are old enough: a checkpoint at the newest
    version and no commit file before it (the snapshot markers are gone)."""
    deltalake.DeltaTable(path).create_checkpoint()
    log = Path(path) / "_delta_log"
    newest = max(int(commit.name[:20]) for commit in log.glob("*.json"))
    for old in log.iterdir():
        if old.name[:20].isdigit() and int(old.name[:20]) < newest and not old.name.endswith(".parquet"):
            old.unlink()


def live_data_files(path: str) -> set[str]:
    """The data files the table's newest version reads, relative to the table."""
    actions = pa.table(deltalake.DeltaTable(path).get_add_actions(flatten=True))
    return {unquote(name) for name in actions.column("path").to_pylist()}


def stale_data_files(lake: LakeStorage, path: str) -> set[str]:
    """The Parquet files on storage below the table that its newest version does not read: what the
    drains replaced, for vacuum to delete (deletion vector files are not counted: a live one that
    compaction releases is as recent as the compaction)."""
    live = live_data_files(path)
    return {name for name in storage_files(lake, path) if name.endswith(".parquet") and name not in live}
