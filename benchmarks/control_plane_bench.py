"""Benchmark: the controller under load, through a real Mosquitto.

1. Heartbeat handling lag: N simulated nodes (default 1,000) are born and
   heartbeat at 1 Hz, spread evenly over each second, from a few MQTT
   connections (one per `--per-connection` nodes, as a gateway would multiplex
   them); the controller (`controller.service.Controller`, the real one)
   records for every heartbeat the time from its send stamp to the end of its
   handling. Prints p50 / p99 / max and how many arrived.
2. Plan and assign a 64-node job: 64 simulated nodes answer the controller's
   profile assignments with synthetic profiles (speeds spread 0.25..1) for a
   Llama-3-8B-shaped model; measured are the pure `plan_job` time and the wall
   time from the train command to the last node receiving its training
   assignment. Two memory regimes: 16 GiB per node (memory does not bind: the
   exact water-filling planner) and 2..8 GiB (memory binds on most nodes: HiGHS
   per participant set, capped at a few seconds, the plan then flagged as not
   proven optimal).

Not a test: numbers, to be quoted. Needs `mosquitto` on the PATH.

    python benchmarks/control_plane_bench.py --nodes 1000 --seconds 20
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import paho.mqtt.client as paho

from controller.service import Controller, ControllerOptions
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.contract.profiles import DeviceProfile, ProfileShape
from xronos.contract.splits import ModelDims
from xronos.mosquitto import Mosquitto
from xronos.planner.job_plan import plan_job

WIDE = ModelDims(
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
)
"""A Llama-3-8B-shaped model: enough KV groups and columns for many devices to matter."""


def client(port: int, name: str) -> paho.Client:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=name, protocol=paho.MQTTv311)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_start()
    return c


def heartbeat_lag(port: int, settings: BrokerSettings, nodes: int, per_connection: int, seconds: float) -> None:
    controller = Controller(ControllerOptions(heartbeat_timeout=30), settings).start()
    ids = [f"sim-{i:04d}" for i in range(nodes)]
    groups = [ids[i : i + per_connection] for i in range(0, nodes, per_connection)]
    clients = [client(port, f"sim-conn-{k}") for k in range(len(groups))]
    for c, group in zip(clients, groups):
        for node_id in group:
            c.publish(
                wire.NODE_STATUS.name(node_id),
                wire.NODE_STATUS.encode(wire.NodeStatus(node_id=node_id, state="online")),
                qos=1,
                retain=False,
            )
    while len(controller.registry.nodes) < nodes:
        time.sleep(0.05)
    controller.lags.clear()
    sent = [0] * len(groups)
    stop = threading.Event()

    def beat(k: int) -> None:
        c, group = clients[k], groups[k]
        gap = 1.0 / len(group)
        start = time.perf_counter() + k * gap / len(groups)  # connections interleave
        i = 0
        while not stop.is_set():
            target = start + i * gap
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            node_id = group[i % len(group)]
            c.publish(
                wire.HEARTBEAT.name(node_id),
                wire.HEARTBEAT.encode(wire.Heartbeat(node_id=node_id, state="idle")),
                qos=0,
            )
            sent[k] += 1
            i += 1

    threads = [threading.Thread(target=beat, args=(k,), daemon=True) for k in range(len(groups))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    time.sleep(1.0)  # let the last ones arrive
    lags = sorted(controller.lags)
    total = sum(sent)
    q = statistics.quantiles(lags, n=100)
    print(
        f"heartbeats: {nodes} nodes at 1 Hz over {len(groups)} connections for {elapsed:.1f} s: "
        f"sent {total} ({total / elapsed:.0f}/s), handled {len(lags)} ({len(lags) / total:.1%})"
    )
    print(
        f"  controller handling lag: p50 {q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms, max {lags[-1] * 1e3:.2f} ms; "
        f"invalid {sum(controller.bus.invalid.values())}"
    )
    for c in clients:
        c.loop_stop()
        c.disconnect()
    controller.close()


def synthetic_profile(node_id: str, speed: float, memory_gib: float) -> DeviceProfile:
    shape = ProfileShape(
        hidden_size=WIDE.hidden_size,
        head_dim=WIDE.head_dim,
        heads_per_group=WIDE.heads_per_group,
        micro_batch=1,
        seq_len=256,
        mlp_block=WIDE.mlp_block,
        vocab_block=WIDE.vocab_block,
        threads=1,
    )
    return DeviceProfile(
        device=node_id,
        speed_hint=speed,
        shape=shape,
        kv_group_seconds=0.040 / speed,
        mlp_block_seconds=0.006 / speed,
        vocab_block_seconds=0.012 / speed,
        layer_fixed_seconds=0.004 / speed,
        step_fixed_seconds=0.01 / speed,
        allreduce_latency_seconds=0.0005,
        allreduce_seconds_per_mib=0.002 / speed,
        memory_bytes=int(memory_gib * 2**30),
        address="127.0.0.1",
    )


def plan_and_assign(port: int, settings: BrokerSettings, nodes: int, tight_memory: bool) -> None:
    controller = Controller(ControllerOptions(heartbeat_timeout=600), settings).start()
    ids = [f"edge-{i:02d}" for i in range(nodes)]
    speeds = {n: 0.25 + 0.75 * i / max(1, nodes - 1) for i, n in enumerate(ids)}
    memory = {n: 2 + 6 * ((i * 7) % nodes) / nodes if tight_memory else 16.0 for i, n in enumerate(ids)}
    job = JobOptions(
        model="/models/wide", data="/data/d.jsonl", output="/out", mode="xronos", batch_size=1, seq_len=256
    )
    trained: dict[str, float] = {}
    done = threading.Event()
    sim = Bus(settings, "sim-64")

    job_id = f"bench-{nodes}-{'tight' if tight_memory else 'rich'}"

    def on_assignment(node_id: str, a: wire.Assignment | None) -> None:
        if a is None or a.job_id != job_id:  # a retained assignment of the previous run
            return
        if a.phase == "profile":
            sim.publish(
                wire.PROFILE,
                node_id,
                wire.ProfileMessage(
                    node_id=node_id,
                    profile=synthetic_profile(node_id, speeds[node_id], memory[node_id]),
                    job_id=a.job_id,
                    dims=WIDE,
                    rendezvous_port=29500,
                ),
            )
        else:
            trained[node_id] = time.perf_counter()
            if len(trained) == nodes:
                done.set()

    sim.subscribe(wire.ASSIGNMENT, on_assignment)
    sim.start()
    for node_id in ids:
        sim.publish(wire.NODE_STATUS, node_id, wire.NodeStatus(node_id=node_id, state="online"))
    while len(controller.registry.nodes) < nodes:
        time.sleep(0.05)
    profiles = [synthetic_profile(n, speeds[n], memory[n]) for n in ids]
    t = time.perf_counter()
    plan = plan_job(job, WIDE, profiles)
    pure = time.perf_counter() - t
    t0 = time.perf_counter()
    sim.publish(wire.TRAIN, "", wire.TrainCommand(job_id=job_id, job=job, nodes=ids))
    if not done.wait(120):
        raise SystemExit(f"only {len(trained)} of {nodes} nodes got a training assignment")
    wall = max(trained.values()) - t0
    regime = "2..8 GiB per node (memory binds)" if tight_memory else "16 GiB per node"
    print(
        f"plan and assign a {nodes}-node job (Llama-3-8B shapes, {regime}): plan_job {pure * 1e3:.1f} ms; "
        f"train command -> last training assignment {wall * 1e3:.0f} ms "
        f"(two rounds: profile assignments, profiles back, plan, training assignments)"
    )
    optimal = "" if plan.optimal else " (best found in the time cap; not proven optimal)"
    print(
        f"  plan: {plan.world_size} of {nodes} nodes take part; predicted step {plan.predicted_step_seconds:.2f} s{optimal}"
    )
    sim.stop()
    controller.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--per-connection", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--job-nodes", type=int, default=64)
    args = parser.parse_args()
    with Mosquitto() as broker:
        settings = BrokerSettings(broker=broker.url)
        heartbeat_lag(broker.port, settings, args.nodes, args.per_connection, args.seconds)
        plan_and_assign(broker.port, settings, args.job_nodes, tight_memory=False)
        plan_and_assign(broker.port, settings, args.job_nodes, tight_memory=True)


if __name__ == "__main__":
    main()
