"""A long-lived controller and agent keep bounded state, and leftovers of killed processes are removed.

`benchmarks/soak_bench.py` shows the same at scale (10,000 rejected commands, 200 jobs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import paho.mqtt.client as paho
from live_cluster import wait_for

from controller.service import KEPT_REJECTED, Controller, ControllerOptions
from edge_node.cleanup import remove_stale_run_dirs
from edge_node.cpu_quota import CGROUP_V1_CPU, cgroup_quota_available, remove_stale_cgroups
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.mqtt import BrokerSettings
from xronos.mosquitto import Mosquitto


def retained_statuses(port: int) -> set[str]:
    seen: set[str] = set()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"count-{time.monotonic_ns()}")
    client.on_message = lambda c, u, m: seen.add(m.topic.split("/")[2]) if m.retain and m.payload else None
    client.connect("127.0.0.1", port)
    client.subscribe(wire.JOB_STATUS.subscription(), qos=1)
    client.loop_start()
    time.sleep(1.0)
    client.loop_stop()
    client.disconnect()
    return seen


def test_rejected_commands_and_finished_jobs_stay_within_their_windows(tmp_path):
    with Mosquitto(users=None) as broker:
        settings = BrokerSettings(broker=broker.url)
        publisher = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="old-controller")
        publisher.connect("127.0.0.1", broker.port)
        publisher.loop_start()
        # an earlier controller's finished jobs: 4 files on disk, 6 retained statuses (2 without a file)
        state = tmp_path / "state"
        (state / "jobs").mkdir(parents=True)
        for i in range(6):
            status = wire.JobStatus(job_id=f"old-{i}", state="completed", ts=1000.0 + i)
            publisher.publish(wire.JOB_STATUS.name(status.job_id), wire.JOB_STATUS.encode(status), qos=1, retain=True)
            if i >= 2:
                (state / "jobs" / f"old-{i}.json").write_text(status.model_dump_json())
        (state / "jobs" / "garbage.json").write_text("{not json")
        publisher.loop_stop()
        controller = Controller(ControllerOptions(state_dir=state, keep_jobs=3), settings).start()
        try:
            assert sorted(p.name for p in (state / "jobs").glob("*.json")) == ["old-3.json", "old-4.json", "old-5.json"]
            wait_for(lambda: retained_statuses(broker.port) == {"old-3", "old-4", "old-5"}, 10, "old statuses pruned")

            job = JobOptions(model="/m", data="/d", output="/o")
            sender = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="operator")
            sender.connect("127.0.0.1", broker.port)
            sender.loop_start()
            for i in range(KEPT_REJECTED + 50):
                command = wire.TrainCommand(job_id=f"junk-{i}", job=job, nodes=["ghost"])
                sender.publish(wire.TRAIN.name(), wire.TRAIN.encode(command), qos=1).wait_for_publish(5)
            sender.loop_stop()
            last = f"junk-{KEPT_REJECTED + 49}"
            wait_for(lambda: last in controller.rejected, 20, "the last rejection")
            assert len(controller.rejected) == KEPT_REJECTED and "junk-0" not in controller.rejected
            assert controller.metrics.invalid.labels("cmd/train")._value.get() == KEPT_REJECTED + 50
            retained = retained_statuses(broker.port)
            assert retained == {"old-3", "old-4", "old-5"} | {f"junk-{i}" for i in range(50, KEPT_REJECTED + 50)}
            assert sorted(p.name for p in (state / "jobs").glob("*.json")) == ["old-3.json", "old-4.json", "old-5.json"]
            # a rejected id is taken while it is kept, free again once it left the window
            with controller.lock:
                controller._on_train("", wire.TrainCommand(job_id=last, job=job, nodes=["ghost"]))
            assert controller.bus.invalid["cmd/train"] == KEPT_REJECTED + 51
        finally:
            controller.close()


def test_leftover_run_directories_go_unless_young_or_in_use(tmp_path):
    old, young, used = (tmp_path / f"xronos-run-{name}" for name in ("old", "young", "used"))
    for path in (old, young, used):
        path.mkdir()
        (path / "spec-0.json").write_text("{}")
    for path in (old, used):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(used / "spec-0.json")])
    try:
        cmdline = f"/proc/{holder.pid}/cmdline"
        wait_for(lambda: str(used) in open(cmdline, "rb").read().decode(errors="replace"), 10, "the holder's exec")
        assert remove_stale_run_dirs(tmp_path) == [old]
        assert not old.exists() and young.exists() and used.exists()
    finally:
        holder.kill()
        holder.wait()


def test_leftover_cgroups_go_unless_a_process_is_in_them():
    assert cgroup_quota_available(), "cgroup v1 cpu quotas are not writable here (run as root)"
    prefix = f"xronos-test-{uuid.uuid4().hex[:8]}-"
    empty, busy = CGROUP_V1_CPU / f"{prefix}empty", CGROUP_V1_CPU / f"{prefix}busy"
    empty.mkdir()
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (busy / "cgroup.procs").write_text(str(holder.pid))
        assert remove_stale_cgroups(prefix, min_age=3600) == []  # both young
        assert remove_stale_cgroups(prefix, min_age=0) == [empty.name]
        assert not empty.exists() and busy.exists()
    finally:
        holder.kill()
        holder.wait()
        for _ in range(50):
            try:
                busy.rmdir()
                break
            except OSError:
                time.sleep(0.1)
