"""The operator's side of the control plane: `xronos train` and `xronos status`.

`train` publishes a train command exactly as any MQTT client could, and with
`wait` follows the job's retained status until it ends. `status` listens a
moment to the retained topics (node births, profiles, job statuses) and to
the heartbeats, and returns what it saw.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid

from pydantic import BaseModel

from xronos.contract import wire
from xronos.contract.errors import XronosError
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.contract.profiles import reference_layer_seconds


def new_job_id() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


def submit(
    settings: BrokerSettings,
    command: wire.TrainCommand,
    wait: bool,
    timeout: float | None = None,
    show_progress: bool = True,
) -> wire.JobStatus | None:
    """Publish `command`; with `wait`, return the job's final status (raises on a timeout)."""
    statuses: list[wire.JobStatus] = []
    changed = threading.Condition()

    def on_status(_: str, status: BaseModel | None) -> None:
        # the bus hands a handler its topic's messages typed as their common base (JOB_STATUS: a JobStatus)
        if isinstance(status, wire.JobStatus):
            with changed:
                statuses.append(status)
                changed.notify_all()

    bus = Bus(settings, client_id=f"xronos-operator-{uuid.uuid4().hex}")
    if wait:
        bus.subscribe(wire.JOB_STATUS, on_status, ident=command.job_id)
    bus.start()
    try:
        if wait:
            time.sleep(0.5)  # retained statuses arrive first
            with changed:
                if any(s.ts < command.ts for s in statuses):
                    raise XronosError(f"job id {command.job_id!r} is taken; choose another --job-id")
        info = bus.publish(wire.TRAIN, "", command)
        info.wait_for_publish(timeout=10)
        if not info.is_published():
            raise XronosError("the broker did not take the train command")
        if not wait:
            return None
        bar, deadline, seen, told = None, None if timeout is None else time.monotonic() + timeout, 0, 0
        while True:
            with changed:
                changed.wait(timeout=1.0)
                fresh, seen = statuses[seen:], len(statuses)
            for status in fresh:
                if status.ts < command.ts:  # a retained status of an earlier job with this id
                    continue
                for recovery in status.recoveries[told:]:  # a node lost: the job goes on without it
                    print(f"job {command.job_id}: {recovery.describe()}", file=sys.stderr)
                told = max(told, len(status.recoveries))
                if show_progress and status.state == "running" and bar is None:
                    from tqdm import tqdm

                    bar = tqdm(
                        total=status.steps, desc=f"{command.job_id} ({command.job.mode})", unit="step", file=sys.stderr
                    )
                if bar is not None and status.step is not None:
                    bar.update(status.step - bar.n)
                    if status.loss is not None:
                        bar.set_postfix(loss=f"{status.loss:.4f}")
                if status.finished:
                    if bar is not None:
                        bar.close()
                    return status
            if deadline is not None and time.monotonic() > deadline:
                raise XronosError(f"job {command.job_id} did not finish within {timeout:g} s")
    finally:
        bus.stop()


class NodeView(BaseModel):
    node_id: str
    status: str | None = None
    state: str | None = None
    job_id: str | None = None
    step: int | None = None
    last_heartbeat_ts: float | None = None
    last_heartbeat_age: float | None = None
    speed_hint: float | None = None
    layer_ms: float | None = None
    """Reference-shape seconds of one layer (fwd+bwd+update), in ms: the device's speed at a glance."""


class ClusterView(BaseModel):
    nodes: list[NodeView]
    jobs: list[wire.JobStatus]


def cluster_status(settings: BrokerSettings, listen_seconds: float = 2.5) -> ClusterView:
    nodes: dict[str, NodeView] = {}
    jobs: dict[str, wire.JobStatus] = {}
    lock = threading.Lock()

    def node(node_id: str) -> NodeView:
        return nodes.setdefault(node_id, NodeView(node_id=node_id))

    def on_status(node_id, msg):
        if msg is not None:
            with lock:
                node(node_id).status = msg.state

    def on_heartbeat(node_id, msg):
        with lock:
            view = node(node_id)
            view.state, view.job_id, view.step = msg.state, msg.job_id, msg.step
            view.last_heartbeat_ts = msg.ts

    def on_profile(node_id, msg):
        if msg is not None and msg.job_id is None:
            with lock:
                view = node(node_id)
                view.speed_hint = msg.profile.speed_hint
                view.layer_ms = 1000 * reference_layer_seconds(msg.profile)

    def on_job(job_id, msg):
        if msg is not None:
            with lock:
                jobs[job_id] = msg

    bus = Bus(settings, client_id=f"xronos-status-{uuid.uuid4().hex}")  # 128 random bits: not guessable
    bus.subscribe(wire.NODE_STATUS, on_status)
    bus.subscribe(wire.HEARTBEAT, on_heartbeat)
    bus.subscribe(wire.PROFILE, on_profile)
    bus.subscribe(wire.JOB_STATUS, on_job)
    bus.start()
    time.sleep(listen_seconds)
    bus.stop()
    now = time.time()
    with lock:
        for view in nodes.values():
            if view.last_heartbeat_ts is not None:
                view.last_heartbeat_age = max(0.0, now - view.last_heartbeat_ts)
        return ClusterView(
            nodes=sorted(nodes.values(), key=lambda n: n.node_id), jobs=sorted(jobs.values(), key=lambda j: j.ts)
        )


def print_cluster(view: ClusterView) -> None:
    print(
        f"{'node':<16} {'status':<8} {'state':<10} {'job':<28} {'step':>5} {'heartbeat':>10} {'speed':>6} {'layer ms':>9}"
    )
    for n in view.nodes:
        age = f"{n.last_heartbeat_age:.1f}s ago" if n.last_heartbeat_age is not None else "-"
        print(
            f"{n.node_id:<16} {n.status or '-':<8} {n.state or '-':<10} {n.job_id or '-':<28} "
            f"{n.step if n.step is not None else '-':>5} {age:>10} "
            f"{n.speed_hint if n.speed_hint is not None else '-':>6} "
            f"{f'{n.layer_ms:.1f}' if n.layer_ms is not None else '-':>9}"
        )
    if view.jobs:
        print()
        print(f"{'job':<28} {'state':<10} {'step':>9} {'loss':>8}  nodes / reason")
        for j in view.jobs:
            steps = f"{j.step if j.step is not None else '-'}/{j.steps or '-'}"
            loss = f"{j.loss:.4f}" if j.loss is not None else "-"
            print(f"{j.job_id:<28} {j.state:<10} {steps:>9} {loss:>8}  {j.reason or ', '.join(j.nodes)}")
            for recovery in j.recoveries:
                print(f"{'':<28} {'':<10} {'':>9} {'':>8}  {recovery.describe()}")
