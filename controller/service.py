"""`xronos controller`: the MQTT control plane.

It keeps the node registry (births, last wills, heartbeats, profiles), takes
train and stop commands, and runs each job through its states:

    planning  -> every chosen node gets a `profile` assignment and answers with
                 its profile at the job's shapes; when all have, `plan_job`
                 (the same function `xronos run` uses) gives ranks and shards;
    running   -> every node gets its `train` assignment; heartbeats carry step
                 and loss into the job's retained status;
    completed -> all ranks sent their results; the report (docs/command-line.md) is built
                 and published; or `failed` (with the reason: a node lost, a
                 worker error, a bad plan) or `stopped` (by command).

A finished job's assignments are cleared, which also stops any worker still
running. Everything a message can get wrong (malformed, unknown node, a command
naming missing nodes, an assignment this controller did not write, a clear of
an assignment it did not clear) is logged, counted and dropped, and a forged or
cleared assignment is put back; a handler that fails anyway is logged and
counted the same way. The controller and the other jobs go on.

A controller runs for months, so all it keeps is bounded: the last
`--keep-jobs` finished jobs (their statuses, without reports, in memory; their
reports in `--state-dir` and in their retained statuses), the last
KEPT_REJECTED rejected commands (a retained status each, no file), the
assignments it wrote lately (SENT_KEPT), and the nodes offline
(KEPT_OFFLINE_NODES). A record that leaves a window is removed everywhere: its
file, its retained status (cleared) and its metrics. Job ids are unique within
the windows, across restarts with `--state-dir`.
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

KEPT_REJECTED = 100
"""Rejected train commands whose failed status stays retained (the operator waiting on it reads why)."""
SENT_KEPT = 1024
"""Assignments written lately, to tell their echoes from forgeries: a job writes two per node."""
KEPT_OFFLINE_NODES = 256
"""Offline nodes the registry keeps (xronos status shows them); a fleet is tens of devices."""
LEFTOVER_SECONDS = 10.0
"""After (re)connecting, a retained assignment older than this controller is an earlier one's leftover."""
MAX_REASON = 2000
"""Characters of a failure reason kept in a job status."""

PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "Gloo")


def _is_peer_error(error: str) -> bool:
    """A failure that is the echo of another node's (a collective broken by a peer that died)."""
    return any(marker in error for marker in PEER_ERRORS)


class ControllerOptions(BaseModel):
    metrics_port: int | None = Field(None, ge=0, le=65535)
    state_dir: Path | None = None
    heartbeat_timeout: float = Field(
        10.0, ge=0.1, le=86_400, allow_inf_nan=False, description="Seconds of silence before a node counts as lost."
    )
    profile_timeout: float = Field(
        900.0, gt=0, le=86_400, allow_inf_nan=False, description="Seconds a job may wait for its nodes' profiles."
    )
    keep_jobs: int = Field(100, ge=1, le=100_000, description="Finished jobs kept (status, report on disk).")


