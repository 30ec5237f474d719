"""What the device's memory looks like, read from Linux's /proc and the cgroup (no torch).

Light on purpose: the node agent reads it every heartbeat for its metrics, and the
agent never imports torch itself (its worker does the heavy work).
"""

from __future__ import annotations

from pathlib import Path


def available_memory_bytes() -> int:
    """MemAvailable, or this cgroup's memory limit when that is smaller."""
    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    limit_file = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit_file.is_file():
        limit = int(limit_file.read_text())
        usage = int(Path("/sys/fs/cgroup/memory/memory.usage_in_bytes").read_text())
        avail = min(avail, max(limit - usage, 0)) if limit < 1 << 60 else avail
    return avail


def resident_bytes(pid: int) -> int:
    """Resident memory of a process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
