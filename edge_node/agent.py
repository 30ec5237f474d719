"""`xronos node`: the device agent.

The agent speaks MQTT, heartbeats, serves metrics, and runs all heavy work
(profiling, training) in one worker process under the device's CPU quota
(`edge_node.worker`, as `xronos run` does); the agent itself is not throttled,
so its heartbeats stay on time while the worker is. It only reads the job's
config and tokenizes its data before the worker starts. Lifecycle of a job here:

1. assignment phase `profile`: read the job's model config and data, start a
   worker that profiles this device at the job's shapes, publish the profile
   (retained) with a free rendezvous port, in case this node becomes rank 0;
2. assignment phase `train`: tell the waiting worker its rank, shard and
   rendezvous (or that it sits out); it joins the job's torch.distributed
   group and trains; every step it writes a progress line, which becomes a
   heartbeat and metrics here;
3. the worker ends: the node publishes its result (retained) and is idle again.
   A cleared assignment, or one for another job, stops a running worker; so
   does a new `profile` assignment for the same job: the controller restarting
   it (on the survivors of a lost node, from a checkpoint every node holds).

At start the node also profiles itself at a small reference shape, so the
registry shows each device's speed before any job. Bad assignments are logged,
counted and dropped; nothing a message says can stop the agent: a handler that
fails anyway is logged, counted and fails the job it was for, with the reason.

On a broker without ACLs anyone can clear or overwrite a node's retained
assignment. The controller counts such a forgery and puts its own assignment
back at once; so a message that would end the job in flight (a clear, another
job's assignment, or the job's restart) waits END_GRACE seconds, and is forgotten if the controller
re-sends the job's assignment meanwhile. What the agent keeps is bounded: the
inbox (the newest INBOX_SIZE messages: a retained topic's latest is what counts),
the assignments already handled, and the job directories (the last
KEPT_JOB_DIRS, each reduced to its worker log and result when the job ends).
"""

from __future__ import annotations

import collections
import logging
import queue
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from edge_node.memory import available_memory_bytes
from edge_node.metrics import NodeMetrics
from edge_node.worker_process import ProgressFile, WorkerProcess, free_port, start_worker, stop_all, warm_worker_server
from xronos.contract import wire
from xronos.contract.files import write_atomically
from xronos.contract.job import JobOptions
from xronos.contract.mqtt import BrokerSettings, Bus
from xronos.contract.profiles import REFERENCE_BATCH, REFERENCE_CONFIG, REFERENCE_SEQ, DeviceProfile
from xronos.contract.report import RankResult
from xronos.contract.splits import ModelDims

log = logging.getLogger("xronos.node")

END_GRACE = 2.0
"""Seconds a message that ends the job in flight waits for the controller to revert it (a forgery)."""
INBOX_SIZE = 64
HANDLED_KEPT = 256
KEPT_JOB_DIRS = 10
"""Job directories kept under WORKDIR/jobs (their worker logs, for troubleshooting); older ones go."""
KEPT_FILES = ("worker.log", "result.json")
"""What a finished job's directory keeps: the worker's log, and its result with every per-step series
(a long job's report in the job status holds its series thinned: `RunReport.series_every`)."""


class _Inbox:
    """The assignments the network thread hands the main loop: the newest `size`, the oldest dropped.

    The network thread must never block on a full queue (heartbeats and reconnects run there).
    """

    def __init__(self, size: int):
        self.items: collections.deque = collections.deque()
        self.size = size
        self.ready = threading.Condition()

    def put(self, item) -> bool:
        """Queue `item`; False when the oldest had to be dropped for it."""
        with self.ready:
            full = len(self.items) >= self.size
            if full:
                self.items.popleft()
            self.items.append(item)
            self.ready.notify()
            return not full

    def get(self, timeout: float):
        with self.ready:
            if not self.items and not self.ready.wait(timeout):
                raise queue.Empty
            if not self.items:
                raise queue.Empty
            return self.items.popleft()

    def __len__(self) -> int:
        return len(self.items)


