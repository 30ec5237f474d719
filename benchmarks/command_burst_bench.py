"""Benchmark: a burst of train commands, through a real Mosquitto, answered one by one.

N commands (default 2,000) with distinct job ids are published at once (QoS 1,
no limit on the sender's in-flight window) by one operator connection; each
names a node that does not exist, so the real controller
(`controller.service.Controller`) answers each with a `failed` job status
("ghost is unknown"). A second operator connection, subscribed before the
burst, counts the job ids that got an answer. Two rounds:

1. online: the controller is connected while the burst arrives;
2. offline: the controller is stopped (its persistent session stays on the
   broker), the burst is sent, then the controller starts again and takes the
   commands queued for it.

The broker runs `deploy/mosquitto/`'s ACLs and the shipped config's queue
settings (`max_queued_messages` and the others of `xronos.mosquitto.TUNING`),
so the figure is the shipped config's. Not a test: numbers, to be quoted.
Needs `mosquitto` on the PATH.

    python benchmarks/command_burst_bench.py --commands 2000
"""

from __future__ import annotations

import argparse
import threading
import time

import paho.mqtt.client as paho

from controller.service import Controller, ControllerOptions
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.mqtt import BrokerSettings
from xronos.mosquitto import CONF_FILE, Mosquitto, shipped_tuning

USERS = {"controller": "ctl-pw", "operator": "op-pw"}


def operator(port: int, name: str) -> paho.Client:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"xronos-{name}", protocol=paho.MQTTv311)
    c.username_pw_set("operator", USERS["operator"])
    c.max_inflight_messages_set(0)  # no window: the whole burst goes out at once
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    return c


def burst(port: int, settings: BrokerSettings, n: int, offline: bool, wait: float) -> tuple[int, float]:
    """(answered job ids, seconds from the first command to the last answer)."""
    answered: set[str] = set()
    lock = threading.Lock()
    last = [0.0]
    prefix = f"burst-{'off' if offline else 'on'}-"

    def on_message(c, u, msg) -> None:
        job_id = msg.topic.split("/")[2]
        if msg.payload and job_id.startswith(prefix):
            with lock:
                answered.add(job_id)
                last[0] = time.monotonic()

    counter = operator(port, f"counter-{prefix}")
    counter.on_message = on_message
    counter.subscribe("xronos/jobs/+/status", qos=1)
    controller = Controller(ControllerOptions(heartbeat_timeout=600), settings).start()
    time.sleep(3.0)  # connected and settled
    if offline:
        controller.close()
        time.sleep(0.5)
    sender = operator(port, f"sender-{prefix}")
    job = JobOptions(model="/m", data="/d", output="/o")
    payloads = [
        wire.TrainCommand(job_id=f"{prefix}{i:05d}", job=job, nodes=["ghost"]).model_dump_json().encode()
        for i in range(n)
    ]
    start = time.monotonic()
    infos = [sender.publish(wire.TRAIN.name(), p, qos=1) for p in payloads]
    for info in infos:
        info.wait_for_publish(timeout=60)
    print(f"  sent {sum(i.is_published() for i in infos):,} of {n:,} in {time.monotonic() - start:.2f} s")
    if offline:
        time.sleep(2.0)  # the commands wait on the broker
        controller = Controller(ControllerOptions(heartbeat_timeout=600), settings).start()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with lock:
            if len(answered) >= n:
                break
        time.sleep(0.1)
    time.sleep(1.0)  # late answers (duplicates would show here)
    controller.close()
    sender.loop_stop()
    counter.loop_stop()
    with lock:
        return len(answered), (last[0] - start if answered else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", type=int, default=2000)
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the answers")
    args = parser.parse_args()
    print("broker tuning (shipped):", "; ".join(shipped_tuning(CONF_FILE.read_text())))
    with Mosquitto(users=USERS, persistence=True) as broker:
        settings = BrokerSettings(broker=broker.url, username="controller", password=USERS["controller"])
        for offline in (False, True):
            print(f"controller {'offline, then started' if offline else 'online'}:")
            got, seconds = burst(broker.port, settings, args.commands, offline, args.wait)
            print(f"  answered {got:,} of {args.commands:,} commands; last answer {seconds:.2f} s after the first send")


if __name__ == "__main__":
    main()
