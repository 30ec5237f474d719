"""Hostile messages against a live controller and node on an open Mosquitto (no ACLs: anyone writes anything).

1. A forged clear of a training node's retained assignment, and a forged assignment of
   another job, are counted by the controller and reverted (its own assignment is
   retained again), and the node's worker trains on: the agent gives a message that
   would end its job END_GRACE seconds for the controller to undo it.
2. A property-based fuzz (hypothesis) over every topic of the contract: valid, broken,
   garbage, empty and oversized payloads, retained or not. Neither process dies, every
   message that breaks the contract is counted by each process subscribed to its topic
   (and every assignment the controller did not write, by the controller), and the node
   trains a job afterwards. `benchmarks/fuzz_bench.py` runs the same with 10,000.
"""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as paho
import pytest
from hypothesis import HealthCheck, given, settings
from live_cluster import train_by_command, wait_for
from wire_fuzz import NODE, Expected, FuzzCluster, hostile_messages, invalid, metrics

from edge_node.agent import END_GRACE
from tests.conftest import SEQ_LEN
from xronos.contract import wire
from xronos.contract.job import JobOptions

FUZZ_MESSAGES = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with FuzzCluster(tmp_path_factory.mktemp("hostile")) as running:
        yield running


def retained_assignment(cluster) -> list:
    """What a new subscriber gets on the node's assignment topic (the retained message, decoded)."""
    seen = []
    probe = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"probe-{time.monotonic_ns()}")
    probe.on_message = lambda c, u, m: seen.append(wire.ASSIGNMENT.decode(m.payload) if m.payload else None)
    probe.connect("127.0.0.1", cluster.broker.port)
    probe.subscribe(wire.ASSIGNMENT.name(NODE), qos=1)
    probe.loop_start()
    time.sleep(1.0)
    probe.loop_stop()
    probe.disconnect()
    return seen


def holds_the_jobs_assignment(cluster, job_id: str) -> bool:
    """Whether a new subscriber ends up with the job's own assignment on the node's topic: the last message of its
    window (the retained one, or the controller's restore when it came during the window)."""
    seen = retained_assignment(cluster)
    return bool(seen) and seen[-1] is not None and (seen[-1].job_id, seen[-1].phase) == (job_id, "train")


def progress_lines(cluster, job_id: str) -> int:
    path = cluster.root / NODE / "jobs" / job_id / "progress.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_forged_and_cleared_assignments_are_counted_reverted_and_the_worker_trains_on(cluster, model_dir, data_file):
    done: dict = {}
    job_id = "long-1"
    runner = threading.Thread(
        target=lambda: done.update(
            result=train_by_command(
                cluster.broker.url,
                "-",
                model_dir("gqa_tied"),
                data_file,
                cluster.root / "out-long",
                job_id,
                "--nodes",
                NODE,
                "--mode",
                "single",
                steps=100_000,
                seq_len=SEQ_LEN,
                batch_size=4,
                log=cluster.root / "train-long.log",
            )
        )
    )
    runner.start()
    try:
        wait_for(lambda: progress_lines(cluster, job_id) >= 1, 120, "the job to train")
        port = cluster.ports["controller"]
        before = invalid(metrics(port), wire.ASSIGNMENT.family)

        cluster.publish(wire.ASSIGNMENT.name(NODE), b"", retain=True)  # an empty retained payload: a clear
        wait_for(lambda: invalid(metrics(port), wire.ASSIGNMENT.family) >= before + 1, 10, "the clear counted")
        wait_for(lambda: holds_the_jobs_assignment(cluster, job_id), 15, "the job's assignment restored")

        forged = wire.Assignment(
            job_id="forged-1", node_id=NODE, phase="profile", job=JobOptions(model="/m", data="/d", output="/o")
        )
        cluster.publish(wire.ASSIGNMENT.name(NODE), wire.ASSIGNMENT.encode(forged), retain=True)
        wait_for(lambda: invalid(metrics(port), wire.ASSIGNMENT.family) >= before + 2, 10, "the forgery counted")
        wait_for(lambda: holds_the_jobs_assignment(cluster, job_id), 15, "the job's assignment restored")

        lines = progress_lines(cluster, job_id)
        time.sleep(END_GRACE + 2)  # past the grace: a message that stopped the job would have done so
        assert progress_lines(cluster, job_id) > lines, "the worker stopped training"
        assert metrics(cluster.ports[NODE]).get(f'xronos_training{{node="{NODE}"}}') == 1
        assert cluster.alive()
        log = (cluster.root / f"{NODE}.log").read_text()
        assert log.count("came again: ignoring the message that would have ended it") >= 2, log[-3000:]
    finally:
        cluster.publish(wire.STOP.name(), wire.STOP.encode(wire.StopCommand(job_id=job_id)), retain=False)
        runner.join(timeout=60)
    assert "job long-1 stopped: stopped by command" in done["result"].stderr


def test_fuzzed_messages_on_every_topic_are_counted_and_the_node_still_trains(cluster, model_dir, data_file):
    expected = Expected()
    port_c, port_n = cluster.ports["controller"], cluster.ports[NODE]
    wait_for(cluster.idle, 60, "the cluster to be idle")
    start_c, start_n = metrics(port_c), metrics(port_n)

    @settings(max_examples=FUZZ_MESSAGES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message=hostile_messages())
    def publish(message):
        name, payload, retain = message
        expected.add(name, payload)
        cluster.publish(name, payload, retain)

    publish()
    end_c, end_n = cluster.settle(expected)
    assert cluster.alive(), "a process died"
    for family, count in expected.controller.items():
        counted = invalid(end_c, family) - invalid(start_c, family)
        assert counted >= count, f"the controller counted {counted} of {count} invalid messages on {family}"
    counted = invalid(end_n, wire.ASSIGNMENT.family, NODE) - invalid(start_n, wire.ASSIGNMENT.family, NODE)
    assert counted >= expected.node > 0, (counted, expected.node)
    assert sum(expected.sent.values()) >= FUZZ_MESSAGES

    wait_for(cluster.idle, 60, "the fuzzed jobs to end")
    result = train_by_command(
        cluster.broker.url,
        "-",
        model_dir("gqa_tied"),
        data_file,
        cluster.root / "out-after",
        "after-fuzz",
        "--nodes",
        NODE,
        steps=3,
        seq_len=SEQ_LEN,
        batch_size=4,
        log=cluster.root / "train-after.log",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert cluster.alive()
    for name in ("controller", NODE):  # every handler survived by itself, not only by the boundary's net
        log = (cluster.root / f"{name}.log").read_text()
        assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]
