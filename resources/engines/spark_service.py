"""The managed Spark with Delta as a long-lived service: ``pgcdc spark-server``.

A fresh Spark JVM costs a run its start (15-45 s on two busy cores) and its first statements'
warm-up (class loading, code generation and the JIT: a fresh JVM's first MERGE took 2-5x as long as
the same MERGE on a JVM that had run one, docs/engine-notes.md, "The costs a user sees first").
``spark.engine: spark`` keeps the JVM it starts for the runs after it until it idles out
(``spark.keep_alive_s``, ``resources.engines.kept_spark``); ``pgcdc spark-server`` runs the same
server (the same jars and settings, ``resources.engines.spark_server``) until it is stopped, and runs
reach it with ``spark.remote: sc://127.0.0.1:PORT``, as they reach any Spark Connect server: its
lifecycle is the user's (a service manager, a container), not pgcdc's.

It listens on the loopback address only: Spark Connect has no authentication of its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

from resources.config import PgcdcConfig
from resources.delta.lake_storage import LakeStorage
from resources.engines.s3a import s3a_settings
from resources.engines.spark_server import (
    DEFAULT_START_TIMEOUT_S,
    managed_server_config,
    start_jvm,
    START_TIMEOUT_ENV,
    stop_group,
    wait_listening,
)


def serve(config: PgcdcConfig, port: int, out: TextIO, stop: threading.Event | None = None) -> int:
    """Run the managed Spark with Delta for ``config``'s lake and ``spark.config`` on 127.0.0.1:``port``
    until SIGTERM or SIGINT (or ``stop``), then stop the JVM; returns the exit status (1: the JVM
    ended by itself). The JVM gets the lake's object-store settings and environment, as the
    managed engine of a run does."""
    lake = LakeStorage(config.delta.root, config.delta.storage)
    os.environ.update(lake.engine_environment())  # the JVM inherits it: credentials stay off its command line
    settings = managed_server_config({**s3a_settings(lake), **config.spark.config})
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _setter(stop))
    work_dir = Path(tempfile.mkdtemp(prefix="pgcdc-spark-"))
    log_path = work_dir / "server.log"
    jvm = start_jvm(f"local[{len(os.sched_getaffinity(0))}]", port, settings, log_path, work_dir)
    try:
        wait_listening(port, jvm, float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)), log_path)
        out.write(
            f"pgcdc: Spark with Delta listening at sc://127.0.0.1:{port} (JVM pid {jvm.pid}, log {log_path}); "
            "set spark.remote to it; SIGTERM or Ctrl-C stops it\n"
        )
        out.flush()
        while not stop.wait(1.0):
            if jvm.poll() is not None:
                out.write(f"pgcdc: the Spark JVM exited with status {jvm.returncode} (log {log_path})\n")
                return 1
    finally:
        stop_group(jvm)
    shutil.rmtree(work_dir, ignore_errors=True)  # the log and Spark's scratch files; kept after a failure
    return 0


def _setter(stop: threading.Event) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    return handler
