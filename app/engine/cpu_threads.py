"""How many OpenBLAS threads a turn on the CPU path uses (issue 14).

OpenBLAS starts one thread per core and they spin while they wait for each
other. On an idle machine that pays: with the starter model at 1k tokens, two
threads gave 36 ms a decode token against 42 with one, and a 17-token turn 83
against 125 ms. Beside a process that keeps one of the two cores busy, two
threads gave 142 ms a token against 42, and 769 ms a turn against 145
(`docs/probes/blas_threads_probe.py`): one thread waits for a core it does not
get.

So each turn takes as many threads as the cores other processes left free
since the last turn began (while the user read and typed): /proc/stat's busy
time of the cores this process may use over that interval, less this
process's own. The count changes only between turns, when
no BLAS call is running (OpenBLAS does not allow changing it during one).
`REPRISE_BLAS_THREADS=N` fixes it. Where there is no /proc/stat or no
OpenBLAS, nothing is changed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from app.engine import cpu_blas

PROC_STAT = Path("/proc/stat")
MIN_WINDOW = 0.25  # seconds between turns below which the load is not judged


@dataclass(frozen=True)
class CpuSample:
    """The machine's CPU time (all cores, seconds) and this process's, at `at`."""

    busy: float
    total: float
    ours: float
    at: float


def sample() -> CpuSample | None:
    """Now, over the cores this process may run on, or None where /proc/stat cannot
    be read. (The machine-wide line would count load on cores a container or an
    affinity mask keeps us off.)"""
    try:
        busy, total = _jiffies(PROC_STAT.read_text().splitlines(), _allowed_cpus())
    except (OSError, ValueError):  # unreadable, or not the layout the kernel documents
        return None
    if not total:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    times = os.times()
    return CpuSample(busy / hz, total / hz, times.user + times.system, time.monotonic())


def _jiffies(lines: list[str], cpus: set[int]) -> tuple[int, int]:
    """Busy and all clock ticks of the per-CPU lines of `cpus`."""
    allowed = {f"cpu{n}" for n in cpus}
    busy = total = 0
    for fields in (line.split() for line in lines):
        if len(fields) < 8 or fields[0] not in allowed:
            continue
        user, nice, system, idle, iowait, irq, softirq = (int(x) for x in fields[1:8])
        steal = int(fields[8]) if len(fields) > 8 else 0
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return busy, total


def others_busy(before: CpuSample, after: CpuSample) -> float | None:
    """How many cores other processes kept busy on average between the samples;
    None for a window too short to judge."""
    wall = after.at - before.at
    if wall < MIN_WINDOW:
        return None
    theirs = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, theirs / wall)


def threads_for(busy_elsewhere: float, cores: int) -> int:
    """The cores left free, rounded to the nearest whole one, at least one."""
    return max(1, min(cores, int(cores - busy_elsewhere + 0.5)))


def _allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cores() -> int:
    return len(_allowed_cpus())


class TurnThreads:
    """Chooses the thread count at the start of each turn from the load since the
    start of the last one (or since it was made); this process's own time, its
    turns included, is not counted."""

    def __init__(self) -> None:
        self._since = sample()

    def start_turn(self) -> int | None:
        """Set the count for the turn about to run; returns it (None: left alone)."""
        fixed = os.environ.get("REPRISE_BLAS_THREADS", "")
        if fixed.isdigit() and int(fixed) > 0:
            return int(fixed) if cpu_blas.set_threads(int(fixed)) else None
        now = sample()
        if now is None or self._since is None:
            return None
        busy = others_busy(self._since, now)
        if busy is None:
            return None  # turns back to back: keep the count, and the window
        self._since = now
        count = threads_for(busy, cores())
        return count if cpu_blas.set_threads(count) else None


_turns = TurnThreads()  # one for the process: the thread count is the library's


def start_turn() -> int | None:
    """`TurnThreads.start_turn` for the process's turns."""
    return _turns.start_turn()
