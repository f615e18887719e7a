"""The files of Delta tables on storage, listed without an engine: data files, ``_delta_log``
entries, and the tables below a location (local paths and ``s3://`` lakes alike, through pyarrow's
filesystems). Maintenance reads them to decide and to report what it did."""

from __future__ import annotations

import re

from resources.delta.lake_storage import LakeStorage
from resources.delta.staging import STAGING_DIRECTORY
from resources.locations import is_object_store, join_location, parse_object_location

DELTA_LOG = "_delta_log"
_COMMIT_FILE = re.compile(r"^(\d{20})\.(?:json|crc|checkpoint(?:\.\d+\.\d+)?\.parquet)$")


def delta_tables_under(lake: LakeStorage, location: str) -> list[str]:
    """Every Delta table at or below ``location`` (a directory holding ``_delta_log``), sorted;
    none when it does not exist. pgcdc's staging tables (``_pgcdc_staging``) are not among them."""
    from pyarrow import fs

    filesystem, base = filesystem_path(lake, location)
    found = set()
    for info in filesystem.get_file_info(fs.FileSelector(base, recursive=True, allow_not_found=True)):  # type: ignore[attr-defined]
        parts = info.path[len(base) :].strip("/").split("/")
        if DELTA_LOG in parts and STAGING_DIRECTORY not in parts:
            table = "/".join(parts[: parts.index(DELTA_LOG)])
            found.add(join_location(location, table) if table else location.rstrip("/"))
    return sorted(found)


def is_delta_table(lake: LakeStorage, path: str) -> bool:
    """Whether ``path`` holds a Delta table (a ``_delta_log`` with at least one file)."""
    return bool(log_files(lake, path))


def filesystem_path(lake: LakeStorage, location: str) -> tuple[object, str]:
    """The pyarrow filesystem holding ``location`` and the path on it."""
    if is_object_store(location):
        return lake.filesystem(), parse_object_location(location).store_path
    from pyarrow import fs

    return fs.LocalFileSystem(), location.removeprefix("file://").rstrip("/")


def storage_files(lake: LakeStorage, path: str) -> dict[str, int]:
    """Data files on storage below the table (partition directories included), relative path ->
    bytes; ``_delta_log`` and the other hidden entries (pgcdc's staging) are not data."""
    from pyarrow import fs

    filesystem, base = filesystem_path(lake, path)
    files = {}
    for info in filesystem.get_file_info(fs.FileSelector(base, recursive=True, allow_not_found=True)):  # type: ignore[attr-defined]
        relative = info.path[len(base) :].strip("/")
        if info.type == fs.FileType.File and not any(_hidden(part) for part in relative.split("/")):
            files[relative] = info.size
    return files


def _hidden(name: str) -> bool:
    """Delta's rule for what is not table data: names starting with ``.``, or with ``_`` unless
    a partition directory (``_pgcdc_bucket=3``)."""
    return name.startswith(".") or (name.startswith("_") and "=" not in name)


def log_files(lake: LakeStorage, path: str) -> set[str]:
    """Names of the commit, checkpoint and checksum files in the table's ``_delta_log``."""
    return set(log_entries(lake, path))


def log_entries(lake: LakeStorage, path: str) -> dict[str, float]:
    """:func:`log_files` with each file's modification time (seconds since the epoch)."""
    from pyarrow import fs

    filesystem, log = filesystem_path(lake, join_location(path, DELTA_LOG))
    selector = fs.FileSelector(log, allow_not_found=True)
    return {
        info.base_name: info.mtime.timestamp()
        for info in filesystem.get_file_info(selector)  # type: ignore[attr-defined]
        if _COMMIT_FILE.match(info.base_name)
    }


def delta_rs_table(lake: LakeStorage, path: str):  # type: ignore[no-untyped-def]  # deltalake.DeltaTable
    """The table at ``path`` opened by delta-rs, in this process."""
    from deltalake import DeltaTable

    return DeltaTable(path, storage_options=lake.object_store_options() or None)
