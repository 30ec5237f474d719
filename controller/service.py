"""`xronos controller`: the MQTT control plane.

It keeps the node registry (births, last wills, heartbeats, profiles), takes
train and stop commands, and runs each job through its states:

    planning  -> every chosen node gets a `profile` assignment and answers with
                 its profile at the job's shapes; when all have, `plan_job`
                 (the same function `xronos run` uses) gives ranks and shards;
    running   -> every node gets its `train` assignment; heartbeats carry step
                 and loss into the job's retained status;
    completed -> all ranks sent their results; the report (DESIGN.md) is built
                 and published; or `failed` (with the reason: a node lost, a
                 worker error, a bad plan) or `stopped` (by command).

A finished job's assignments are cleared, which also stops any worker still
running. Everything a message can get wrong (malformed, unknown node, a command
naming missing nodes, an assignment this controller did not write) is logged,
counted and dropped; the controller and the other jobs go on. Job statuses are
kept in `--state-dir`, so job ids stay unique across restarts.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field

from controller.metrics import ControllerMetrics
from controller.registry import Registry
from xronos.contract import wire
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.contract.report import RankResult
from xronos.planner.job_plan import JobPlan, plan_job, planned_report

log = logging.getLogger("xronos.controller")


FAILURE_GRACE = 1.5
"""Seconds to wait after a node's failure for its peers' reports, before failing the job."""

PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "Gloo")


def _is_peer_error(error: str) -> bool:
    """A failure that is the echo of another node's (a collective broken by a peer that died)."""
    return any(marker in error for marker in PEER_ERRORS)


class ControllerOptions(BaseModel):
    metrics_port: int | None = Field(None, ge=0, le=65535)
    state_dir: Path | None = None
    heartbeat_timeout: float = Field(10.0, gt=0, description="Seconds of silence before a node counts as lost.")
    profile_timeout: float = Field(900.0, gt=0, description="Seconds a job may wait for its nodes' profiles.")


class Job:
    """A job in flight (or finished), as the controller tracks it."""

    def __init__(self, command: wire.TrainCommand, nodes: list[str]):
        self.command, self.nodes = command, nodes
        self.status = wire.JobStatus(job_id=command.job_id, state="planning", steps=command.job.steps, nodes=nodes)
        self.profiles: dict[str, wire.ProfileMessage] = {}
        self.results: dict[str, RankResult] = {}
        self.plan: JobPlan | None = None
        self.started = time.monotonic()
        self.planning = False
        self.failures: dict[str, str] = {}
        self.fail_at: float | None = None

    @property
    def id(self) -> str:
        return self.command.job_id

    @property
    def members(self) -> list[str]:
        """Participating nodes in rank order (all chosen nodes until planned)."""
        return [self.nodes[d] for d in self.plan.members] if self.plan else self.nodes


