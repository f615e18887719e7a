"""Where a drain's CPU goes: the walsender, pgcdc's threads, the embedded Sail server.

A drain involves three processes on one machine: PostgreSQL's walsender decoding WAL through
pgoutput (the same work ``pg_recvlogical`` makes it do), pgcdc's process (decode, fold, staging
Parquet, waiting) and, on embedded Sail, the engine's server process (the MERGEs). On a machine with
few cores their sum against the wall time says whether a faster client can still gain: when the
three together keep every core busy, only less CPU helps.

``with cpu_split(postmaster_pid, server_pid) as split:`` samples, on a thread every 50 ms, the CPU
of every walsender child of the postmaster (it exits with its connection, so the last sample is
its total, to within one interval). It reads this process's main thread, the whole process and the
server's CPU at the start and the end of the block from ``/proc`` (Linux only), and the CPU of child
processes that ended in it (``pg_recvlogical``). :func:`describe` prints the split.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> list[str] | None:
    """The fields after the command name of a ``/proc/.../stat`` file, ``None`` once it is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(path: Path) -> float:
    """User + system CPU of a process or thread (``/proc/<pid>/stat`` or ``.../task/<tid>/stat``)."""
    fields = _stat_fields(path)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / TICK


def _walsenders(postmaster: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry / "stat")
        if fields is None or int(fields[1]) != postmaster:
            continue
        try:
            if (entry / "cmdline").read_bytes().startswith(b"postgres: walsender"):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _usage(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@dataclass
class CpuSplit:
    """CPU seconds of each part over the block, and its wall time."""

    wall_s: float = 0.0
    walsender_s: float = 0.0
    main_thread_s: float = 0.0
    other_threads_s: float = 0.0
    server_s: float = 0.0
    children_s: float = 0.0
    _walsender_peaks: dict[int, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.walsender_s + self.main_thread_s + self.other_threads_s + self.server_s + self.children_s


@contextmanager
def cpu_split(postmaster_pid: int, server_pid: int | None) -> Iterator[CpuSplit]:
    split = CpuSplit()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid in _walsenders(postmaster_pid):
                seconds = cpu_seconds(Path(f"/proc/{pid}/stat"))
                split._walsender_peaks[pid] = max(seconds, split._walsender_peaks.get(pid, 0.0))
            stop.wait(0.05)

    existing = set(_walsenders(postmaster_pid))
    server_stat = Path(f"/proc/{server_pid}/stat") if server_pid else None
    main_stat = Path(f"/proc/self/task/{threading.main_thread().native_id}/stat")
    main_before, process_before, children_before = (
        cpu_seconds(main_stat),
        _usage(resource.RUSAGE_SELF),
        _usage(resource.RUSAGE_CHILDREN),
    )
    server_before = cpu_seconds(server_stat) if server_stat else 0.0
    sampler = threading.Thread(target=sample, name="cpu-split", daemon=True)
    started = time.perf_counter()
    sampler.start()
    try:
        yield split
    finally:
        split.wall_s = time.perf_counter() - started
        sampler_s = cpu_seconds(Path(f"/proc/self/task/{sampler.native_id}/stat"))
        split.main_thread_s = cpu_seconds(main_stat) - main_before
        split.other_threads_s = _usage(resource.RUSAGE_SELF) - process_before - split.main_thread_s - sampler_s
        split.children_s = _usage(resource.RUSAGE_CHILDREN) - children_before
        split.server_s = (cpu_seconds(server_stat) if server_stat else 0.0) - server_before
        stop.set()
        sampler.join()
        split.walsender_s = sum(s for pid, s in split._walsender_peaks.items() if pid not in existing)


def describe(name: str, split: CpuSplit) -> str:
    """One line: each part's CPU-seconds and share of one core over the wall time (parts under 10 ms left out)."""
    parts = (
        ("walsender", split.walsender_s),
        ("this process's main thread", split.main_thread_s),
        ("its other threads", split.other_threads_s),
        ("Sail server", split.server_s),
        ("child processes", split.children_s),
    )
    shown = ", ".join(
        f"{label} {seconds:.2f} s ({seconds / split.wall_s:.0%})" for label, seconds in parts if seconds >= 0.01
    )
    return (
        f"CPU of {name} over {split.wall_s:.2f} s wall: {shown}; "
        f"total {split.total_s:.2f} CPU-s = {split.total_s / split.wall_s:.2f} cores"
    )
