"""Emulating a slower device: a CPU quota per worker process.

The mechanism is the one behind Docker's `cpus:` limit, CFS bandwidth
control, through cgroup v1 (`cpu.cfs_quota_us`; on these machines cgroup v2
has no cpu controller). Speed 1 = one full core. The period is 4 ms (longer
only where the quota would fall under the kernel's 1 ms minimum), not the
100 ms default nor the 10 ms used before: a quota is a share of each period,
so a worker that waited part of a period (in a collective) then computes at
full speed until the period's quota is spent, and one that computes without
pause is throttled in long stretches. The longer the period, the further
that is from a device that is merely slower (`benchmarks/quota_period_bench.py`:
one SmolLM2 MLP step under a 0.25 quota, 10 ms periods, 82 ms back to back and
61-75 ms after a 5-50 ms wait; 4 ms periods, 85-96 ms either way). With 100 ms a throttled worker stops for up to 75 ms at
a stretch and stalls every collective.

A worker joins its cgroup itself, once its imports are done (`join_quota`):
startup is not what the emulation is about, and a 0.25 device would spend
~18 s importing torch and transformers under its quota, in every test and
bench run. Everything timed (profile, load, steps) runs under the quota.

Where no cgroup can be written (not root, no v1 cpu controller), the fallback
is a duty cycle driven from the launcher: SIGCONT for `speed` of each 10 ms
period and SIGSTOP for the rest. Coarser (it depends on the launcher being
scheduled on time) but the same average speed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 4_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller cfs_quota_us
DUTY_PERIOD_SECONDS = 0.01  # the fallback's: signals from a Python thread cannot keep a finer beat


def period_and_quota_us(speed: float) -> tuple[int, int]:
    """The cgroup period and quota for `speed` cores: PERIOD_US, stretched for very slow speeds."""
    period = max(PERIOD_US, round(MIN_QUOTA_US / speed))
    return period, max(MIN_QUOTA_US, round(speed * period))


def cgroup_quota_available() -> bool:
    return (CGROUP_V1_CPU / "cpu.cfs_quota_us").is_file() and os.access(CGROUP_V1_CPU, os.W_OK)


class CgroupQuota:
    """A cgroup v1 cpu group limited to `speed` cores; processes are moved in with `add`."""

    def __init__(self, name: str, speed: float):
        self.path = CGROUP_V1_CPU / name
        self.path.mkdir(exist_ok=True)
        period, quota = period_and_quota_us(speed)
        (self.path / "cpu.cfs_quota_us").write_text("-1")  # a period shorter than the set quota is refused
        (self.path / "cpu.cfs_period_us").write_text(str(period))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    @property
    def procs_file(self) -> str:
        """Where a worker writes its own pid to join (`join_quota`)."""
        return str(self.path / "cgroup.procs")

    def add(self, pid: int) -> None:
        Path(self.procs_file).write_text(str(pid))

    def close(self) -> None:
        for _ in range(50):  # the group can be removed once its processes have exited
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        log.warning("could not remove cgroup %s", self.path)


class DutyCycleQuota:
    """Fallback: SIGSTOP/SIGCONT a process so it runs `speed` of every period."""

    procs_file = None  # the launcher adds the process at once (`add`)

    def __init__(self, name: str, speed: float):
        self.speed = min(speed, 1.0)
        self.pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"duty-{name}", daemon=True)

    def add(self, pid: int) -> None:
        self.pids.append(pid)
        if self.speed < 1.0 and not self._thread.is_alive():
            self._thread.start()

    def _signal(self, sig) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _run(self) -> None:
        period = DUTY_PERIOD_SECONDS
        while not self._stop.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self.speed * period)
            self._signal(signal.SIGSTOP)
            time.sleep((1 - self.speed) * period)
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def pack_cores(speeds: list[float], cores: int) -> list[set[int]] | None:
    """The cores each emulated device may run on, so that no core carries more than one core's worth.

    A real device has cores of its own; emulated ones share this machine's, and when the
    scheduler puts the 1-core device beside the 0.5 one on the same core both run slower
    than their quotas say, differently from run to run. First-fit decreasing packs the
    speeds into the cores (speed 1 gets a core to itself). None when they do not fit
    (or a device wants more than one core): then the scheduler places them.
    """
    if not speeds or max(speeds) > 1 or sum(speeds) > cores:
        return None
    load = [0.0] * cores
    placed: list[set[int]] = [set() for _ in speeds]
    for device in sorted(range(len(speeds)), key=lambda d: -speeds[d]):
        core = next((c for c in range(cores) if load[c] + speeds[device] <= 1 + 1e-9), None)
        if core is None:
            return None
        load[core] += speeds[device]
        placed[device] = {core}
    return placed


def join_quota(procs_file: str, cpus: list[int] | None = None) -> None:
    """Move this process into the cgroup whose `cgroup.procs` this is (a worker, after its imports), and
    onto its emulated device's `cpus`. Until then it imports on any core: the devices two quotas share
    a core of would otherwise import one after the other there (+4.5 s before a 3-device job's first
    step, with speeds 0.5 and 0.25 on one core), where real devices import side by side."""
    Path(procs_file).write_text(str(os.getpid()))
    if cpus:
        os.sched_setaffinity(0, cpus)


def start_under(quota: CgroupQuota | DutyCycleQuota, pid: int) -> None:
    """Put a just-started worker under `quota`: a cgroup it joins itself (its spec names
    `quota.procs_file`), a duty cycle from now on."""
    if quota.procs_file is None:
        quota.add(pid)


def make_quota(name: str, speed: float) -> CgroupQuota | DutyCycleQuota:
    """The best available emulation of a device of `speed` cores."""
    if cgroup_quota_available():
        return CgroupQuota(name, speed)
    log.warning(
        "cgroup v1 cpu quotas are not writable here; emulating speed %.2f with a SIGSTOP/SIGCONT duty cycle", speed
    )
    return DutyCycleQuota(name, speed)


STALE_GROUP_SECONDS = 600.0
"""An empty group older than this is a leftover: a worker joins its group within seconds of its start
(after its imports), so a younger empty group may be one whose worker is still importing."""


def remove_stale_cgroups(prefix: str, min_age: float = STALE_GROUP_SECONDS) -> list[str]:
    """Remove the empty cpu groups named `prefix*` older than `min_age`: what a killed launcher or agent left.

    A group with a process in it cannot be removed (the kernel answers EBUSY), so one in use is
    never touched; nor is a young empty one. Returns the names removed.
    """
    if not CGROUP_V1_CPU.is_dir():
        return []
    removed, now = [], time.time()
    for group in CGROUP_V1_CPU.glob(f"{prefix}*"):
        try:
            if not group.is_dir() or now - group.stat().st_mtime < min_age:
                continue
            if (group / "cgroup.procs").read_text().strip():
                continue
            group.rmdir()
            removed.append(group.name)
        except OSError:
            continue
    if removed:
        log.info("removed %d leftover cgroup(s): %s", len(removed), ", ".join(removed[:5]))
    return removed
