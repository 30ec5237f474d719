"""A controller killed mid-job (SIGKILL) and started again with the same `--state-dir` sees the job
through, exactly once; a second controller started while one is live refuses, and the live one goes on.

All real: Mosquitto from the shipped `deploy/mosquitto/mosquitto.conf` and `acl` (TLS; on the device
listener the broker binds client ids to usernames, so a second `controller` connecting there would
take over the live one's session), `xronos controller`, three `xronos node` processes training a
tiny model with tensor parallelism over gloo, and `xronos train --wait` as the operator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from live_cluster import train_by_command, uninterrupted, wait_for
from transformers import AutoModelForCausalLM

from edge_node.toy_model import make_data, make_model
from edge_node.worker_process import free_port, stop_processes
from xronos.contract import wire
from xronos.mosquitto import Mosquitto

REPO = Path(__file__).resolve().parent.parent
MAKE_CERTS = REPO / "deploy" / "mosquitto" / "make-certs.sh"
NODES = ("n0", "n1", "n2")
USERS = {"controller": "ctl-" + uuid.uuid4().hex, "operator": "op-" + uuid.uuid4().hex}
USERS |= {n: f"{n}-" + uuid.uuid4().hex for n in NODES}
STEPS, BATCH, SEQ = 60, 8, 64
"""About 0.2-0.4 s a step on 2 shared cores: the job outlives a controller's restart."""
JOB = "survives-restart"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A model and data big enough for steps of a few tenths of a second (the shared ones take ms)."""
    root = tmp_path_factory.mktemp("tiny")
    model = make_model(
        root / "model", hidden=192, layers=3, heads=6, kv_heads=3, intermediate=576, vocab=320, tie=True, seed=1
    )
    return model, make_data(root / "rows.jsonl", rows=64, seq_len=SEQ + 4, vocab=320, seed=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    env = {**os.environ, "XRONOS_BROKER_NAMES": "127.0.0.1 localhost"}
    subprocess.run(["sh", str(MAKE_CERTS), str(out), *NODES], check=True, env=env, capture_output=True)
    return out


def tls(certs: Path, user: str) -> list[str]:
    return ["--ca-file", str(certs / "ca.crt"), "--cert-file", str(certs / f"{user}.crt")] + [
        "--key-file",
        str(certs / f"{user}.key"),
    ]


def xronos(broker: Mosquitto, certs: Path, user: str, *args: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XRONOS_")}
    env |= {"XRONOS_BROKER": broker.url, "XRONOS_USERNAME": user, "XRONOS_PASSWORD": USERS[user]}
    return subprocess.Popen(
        [sys.executable, "-m", "xronos.cli", args[0], *tls(certs, user), *args[1:]],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def controller(broker: Mosquitto, certs: Path, state: Path, port: int, log: Path) -> subprocess.Popen:
    return xronos(
        broker,
        certs,
        "controller",
        "controller",
        "--state-dir",
        str(state),
        "--metrics-port",
        str(port),
        "--probe-broker",  # the test broker's operator listener is not on the shipped port 8884
        broker.operator_url,
        log=log,
    )


def nodes_online(port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return next(
        (float(line.split()[-1]) for line in text.splitlines() if line.startswith("xronos_nodes_online ")), None
    )


class Watcher:
    """The operator's view over TLS: every job status and controller status, retained ones marked."""

    def __init__(self, broker: Mosquitto, certs: Path):
        self.seen: list[tuple[str, bool, dict | None]] = []
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2, client_id=f"xronos-watch-{uuid.uuid4().hex}", protocol=paho.MQTTv311
        )
        self.client.username_pw_set("operator", USERS["operator"])
        self.client.tls_set(
            ca_certs=str(certs / "ca.crt"), certfile=str(certs / "operator.crt"), keyfile=str(certs / "operator.key")
        )
        self.client.on_message = lambda c, u, m: self.seen.append(
            (m.topic, m.retain, json.loads(m.payload) if m.payload else None)
        )
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(
            [(wire.JOB_STATUS.name(JOB), 1), (wire.CONTROLLER_STATUS.name(), 1)]
        )
        self.client.connect("127.0.0.1", broker.operator_port)
        self.client.loop_start()

    def statuses(self, state: str, live_only: bool = True) -> list[dict]:
        return [
            m
            for topic, retained, m in list(self.seen)
            if topic == wire.JOB_STATUS.name(JOB) and m and m["state"] == state and not (live_only and retained)
        ]

    def controllers(self) -> list[dict]:
        return [m for topic, _, m in list(self.seen) if topic == wire.CONTROLLER_STATUS.name() and m]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def steps_done(root: Path) -> int:
    """The last step rank 0's worker finished (its progress file; the node removes it when the job ends)."""
    try:
        lines = (root / "n0" / "jobs" / JOB / "progress.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)
    except (OSError, ValueError):
        return 0


def test_a_controller_killed_mid_job_restarts_from_its_state_and_the_job_completes_once(tmp_path, certs, tiny):
    model, data = tiny
    state = tmp_path / "state"
    ports = {name: free_port() for name in ("a", "b", "c", *NODES)}
    procs: list[subprocess.Popen] = []
    with Mosquitto(users=USERS, certs=certs) as broker:
        watcher = Watcher(broker, certs)
        try:
            first = controller(broker, certs, state, ports["a"], tmp_path / "controller-a.log")
            procs.append(first)
            for node in NODES:
                procs.append(
                    xronos(
                        broker,
                        certs,
                        node,
                        "node",
                        "--node-id",
                        node,
                        "--workdir",
                        str(tmp_path / node),
                        "--heartbeat-seconds",
                        "0.5",
                        "--metrics-port",
                        str(ports[node]),
                        log=tmp_path / f"{node}.log",
                    )
                )
            wait_for(lambda: nodes_online(ports["a"]) == 3, 120, "the controller to see 3 nodes", poll=0.5)

            done: dict = {}
            runner = threading.Thread(
                target=lambda: done.update(
                    result=train_by_command(
                        broker.operator_url,
                        USERS["operator"],
                        model,
                        data,
                        tmp_path / "out",
                        JOB,
                        "--mode",
                        "tp",
                        "--nodes",
                        ",".join(NODES),
                        *tls(certs, "operator"),
                        steps=STEPS,
                        seq_len=SEQ,
                        batch_size=BATCH,
                        log=tmp_path / "train.log",
                    )
                )
            )
            runner.start()
            wait_for(lambda: steps_done(tmp_path) >= 3, 150, "the job to train a few steps")
            assert (state / "running" / f"{JOB}.json").is_file(), "the job in flight is not in --state-dir"

            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            killed_at = steps_done(tmp_path)
            time.sleep(2.0)
            trained_alone = steps_done(tmp_path)
            assert trained_alone > killed_at, "the nodes stopped training without the controller"
            assert trained_alone < STEPS, "the job ended before the controller came back: make it longer"

            second = controller(broker, certs, state, ports["b"], tmp_path / "controller-b.log")
            procs.append(second)
            wait_for(lambda: nodes_online(ports["b"]) == 3, 60, "the restarted controller to see the nodes", poll=0.3)

            # a third controller while the second is live: refused in one line, exit 2, nothing disturbed
            third = subprocess.run(
                [sys.executable, "-m", "xronos.cli", "controller", *tls(certs, "controller")]
                + ["--state-dir", str(tmp_path / "state-3"), "--probe-broker", broker.operator_url],
                env={k: v for k, v in os.environ.items() if not k.startswith("XRONOS_")}
                | {
                    "XRONOS_BROKER": broker.url,
                    "XRONOS_USERNAME": "controller",
                    "XRONOS_PASSWORD": USERS["controller"],
                },
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert third.returncode == 2, third.stdout + third.stderr
            last = third.stderr.strip().splitlines()[-1]
            assert last.startswith("xronos: error: another controller is live on this broker"), third.stderr
            assert f"pid {second.pid}" in last, last
            assert not (tmp_path / "state-3").exists()

            runner.join(timeout=300)
            result = done["result"]
            assert result.returncode == 0, result.stdout + result.stderr
            assert f"job {JOB} completed" in result.stdout
            assert second.poll() is None, "the restarted controller died"
        finally:
            watcher.close()
            stop_processes(procs, grace=15)

    log_b = (tmp_path / "controller-b.log").read_text()
    assert f"job {JOB} taken up from --state-dir: running" in log_b, log_b[-3000:]
    assert "lost the broker" not in log_b, "the refused controller disturbed the live one"
    assert "restarted during the job" not in log_b

    # exactly once: one `completed`, each node assigned its rank once, the worker never restarted
    completed = watcher.statuses("completed")
    assert len(completed) == 1, [m["state"] for _, _, m in watcher.seen if m]
    assert all(len(watcher.statuses(s)) == 0 for s in ("failed", "stopped"))
    for node in NODES:
        assigned = (tmp_path / f"{node}.log").read_text().count(f"job {JOB}: rank ")
        assert assigned == 1, f"{node} was given its rank {assigned} times"
    report = completed[0]["report"]
    assert len(report["losses"]) == STEPS and report["world_size"] == 3
    assert sorted(n["name"] for n in report["nodes"]) == list(NODES)
    kept = json.loads((state / "jobs" / f"{JOB}.json").read_text())
    assert kept["state"] == "completed" and kept["report"]["losses"] == report["losses"]
    assert not list((state / "running").glob("*.json")), "a finished job left its in-flight record"

    # the controller status: the killed one's will (offline), then the restarted one live
    instances = [(m["instance"], m["state"]) for m in watcher.controllers()]
    a_instance = instances[0][0]
    assert (a_instance, "offline") in instances
    assert any(i != a_instance and s == "online" for i, s in instances)

    # the model the job wrote loads, and it trained as an uninterrupted run on the same data does
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert trained.config.num_hidden_layers == 3
    reference = uninterrupted(model, data, tmp_path / "reference", steps=STEPS, batch_size=BATCH, seq_len=SEQ)
    assert report["losses"][-1] == pytest.approx(reference.losses[-1], rel=0.01)
    assert report["losses"][-1] < report["losses"][0]
