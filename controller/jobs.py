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
