"""When a worker's start-up phases end, in seconds since its process started (`RankResult.timeline`).

The origin is the process's own start as the kernel recorded it (`/proc/self/stat`, in clock
ticks since boot, read against CLOCK_BOOTTIME), not a time the launcher writes in the spec:
it counts the interpreter's start and the imports before any of our code runs, needs no
clock shared with whoever started the worker (the local launcher or a node agent on
another device), and costs nothing to pass. Its resolution is one clock tick (10 ms).
"""

from __future__ import annotations

import os
import time

from xronos.contract.report import TimelineEvent


def process_age() -> float:
    """Seconds since this process started (since this call, where /proc cannot tell)."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Timeline:
    """The events of one worker process, timed from its start."""

    def __init__(self) -> None:
        age = process_age()
        self.origin = time.perf_counter() - age
        self.started_at = time.time() - age
        self.events: list[TimelineEvent] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def mark(self, name: str, seconds: float | None = None) -> None:
        """`name` ended now (after `seconds`, for a phase that did not start at the previous event)."""
        self.events.append(TimelineEvent(name=name, at_seconds=self.now(), seconds=seconds))
