"""What the device's memory looks like, read from Linux's /proc and the cgroup (no torch).

Light on purpose: the node agent reads it every heartbeat for its metrics, and the
agent never imports torch itself (its worker does the heavy work).
"""

from __future__ import annotations

from pathlib import Path

CGROUP_LIMITS = (
    # (limit, usage): cgroup v1, then v2 (a container's `--memory` on current Docker hosts)
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
)


def available_memory_bytes() -> int:
    """MemAvailable, or what this cgroup's memory limit leaves when that is smaller."""
    avail = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    for limit_file, usage_file in CGROUP_LIMITS:
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and int(limit_text) < 1 << 60:  # v2 says "max", v1 a huge number, for none
            avail = min(avail, max(int(limit_text) - usage, 0))
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
