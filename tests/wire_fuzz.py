"""Generated hostile MQTT traffic for a live controller and node, and what each must count.

Shared by `tests/test_hostile.py` (a few hundred messages) and
`benchmarks/fuzz_bench.py` (ten thousand). On an open broker (no ACLs: the worst
case, where anyone may write any topic) a fuzzer publishes, on every topic family
of the wire contract, valid messages, valid messages with one thing wrong (the
version, an unknown field, a missing field, another id than the topic's),
garbage bytes, empty payloads and oversized ones, retained or not.

`expected_counts` is the oracle: the contract (`wire.Topic.decode`, the id rules)
says which messages break it, and every process subscribed to a topic must count
those in `xronos_invalid_messages_total`. The controller must also count every
message on an assignment topic, whatever it holds: only the controller writes
assignments, so each one it receives and did not write is a forgery.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as paho
from hypothesis import strategies as st
from live_cluster import metrics, node_process, wait_for, xronos_process

from edge_node.worker_process import free_port, stop_processes
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.mosquitto import Mosquitto

NODE = "n0"
IDS = st.sampled_from([NODE, "n1", "ghost-1", "job-a", "kitchen_2"]) | st.from_regex(
    r"[A-Za-z0-9_-]{1,64}", fullmatch=True
)
BAD_IDS = st.sampled_from(["bad.id", "sp ace", "ünï", "a" * 65, "x:y"])
texts = st.text(max_size=30)
floats = st.floats(allow_nan=False, allow_infinity=False, width=32)

PROFILE = {
    "node_id": NODE,
    "profile": {
        "device": NODE,
        "shape": {
            "hidden_size": 64,
            "head_dim": 8,
            "heads_per_group": 1,
            "micro_batch": 4,
            "seq_len": 16,
            "mlp_block": 64,
            "vocab_block": 64,
            "threads": 1,
        },
        "kv_group_seconds": 0.001,
        "mlp_block_seconds": 0.001,
        "vocab_block_seconds": 0.001,
        "layer_fixed_seconds": 0.001,
        "step_fixed_seconds": 0.001,
        "allreduce_latency_seconds": 0.0001,
        "allreduce_seconds_per_mib": 0.001,
        "memory_bytes": 1 << 30,
        "address": "127.0.0.1",
    },
}
"""A valid profile message (the fuzzer sets its ids and port)."""

jobs = st.builds(
    JobOptions,
    model=st.text(min_size=1, max_size=20),
    data=st.text(min_size=1, max_size=20),
    output=st.text(min_size=1, max_size=20),
    steps=st.integers(1, 10**6),
    batch_size=st.sampled_from([1, 2, 4, 8]),
    seq_len=st.integers(2, 4096),
)


def _message(topic: wire.Topic, ident: str):
    """A strategy of valid messages for `topic` naming `ident` (the topic's own id)."""
    own = {"node_id": st.just(ident)} if "nodes/" in topic.pattern else {}
    own = {"job_id": st.just(ident)} if "jobs/" in topic.pattern else own
    model = topic.model
    if model is wire.NodeStatus:
        return st.builds(model, state=st.sampled_from(["online", "offline"]), **own)
    if model is wire.Heartbeat:
        return st.builds(
            model,
            state=st.sampled_from(["idle", "profiling", "training"]),
            job_id=st.none() | IDS,
            step=st.none() | st.integers(-(2**70), 2**70),
            loss=st.none() | floats,
            step_seconds=st.none() | st.floats(0, 1e6),
            **own,
        )
    if model is wire.Assignment:
        return st.builds(model, job_id=IDS, phase=st.just("profile"), job=jobs, **own) | st.builds(
            model, job_id=IDS, phase=st.just("train"), job=jobs, rank=st.none(), **own
        )
    if model is wire.NodeResult:
        return st.builds(model, job_id=IDS, ok=st.booleans(), error=st.none() | texts, **own)
    if model is wire.JobStatus:
        return st.builds(
            model,
            state=st.sampled_from(["planning", "running", "completed", "failed", "stopped"]),
            step=st.none() | st.integers(0, 10**6),
            reason=st.none() | texts,
            ts=st.floats(0, 2e9),
            **own,
        )
    if model is wire.TrainCommand:
        return st.builds(model, job_id=IDS, job=jobs, nodes=st.none() | st.lists(IDS, max_size=4))
    if model is wire.StopCommand:
        return st.builds(model, job_id=IDS)
    if model is wire.ControllerStatus:
        return st.builds(
            model,
            state=st.sampled_from(["online", "offline"]),
            instance=IDS,
            started=st.floats(0, 2e9),
            host=st.none() | texts,
            pid=st.none() | st.integers(1, 2**22),
        )
    if model is wire.ProfileMessage:
        return st.builds(
            lambda job_id, port, **kw: model.model_validate(
                {**PROFILE, **kw, "job_id": job_id, "rendezvous_port": port}
            ),
            job_id=st.none() | IDS,
            port=st.none() | st.integers(1, 65535),
            **own,
        )
    raise AssertionError(f"no strategy for {model.__name__}")


def _broken(raw: dict):
    """One thing wrong with a valid message's JSON."""
    keys = sorted(raw)
    return st.one_of(
        st.just({**raw, "schema_version": 2}),
        st.just({**raw, "surprise": 1}),
        st.sampled_from(keys).map(lambda k: {key: v for key, v in raw.items() if key != k}),
        st.sampled_from(keys).flatmap(lambda k: (st.integers() | texts | st.none()).map(lambda v: {**raw, k: v})),
    )


@st.composite
def hostile_messages(draw) -> tuple[str, bytes, bool]:
    """(topic, payload, retain) on any topic of the contract."""
    topic = draw(st.sampled_from(wire.TOPICS))
    ident = draw(st.one_of(st.just(NODE), IDS, BAD_IDS)) if "{}" in topic.pattern else ""
    name = topic.name(ident)
    kind = draw(st.sampled_from(["valid", "other-id", "broken", "garbage", "text", "empty", "huge"]))
    payload = b""
    if kind in ("valid", "other-id", "broken"):
        base = draw(_message(topic, draw(IDS) if kind == "other-id" else ident if wire.valid_id(ident) else NODE))
        payload = topic.encode(base)
        if kind == "broken":
            payload = json.dumps(draw(_broken(json.loads(payload)))).encode()
    elif kind == "garbage":
        payload = draw(st.binary(min_size=1, max_size=200))
    elif kind == "text":
        payload = draw(st.text(min_size=1, max_size=200)).encode()
    elif kind == "huge":
        payload = b'{"schema_version": 1, "pad": "' + b"x" * wire.MAX_PAYLOAD_BYTES + b'"}'
    return name, payload, draw(st.booleans())


def breaks_contract(name: str, payload: bytes) -> str | None:
    """The family of `name` if (topic, payload) breaks the wire contract, as every subscriber must judge it."""
    for topic in wire.TOPICS:
        found = topic.ident(name)
        if found is None:
            continue
        if not payload:
            return None  # a cleared retained message: not malformed (what it means is the handler's call)
        try:
            message = topic.decode(payload)
            if found and not wire.valid_id(found):
                return topic.family
            own = getattr(message, "node_id" if "nodes/" in topic.pattern else "job_id", None)
            if "{}" in topic.pattern and own != found:
                return topic.family
        except wire.WireError:
            return topic.family
        return None
    return None


@dataclass
class Expected:
    controller: collections.Counter = field(default_factory=collections.Counter)
    node: int = 0
    sent: collections.Counter = field(default_factory=collections.Counter)

    def add(self, name: str, payload: bytes) -> None:
        family = next(t.family for t in wire.TOPICS if t.ident(name) is not None)
        self.sent[family] += 1
        broken = breaks_contract(name, payload)
        if family == wire.ASSIGNMENT.family:
            self.controller[family] += 1  # only the controller writes assignments: every other one counts
            if name == wire.ASSIGNMENT.name(NODE) and broken:
                self.node += 1
        elif broken or (not payload and not any(t.retain for t in wire.TOPICS if t.family == family)):
            self.controller[family] += 1  # an empty heartbeat or command is nothing: counted too


def invalid(values: dict[str, float], family: str, node: str | None = None) -> float:
    labels = f'node="{node}",topic="{family}"' if node else f'topic="{family}"'
    return values.get(f"xronos_invalid_messages_total{{{labels}}}", 0.0)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class FuzzCluster:
    """An open Mosquitto (no ACLs), `xronos controller` and `xronos node n0` as processes, and a raw publisher."""

    def __init__(self, root: Path, heartbeat_timeout: float = 5.0, keep_jobs: int = 100):
        self.root, self.heartbeat_timeout, self.keep_jobs = root, heartbeat_timeout, keep_jobs
        self.broker = Mosquitto(users=None)
        self.ports = {"controller": free_port(), NODE: free_port()}
        self.procs = []

    def __enter__(self) -> FuzzCluster:
        self.broker.__enter__()
        url = self.broker.url
        self.controller = xronos_process(
            "controller",
            "--metrics-port",
            str(self.ports["controller"]),
            "--state-dir",
            str(self.root / "state"),
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
            "--keep-jobs",
            str(self.keep_jobs),
            user="controller",
            password="-",
            url=url,
            log=self.root / "controller.log",
        )
        self.node = node_process(NODE, self.root, url, "-", metrics_port=self.ports[NODE])
        self.procs = [self.controller, self.node]
        self.started = time.monotonic()
        wait_for(self._node_online, 90, "the controller to see the node", poll=0.5)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="fuzzer", protocol=paho.MQTTv311)
        self.client.max_queued_messages_set(0)
        self.client.connect("127.0.0.1", self.broker.port, keepalive=30)
        self.client.loop_start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.client.loop_stop()
            self.client.disconnect()
        except AttributeError:
            pass
        stop_processes(self.procs, grace=15)
        self.broker.__exit__(*exc)

    def _node_online(self) -> bool:
        try:
            return metrics(self.ports["controller"]).get("xronos_nodes_online") == 1
        except OSError:
            return False

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def publish(self, name: str, payload: bytes, retain: bool) -> None:
        """QoS 1 from one client: the broker hands them on in order, so a last sentinel marks the end."""
        self.client.publish(name, payload, qos=1, retain=retain).wait_for_publish(10)

    def settle(self, expected: Expected, timeout: float = 120) -> tuple[dict, dict]:
        """Send a garbage sentinel on cmd/stop and n0's assignment; wait until both are counted."""
        before_c = invalid(metrics(self.ports["controller"]), wire.STOP.family)
        before_n = invalid(metrics(self.ports[NODE]), wire.ASSIGNMENT.family, NODE)
        self.publish(wire.STOP.name(), b"sentinel", False)
        self.publish(wire.ASSIGNMENT.name(NODE), b"sentinel", False)
        expected.add(wire.STOP.name(), b"sentinel")
        expected.add(wire.ASSIGNMENT.name(NODE), b"sentinel")
        wait_for(
            lambda: (
                invalid(metrics(self.ports["controller"]), wire.STOP.family) > before_c
                and invalid(metrics(self.ports[NODE]), wire.ASSIGNMENT.family, NODE) > before_n
            ),
            timeout,
            "the sentinels to be counted",
            poll=0.2,
        )
        return metrics(self.ports["controller"]), metrics(self.ports[NODE])

    def idle(self) -> bool:
        values = metrics(self.ports["controller"])
        busy = values.get('xronos_jobs{state="planning"}', 0) + values.get('xronos_jobs{state="running"}', 0)
        return busy == 0 and values.get(f'xronos_node_online{{node="{NODE}"}}') == 1
