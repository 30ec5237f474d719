"""Faults a job survives (issue 30), really run: Mosquitto with passwords, the deploy/ ACLs, the shipped
queue settings and a database on disk; `xronos controller`, three `xronos node`s and `xronos train --wait`
as separate processes. Nodes lost mid-job (item 1), broker restarts and outages (item 3), commands sent
while the controller is down (item 4).

Each fault test runs a 3-node job of a tiny model through the fault and asserts that it completed, that
the exported model loads with transformers, and that its final loss is an uninterrupted run's (one
process, the same data and options) within 1%. Each prints a `FAULT` line: the numbers of the fault
table in docs/faults.md.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from live_cluster import (
    controller_sees,
    kill_tree,
    metrics,
    node_process,
    train_by_command,
    uninterrupted,
    wait_for,
    xronos_process,
)
from transformers import AutoModelForCausalLM

from edge_node.worker_process import free_port, stop_processes
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.mosquitto import Mosquitto

USERS = {"controller": "ctl-pw", "operator": "op-pw", "n0": "n0-pw", "n1": "n1-pw", "n2": "n2-pw"}
NODES = ("n0", "n1", "n2")
BATCH, SEQ = 4, 16
SPEED = "0.3"
"""Each node's CPU quota: slow enough that a job outlasts a 30 s outage in a couple of hundred steps."""


def start_controller(root: Path, broker: Mosquitto, port: int, log: str = "controller.log") -> subprocess.Popen:
    return xronos_process(
        "controller",
        "--metrics-port",
        str(port),
        "--state-dir",
        str(root / "state"),
        user="controller",
        password=USERS["controller"],
        url=broker.url,
        log=root / log,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, data_file):
    root = tmp_path_factory.mktemp("resilience")
    with Mosquitto(users=USERS, persistence=True) as broker:
        ports = {name: free_port() for name in ("controller", *NODES)}
        procs = {"controller": start_controller(root, broker, ports["controller"])}
        for node in NODES:
            procs[node] = node_process(node, root, broker.url, USERS[node], "--speed", SPEED, metrics_port=ports[node])
        try:
            wait_for(lambda: controller_sees(ports["controller"], 3), 120, "the controller to see 3 nodes", poll=0.5)
            yield dict(root=root, broker=broker, ports=ports, procs=procs, model=model_dir("gqa_tied"), data=data_file)
        finally:
            stop_processes(list(procs.values()), grace=15)


REFERENCE: dict[tuple[str, int], list[float]] = {}


def reference_losses(cluster, steps: int, tmp: Path) -> list[float]:
    """The uninterrupted run: one process, the same model, data and options."""
    key = (str(cluster["model"]), steps)
    if key not in REFERENCE:
        REFERENCE[key] = uninterrupted(
            cluster["model"], cluster["data"], tmp / f"single-{steps}", steps=steps, batch_size=BATCH, seq_len=SEQ
        ).losses
    return REFERENCE[key]


def train_in_background(
    cluster, job_id: str, steps: int, mode: str = "tp", *extra: str
) -> tuple[threading.Thread, dict]:
    """`xronos train --wait` of a 3-node job (TP unless `mode`) in a thread; its result and report land in
    the dict."""
    root, done = cluster["root"], {}

    def run():
        done["result"] = train_by_command(
            cluster["broker"].url,
            USERS["operator"],
            cluster["model"],
            cluster["data"],
            root / f"out-{job_id}",
            job_id,
            "--mode",
            mode,
            *extra,
            "--nodes",
            ",".join(NODES),
            "--report",
            str(root / f"report-{job_id}.json"),
            steps=steps,
            seq_len=SEQ,
            batch_size=BATCH,
            log=root / f"train-{job_id}.log",
        )

    runner = threading.Thread(target=run)
    runner.start()
    return runner, done


def steps_done(cluster, job_id: str, node: str = "n0") -> int:
    progress = cluster["root"] / node / "jobs" / job_id / "progress.jsonl"
    try:
        return len(progress.read_text().splitlines())
    except OSError:
        return 0