class NodeOptions(BaseModel):
    node_id: wire.Id
    speed: float | None = Field(
        None,
        ge=0.001,
        le=1024,
        allow_inf_nan=False,
        description="Emulated CPU speed (1 = one full core), applied to the worker: 1 ms of each 1 s "
        "period (the kernel's longest) up to 1,024 cores.",
    )
    metrics_port: int | None = Field(None, ge=0, le=65535)
    address: str | None = Field(
        None, description="Address other nodes reach this one at (default: the one facing the broker)."
    )
    threads: int = Field(1, ge=1, le=1024)
    workdir: Path
    heartbeat_seconds: float = Field(2.0, ge=0.1, le=3600, allow_inf_nan=False)
    startup_profile: bool = True


class _Job:
    """The job this node is part of: its worker and files."""

    def __init__(self, job_id: str, job: JobOptions, directory: Path):
        self.id, self.job, self.dir = job_id, job, directory
        self.worker: WorkerProcess | None = None
        self.quota = None
        self.rank: int | None = None
        self.port: int | None = None
        self.profiled = False
        self.progress = ProgressFile(self.file("progress.jsonl"))
        self.step: int | None = None
        self.loss: float | None = None
        self.step_seconds: float | None = None
        self.dims: ModelDims | None = None
        self.resume_from: Path | None = None
        self.started = time.time()
        self.attempt: float | None = None
        """The `ts` of the profile assignment this part began with (results and profiles say it back)."""
        """The checkpoint `--resume` continues from, as the preflight found and verified it."""

    def file(self, name: str) -> Path:
        return self.dir / name


