"""The MQTT control plane, really run: Mosquitto with passwords and the deploy/ ACLs,
`xronos controller`, `xronos node` and `xronos train --wait` as separate processes,
and the node agent and controller against the embedded broker.

Bad input of every kind is thrown at the running processes; they log, count and
drop it, and the jobs go on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import torch
from live_cluster import metrics, node_process, train_by_command, uninterrupted, wait_for, xronos_process
from transformers import AutoModelForCausalLM

from controller.registry import Registry
from controller.service import Controller, ControllerOptions
from edge_node.agent import NodeAgent, NodeOptions
from edge_node.worker_process import free_port, stop_processes
from xronos.broker import EmbeddedBroker
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.mosquitto import Mosquitto
from xronos.operator import cluster_status

USERS = {"controller": "ctl-pw", "operator": "op-pw", "n0": "n0-pw", "n1": "n1-pw", "intruder": "in-pw"}
STEPS, BATCH, SEQ = 4, 4, 16


def raw_client(url_port: int, user: str) -> paho.Client:
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2, client_id=f"raw-{user}-{time.monotonic_ns()}", protocol=paho.MQTTv311
    )
    client.username_pw_set(user, USERS[user])
    client.connect("127.0.0.1", url_port)
    client.loop_start()
    return client


def xronos(*args: str, user: str, url: str, log: Path) -> subprocess.Popen:
    return xronos_process(*args, user=user, password=USERS[user], url=url, log=log)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, data_file):
    """Mosquitto (passwords + deploy/ ACLs), a controller and nodes n0, n1: all real processes."""
    root = tmp_path_factory.mktemp("cluster")
    with Mosquitto(users=USERS) as broker:
        ports = {"controller": free_port(), "n0": free_port(), "n1": free_port()}
        procs = [
            xronos(
                "controller",
                "--metrics-port",
                str(ports["controller"]),
                "--state-dir",
                str(root / "state"),
                user="controller",
                url=broker.url,
                log=root / "controller.log",
            )
        ]
        for node in ("n0", "n1"):
            procs.append(node_process(node, root, broker.url, USERS[node], metrics_port=ports[node]))
        settings = BrokerSettings(broker=broker.url, username="operator", password=USERS["operator"])
        try:

            def controller_sees_both():
                try:
                    return metrics(ports["controller"]).get("xronos_nodes_online") == 2
                except OSError:
                    return False

            wait_for(controller_sees_both, 90, "the controller to see both nodes online", poll=0.5)
            yield dict(
                root=root,
                broker=broker,
                ports=ports,
                settings=settings,
                procs=procs,
                model=model_dir("gqa_tied"),
                data=data_file,
            )
        finally:
            stop_processes(procs, grace=15)
            for p in procs:
                assert p.returncode is not None


def train(cluster, job_id: str, *extra: str, log_name: str) -> subprocess.CompletedProcess:
    root = cluster["root"]
    return train_by_command(
        cluster["broker"].url,
        USERS["operator"],
        cluster["model"],
        cluster["data"],
        root / f"out-{job_id}",
        job_id,
        *extra,
        steps=STEPS,
        seq_len=SEQ,
        batch_size=BATCH,
        log=root / log_name,
    )


def test_train_wait_runs_a_job_through_mosquitto_while_bad_input_is_dropped(cluster, tmp_path):
    port = cluster["broker"].port
    intruder, operator = raw_client(port, "intruder"), raw_client(port, "operator")
    hb = "xronos/nodes/intruder/heartbeat"
    job = JobOptions(model="m", data="d", output="o")
    bad = [
        (intruder, hb, b"{not json"),
        (intruder, hb, json.dumps({"schema_version": 2, "node_id": "intruder", "state": "idle"}).encode()),
        (intruder, hb, b" " * (wire.MAX_PAYLOAD_BYTES + 10)),
        (intruder, hb, wire.Heartbeat(node_id="intruder", state="idle").model_dump_json().encode()),  # never born
        (
            intruder,
            "xronos/nodes/n0/assignment",  # the ACL drops it: only the controller writes assignments
            wire.Assignment(job_id="evil", node_id="n0", phase="profile", job=job).model_dump_json().encode(),
        ),
        (operator, "xronos/cmd/train", b"[1, 2, 3]"),
        (operator, "xronos/cmd/stop", wire.StopCommand(job_id="nosuchjob").model_dump_json().encode()),
        (
            operator,
            "xronos/cmd/train",
            wire.TrainCommand(job_id="ghostly", job=job, nodes=["n0", "ghost"]).model_dump_json().encode(),
        ),
    ]
    for client, topic, payload in bad:
        client.publish(topic, payload, qos=1).wait_for_publish(5)

    result = train(
        cluster,
        "good-1",
        "--mode",
        "tp",
        "--nodes",
        "n0,n1",
        "--report",
        str(tmp_path / "r.json"),
        log_name="train-good.log",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed: model written to" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mode"] == "tp" and report["world_size"] == 2 and len(report["losses"]) == STEPS
    assert sorted(n["name"] for n in report["nodes"]) == ["n0", "n1"]

    # same math as one process: the report's losses and the exported weights
    out = cluster["root"] / "out-good-1"
    reference = uninterrupted(
        cluster["model"], cluster["data"], tmp_path / "single", steps=STEPS, batch_size=BATCH, seq_len=SEQ
    )
    assert report["losses"] == pytest.approx(reference.losses, rel=1e-5)
    trained = AutoModelForCausalLM.from_pretrained(out)
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "single")
    for (name, a), (_, b) in zip(trained.state_dict().items(), single.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3, msg=name)

    # the bad input was counted, the command naming a missing node failed with the reason
    ctl = metrics(cluster["ports"]["controller"])
    assert ctl['xronos_invalid_messages_total{topic="nodes/+/heartbeat"}'] >= 4
    assert ctl['xronos_invalid_messages_total{topic="cmd/train"}'] >= 2
    assert ctl['xronos_invalid_messages_total{topic="cmd/stop"}'] >= 1
    assert ctl['xronos_jobs{state="completed"}'] >= 1
    assert ctl['xronos_job_step_seconds{job_id="good-1"}'] > 0
    jobs = {j.job_id: j for j in cluster_status(cluster["settings"], 1.0).jobs}
    assert jobs["ghostly"].state == "failed" and "ghost is unknown" in jobs["ghostly"].reason
    assert jobs["good-1"].state == "completed" and "evil" not in jobs
    node = metrics(cluster["ports"]["n0"])
    assert node['xronos_tokens_total{job_id="good-1",node="n0"}'] == STEPS * BATCH * SEQ
    assert node['xronos_step_seconds_count{job_id="good-1",node="n0"}'] == STEPS
    n1 = metrics(cluster["ports"]["n1"])['xronos_shard_kv_groups{job_id="good-1",node="n1"}']
    assert node['xronos_shard_kv_groups{job_id="good-1",node="n0"}'] + n1 == 3
    intruder.loop_stop()
    operator.loop_stop()


def train_long_in_background(cluster, job_id: str) -> tuple[threading.Thread, dict]:
    """`xronos train --wait` of a job far too long to finish, in a thread; its result lands in the dict."""
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update(
            result=train(
                cluster, job_id, "--mode", "tp", "--nodes", "n0,n1", "--steps", "3000", log_name=f"train-{job_id}.log"
            )
        )
    )
    runner.start()
    return runner, done


def test_a_job_whose_worker_is_killed_goes_on_without_that_node_which_is_free_again(cluster):
    """A worker killed by a signal (the OOM killer, a user) loses its node to the job, as a device lost
    does: the job resumes on the other node (docs/faults.md); its failure is not the job's own."""
    root = cluster["root"]
    runner, done = train_long_in_background(cluster, "doomed")
    spec = root / "n1" / "jobs" / "doomed" / "spec.json"

    def n1_worker_training():
        if not (root / "n1" / "jobs" / "doomed" / "progress.jsonl").is_file():
            return None
        return next(iter(processes_mentioning(str(spec))), None)

    pid = wait_for(n1_worker_training, 120, "n1's worker to train")
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=300)
    result = done["result"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "doomed: resumed on 1 node after losing n1 at step" in result.stderr
    assert "job doomed completed" in result.stdout
    # both nodes are free again: a new job on them completes
    again = train(cluster, "after-1", "--mode", "xronos", "--steps", "2", log_name="train-after.log")
    assert again.returncode == 0, again.stdout + again.stderr


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_stop_command_stops_the_job_and_its_workers(cluster):
    root = cluster["root"]
    runner, done = train_long_in_background(cluster, "halted")
    wait_for(lambda: (root / "n0" / "jobs" / "halted" / "progress.jsonl").is_file(), 120, "the job to train")
    operator = raw_client(cluster["broker"].port, "operator")
    operator.publish(
        wire.STOP.name(), wire.StopCommand(job_id="halted").model_dump_json().encode(), qos=1
    ).wait_for_publish(5)
    runner.join(timeout=60)
    result = done["result"]
    assert result.returncode != 0 and "job halted stopped: stopped by command" in result.stderr
    wait_for(
        lambda: (
            not processes_mentioning(str(root / "n0" / "jobs" / "halted"))
            and not processes_mentioning(str(root / "n1" / "jobs" / "halted"))
        ),
        20,
        "the workers to stop",
    )
    operator.loop_stop()


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_command(program: str) -> list[str]:
    """The README's one `program ...` command line, as the shell would split it (no expansion)."""
    lines = [line for line in README.read_text().splitlines() if line.startswith(f"{program} ")]
    assert len(lines) == 1, f"the README should show one {program} command line, not {len(lines)}"
    return shlex.split(lines[0])


def test_readme_mosquitto_pub_example_trains_a_job_to_completion(cluster, tmp_path):
    """The README's plain-MQTT example, run as written with the real Mosquitto clients: its
    placeholders (HOST, the port, $PASSWORD, the nodes' /models and /data paths) filled in, and
    the job made small enough for a test."""
    for tool in ("mosquitto_pub", "mosquitto_sub"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (apt-get install --no-install-recommends mosquitto-clients)")
    fill = {"HOST": "127.0.0.1", "1883": str(cluster["broker"].port), "$PASSWORD": USERS["operator"]}
    pub = [fill.get(word, word) for word in readme_command("mosquitto_pub")]
    sub = [fill.get(word, word) for word in readme_command("mosquitto_sub")]
    assert pub[pub.index("-t") + 1] == "xronos/cmd/train" and pub[pub.index("-u") + 1] == "operator"

    at = pub.index("-m") + 1
    wire.TRAIN.decode(pub[at].encode())  # as written, before the test's own paths and sizes
    command = json.loads(pub[at])
    job = command["job"]
    assert (
        job["model"].startswith("/models/")
        and job["data"].startswith("/data/")
        and job["output"].startswith("/models/")
    )
    job.update(
        model=str(cluster["model"]),
        data=str(cluster["data"]),
        output=str(tmp_path / "out"),
        steps=3,
        batch_size=BATCH,
        seq_len=SEQ,
    )
    pub[at] = json.dumps(command)
    published = subprocess.run(pub, capture_output=True, text=True, timeout=30)
    assert published.returncode == 0, published.stderr

    topic = sub[sub.index("-t") + 1]
    assert topic == f"xronos/jobs/{command['job_id']}/status"
    follow = subprocess.Popen([*sub, "-W", "120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    status: dict = {}
    try:
        for line in follow.stdout:  # -v: "topic payload"; the status is retained, then each change
            name, _, payload = line.rstrip("\n").partition(" ")
            if name == topic:
                status = json.loads(payload)
                if status["state"] in ("completed", "failed", "stopped"):
                    break
    finally:
        follow.terminate()
        follow.wait(timeout=10)
    assert status.get("state") == "completed", status.get("reason") or status
    assert len(status["report"]["losses"]) == 3
    assert status["output"].endswith(f":{tmp_path / 'out'}")
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.fixture
def open_broker():
    port = free_port()
    broker = EmbeddedBroker("127.0.0.1", port).start()
    yield broker, BrokerSettings(broker=f"mqtt://127.0.0.1:{port}")
    broker.stop()


def test_embedded_broker_does_not_warn_about_a_reachability_probe(open_broker, caplog):
    """Every command-line client first opens and closes a bare TCP connection (`Bus.start`)."""
    broker, settings = open_broker
    caplog.set_level(logging.INFO, logger="amqtt")
    socket.create_connection(("127.0.0.1", broker.port), timeout=5).close()
    Bus(settings, "probe-test").start(wait=5).stop()
    wait_for(lambda: sum("Connection from" in r.getMessage() for r in caplog.records) >= 3, 5, "three connections")
    time.sleep(0.5)  # the broker's loop has handled the probes' end too
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


def test_controller_and_node_drop_forgeries_and_reconnect_on_an_open_broker(open_broker, tmp_path):
    """Without ACLs (the embedded broker) the controller undoes assignments it did not write;
    garbage to a node is counted and dropped; both come back after the broker restarts."""
    broker, settings = open_broker
    controller = Controller(ControllerOptions(heartbeat_timeout=30), settings).start()
    agent = NodeAgent(
        NodeOptions(node_id="gw-1", workdir=tmp_path / "gw-1", heartbeat_seconds=0.3, startup_profile=False), settings
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    forger = Bus(settings, "forger").start()
    try:
        wait_for(lambda: controller.registry.alive("gw-1"), 10, "the node's birth")
        job = JobOptions(model="m", data="d", output="o")
        forger.client.publish("xronos/nodes/gw-1/assignment", b"\xff\xfe garbage", qos=1)
        wait_for(lambda: agent.bus.invalid["nodes/+/assignment"] >= 1, 10, "the node to drop garbage")
        wait_for(lambda: controller.bus.invalid["nodes/+/assignment"] >= 1, 10, "the controller to drop garbage")
        forger.publish(
            wire.ASSIGNMENT, "gw-1", wire.Assignment(job_id="forged", node_id="gw-1", phase="profile", job=job)
        )
        wait_for(lambda: controller.bus.invalid["nodes/+/assignment"] >= 2, 10, "the controller to see the forgery")
        # the controller cleared it: nothing retained remains for the node
        seen = []
        probe = Bus(settings, "probe")
        probe.subscribe(wire.ASSIGNMENT, lambda i, m: seen.append(m), ident="gw-1")
        probe.start()
        time.sleep(1.0)
        probe.stop()
        assert all(m is None for m in seen)
        # a command naming a node that does not exist fails the job; the controller goes on
        forger.publish(wire.TRAIN, "", wire.TrainCommand(job_id="j-missing", job=job, nodes=["gw-9"]))
        wait_for(lambda: "j-missing" in controller.rejected, 10, "the rejected job")
        assert "gw-9 is unknown" in controller.rejected["j-missing"].reason

        # the broker goes away and comes back on the same port: both reconnect by themselves
        broker.stop()
        wait_for(lambda: not agent.bus.connected.is_set(), 10, "the node to notice")
        with controller.lock:  # forget the node: only a new birth can bring it back
            controller.registry.nodes.clear()
        restarted = EmbeddedBroker("127.0.0.1", broker.port).start()
        try:
            wait_for(lambda: agent.bus.connected.is_set() and controller.bus.connected.is_set(), 30, "reconnects")
            wait_for(lambda: controller.registry.alive("gw-1"), 15, "a new birth after reconnecting")
        finally:
            agent.stop()
            thread.join(timeout=10)
            restarted.stop()
    finally:
        agent.stop()
        forger.stop()
        controller.close()


def test_registry_declares_silent_nodes_lost():
    reg = Registry(timeout=5)
    reg.online("a", now=0.0)
    reg.online("b", now=0.0)
    reg.nodes["b"].last_seen = 4.0
    assert [n.node_id for n in reg.expire(now=6.0)] == ["a"]
    assert reg.alive("a") is None and reg.alive("b") is not None
    assert "no heartbeat" in reg.nodes["a"].lost_reason
    assert reg.available(busy={"b"}) == []
    assert reg.available(busy=set()) == ["b"]


def test_demo_runs_the_whole_system_and_leaves_no_process(tmp_path):
    work = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "xronos.cli", "demo", "--workdir", str(work), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "publishing xronos/cmd/train" in result.stdout
    assert "xronos step time is" in result.stdout
    assert "mode tp: 3 worker(s)" in result.stdout
    assert re.search(r"Prometheus metrics at controller http://127\.0\.0\.1:\d+/metrics, node-0 http://", result.stdout)
    left = processes_mentioning(str(work))
    assert not left, f"processes left behind: {left}"


def test_broker_command_requires_its_password_and_status_reads_through_it():
    port = free_port()
    env = {**os.environ, "XRONOS_USERNAME": "ops", "XRONOS_PASSWORD": "s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "xronos.cli", "broker", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert "password required" in proc.stdout.readline()
        url = f"mqtt://127.0.0.1:{port}"
        with pytest.raises(Exception, match="Not authorized"):
            Bus(BrokerSettings(broker=url, username="ops", password="wrong"), "bad").start(wait=5)
        status = subprocess.run(
            [sys.executable, "-m", "xronos.cli", "status", "--json", "--listen", "0.5", "--broker", url],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout) == {"nodes": [], "jobs": []}
        missing = subprocess.run(
            [sys.executable, "-m", "xronos.cli", "status", "--broker", "mqtt://127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert missing.returncode == 2 and missing.stderr.startswith("xronos: error: cannot connect to the broker")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