def assert_completed_like_uninterrupted(
    cluster, job_id: str, steps: int, done: dict, tmp: Path, world_size: int = 3
) -> dict:
    result = done["result"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed: model written to" in result.stdout
    report = json.loads((cluster["root"] / f"report-{job_id}.json").read_text())
    assert report["world_size"] == world_size and len(report["losses"]) == steps
    reference = reference_losses(cluster, steps, tmp)
    assert report["losses"][-1] == pytest.approx(reference[-1], rel=0.01)
    model = AutoModelForCausalLM.from_pretrained(cluster["root"] / f"out-{job_id}")
    assert model.config.num_hidden_layers == 2
    return report


def broker_fault(cluster, job_id: str, steps: int, sig: int, outage: float, tmp: Path) -> None:
    """A job through the broker's stop by `sig`, `outage` seconds down, and its start (same port, same
    database): training goes on meanwhile, every process reconnects, the job completes."""
    broker, root = cluster["broker"], cluster["root"]
    runner, done = train_in_background(cluster, job_id, steps)
    wait_for(lambda: steps_done(cluster, job_id) >= 3, 120, "the job to train")
    broker.stop(sig)
    step_at_down = steps_done(cluster, job_id)
    time.sleep(outage)
    trained_while_down = (steps_done(cluster, job_id) or steps) - step_at_down  # no file: the nodes finished
    broker.start()
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert_completed_like_uninterrupted(cluster, job_id, steps, done, tmp)
    # the collectives went on without the broker
    assert trained_while_down > 0, "no step while the broker was down"
    # nobody was declared lost; every process is still running and the controller sees all nodes again
    ctl_log = (root / "controller.log").read_text()
    assert f"job {job_id} failed" not in ctl_log
    assert all(p.poll() is None for p in cluster["procs"].values())
    wait_for(lambda: controller_sees(cluster["ports"]["controller"], 3), 30, "3 nodes online again", poll=0.5)
    print(
        f"FAULT broker {signal.Signals(sig).name} {outage:g} s: completed; 0 steps lost; "
        f"{trained_while_down} steps trained while it was down; training never stopped"
    )


def test_job_survives_a_graceful_broker_restart(cluster, tmp_path):
    """SIGTERM: Mosquitto publishes every node's last will as it stops and saves them; the controller
    takes none of them for a lost device (the births after the reconnect cancel them)."""
    broker_fault(cluster, "sigterm-1", 40, signal.SIGTERM, 3.0, tmp_path)
    # the wills were published (retained `offline`), then the births replaced them
    statuses = retained(cluster, "xronos/nodes/+/status")
    assert {json.loads(p)["state"] for p in statuses.values()} == {"online"}, statuses


def test_job_survives_a_30_s_broker_crash(cluster, tmp_path):
    """SIGKILL and 30 s down: no will, no clean save; the controller expires nobody while it is itself
    cut off, and the result published while the broker is down arrives after it."""
    broker_fault(cluster, "sigkill-1", 500, signal.SIGKILL, 30.0, tmp_path)


def retained(cluster, pattern: str, listen: float = 1.0) -> dict[str, bytes]:
    got: dict[str, bytes] = {}
    client = operator_client(
        cluster["broker"].port, lambda c, u, m: got.__setitem__(m.topic, m.payload) if m.retain else None
    )
    client.subscribe(pattern, qos=1)
    time.sleep(listen)
    client.loop_stop()
    client.disconnect()
    return got


def test_a_train_command_sent_while_the_controller_is_down_runs_once_when_it_starts(cluster, tmp_path):
    """The controller's persistent session: the broker keeps the command for it. The same command sent
    twice (a duplicate) is answered, not run twice."""
    root, ports = cluster["root"], cluster["ports"]
    ctl = cluster["procs"]["controller"]
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0
    steps = 6
    commands: list[bytes] = []
    watcher = operator_client(cluster["broker"].port, lambda c, u, m: commands.append(m.payload))
    watcher.subscribe(wire.TRAIN.name(), qos=1)
    time.sleep(0.5)
    runner, done = train_in_background(cluster, "while-down", steps)
    wait_for(lambda: commands, 60, "`xronos train` to publish its command")
    # a duplicate of the same job id, as a redelivery or a second operator would send it
    job = JobOptions(
        model=str(cluster["model"]), data=str(cluster["data"]), output=str(root / "out-dup"), steps=2, mode="tp"
    )
    dup = wire.TrainCommand(job_id="while-down", job=job, nodes=list(NODES)).model_dump_json().encode()
    watcher.publish(wire.TRAIN.name(), dup, qos=1).wait_for_publish(5)
    watcher.loop_stop()
    watcher.disconnect()
    time.sleep(1)
    assert runner.is_alive() and not steps_done(cluster, "while-down")
    cluster["procs"]["controller"] = start_controller(root, cluster["broker"], ports["controller"], "controller-2.log")
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert_completed_like_uninterrupted(cluster, "while-down", steps, done, tmp_path)
    log = (root / "controller-2.log").read_text()
    assert log.count("job while-down: tp on") == 1, log[-3000:]  # planned once: the duplicate did not run
    assert not (root / "out-dup").exists()
    ctl_metrics = metrics(ports["controller"])
    assert ctl_metrics['xronos_invalid_messages_total{topic="cmd/train"}'] >= 1  # the duplicate, counted
    assert ctl_metrics['xronos_jobs{state="completed"}'] >= 1


def operator_client(port: int, on_message) -> paho.Client:
    """A raw MQTT client of the operator's, connected."""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"xronos-test-{time.monotonic_ns()}")
    client.username_pw_set("operator", USERS["operator"])
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def test_registry_gives_a_will_and_a_reconnect_a_grace_period():
    from controller.registry import Registry

    reg = Registry(timeout=10)
    reg.online("a", now=0.0)
    reg.online("b", now=0.0)
    reg.online("c", now=0.0)
    # a will (a broker shutting down publishes everyone's): not lost at once, not offered to new jobs
    assert reg.said_offline("a", now=1.0) is not None and reg.said_offline("b", now=1.0) is not None
    assert reg.alive("a") is not None and reg.available(busy=set()) == ["c"]
    assert reg.expire(now=5.0) == []
    # a heartbeat (or a birth) within the grace cancels it
    reg.heard("a", now=6.0)
    reg.online("c", now=6.0)
    assert reg.available(busy=set()) == ["a", "c"]
    lost = reg.expire(now=11.5)
    assert [n.node_id for n in lost] == ["b"] and reg.nodes["b"].lost_reason == "went offline"
    # the controller was cut off from 6 s to 30 s: on its reconnect everyone gets a full timeout again
    reg.refresh(now=30.0)
    assert reg.expire(now=39.0) == []
    assert sorted(n.node_id for n in reg.expire(now=40.5)) == ["a", "c"]
    assert "no heartbeat" in (reg.nodes["a"].lost_reason or "")
    # a heartbeat from a node declared lost brings it back
    assert reg.heard("b", now=41.0) is not None and reg.alive("b") is not None