class NodeAgent:
    def __init__(self, options: NodeOptions, settings: BrokerSettings):
        self.o = options
        self.id = options.node_id
        self.metrics = NodeMetrics(self.id, subscribed=(wire.ASSIGNMENT.family,))
        self.bus = Bus(
            settings,
            client_id=f"xronos-node-{self.id}",
            will=(wire.NODE_STATUS, self.id, wire.NodeStatus(node_id=self.id, state="offline")),
            on_connect=self._born,
            on_invalid=self.metrics.dropped,
        )
        self.bus.subscribe(wire.ASSIGNMENT, self._assigned, ident=self.id)
        self.inbox = _Inbox(INBOX_SIZE)
        self.state = "idle"
        self.job: _Job | None = None
        self.stopping = threading.Event()
        self.handled: collections.OrderedDict[tuple[str, str, float], None] = collections.OrderedDict()
        """Keys of the assignments handled lately (a retained copy comes again after a reconnect)."""
        self.pending: tuple[wire.Assignment | None, float] | None = None
        """A message that ends the job in flight, and when it takes effect (END_GRACE)."""

    # -- MQTT side (network thread) ---------------------------------------------------
    def _born(self) -> None:
        self.bus.publish(wire.NODE_STATUS, self.id, wire.NodeStatus(node_id=self.id, state="online"))
        self._heartbeat()

    def _assigned(self, node_id: str, message: wire.Assignment | None) -> None:
        if not self.inbox.put(message):
            self.metrics.dropped(wire.ASSIGNMENT.family, "inbox full")
            log.warning("dropped the oldest queued assignment: %d are waiting", INBOX_SIZE)

    def _heartbeat(self) -> None:
        job = self.job if self.job is not None and self.job.id != "startup" else None
        checkpoint = None
        if job is not None:  # a job's preflight has imported it (and torch) already: the idle agent stays light
            checkpoint = _checkpoint_held(job)
        self.bus.publish(
            wire.HEARTBEAT,
            self.id,
            wire.Heartbeat(
                node_id=self.id,
                state=self.state,
                job_id=job.id if job else None,
                step=job.step if job else None,
                loss=job.loss if job else None,
                step_seconds=job.step_seconds if job else None,
                checkpoint=checkpoint,
            ),
        )

    # -- main loop -----------------------------------------------------------------
    def run(self) -> None:
        self.o.workdir.mkdir(parents=True, exist_ok=True)
        self._tidy_job_dirs()
        warm_worker_server()  # every job's worker is forked from it, its imports done once
        if self.o.metrics_port is not None:
            self.metrics.serve(self.o.metrics_port)
        self.bus.start(wait=None)  # keep trying until the broker is there
        beat = threading.Thread(target=self._beat, daemon=True)
        beat.start()
        try:
            if self.o.startup_profile:
                self._start_reference_profile()
            while not self.stopping.is_set():
                try:
                    message = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    pass
                else:
                    self._guarded(self._receive, message)
                if self.pending is not None and time.monotonic() >= self.pending[1]:
                    message, self.pending = self.pending[0], None
                    self._guarded(self._handle, message)
                self._guarded(self._poll, None)
        finally:
            self._end_job()
            if self.bus.connected.is_set():  # else the broker publishes the will once it notices
                self.bus.publish(
                    wire.NODE_STATUS, self.id, wire.NodeStatus(node_id=self.id, state="offline")
                ).wait_for_publish(2)
            self.bus.stop()
            self.metrics.close()

    def stop(self, *_) -> None:
        self.stopping.set()

    def _guarded(self, step, message: wire.Assignment | None) -> None:
        """The handler boundary: whatever a message (or a worker's files, for `_poll`) makes `step`
        raise is logged, counted (a message's) and fails the job it concerns with the reason."""
        try:
            step() if step == self._poll else step(message)
        except Exception as err:  # noqa: BLE001 - nothing a message or a file says may stop the agent
            log.exception("%s failed", step.__name__)
            if step != self._poll:
                self.metrics.dropped(wire.ASSIGNMENT.family, f"handler failed: {err}")
            job_id = message.job_id if message is not None else self.job.id if self.job is not None else None
            try:
                if job_id is None or job_id == "startup":
                    self._end_job()
                else:
                    self._fail(job_id, f"this node could not handle the job: {type(err).__name__}: {err}")
            except Exception:  # noqa: BLE001 - the broker or the disk failing too: the loop still goes on
                log.exception("could not fail job %s", job_id)

    def _beat(self) -> None:
        while not self.stopping.wait(self.o.heartbeat_seconds):
            job = self.job
            self.metrics.memory(job.worker.proc.pid if job is not None and job.worker is not None else None)
            if self.bus.connected.is_set():
                self._heartbeat()

    def _address(self) -> str:
        if self.o.address:
            return self.o.address
        sock = self.bus.client.socket()
        return sock.getsockname()[0] if isinstance(sock, socket.socket) else "127.0.0.1"

    # -- assignments -----------------------------------------------------------------
    def _receive(self, a: wire.Assignment | None) -> None:
        """A message from the inbox: at once, unless it would end the job in flight (see END_GRACE)."""
        job = self.job
        if job is None or job.id == "startup":
            self._handle(a)
        elif a is not None and a.job_id == job.id and not self._restarts(a):  # the controller's word on it
            if self.pending is not None:
                log.warning("job %s's assignment came again: ignoring the message that would have ended it", job.id)
                self.pending = None
            self._handle(a)
        else:  # a clear, another job, a restart: takes effect after the grace unless the controller reverts it
            self.pending = (a, self.pending[1] if self.pending else time.monotonic() + END_GRACE)

    def _restarts(self, a: wire.Assignment) -> bool:
        """A `profile` assignment not handled yet for the job in flight: the job starts over."""
        return a.phase == "profile" and (a.job_id, a.phase, a.ts) not in self.handled

    def _handle(self, a: wire.Assignment | None) -> None:
        if a is None:  # the controller cleared the assignment: the job is over for this node
            if self.job is not None and self.job.id != "startup":
                log.info("assignment for %s cleared; stopping its worker", self.job.id)
                self._end_job()
            return
        key = (a.job_id, a.phase, a.ts)
        if key in self.handled:  # a retained copy delivered again after a reconnect
            return
        self.handled[key] = None
        while len(self.handled) > HANDLED_KEPT:
            self.handled.popitem(last=False)
        if self.job is not None and self.job.id != a.job_id:
            log.info("new job %s replaces %s", a.job_id, self.job.id)
            self._end_job()
        elif self.job is not None and a.phase == "profile":  # its worker must not train on beside the new one
            log.info("job %s restarts; stopping its worker", a.job_id)
            self._end_job()
        if a.phase == "profile":
            self._profile_for(a)
        elif self.job is None or not self.job.profiled:
            self._fail(a.job_id, "a training assignment came before this node was asked to profile for the job")
        else:
            self._train(a)

    def _profile_for(self, a: wire.Assignment) -> None:
        from safetensors.torch import save_file

        from edge_node.preflight import job_inputs
        from xronos.contract.errors import XronosError

        job = _Job(a.job_id, a.job, self.o.workdir / "jobs" / a.job_id)
        shutil.rmtree(job.dir, ignore_errors=True)
        job.dir.mkdir(parents=True)
        self._prune_job_dirs()
        self.job, self.state = job, "profiling"
        try:
            dims, rows, resume_from = job_inputs(a.job)
            save_file({"input_ids": rows}, job.file("rows.safetensors"))
        except (XronosError, OSError, ValueError) as err:  # the user's mistakes; anything else: `_guarded`
            self._fail(a.job_id, str(err))
            return
        job.dims, job.resume_from, job.attempt = dims, resume_from, a.ts
        job.port = free_port(self._address())
        self._start_worker(job, a.job, plan=True)

    def _start_reference_profile(self) -> None:
        from transformers import LlamaConfig

        ref = self.o.workdir / "reference-model"
        if not (ref / "config.json").is_file():
            LlamaConfig(**dict[str, Any](REFERENCE_CONFIG)).save_pretrained(ref)
        job = _Job(
            "startup",
            JobOptions(
                model=str(ref),
                data="-",
                output=str(self.o.workdir / "unused"),
                batch_size=REFERENCE_BATCH,
                seq_len=REFERENCE_SEQ,
            ),
            self.o.workdir / "startup",
        )
        shutil.rmtree(job.dir, ignore_errors=True)
        job.dir.mkdir(parents=True)
        self.job, self.state = job, "profiling"
        self._start_worker(job, job.job, plan=False)

    def _start_worker(self, job: _Job, options: JobOptions, plan: bool) -> None:
        from edge_node.trainer import WorkerSpec

        spec = WorkerSpec(
            job=options,
            device=0,
            name=self.id,
            speed_hint=self.o.speed,
            memory_bytes=available_memory_bytes(),
            profile_file=str(job.file("profile.json")),
            plan_file=str(job.file("plan.json")) if plan else None,
            rows_file=str(job.file("rows.safetensors")),
            resume_from=str(job.resume_from) if job.resume_from is not None else None,
            result_file=str(job.file("result.json")),
            progress_file=str(job.file("progress.jsonl")),
            threads=self.o.threads,
            replicate_checkpoints=True,  # every node keeps the whole checkpoint: it must outlive any one node
        )
        job.worker, job.quota = start_worker(
            spec,
            job.file("spec.json"),
            job.file("worker.log"),
            self.o.speed,
            f"xronos-node-{self.id}-{job.id}",
            threads=self.o.threads,
            loopback=self._address().startswith("127."),
        )

    def _train(self, a: wire.Assignment) -> None:
        job = self.job
        if job is None or job.worker is None:  # _assigned routes a train phase to the job it profiled
            raise RuntimeError(f"a training assignment for {a.job_id} with no job profiling here")
        job.rank = a.rank
        write_atomically(job.file("plan.json"), a.rank_assignment().model_dump_json())
        if a.rank is None:
            log.info("job %s leaves this node out", a.job_id)
            self._end_job()
            return
        job.worker.rank = a.rank
        self.state = "training"
        self.metrics.training.labels(self.id).set(1)
        log.info("job %s: rank %d of %d", a.job_id, a.rank, a.world_size)
        self._heartbeat()

    # -- watching the worker ------------------------------------------------------------
    def _poll(self) -> None:
        job = self.job
        if job is None or job.worker is None:
            return
        if not job.profiled and job.file("profile.json").is_file():
            job.profiled = True
            profile = DeviceProfile.model_validate_json(job.file("profile.json").read_text())
            profile = profile.model_copy(update={"address": self._address()})
            startup = job.id == "startup"
            self.bus.publish(
                wire.PROFILE,
                self.id,
                wire.ProfileMessage(
                    node_id=self.id,
                    profile=profile,
                    job_id=None if startup else job.id,
                    dims=None if startup else job.dims,
                    rendezvous_port=None if startup else job.port,
                    attempt=None if startup else job.attempt,
                ),
            )
        self._read_progress(job)
        rc = job.worker.proc.poll()
        if rc is None:
            return
        if job.id == "startup":
            if rc != 0:
                log.warning("start-up profile failed: %s", job.worker.cause())
            self._end_job()
        elif rc == 0 and job.rank is not None:
            self._read_progress(job)
            result = RankResult.model_validate_json(job.file("result.json").read_text())
            # a long job's result goes in parts
            for part in wire.result_parts(job.id, self.id, result, attempt=job.attempt):
                self.bus.publish(wire.RESULT, self.id, part)
            log.info("job %s done", job.id)
            self._end_job()
        elif rc != 0:
            self._fail(job.id, job.worker.cause())

    def _read_progress(self, job: _Job) -> None:
        for step in job.progress.new_lines():
            job.step, job.loss, job.step_seconds = step["step"], step["loss"], step["step_seconds"]
            self.metrics.step(job.id, step)
            self._heartbeat()

    def _fail(self, job_id: str, why: str) -> None:
        log.warning("job %s failed here: %s", job_id, why)
        attempt = self.job.attempt if self.job is not None and self.job.id == job_id else None
        self.bus.publish(
            wire.RESULT,
            self.id,
            wire.NodeResult(job_id=job_id, node_id=self.id, ok=False, error=why[:2000], attempt=attempt),
        )
        self._end_job()

    def _end_job(self) -> None:
        job = self.job
        if job is not None:
            if job.worker is not None:
                stop_all([job.worker])
            if job.quota is not None:
                job.quota.close()
            _keep_only_logs(job.dir)
        self.job, self.state = None, "idle"
        self.metrics.training.labels(self.id).set(0)
        if self.bus.connected.is_set():
            self._heartbeat()

    # -- disk ---------------------------------------------------------------------------
    def _prune_job_dirs(self) -> None:
        """Keep the newest KEPT_JOB_DIRS job directories."""
        root = self.o.workdir / "jobs"
        dirs = sorted((p for p in root.iterdir() if p.is_dir()), key=_mtime) if root.is_dir() else []
        for old in dirs[:-KEPT_JOB_DIRS]:
            shutil.rmtree(old, ignore_errors=True)

    def _tidy_job_dirs(self) -> None:
        """At start: what an agent killed mid-job left (its rows, its specs, its CPU quota groups)."""
        from edge_node.cpu_quota import remove_stale_cgroups

        root = self.o.workdir / "jobs"
        for directory in [*(root.iterdir() if root.is_dir() else []), self.o.workdir / "startup"]:
            if directory.is_dir():
                _keep_only_logs(directory)
        self._prune_job_dirs()
        remove_stale_cgroups(f"xronos-node-{self.id}-", min_age=0.0)  # its workers died with that agent


def _checkpoint_held(job: _Job) -> int | None:
    """The newest checkpoint this node holds for `job`, for its heartbeat: one sealed since the job began
    here, or the one it resumed from (an older one under the same output is another job's, or an earlier
    attempt's that the survivors did not all reach)."""
    from edge_node.checkpoint import sealed_steps, step_of

    try:
        steps = sealed_steps(Path(job.job.output), since=job.started)
    except OSError:
        return None
    if job.resume_from is not None:
        steps.append(step_of(job.resume_from))
    return max(steps, default=None)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _keep_only_logs(directory: Path) -> None:
    """A finished job's directory: its worker log (README: troubleshooting) and result stay, the rest goes."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name in KEPT_FILES:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def run_node(options: NodeOptions, settings: BrokerSettings) -> int:
    agent = NodeAgent(options, settings)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.run()
    return 0
