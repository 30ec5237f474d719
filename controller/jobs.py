"""A job as the controller tracks it, and the pure rules about it: the watchdog's limit, which
failure is the root cause, the report that fits in a job status, the record a restart reads."""

from __future__ import annotations

import time

from pydantic import BaseModel

from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.report import RankResult, RunReport, thin_series
from xronos.planner.job_plan import JobPlan

MAX_REASON = 2000
"""Characters of a failure reason kept in a job status."""
STALL_STEPS = 20.0
"""The watchdog fails a running job when a node made no progress for this many predicted steps (or
`--stall-floor` seconds, if longer) plus twice the job's collective timeout (`stall_limit`)."""

PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "Gloo")


def is_peer_error(error: str) -> bool:
    """A failure that is the echo of another node's (a collective broken by a peer that died)."""
    return any(marker in error for marker in PEER_ERRORS)


def stall_limit(job: JobOptions, predicted_step_seconds: float | None, floor: float) -> float:
    """Seconds a running job's node may go without a new step before the watchdog fails the job.

    STALL_STEPS predicted steps (the prediction can be off several times over, and a device
    slowed 20-fold is as good as stalled), never under `floor` (steps of tiny jobs take
    milliseconds; scheduling and heartbeats take seconds), plus two collective timeouts: the
    longest pauses between two steps that are not stalls (the slowest device's load before the
    first step, a checkpoint or the final save, a re-shard's save and reload) must each fit in one
    collective timeout, as its peers wait for them in a collective (`JobOptions.collective_timeout`).
    """
    return max(floor, STALL_STEPS * (predicted_step_seconds or 0.0)) + 2 * job.collective_timeout


def shorten(text: str, limit: int = MAX_REASON) -> str:
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text):,} chars)"


class RunningJob(BaseModel):
    """A job in flight as `--state-dir/running/<job>.json` keeps it (written before its assignments go out,
    removed when it finishes): what a restarted controller needs to see it through without re-planning it."""

    command: wire.TrainCommand
    nodes: list[str]
    status: wire.JobStatus
    profiles: dict[str, wire.ProfileMessage] = {}
    plan: JobPlan | None = None
    assignments: dict[str, wire.Assignment] = {}
    attempt: float | None = None


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
        self.parts: dict[str, dict[int, wire.NodeResult]] = {}
        """The parts of a long result received so far, by node (`wire.result_parts`)."""
        self.progress: dict[str, tuple[int, float]] = {}
        """Per member while running: the last step it reported, and when (monotonic) it first did."""
        self.checkpoints: dict[str, int] = {}
        """Per member: the newest checkpoint step it holds, as its heartbeats say (`Heartbeat.checkpoint`)."""
        self.attempt: float | None = None
        """The `ts` of this attempt's profile assignments: results of an attempt before a recovery are echoes."""

    def restart(self, command: wire.TrainCommand, nodes: list[str], attempt: float) -> None:
        """Back to planning on `nodes` for the next attempt (a recovery): what the last one gathered is dropped."""
        self.command, self.nodes, self.attempt = command, nodes, attempt
        self.profiles, self.results, self.parts, self.failures = {}, {}, {}, {}
        self.plan, self.planning, self.fail_at = None, False, None
        self.progress = {}
        self.checkpoints = {n: step for n, step in self.checkpoints.items() if n in nodes}  # still on their disks
        self.started = time.monotonic()

    @property
    def id(self) -> str:
        return self.command.job_id

    @property
    def members(self) -> list[str]:
        """Participating nodes in rank order (all chosen nodes until planned)."""
        return [self.nodes[d] for d in self.plan.members] if self.plan else self.nodes


def failure_reason(job: Job) -> str:
    """The nodes' failures, root causes first. A member that sent none while the others' collectives
    broke or timed out is named first: frozen, unplugged or cut off, it is what they waited for."""
    ranked = sorted(job.failures.items(), key=lambda kv: is_peer_error(kv[1]))
    echoes = all(is_peer_error(e) or "timed out" in e.lower() or "timeout" in e.lower() for e in job.failures.values())
    silent = [n for n in job.members if n not in job.failures and n not in job.results and n not in job.parts]
    named = [f"node {n}: {e}" for n, e in ranked]
    if job.plan is not None and echoes and silent:
        named.insert(0, f"node {', '.join(silent)} reported nothing while its peers' collectives failed waiting")
    return "; ".join(named)


def lost_members(job: Job, alive) -> list[str]:
    """The members a failed attempt lost: gone from the broker (`alive` says no: a will, silence), or whose
    worker was killed by a signal (the kernel's OOM killer, a user's kill); the job can go on without them.
    None lost: the failure is the job's own (a worker's error), which another attempt would repeat."""
    return [
        n
        for n in job.members
        if not alive(n)
        or (n in job.failures and "was killed by" in job.failures[n] and not is_peer_error(job.failures[n]))
    ]


def resume_point(job: Job, survivors: list[str]) -> tuple[list[str], int]:
    """Who goes on and from which checkpoint step (0: from the start). Every rank keeps the whole checkpoint
    (docs/control-plane.md), so any survivor that holds one can resume; they go on from the newest step all of
    them hold (a node lost mid-save may leave the newest sealed on some only; each keeps the one before too).
    Survivors without a checkpoint while others have one are left out (nothing to load): the next job uses them."""
    held = [n for n in survivors if job.checkpoints.get(n)]
    if not held:
        return survivors, 0
    return held, min(job.checkpoints[n] for n in held)


def fitting(status: wire.JobStatus, report: RunReport) -> RunReport:
    """The report as the job's status carries it: its per-step series thinned (`thin_series`) until the
    status fits in one message; every aggregate of it stays computed from every step."""
    every = 1
    while True:
        fitted = thin_series(report, every)
        size = len(wire.JOB_STATUS.encode(status.model_copy(update={"report": fitted})))
        if size <= wire.MAX_PAYLOAD_BYTES - 4096 or every >= len(report.losses):
            return fitted
        every *= 2
