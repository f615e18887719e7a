"""How pgcdc opens every Spark Connect session, and how a dead engine is reported.

Every engine pgcdc uses (embedded Sail, managed Spark, a remote server or cluster) is reached
through Spark Connect, and every session is built here, because PySpark's defaults are wrong
for a pipeline (measured in docs/engine-notes.md):

* The default retry policy retries an unreachable server for at least ten minutes (15 retries,
  back-off x4 up to 60 s): a dead engine looked like a hang, and the abandoned client's retry
  re-executed a killed MERGE on the restarted server three minutes later, from no live caller.
  A replayed keyed MERGE is harmless, a replayed append is a duplicate. Retries are bounded
  to a few seconds: a blip is absorbed, a dead engine fails the run.
* gRPC keeps reconnect back-off per address in a process-wide subchannel pool: after an engine
  restart, new sessions to the same address failed for a while. Each session gets its own
  pool and a short reconnect back-off.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pyspark.sql import SparkSession

from resources.errors import PgcdcError

RETRY_POLICY: dict[str, Any] = {
    "max_retries": 5,
    "initial_backoff": 100,
    "max_backoff": 2000,
    "backoff_multiplier": 2.0,
}
"""About 3 s of retries (0.1 + 0.2 + 0.4 + 0.8 + 1.6 s, plus jitter) before a call fails."""

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# PySpark warns when a call used up its retries, just before it raises: the failure itself
# becomes pgcdc's one line (engine_unavailable), the warning would be a second one.
warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]", category=UserWarning)

_ENGINE_GONE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})


class EngineUnavailable(PgcdcError):
    """The Spark engine stopped answering; nothing was confirmed past what Delta holds."""


def connect_session(url: str, config: Mapping[str, str] | None = None) -> SparkSession:
    """A Spark Connect session to ``url`` (``sc://host:port[/;token=...]``) with bounded
    retries, its own reconnect state and plain (not reattachable) execution.

    Reattachable execution releases results on a thread pool shared by every session of the
    process, and closing any session (also from its finalizer, which the garbage collector
    may run on one of those pool threads while it holds the gRPC channel's lock) joins that
    pool: a deadlock seen under parallel snapshots. pgcdc's operations are short commands,
    so plain execution loses nothing.
    """
    from pyspark.sql.connect.client import DefaultChannelBuilder
    from pyspark.sql.connect.client.retries import DefaultPolicy
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    # What SparkSession.builder.remote() sets: pyspark.sql.functions and DataFrame helpers
    # dispatch to their Spark Connect implementations only with it (a channel builder does not set it).
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    builder = ConnectSession.builder.channelBuilder(DefaultChannelBuilder(url, CHANNEL_OPTIONS))
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    spark = builder.create()
    spark.client.disable_reattachable_execute()
    spark.client.set_retry_policies([DefaultPolicy(**RETRY_POLICY)])
    return spark  # type: ignore[return-value]  # the Connect session has the classic session's API


def engine_address(spark: SparkSession) -> str:
    """``sc://host:port`` of a Connect session, without the token or other parameters."""
    if ".connect." not in type(spark).__module__:  # a classic session's .client raises
        return "the in-process Spark session"
    url = getattr(getattr(getattr(spark, "client", None), "_builder", None), "url", None)
    return f"sc://{url.netloc}" if url is not None else "the in-process Spark session"


def engine_unavailable(error: BaseException, spark: SparkSession) -> EngineUnavailable | None:
    """The one-line error for a call that failed because the engine is gone, else None.

    PySpark's message starts with ``<_MultiThreadedRendezvous of RPC that terminated with:``;
    the status and its details are on the gRPC error in the exception chain.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "code", None)
        details = getattr(current, "details", None)
        if callable(code) and callable(details):
            status = getattr(code(), "name", str(code()))
            if status in _ENGINE_GONE_CODES:
                text = (str(details() or "").strip().splitlines() or [""])[0][:300]
                return EngineUnavailable(
                    f"Spark engine at {engine_address(spark)} stopped answering ({status}: {text})",
                    "restart it (or check the network to it) and run again; nothing was confirmed "
                    "to the slot past what Delta holds, so the next run resumes exactly",
                )
        current = current.__cause__ or current.__context__
    return None


F = TypeVar("F", bound=Callable[..., Any])


def reports_dead_engine(function: F) -> F:
    """Turn a dead engine under ``function(config, destination, ...)`` into :class:`EngineUnavailable`
    (the destination's ``spark`` session names the engine; a destination without one has no engine)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:  # also a PgcdcError raised while the engine was failing
            destination = kwargs.get("destination", args[1] if len(args) > 1 else None)
            spark = getattr(destination, "spark", None)
            translated = engine_unavailable(error, spark) if spark is not None else None
            if translated is None:
                raise
            raise translated from error

    return wrapper  # type: ignore[return-value]