# -- nodes lost mid-job (item 1) ------------------------------------------------------------------
CHECKPOINT_EVERY = 5


def watch_job(cluster, job_id: str) -> tuple[paho.Client, list[dict]]:
    """The job's statuses as the controller publishes them, in a list that fills as they come."""
    statuses: list[dict] = []
    client = operator_client(
        cluster["broker"].port, lambda c, u, m: statuses.append(json.loads(m.payload)) if m.payload else None
    )
    client.subscribe(f"xronos/jobs/{job_id}/status", qos=1)
    return client, statuses


def running_on(statuses: list[dict]) -> list[str] | None:
    """The nodes of the job's first `running` status, in rank order (None: not running yet)."""
    return next((s["nodes"] for s in statuses if s["state"] == "running"), None)


def first_step(cluster, job_id: str, node: str) -> int | None:
    """The first step in the node's progress file for the job (a resumed attempt starts past 1)."""
    try:
        first = (cluster["root"] / node / "jobs" / job_id / "progress.jsonl").read_text().splitlines()[0]
        return json.loads(first)["step"]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def restart_node(cluster, node: str) -> None:
    """The node's device comes back: its agent starts again (same work directory) and is seen online."""
    cluster["procs"][node] = node_process(
        node, cluster["root"], cluster["broker"].url, USERS[node], "--speed", SPEED, metrics_port=cluster["ports"][node]
    )
    wait_for(lambda: controller_sees(cluster["ports"]["controller"], 3), 120, f"{node} back online", poll=0.5)