def _shorten(text: str, limit: int = MAX_REASON) -> str:
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text):,} chars)"


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
        self.finished: collections.OrderedDict[str, wire.JobStatus] = collections.OrderedDict()
        """The last `keep_jobs` finished jobs, oldest first, without their reports (those are on disk)."""
        self.rejected: collections.OrderedDict[str, wire.JobStatus] = collections.OrderedDict()
        """The last KEPT_REJECTED rejected commands' statuses."""
        self.written: dict[str, wire.Assignment] = {}
        """The assignment in force that this controller wrote for each node (none: cleared)."""
        self.sent: collections.OrderedDict[tuple[str, str, str, float], None] = collections.OrderedDict()
        """The last SENT_KEPT assignments this controller wrote, to tell its own echoes from forgeries."""
        self.clearing: collections.Counter[str] = collections.Counter()
        """Clears this controller published whose echo has not come back, by node."""
        self.started_at = time.time()
        self.connected_at = time.monotonic()
        self.lags: collections.deque[float] = collections.deque(maxlen=200_000)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.bus = Bus(settings, client_id=client_id, on_invalid=self.metrics.dropped, on_connect=self._connected)
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
            self.bus.subscribe(topic, self._locked(handler, topic.family))

    def _locked(self, handler, family: str):
        """A handler under the lock, and the handler boundary: what it raises is logged and counted."""

        def run(ident, message):
            with self.lock:
                try:
                    handler(ident, message)
                except Exception as err:  # noqa: BLE001 - no message may stop the controller
                    log.exception("handling a message on %s failed", family)
                    self.bus.drop(family, f"handler failed: {type(err).__name__}: {err}")

        return run

    def _connected(self) -> None:
        self.connected_at = time.monotonic()

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
            self._node_lost(node.node_id, node.lost_reason or "lost")
        busy = {n for j in self.jobs.values() for n in j.nodes}
        for node_id in self.registry.forget_offline(KEPT_OFFLINE_NODES, keep=busy):
            self.metrics.forget_node(node_id)
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
            [j.status.state for j in self.jobs.values()]
            + [s.state for s in self.finished.values()]
            + ["failed"] * len(self.rejected)
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

    def _on_heartbeat(self, node_id: str, msg: wire.Heartbeat | None) -> None:
        if msg is None:
            self.bus.drop("nodes/+/heartbeat", f"empty heartbeat of {node_id}")
            return
        node = self.registry.nodes.get(node_id)
        if node is None:
            self._unknown("nodes/+/heartbeat", node_id)
            return
        if not node.online:  # a node declared lost (a network cut, a forged `offline`) that is alive after all
            log.info("node %s is back (heartbeat)", node_id)
            node = self.registry.online(node_id, time.monotonic())
        node.last_seen, node.last_heartbeat_ts = time.monotonic(), msg.ts
        node.state, node.job_id, node.step, node.loss = msg.state, msg.job_id, msg.step, msg.loss
        job = self.jobs.get(msg.job_id) if msg.job_id else None
        if job is not None and job.status.state == "running" and msg.step is not None and node_id in job.members:
            if not 0 <= msg.step <= job.command.job.steps:
                self.bus.drop("nodes/+/heartbeat", f"{node_id}: step {msg.step} of a {job.command.job.steps}-step job")
            elif job.status.step is None or msg.step > job.status.step:
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
        """Only this controller writes assignments: anything else on the topic is counted and undone."""
        mine = self.written.get(node_id)
        if msg is None:
            if self.clearing[node_id] > 0:  # the echo of this controller's own clear
                self.clearing[node_id] -= 1
                if not self.clearing[node_id]:
                    del self.clearing[node_id]
                return
            self.bus.drop("nodes/+/assignment", f"assignment of {node_id} cleared, not by this controller")
            if mine is not None:  # a node's job was in force: put it back before the node gives it up
                self._assign(node_id, mine)
            return
        if (node_id, msg.job_id, msg.phase, msg.ts) in self.sent:
            return
        if mine is None and msg.ts < self.started_at and time.monotonic() - self.connected_at < LEFTOVER_SECONDS:
            self._assign(node_id, None)  # retained from before this controller started: no job of ours
            return
        self.bus.drop("nodes/+/assignment", f"assignment for {node_id} not written by this controller")
        self._assign(node_id, mine)  # put back what this controller said (or clear it)

    def _on_job_status(self, job_id: str, msg: wire.JobStatus | None) -> None:
        """A job left unfinished by an earlier controller (a restart) is marked failed, not left `running`;
        one left finished joins the kept window (so it is removed in its turn, not retained for ever)."""
        if msg is None or job_id in self.jobs or msg.ts >= self.started_at:
            return
        if msg.finished:
            if job_id in self.finished or job_id in self.rejected:
                return
            oldest = next(iter(self.finished.values()), None)
            if len(self.finished) >= self.o.keep_jobs and oldest is not None and msg.ts < oldest.ts:
                self.bus.publish(wire.JOB_STATUS, job_id, None)  # older than all we keep: gone at once
            else:
                self._keep_finished(msg)
            return
        status = msg.model_copy(
            update={"state": "failed", "reason": "the controller restarted during the job", "ts": time.time()}
        )
        self._publish(status)  # its mode is not known here: no xronos_job_info for it
        self._keep_finished(status)

    def _node_lost(self, node_id: str, reason: str) -> None:
        for job in list(self.jobs.values()):
            if node_id in job.members or (job.status.state == "planning" and node_id in job.nodes):
                self._finish(job, "failed", reason=f"node {node_id} {reason}")

    # -- commands ----------------------------------------------------------------------
    def _on_train(self, _: str, cmd: wire.TrainCommand | None) -> None:
        if cmd is None:
            self.bus.drop("cmd/train", "an empty command")
            return
        if cmd.job_id in self.jobs or cmd.job_id in self.finished or cmd.job_id in self.rejected:
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
            problems += [] if nodes else ["the command names no nodes (leave `nodes` out for every idle one)"]
        else:
            nodes = self.registry.available(busy)
            problems = [] if nodes else ["no idle online node"]
        if cmd.job.mode == "single" and len(nodes) > 1:
            problems.append(f"mode single trains on one node, not {len(nodes)}")
        if problems:
            self._reject(cmd, nodes, problems)
            return
        job = Job(cmd, nodes)
        self.jobs[cmd.job_id] = job
        log.info("job %s: %s on %s", cmd.job_id, cmd.job.mode, ", ".join(nodes))
        self._publish_status(job)
        for node_id in nodes:
            self._assign(node_id, wire.Assignment(job_id=job.id, node_id=node_id, phase="profile", job=cmd.job))

    def _reject(self, cmd: wire.TrainCommand, nodes: list[str], problems: list[str]) -> None:
        """A command that cannot run: counted, and a failed status retained for whoever waits on it,
        within the last KEPT_REJECTED (no file: a flood of junk commands must not fill the disk)."""
        reason = _shorten("; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))
        self.bus.drop("cmd/train", f"job {cmd.job_id}: {reason}")
        status = wire.JobStatus(job_id=cmd.job_id, state="failed", steps=cmd.job.steps, nodes=nodes[:16], reason=reason)
        self.bus.publish(wire.JOB_STATUS, cmd.job_id, status)
        self.metrics.rejected()
        self.rejected[cmd.job_id] = status
        while len(self.rejected) > KEPT_REJECTED:
            old, _ = self.rejected.popitem(last=False)
            self.bus.publish(wire.JOB_STATUS, old, None)

    def _on_stop(self, _: str, cmd: wire.StopCommand | None) -> None:
        if cmd is None:
            self.bus.drop("cmd/stop", "an empty command")
            return
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
        if dims is None:
            problem = f"node {job.nodes[0]} sent its job profile without the model's sizes"
        elif any(job.profiles[n].dims != dims for n in job.nodes):
            problem = "the nodes hold different models at the job's model path"
        else:
            try:
                plan = plan_job(job.command.job, dims, profiles)
            except XronosError as err:
                problem = f"cannot plan: {err}"
            except Exception as err:  # noqa: BLE001 - profiles from the network: fail the job, not the thread
                log.exception("planning job %s failed", job.id)
                problem = f"cannot plan: {type(err).__name__}: {err}"
        with self.lock:
            if self.jobs.get(job.id) is not job or job.status.state != "planning":
                return  # stopped or failed meanwhile
            if problem is not None:
                self._finish(job, "failed", reason=problem)
                return
            assert plan is not None  # planned, or a problem said why not
            job.plan = plan
            self._assign_shards(job, plan)

    def _assign_shards(self, job: Job, plan: JobPlan) -> None:
        master = job.profiles[job.members[0]]
        if master.rendezvous_port is None:
            self._finish(job, "failed", reason=f"rank 0's node {job.members[0]} offered no rendezvous port")
            return
        for d, node_id in enumerate(job.nodes):
            place = plan.rank_assignment(d, master.profile.address or "127.0.0.1", master.rendezvous_port)
            self._assign(
                node_id,
                wire.Assignment(job_id=job.id, node_id=node_id, phase="train", job=job.command.job, **dict(place)),
            )
        self.metrics.planned(job.id, plan.predicted_step_seconds, job.members, plan.predicted)
        log.info("job %s planned: %s", job.id, plan.split.describe() if plan.split else plan.stages)
        self._publish_status(job, state="running", step=0, split=plan.split, stages=plan.stages, nodes=job.members)

    def _complete(self, job: Job) -> None:
        options, plan = job.command.job, job.plan
        dims = job.profiles[job.nodes[0]].dims
        assert plan is not None and dims is not None  # a job completes only after it was planned from them
        speeds = [job.profiles[n].profile.speed_hint for n in job.nodes]
        results = [job.results[n] for n in job.members]
        try:
            report = planned_report(options, dims, plan, [job.profiles[n].profile for n in job.nodes], speeds, results)
        except Exception as err:  # noqa: BLE001 - results from the network that do not add up
            log.exception("the report of job %s", job.id)
            self._finish(job, "failed", reason=f"the nodes' results make no report: {type(err).__name__}: {err}")
            return
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
            if node_id in self.written:
                self._assign(node_id, None)
        if "reason" in update:
            update["reason"] = _shorten(update["reason"])
        self._keep_finished(self._publish_status(job, state=state, **update))
        log.info("job %s %s%s", job.id, state, f": {update['reason']}" if "reason" in update else "")

    def _keep_finished(self, status: wire.JobStatus) -> None:
        """Into the window of finished jobs; the oldest beyond `keep_jobs` leaves it, its file and retained status."""
        self.finished[status.job_id] = status.model_copy(update={"report": None})
        while len(self.finished) > self.o.keep_jobs:
            old, _ = self.finished.popitem(last=False)
            self.bus.publish(wire.JOB_STATUS, old, None)
            if self.o.state_dir is not None:
                (self.o.state_dir / "jobs" / f"{old}.json").unlink(missing_ok=True)

    def _assign(self, node_id: str, assignment: wire.Assignment | None) -> None:
        if assignment is None:
            self.written.pop(node_id, None)
            self.clearing[node_id] += 1
        else:
            self.written[node_id] = assignment
            self.sent[(node_id, assignment.job_id, assignment.phase, assignment.ts)] = None
            while len(self.sent) > SENT_KEPT:
                self.sent.popitem(last=False)
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
        """The finished jobs of earlier runs, oldest first; beyond `keep_jobs` (and unreadable files) removed."""
        if self.o.state_dir is None:
            return
        loaded = []
        for path in (self.o.state_dir / "jobs").glob("*.json"):
            try:
                status = wire.JobStatus.model_validate_json(path.read_text())
            except (OSError, ValueError) as err:
                log.warning("removing unreadable %s: %s", path, err)
                path.unlink(missing_ok=True)
                continue
            loaded.append(status.model_copy(update={"report": None}))
        loaded.sort(key=lambda s: s.ts)
        for status in loaded[: -self.o.keep_jobs]:
            (self.o.state_dir / "jobs" / f"{status.job_id}.json").unlink(missing_ok=True)
        for status in loaded[-self.o.keep_jobs :]:
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
