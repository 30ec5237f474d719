"""Speed emulation: a worker under a quota gets about its share of one core, not more."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edge_node.cpu_quota import CgroupQuota, DutyCycleQuota, cgroup_quota_available

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 60: pass\n"


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(quota, seconds: float = 2.0) -> float:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        quota.add(proc.pid)
        start_cpu, start = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        return (_cpu_seconds(proc.pid) - start_cpu) / (time.monotonic() - start)
    finally:
        proc.kill()
        proc.wait()
        quota.close()


@pytest.mark.skipif(not cgroup_quota_available(), reason="needs a writable cgroup v1 cpu controller (root)")
def test_cgroup_quota_caps_a_busy_process():
    share = _measure(CgroupQuota(f"xronos-test-{os.getpid()}", 0.25))
    assert 0.05 < share < 0.35  # a cap: never more than the quota (plus tick rounding)


def test_duty_cycle_fallback_slows_a_busy_process():
    share = _measure(DutyCycleQuota("test", 0.3))
    assert 0.05 < share < 0.6


def test_devices_are_packed_onto_cores_so_that_none_is_oversubscribed():
    from edge_node.cpu_quota import pack_cores

    assert pack_cores([1, 0.5, 0.25], 2) == [{0}, {1}, {1}]
    assert pack_cores([0.43, 0.65, 0.52], 2) == [{1}, {0}, {1}]
    assert pack_cores([0.6, 0.6, 0.6], 2) is None  # fits by sum, not by cores: the scheduler places them
    assert pack_cores([1, 1, 0.5], 2) is None
    assert pack_cores([1.5], 2) is None
