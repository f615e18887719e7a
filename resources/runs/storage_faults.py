"""A full or unwritable lake, or a store refusing a write, said in one line by a drain: what a run shows
instead of the storage client's or the engine's own multi-line error (``resources.errors.storage_fault``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from resources.errors import DRAIN_RESUMES, PgcdcError, storage_fault

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