def node_loss(cluster, job_id: str, mode: str, rank: int, steps: int, tmp: Path) -> None:
    """SIGKILL the node (agent and worker, as a device unplugged) that holds `rank` (-1: the last) at a random
    step past the first checkpoint: the job goes on on the other ranks from the newest checkpoint they hold,
    loses at most one checkpoint interval, and ends as an uninterrupted run would. The node then comes back."""
    watcher, statuses = watch_job(cluster, job_id)
    layouts = ("--layouts", "tp") if mode == "xronos" else ()  # a small model's job may rightly stay on one device
    runner, done = train_in_background(
        cluster, job_id, steps, mode, *layouts, "--checkpoint-every", str(CHECKPOINT_EVERY)
    )
    ranks = wait_for(lambda: running_on(statuses), 180, "the job to be planned")
    watcher.loop_stop()
    watcher.disconnect()
    world = len(ranks)
    assert world >= 2, f"the plan put the job on {ranks} alone: no node to lose it to"  # before any kill
    victim = ranks[rank % world]
    at = random.Random(job_id).randint(CHECKPOINT_EVERY + 1, steps // 2)
    wait_for(lambda: steps_done(cluster, job_id, victim) >= at, 180, f"step {at}")
    kill_tree(cluster["procs"][victim].pid)
    killed_at = time.monotonic()
    survivor = next(n for n in ranks if n != victim)
    resumed = wait_for(lambda: (first_step(cluster, job_id, survivor) or 1) > 1, 180, "training again")
    again = time.monotonic() - killed_at
    runner.join(timeout=300)
    assert not runner.is_alive()
    try:
        assert_completed_like_uninterrupted(cluster, job_id, steps, done, tmp, world_size=world - 1)
        out = done["result"].stdout
        said = re.search(
            r"resumed on (\d+) nodes? after losing (\S+) at step (\d+); (\d+) steps? lost "
            r"\(from the checkpoint of step (\d+)\)",
            out,
        )
        assert said is not None, out
        assert int(said[1]) == world - 1 and said[2] == victim
        lost, checkpoint = int(said[4]), int(said[5])
        assert checkpoint % CHECKPOINT_EVERY == 0 and checkpoint >= CHECKPOINT_EVERY and resumed
        assert lost <= CHECKPOINT_EVERY, out  # at most one checkpoint interval of work
        written = re.search(r"model written to \S+ on node (\S+)", out)
        assert written is not None and written[1] != victim  # by the new rank 0
        assert f"job {job_id} failed" not in (cluster["root"] / "controller.log").read_text()
        print(
            f"FAULT {mode} job, node of rank {rank % world} of {world} SIGKILLed at step {at}: completed on "
            f"{world - 1}; {lost} steps lost; "
            f"resumed from the checkpoint of step {checkpoint}; training again {again:.1f} s after the fault"
        )
    finally:
        restart_node(cluster, victim)


def test_a_job_goes_on_on_the_survivors_when_a_node_of_a_non_zero_rank_dies(cluster, model_dir, tmp_path):
    """Mode xronos: the survivors are planned again from their profiles (the plan may leave a node out). A model
    wide enough that its TP plan spreads (the cluster's tiny one predicts steps only ~7% shorter on three devices
    than on one, and its profiles under load can rightly keep it on one: then no node is left to lose it to)."""
    node_loss({**cluster, "model": model_dir("gqa_wide")}, "lose-last-rank", "xronos", -1, 40, tmp_path)


def test_a_job_goes_on_on_the_survivors_when_rank_0_s_node_dies(cluster, tmp_path):
    """Rank 0 wrote the checkpoints, but every rank keeps the whole of each: the survivors resume from their
    own copies, and the new rank 0 writes the model."""
    node_loss(cluster, "lose-rank-0", "tp", 0, 40, tmp_path)
