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
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, Field

from controller.jobs import (
    STALL_STEPS,
    Job,
    RunningJob,
    failure_reason,
    fitting,
    lost_members,
    resume_point,
    shorten,
    stall_limit,
)
from controller.leader import CONTROLLER_BEAT, PROBE_CONNECT_SECONDS, live_controller, probe_url, refusal
from controller.metrics import ControllerMetrics
from controller.registry import Registry
from xronos.contract import wire
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.planner.checkpoint_plan import checkpoint_interval
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
COMMAND_SETTLE = 2.0
"""Seconds after a (re)connect that commands wait for the retained births to arrive: the commands queued in
the controller's session come first, before it knows any node. Longer (up to the heartbeat timeout) while a
node's `offline`, which a broker that shut down publishes for everyone, waits for its birth."""
HELD_KEPT = 100_000
"""Commands held at most while settling; beyond, they are handled at once."""


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
    probe_broker: str | None = Field(
        None,
        description="Where to look for another live controller before connecting (`probe_url`): a listener "
        "where client ids are not bound to usernames, so the look cannot take over a live controller's session.",
    )
    stall_floor: float = Field(
        120.0,
        ge=1.0,
        le=86_400,
        allow_inf_nan=False,
        description="Seconds: the least a running job's node may go without progress before the watchdog "
        "fails the job (`stall_limit`), however short its predicted step.",
    )


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
        self.settings = settings
        self.instance = uuid.uuid4().hex[:16]
        """This process among controllers (`xronos/controller/status`)."""
        self.connected_at = time.monotonic()
        self.lags: collections.deque[float] = collections.deque(maxlen=200_000)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.held: collections.deque[tuple[str, wire.TrainCommand | wire.StopCommand]] = collections.deque()
        """Commands that came while settling after a (re)connect, in order (COMMAND_SETTLE)."""
        # a persistent session: commands sent while this controller is away wait on the broker for it
        self.bus = Bus(
            settings,
            client_id=client_id,
            on_invalid=self.metrics.dropped,
            on_connect=self._connected,
            clean_session=False,
            will=(wire.CONTROLLER_STATUS, "", self._controller_status("offline")),
        )
        for topic, handler in (
            (wire.NODE_STATUS, self._on_status),
            (wire.HEARTBEAT, self._on_heartbeat),
            (wire.PROFILE, self._on_profile),
            (wire.RESULT, self._on_result),
            (wire.ASSIGNMENT, self._on_assignment),
            (wire.JOB_STATUS, self._on_job_status),
            (wire.TRAIN, self._on_train),
            (wire.STOP, self._on_stop),
            (wire.CONTROLLER_STATUS, self._on_controller_status),
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
        """(Re)connected: nodes get a full heartbeat timeout from now (nobody was heard while the controller
        was away), and what is in force is published again, since a broker that crashed may have lost it or
        kept an older copy: the jobs' statuses and the nodes' assignments (a node ignores one it has handled)."""
        with self.lock:
            self.connected_at = time.monotonic()
            self.registry.refresh(self.connected_at)
            for job in list(self.jobs.values()):
                self._publish_status(job)
            for node_id, assignment in list(self.written.items()):
                self.bus.publish(wire.ASSIGNMENT, node_id, assignment)
            self._announce()

    # -- one controller at a time ----------------------------------------------------------
    def _controller_status(self, state: str) -> wire.ControllerStatus:
        return wire.ControllerStatus(
            state=state,
            instance=self.instance,
            started=self.started_at,
            host=socket.gethostname()[:255],
            pid=os.getpid(),
        )

    def _announce(self) -> None:
        self.bus.publish(wire.CONTROLLER_STATUS, "", self._controller_status("online"))

    def _announce_loop(self) -> None:
        while not self.stopping.wait(CONTROLLER_BEAT):
            if self.bus.connected.is_set():
                self._announce()

    def _on_controller_status(self, _: str, msg: wire.ControllerStatus | None) -> None:
        """Another controller's `online` is said loudly (two on one broker); an `offline` or a clear (a will
        the broker published as it shut down, a forgery) is answered with this one's `online`."""
        if msg is not None and msg.state == "online":
            if msg.instance != self.instance:
                log.warning(
                    "another controller (instance %s, pid %s on %s) says it is live on this broker too",
                    msg.instance,
                    msg.pid,
                    msg.host,
                )
            return
        if self.bus.connected.is_set():
            self._announce()

    def _refuse_if_another_is_live(self, wait: float | None) -> None:
        """Before connecting as the controller: a live one there means this one must not start (exit 2)."""
        url = self.o.probe_broker or probe_url(self.settings.broker)
        while True:
            try:
                other = live_controller(self.settings, url, wait or PROBE_CONNECT_SECONDS)
                break
            except XronosError as err:
                why = f"cannot look for another live controller at {url} (--probe-broker): {err}"
                if wait is not None:
                    raise XronosError(why) from None
                log.warning("%s; trying again", why)
                if self.stopping.wait(2.0):
                    return
        if other is not None:
            raise XronosError(refusal(other))

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, wait: float | None = 10.0) -> Controller:
        self._refuse_if_another_is_live(wait)  # before its state is read, and before it connects as the controller
        self._load_state()
        if self.o.metrics_port is not None:
            self.metrics.serve(self.o.metrics_port)
        self.bus.start(wait=wait)
        self._ticker = threading.Thread(target=self._tick_loop, daemon=True)
        self._ticker.start()
        threading.Thread(target=self._announce_loop, daemon=True, name="announce").start()
        return self

    def stop(self, *_) -> None:
        self.stopping.set()

    def close(self) -> None:
        self.stopping.set()
        if self.bus.connected.is_set():  # else the broker publishes the will
            self.bus.publish(wire.CONTROLLER_STATUS, "", self._controller_status("offline")).wait_for_publish(2)
        self.bus.stop()
        self.metrics.close()

    def _tick_loop(self) -> None:
        while not self.stopping.wait(0.5):
            with self.lock:
                self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Liveness and timeouts: lost nodes fail their jobs; jobs stuck in planning fail; held commands run.

        Nobody is declared lost while the controller is cut off from the broker (it hears no one then)."""
        if self.bus.connected.is_set():
            for node in self.registry.expire(now):
                log.warning("node %s lost: %s", node.node_id, node.lost_reason)
                self._node_lost(node.node_id, node.lost_reason or "lost")
            self._run_held(now)
        busy = {n for j in self.jobs.values() for n in j.nodes}
        for node_id in self.registry.forget_offline(KEPT_OFFLINE_NODES, keep=busy):
            self.metrics.forget_node(node_id)
        for job in list(self.jobs.values()):
            if job.fail_at is not None and now >= job.fail_at:
                lost = lost_members(job, self._alive) if job.plan is not None else []
                why = "; ".join(f"node {n}: {job.failures[n]}" for n in lost if n in job.failures)
                if not (lost and self._recover(job, lost, why or f"node {', '.join(lost)} went offline")):
                    self._finish(job, "failed", reason=failure_reason(job))
            elif job.status.state == "planning" and now - job.started > self.o.profile_timeout:
                missing = sorted(set(job.nodes) - set(job.profiles))
                self._finish(
                    job, "failed", reason=f"no profile from {', '.join(missing)} in {self.o.profile_timeout:g} s"
                )
        self._watch_progress(now)
        self.metrics.nodes_online.set(self.registry.online_count)
        self.metrics.nodes_known.set(len(self.registry.nodes))
        for node in self.registry.nodes.values():
            self.metrics.node(node.node_id, node.online, now - node.last_seen)
        self._count_jobs()

    def _count_jobs(self) -> None:
        """The jobs-by-state gauge: on every tick, and as a job finishes (a scrape right after its
        final status, as a job of a few fast steps allows, must count it)."""
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
        elif self.registry.said_offline(node_id, time.monotonic()) is not None:
            # a broker shutting down publishes every client's will: lost only if it stays silent (tick)
            log.info("node %s said offline; lost unless heard from in %g s", node_id, self.registry.timeout)

    def _on_heartbeat(self, node_id: str, msg: wire.Heartbeat | None) -> None:
        if msg is None:
            self.bus.drop("nodes/+/heartbeat", f"empty heartbeat of {node_id}")
            return
        node = self.registry.nodes.get(node_id)
        if node is None:
            self._unknown("nodes/+/heartbeat", node_id)
            return
        if not node.online or node.said_offline:  # lost, or said offline (a broker's restart, a forgery): alive
            log.info("node %s is back (heartbeat)", node_id)
        node = self.registry.heard(node_id, time.monotonic()) or node
        node.last_heartbeat_ts = msg.ts
        node.state, node.job_id, node.step, node.loss = msg.state, msg.job_id, msg.step, msg.loss
        job = self.jobs.get(msg.job_id) if msg.job_id else None
        if job is not None and job.status.state == "running" and msg.step is not None and node_id in job.members:
            if not 0 <= msg.step <= job.command.job.steps:
                self.bus.drop("nodes/+/heartbeat", f"{node_id}: step {msg.step} of a {job.command.job.steps}-step job")
            elif job.status.step is None or msg.step > job.status.step:
                self._publish_status(job, step_seconds=msg.step_seconds, step=msg.step, loss=msg.loss)
            if 0 <= msg.step <= job.command.job.steps and msg.step > job.progress.get(node_id, (-1, 0.0))[0]:
                job.progress[node_id] = (msg.step, time.monotonic())
        if job is not None and node_id in job.nodes and msg.checkpoint is not None:
            job.checkpoints[node_id] = msg.checkpoint
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
        if msg.attempt is not None and job.attempt is not None and msg.attempt != job.attempt:
            return  # of the attempt before a recovery: its rendezvous port is another worker's
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
        if msg.attempt is not None and job.attempt is not None and msg.attempt != job.attempt:
            return  # of the attempt before a recovery: its workers were stopped
        if not msg.ok:
            # one worker's death makes its peers fail too (their collectives break): gather
            # what arrives within FAILURE_GRACE and report the root cause first
            job.failures[node_id] = msg.error or "failed"
            job.fail_at = job.fail_at or time.monotonic() + FAILURE_GRACE
            return
        if job.status.state != "running" or node_id not in job.members or msg.result is None:
            return
        if msg.parts > 1:  # a long job's result, in parts: the report needs every step of every rank
            parts = job.parts.setdefault(node_id, {})
            if any(m.parts != msg.parts for m in parts.values()):
                parts.clear()  # parts of another sending (a retained copy of an older one): start again
            parts[msg.part] = msg
            if len(parts) < msg.parts:
                return
            result = wire.join_result_parts(list(parts.values()))
            del job.parts[node_id]
        else:
            result = msg.result
        job.results[node_id] = result
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
        if msg is None or msg.ts >= self.started_at:
            return
        job = self.jobs.get(job_id)
        if job is not None:  # restored from --state-dir: the retained status may know a later step
            if job.status.state == msg.state == "running" and (msg.step or 0) > (job.status.step or 0):
                job.status = job.status.model_copy(update={"step": msg.step, "loss": msg.loss})
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
            if node_id in job.members and (job.plan is not None or job.status.recoveries):
                if job.fail_at is not None:
                    continue  # its members' failures are in: their grace ends in `tick`, which recovers or fails
                if self._recover(job, [node_id], f"node {node_id} {reason}"):
                    continue
            if node_id in job.members or (job.status.state == "planning" and node_id in job.nodes):
                self._finish(job, "failed", reason=f"node {node_id} {reason}")

    def _alive(self, node_id: str) -> bool:
        node = self.registry.nodes.get(node_id)
        return node is not None and node.online and not node.said_offline

    def _recover(self, job: Job, lost: list[str], reason: str) -> bool:
        """A running job that lost nodes goes on without them (issue 30): the survivors' workers are stopped,
        they profile again (a fresh rendezvous port, and their speeds as they are now), the same planner
        plans them (`_plan`), and they resume from the newest checkpoint they all hold (`resume_point`), so
        at most one checkpoint interval of work is lost. False (the caller fails the job): mode single, no
        survivor, or MAX_RECOVERIES already."""
        options = job.command.job
        survivors = [n for n in job.members if n not in lost and self._alive(n)]
        if options.mode == "single" or not survivors or len(job.status.recoveries) >= wire.MAX_RECOVERIES:
            return False
        survivors, step = resume_point(job, survivors)
        at_step = max([job.status.step or 0, *(s for s, _ in job.progress.values())])
        resumed = options.model_copy(update={"resume": step > 0, "resume_step": step or None})
        recovery = wire.Recovery(
            lost=sorted(lost), reason=shorten(reason), at_step=at_step, resumed_from=step, nodes=survivors
        )
        for node_id in job.nodes:  # lost ones (and any the last plan left out) let go of the job
            if node_id not in survivors and node_id in self.written:
                self._assign(node_id, None)
        attempt = time.time()
        job.restart(job.command.model_copy(update={"job": resumed}), survivors, attempt)
        assignments = {
            n: wire.Assignment(job_id=job.id, node_id=n, phase="profile", job=resumed, ts=attempt) for n in survivors
        }
        self._publish_status(
            job,
            state="planning",
            nodes=survivors,
            split=None,
            stages=None,
            step=step,
            recoveries=[*job.status.recoveries, recovery],
        )
        self._save(job, assignments)
        for node_id, assignment in assignments.items():
            self._assign(node_id, assignment)  # a node stops the attempt's worker and profiles anew
        self.metrics.recovered(job.id)
        log.warning("job %s: %s (%s)", job.id, recovery.describe(), reason)
        return True

    # -- commands ----------------------------------------------------------------------
    def _settling(self, now: float) -> bool:
        """Just (re)connected: the retained births (and the births of nodes whose will the broker published
        as it shut down) are still to come; commands wait (COMMAND_SETTLE)."""
        since = now - self.connected_at
        if not self.bus.connected.is_set() or since < COMMAND_SETTLE:
            return True
        return since < self.registry.timeout and any(n.said_offline for n in self.registry.nodes.values())

    def _hold(self, kind: str, cmd: wire.TrainCommand | wire.StopCommand) -> bool:
        """Keep `cmd` for later if commands are waiting (settling, or older ones held); True if kept."""
        if (self.held or self._settling(time.monotonic())) and len(self.held) < HELD_KEPT:
            self.held.append((kind, cmd))
            return True
        return False

    def _run_held(self, now: float) -> None:
        while self.held and not self._settling(now):
            kind, cmd = self.held.popleft()
            try:
                if isinstance(cmd, wire.TrainCommand):
                    self._train(cmd)
                else:
                    self._stop(cmd)
            except Exception as err:  # noqa: BLE001 - the handler boundary, as in `_locked`
                log.exception("handling a held command on cmd/%s failed", kind)
                self.bus.drop(f"cmd/{kind}", f"handler failed: {type(err).__name__}: {err}")

    def _on_train(self, _: str, cmd: wire.TrainCommand | None) -> None:
        if cmd is None:
            self.bus.drop("cmd/train", "an empty command")
            return
        if not self._hold("train", cmd):
            self._train(cmd)

    def _answer_taken(self, job_id: str) -> None:
        """A command for a job id already known (a duplicate, or a redelivery): counted, never run again, and
        answered with the job's status as it stands (a finished one's from `--state-dir`, report and all)."""
        self.bus.drop("cmd/train", f"job id {job_id!r} is taken")
        job = self.jobs.get(job_id)
        if job is not None:
            self._publish_status(job)
        elif job_id in self.rejected:
            self.bus.publish(wire.JOB_STATUS, job_id, self.rejected[job_id])
        elif self.o.state_dir is not None and (self.o.state_dir / "jobs" / f"{job_id}.json").is_file():
            try:
                status = wire.JobStatus.model_validate_json((self.o.state_dir / "jobs" / f"{job_id}.json").read_text())
            except (OSError, ValueError) as err:
                log.warning("cannot answer the duplicate command for %s: %s", job_id, err)
                return
            self.bus.publish(wire.JOB_STATUS, job_id, status)
        # else: a finished job kept without its report: its retained status (report and all) is the answer

    def _train(self, cmd: wire.TrainCommand) -> None:
        if cmd.job_id in self.jobs or cmd.job_id in self.finished or cmd.job_id in self.rejected:
            self._answer_taken(cmd.job_id)
            return
        busy = {n for j in self.jobs.values() for n in j.nodes}
        if cmd.nodes is not None:
            problems = [
                f"{n} is unknown"
                if n not in self.registry.nodes
                else f"{n} is offline"
                if not self.registry.nodes[n].online or self.registry.nodes[n].said_offline
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
        job.attempt = time.time()
        assignments = {
            n: wire.Assignment(job_id=job.id, node_id=n, phase="profile", job=cmd.job, ts=job.attempt) for n in nodes
        }
        self._save(job, assignments)
        self._publish_status(job)
        for node_id, assignment in assignments.items():
            self._assign(node_id, assignment)

    def _reject(self, cmd: wire.TrainCommand, nodes: list[str], problems: list[str]) -> None:
        """A command that cannot run: counted, and a failed status retained for whoever waits on it,
        within the last KEPT_REJECTED (no file: a flood of junk commands must not fill the disk)."""
        reason = shorten("; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))
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
        if not self._hold("stop", cmd):  # after the train commands that came before it
            self._stop(cmd)

    def _stop(self, cmd: wire.StopCommand) -> None:
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
        dims = master.dims
        if job.command.job.checkpoint_every is None and dims is not None:  # auto: a small share of the time
            every = checkpoint_interval(job.command.job, dims, plan, [job.profiles[n].profile for n in job.members])
            job.command = job.command.model_copy(
                update={"job": job.command.job.model_copy(update={"checkpoint_every": every})}
            )
            log.info("job %s checkpoints every %d steps", job.id, every)
        assignments = {
            node_id: wire.Assignment(
                job_id=job.id,
                node_id=node_id,
                phase="train",
                job=job.command.job,
                **dict(plan.rank_assignment(d, master.profile.address or "127.0.0.1", master.rendezvous_port)),
            )
            for d, node_id in enumerate(job.nodes)
        }
        self._save(job, assignments)
        for node_id, assignment in assignments.items():
            self._assign(node_id, assignment)
        self.metrics.planned(job.id, plan.predicted_step_seconds, job.members, plan.predicted)
        log.info("job %s planned: %s", job.id, plan.split.describe() if plan.split else plan.stages)
        self._publish_status(job, state="running", step=0, split=plan.split, stages=plan.stages, nodes=job.members)
        job.progress = {n: (0, time.monotonic()) for n in job.members}  # the watchdog's clocks start

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
            report=fitting(job.status, report),
            output=f"{job.members[0]}:{options.output}",
            loss=report.losses[-1],
            step=len(report.losses),
        )

    def _watch_progress(self, now: float) -> None:
        """The watchdog (from `tick`): a running job with a node that made no progress (no new step, no
        result) for `stall_limit` seconds fails, naming that node; `_finish` stops every worker."""
        for job in list(self.jobs.values()):
            if job.status.state != "running" or job.fail_at is not None or job.plan is None:
                continue
            limit = stall_limit(job.command.job, job.plan.predicted_step_seconds, self.o.stall_floor)
            stalled = [
                n
                for n in job.members
                # from its last step, or from the controller's (re)connect: nothing is heard while cut off
                if n not in job.results
                and n not in job.parts
                and now - max(job.progress.get(n, (0, now))[1], self.connected_at) > limit
            ]
            if not stalled:
                continue
            predicted = job.plan.predicted_step_seconds
            self._finish(
                job,
                "failed",
                reason=f"no progress for over {limit:.0f} s from "
                + ", ".join(f"node {n} (at step {job.progress[n][0]} of {job.command.job.steps})" for n in stalled)
                + f": the watchdog's limit is max({self.o.stall_floor:g} s, {STALL_STEPS:g} x the predicted step "
                + (f"{predicted:.3g} s" if predicted is not None else "(none)")
                + f") + 2 x the collective timeout {job.command.job.collective_timeout:g} s",
            )

    def _finish(self, job: Job, state: str, **update) -> None:
        self.jobs.pop(job.id, None)
        for node_id in job.nodes:
            if node_id in self.written:
                self._assign(node_id, None)
        if "reason" in update:
            update["reason"] = shorten(update["reason"])
        self._keep_finished(self._publish_status(job, state=state, **update))
        self._count_jobs()
        if self.o.state_dir is not None:  # its finished status is on disk (`_publish`): no longer in flight
            (self.o.state_dir / "running" / f"{job.id}.json").unlink(missing_ok=True)
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
        for path in sorted((self.o.state_dir / "running").glob("*.json")):
            try:
                record = RunningJob.model_validate_json(path.read_text())
            except (OSError, ValueError) as err:
                log.warning("removing unreadable %s: %s", path, err)
                path.unlink(missing_ok=True)
                continue
            if record.command.job_id in self.finished or path.stem != record.command.job_id:
                path.unlink(missing_ok=True)  # it finished after all (the file went a moment too late)
                continue
            self._restore(record)

    def _save(self, job: Job, assignments: dict[str, wire.Assignment]) -> None:
        """The job in flight and the assignments about to go out, to `--state-dir/running` first: a controller
        restarted at any moment knows every assignment on the wire (atomically: never half a file)."""
        if self.o.state_dir is None:
            return
        record = RunningJob(
            command=job.command,
            nodes=job.nodes,
            status=job.status,
            profiles=job.profiles,
            plan=job.plan,
            assignments={**{n: a for n, a in self.written.items() if a.job_id == job.id}, **assignments},
            attempt=job.attempt,
        )
        path = self.o.state_dir / "running" / f"{job.id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, record.model_dump_json())

    def _restore(self, record: RunningJob) -> None:
        """A job an earlier controller left in flight: its nodes train on (the collectives need no controller),
        so it is taken up where it is, never planned or assigned again: its assignments are this controller's
        own (their retained copies are echoes, and `_connected` publishes them again, which a node that handled
        them ignores), its nodes count as online until their retained status or their silence says otherwise,
        and their heartbeats and results come here."""
        job = Job(record.command, record.nodes)
        job.profiles, job.plan, job.attempt = dict(record.profiles), record.plan, record.attempt
        now = time.monotonic()
        if job.plan is not None:
            step = record.status.step or 0
            job.status = record.status.model_copy(
                update=dict(state="running", step=step, split=job.plan.split, stages=job.plan.stages, nodes=job.members)
            )
            job.progress = {n: (step, now) for n in job.members}
            self.metrics.planned(job.id, job.plan.predicted_step_seconds, job.members, job.plan.predicted)
        else:  # planning: the nodes' retained profiles come again, and it is planned when all are in
            job.status = record.status.model_copy(update={"state": "planning"})
        self.jobs[job.id] = job
        for node_id, assignment in record.assignments.items():
            self.written[node_id] = assignment
            self.sent[(node_id, assignment.job_id, assignment.phase, assignment.ts)] = None
        for node_id in job.nodes:
            self.registry.online(node_id, now)
        self.metrics.job(job.status, job.command.job.mode)
        log.info("job %s taken up from --state-dir: %s at step %s", job.id, job.status.state, job.status.step)


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