class Controller:
    def __init__(self, options: ControllerOptions, settings: BrokerSettings, client_id: str = "xronos-controller"):
        self.o = options
        self.metrics = ControllerMetrics()
        self.registry = Registry(options.heartbeat_timeout)
        self.jobs: dict[str, Job] = {}
        self.finished: dict[str, wire.JobStatus] = {}
        self.written: dict[str, wire.Assignment | None] = {}
        """The assignment this controller last wrote for each node (None: cleared)."""
        self.sent: set[tuple[str, str, str, float]] = set()
        """Every assignment this controller wrote, to tell its own echoes from forgeries."""
        self.started_at = time.time()
        self.lags: collections.deque[float] = collections.deque(maxlen=200_000)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.bus = Bus(settings, client_id=client_id, on_invalid=self.metrics.dropped)
        for topic, handler in (
            (wire.NODE_STATUS, self._on_status),
            (wire.HEARTBEAT, self._on_heartbeat),
            (wire.PROFILE, self._on_profile),
            (wire.RESULT, self._on_result),
            (wire.ASSIGNMENT, self._on_assignment),
            (wire.JOB_STATUS, self._on_job_status),
            (wire.TRAIN, self._on_train),
            (wire.STOP, self._on_stop),
        ):
            self.bus.subscribe(topic, self._locked(handler))

    def _locked(self, handler):
        def run(ident, message):
            with self.lock:
                handler(ident, message)

        return run

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, wait: float | None = 10.0) -> Controller:
        self._load_state()
        if self.o.metrics_port is not None:
            self.metrics.serve(self.o.metrics_port)
        self.bus.start(wait=wait)
        self._ticker = threading.Thread(target=self._tick_loop, daemon=True)
        self._ticker.start()
        return self

    def stop(self, *_) -> None:
        self.stopping.set()

    def close(self) -> None:
        self.stopping.set()
        self.bus.stop()
        self.metrics.close()

    def _tick_loop(self) -> None:
        while not self.stopping.wait(0.5):
            with self.lock:
                self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Liveness and timeouts: lost nodes fail their jobs; jobs stuck in planning fail."""
        for node in self.registry.expire(now):
            log.warning("node %s lost: %s", node.node_id, node.lost_reason)
            self._node_lost(node.node_id, node.lost_reason)
        for job in list(self.jobs.values()):
            if job.fail_at is not None and now >= job.fail_at:
                ranked = sorted(job.failures.items(), key=lambda kv: _is_peer_error(kv[1]))
                self._finish(job, "failed", reason="; ".join(f"node {n}: {e}" for n, e in ranked))
            elif job.status.state == "planning" and now - job.started > self.o.profile_timeout:
                missing = sorted(set(job.nodes) - set(job.profiles))
                self._finish(
                    job, "failed", reason=f"no profile from {', '.join(missing)} in {self.o.profile_timeout:g} s"
                )
        self.metrics.nodes_online.set(self.registry.online_count)
        self.metrics.nodes_known.set(len(self.registry.nodes))
        for node in self.registry.nodes.values():
            self.metrics.node(node.node_id, node.online, now - node.last_seen)
        self.metrics.job_counts(
            [j.status.state for j in self.jobs.values()] + [s.state for s in self.finished.values()]
        )

    # -- node messages ---------------------------------------------------------------
    def _unknown(self, family: str, node_id: str) -> None:
        self.bus.drop(family, f"unknown node {node_id!r}")

    def _on_status(self, node_id: str, msg: wire.NodeStatus | None) -> None:
        if msg is None:
            return
        if msg.state == "online":
            self.registry.online(node_id, time.monotonic())
            log.info("node %s online", node_id)
        elif self.registry.offline(node_id, "went offline") is not None:
            log.info("node %s offline", node_id)
            self._node_lost(node_id, "went offline")

    def _on_heartbeat(self, node_id: str, msg: wire.Heartbeat) -> None:
        node = self.registry.alive(node_id)
        if node is None:
            self._unknown("nodes/+/heartbeat", node_id)
            return
        node.last_seen, node.last_heartbeat_ts = time.monotonic(), msg.ts
        node.state, node.job_id, node.step, node.loss = msg.state, msg.job_id, msg.step, msg.loss
        job = self.jobs.get(msg.job_id) if msg.job_id else None
        if job is not None and job.status.state == "running" and msg.step is not None and node_id in job.members:
            if job.status.step is None or msg.step > job.status.step:
                self._publish_status(job, step_seconds=msg.step_seconds, step=msg.step, loss=msg.loss)
        lag = time.time() - msg.ts
        self.lags.append(lag)
        self.metrics.heartbeat_lag.observe(max(0.0, lag))

    def _on_profile(self, node_id: str, msg: wire.ProfileMessage | None) -> None:
        if msg is None:
            return
        node = self.registry.nodes.get(node_id)
        if node is None:
            self._unknown("nodes/+/profile", node_id)
            return
        if msg.job_id is None:
            node.profile = msg.profile
            return
        job = self.jobs.get(msg.job_id)
        if job is None or job.status.state != "planning" or node_id not in job.nodes:
            return  # a retained profile of an earlier job
        if msg.dims is None or msg.rendezvous_port is None:
            self.bus.drop("nodes/+/profile", f"profile for job {msg.job_id} from {node_id} lacks dims or port")
            return
        job.profiles[node_id] = msg
        if set(job.profiles) == set(job.nodes) and not job.planning:
            job.planning = True  # planning can take seconds when memory binds: off the network thread
            threading.Thread(target=self._plan, args=(job,), daemon=True, name=f"plan-{job.id}").start()

    def _on_result(self, node_id: str, msg: wire.NodeResult | None) -> None:
        if msg is None:
            return
        job = self.jobs.get(msg.job_id)
        if job is None or node_id not in job.nodes:
            return  # a retained result of an earlier job
        if not msg.ok:
            # one worker's death makes its peers fail too (their collectives break): gather
            # what arrives within FAILURE_GRACE and report the root cause first
            job.failures[node_id] = msg.error or "failed"
            job.fail_at = job.fail_at or time.monotonic() + FAILURE_GRACE
            return
        if job.status.state != "running" or node_id not in job.members or msg.result is None:
            return
        job.results[node_id] = msg.result
        if set(job.results) == set(job.members):
            self._complete(job)

    def _on_assignment(self, node_id: str, msg: wire.Assignment | None) -> None:
        mine = self.written.get(node_id)
        if msg is None or (node_id, msg.job_id, msg.phase, msg.ts) in self.sent:
            return
        if msg.ts < self.started_at and node_id not in self.written:  # left from before this controller started
            self._assign(node_id, None)
            return
        self.bus.drop("nodes/+/assignment", f"assignment for {node_id} not written by this controller")
        self.bus.publish(wire.ASSIGNMENT, node_id, mine)  # put back what this controller said (or clear it)

    def _on_job_status(self, job_id: str, msg: wire.JobStatus | None) -> None:
        """A job left unfinished by an earlier controller (a restart) is marked failed, not left `running`."""
        if msg is None or msg.finished or job_id in self.jobs or msg.ts >= self.started_at:
            return
        status = msg.model_copy(
            update={"state": "failed", "reason": "the controller restarted during the job", "ts": time.time()}
        )
        self.finished[job_id] = status
        self._publish(status)  # its mode is not known here: no xronos_job_info for it

    def _node_lost(self, node_id: str, reason: str) -> None:
        for job in list(self.jobs.values()):
            if node_id in job.members or (job.status.state == "planning" and node_id in job.nodes):
                self._finish(job, "failed", reason=f"node {node_id} {reason}")

    # -- commands ----------------------------------------------------------------------
    def _on_train(self, _: str, cmd: wire.TrainCommand) -> None:
        if cmd.job_id in self.jobs or cmd.job_id in self.finished:
            self.bus.drop("cmd/train", f"job id {cmd.job_id!r} is taken")
            return
        busy = {n for j in self.jobs.values() for n in j.nodes}
        if cmd.nodes is not None:
            problems = [
                f"{n} is unknown"
                if n not in self.registry.nodes
                else f"{n} is offline"
                if not self.registry.nodes[n].online
                else f"{n} is busy"
                for n in dict.fromkeys(cmd.nodes)
                if n not in self.registry.available(busy)
            ]
            nodes = list(dict.fromkeys(cmd.nodes))
        else:
            nodes = self.registry.available(busy)
            problems = [] if nodes else ["no idle online node"]
        if cmd.job.mode == "single" and len(nodes) > 1:
            problems.append(f"mode single trains on one node, not {len(nodes)}")
        job = Job(cmd, nodes)
        if problems:
            self.bus.drop("cmd/train", f"job {cmd.job_id}: {'; '.join(problems)}")
            self.finished[cmd.job_id] = job.status.model_copy(update={"state": "failed", "reason": "; ".join(problems)})
            self._publish(self.finished[cmd.job_id], mode=cmd.job.mode)
            return
        self.jobs[cmd.job_id] = job
        log.info("job %s: %s on %s", cmd.job_id, cmd.job.mode, ", ".join(nodes))
        self._publish_status(job)
        for node_id in nodes:
            self._assign(node_id, wire.Assignment(job_id=job.id, node_id=node_id, phase="profile", job=cmd.job))

    def _on_stop(self, _: str, cmd: wire.StopCommand) -> None:
        job = self.jobs.get(cmd.job_id)
        if job is None:
            self.bus.drop("cmd/stop", f"no job {cmd.job_id!r} in flight")
            return
        self._finish(job, "stopped", reason="stopped by command")

    # -- the job's way through ------------------------------------------------------------
    def _plan(self, job: Job) -> None:
        profiles = [job.profiles[n].profile for n in job.nodes]
        dims = job.profiles[job.nodes[0]].dims
        plan, problem = None, None
        if any(job.profiles[n].dims != dims for n in job.nodes):
            problem = "the nodes hold different models at the job's model path"
        else:
            try:
                plan = plan_job(job.command.job, dims, profiles)
            except XronosError as err:
                problem = f"cannot plan: {err}"
        with self.lock:
            if self.jobs.get(job.id) is not job or job.status.state != "planning":
                return  # stopped or failed meanwhile
            if problem is not None:
                self._finish(job, "failed", reason=problem)
                return
            job.plan = plan
            self._assign_shards(job)

    def _assign_shards(self, job: Job) -> None:
        master = job.profiles[job.members[0]]
        for d, node_id in enumerate(job.nodes):
            self._assign(
                node_id,
                wire.Assignment(
                    job_id=job.id,
                    node_id=node_id,
                    phase="train",
                    job=job.command.job,
                    rank=job.plan.ranks[d],
                    world_size=job.plan.world_size,
                    master_addr=master.profile.address or "127.0.0.1",
                    master_port=master.rendezvous_port,
                    split=job.plan.split,
                    stages=job.plan.stages,
                    micro_batches=job.plan.micro_batches,
                    profiles=job.plan.profiles,
                ),
            )
        self.metrics.planned(job.id, job.plan.predicted_step_seconds, job.members, job.plan.predicted)
        log.info("job %s planned: %s", job.id, job.plan.split.describe() if job.plan.split else job.plan.stages)
        self._publish_status(
            job, state="running", step=0, split=job.plan.split, stages=job.plan.stages, nodes=job.members
        )

    def _complete(self, job: Job) -> None:
        options, plan = job.command.job, job.plan
        dims = job.profiles[job.nodes[0]].dims
        speeds = [job.profiles[n].profile.speed_hint for n in job.nodes]
        results = [job.results[n] for n in job.members]
        report = planned_report(options, dims, plan, [job.profiles[n].profile for n in job.nodes], speeds, results)
        report = report.model_copy(
            update={
                "nodes": [n.model_copy(update={"name": job.nodes[n.device]}) for n in report.nodes],
                "excluded": [e.model_copy(update={"name": job.nodes[e.device]}) for e in report.excluded],
            }
        )
        self.metrics.completed(job.id, report.mean_step_seconds, report.idle_ratio)
        self._finish(
            job,
            "completed",
            report=report,
            output=f"{job.members[0]}:{options.output}",
            loss=report.losses[-1],
            step=len(report.losses),
        )

    def _finish(self, job: Job, state: str, **update) -> None:
        self.jobs.pop(job.id, None)
        for node_id in job.nodes:
            self._assign(node_id, None)
        self.finished[job.id] = self._publish_status(job, state=state, **update)
        log.info("job %s %s%s", job.id, state, f": {update['reason']}" if "reason" in update else "")

    def _assign(self, node_id: str, assignment: wire.Assignment | None) -> None:
        self.written[node_id] = assignment
        if assignment is not None:
            self.sent.add((node_id, assignment.job_id, assignment.phase, assignment.ts))
        self.bus.publish(wire.ASSIGNMENT, node_id, assignment)

    def _publish_status(self, job: Job, step_seconds: float | None = None, **update) -> wire.JobStatus:
        job.status = wire.JobStatus(**{**job.status.model_dump(), "ts": time.time(), **update})
        self._publish(job.status, mode=job.command.job.mode, step_seconds=step_seconds)
        return job.status

    def _publish(self, status: wire.JobStatus, mode: str | None = None, step_seconds: float | None = None) -> None:
        self.bus.publish(wire.JOB_STATUS, status.job_id, status)
        self.metrics.job(status, mode, step_seconds)
        if self.o.state_dir is not None and status.finished:
            path = self.o.state_dir / "jobs" / f"{status.job_id}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, status.model_dump_json(indent=2))

    def _load_state(self) -> None:
        if self.o.state_dir is None:
            return
        for path in sorted((self.o.state_dir / "jobs").glob("*.json")):
            try:
                status = wire.JobStatus.model_validate_json(path.read_text())
            except ValueError as err:
                log.warning("ignoring %s: %s", path, err)
                continue
            self.finished[status.job_id] = status


def run_controller(options: ControllerOptions, settings: BrokerSettings) -> int:
    import signal

    controller = Controller(options, settings)
    signal.signal(signal.SIGTERM, controller.stop)
    signal.signal(signal.SIGINT, controller.stop)
    controller.start(wait=None)
    log.info("controller started (broker %s:%d)", controller.bus.address.host, controller.bus.address.port)
    try:
        while not controller.stopping.wait(0.5):
            pass
    finally:
        controller.close()
    return 0
