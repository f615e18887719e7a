"""A full or unwritable volume, or an object store refusing a write, said in one line.

What a run under such a lake (or spill directory) shows instead of the storage client's or the engine's
own multi-line error: a :class:`~resources.errors.StorageFault` naming what was being written, the setting
that points there, and what to do. Recognised in any exception chain by errno (Python's and pyarrow's
``OSError``) or by how the engine and the storage clients spell it (Rust's ``(os error 28)``, the AWS
SDK's ``ACCESS_DENIED``, delta-rs's "lacked the necessary privileges"). PostgreSQL's own "permission
denied" (a missing grant) is not a volume's: psycopg errors are skipped.
"""

from __future__ import annotations

import errno
import functools
import os
import pwd
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from resources.errors import PgcdcError, StorageFault

DRAIN_RESUMES = "run the drain again: nothing was confirmed to the slot past what Delta holds, so it resumes exactly"
"""What to do after fixing a volume a drain could not write (``storage_fault``'s ``then``)."""

Kind = Literal["full", "unwritable", "denied"]

_KINDS: dict[int, Kind] = {
    errno.ENOSPC: "full", errno.EDQUOT: "full",
    errno.EACCES: "unwritable", errno.EPERM: "unwritable", errno.EROFS: "unwritable",
}  # fmt: skip
_PHRASES: dict[str, tuple[Kind, str]] = {
    "no space left on device": ("full", os.strerror(errno.ENOSPC)),
    "disk quota exceeded": ("full", os.strerror(errno.EDQUOT)),
    "read-only file system": ("unwritable", os.strerror(errno.EROFS)),
    "permission denied": ("unwritable", os.strerror(errno.EACCES)),
    "operation not permitted": ("unwritable", os.strerror(errno.EPERM)),
    "access_denied": ("denied", "access denied"),
    "accessdenied": ("denied", "access denied"),
    "lacked the necessary privileges": ("denied", "access denied"),
    "403 forbidden": ("denied", "403 Forbidden"),
}


def storage_fault_kind(error: BaseException) -> tuple[Kind, str] | None:
    """(what kind of storage fault, how the system says it) under ``error`` and its chain, else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if not type(current).__module__.startswith("psycopg"):
            if isinstance(current, OSError) and current.errno in _KINDS:
                return _KINDS[current.errno], os.strerror(current.errno)
            text = str(current).lower()
            for phrase, found in _PHRASES.items():
                if phrase in text:
                    return found
        current = current.__cause__ or current.__context__
    return None


def storage_fault(error: BaseException, where: str, setting: str, then: str) -> StorageFault | None:
    """The one line for ``error`` when a volume is full or not writable, or the store refused, else None.

    ``where`` names what was being written, ``setting`` what points there (``delta.root``, ``TMPDIR``),
    ``then`` what to do after the fix."""
    found = storage_fault_kind(error)
    if found is None:
        return None
    kind, said = found
    if kind == "full":
        return StorageFault(
            f"no space left for {where} ({said})",
            f"free space on that volume or grow it (or point {setting} at a larger one), then {then}",
        )
    if kind == "denied":
        return StorageFault(
            f"the object store refused a write to {where} ({said})",
            "give the credentials (delta.storage.access_key_id / secret_access_key, or AWS_*) write access"
            f" to {setting} (s3:PutObject, s3:DeleteObject), then {then}",
        )
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        name = "?"
    return StorageFault(
        f"cannot write {where} as user {name} (uid {os.geteuid()}) ({said})",
        f"make {setting} writable by that user (or run pgcdc as its owner), then {then}",
    )


F = TypeVar("F", bound=Callable[..., Any])


def reports_storage_faults(function: F) -> F:
    """Turn a storage fault under ``function(config, ...)`` (a drain) into a
    :class:`~resources.errors.StorageFault` naming ``delta.root``; pgcdc's own errors pass as they are
    (the spill directory's faults are named where it is written, ``resources/cdc/transactions.py``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except PgcdcError:
            raise
        except Exception as error:
            config = kwargs.get("config", args[0] if args else None)
            root = getattr(getattr(config, "delta", None), "root", "the lake")
            fault = storage_fault(error, f"the lake at {root}", "delta.root", DRAIN_RESUMES)
            if fault is None:
                raise
            raise fault from error

    return wrapper  # type: ignore[return-value]
