"""The controller's Prometheus metrics (docs/monitoring.md): nodes online, jobs by state,
predicted vs measured step time, invalid messages, and how late it handles heartbeats.

Per-job series carry `job_id` (Prometheus's own `job` label names the scrape
job). They are kept for the jobs in flight and the last KEPT_FINISHED finished
ones; Prometheus keeps the history, and a controller that runs for months must
not grow a series set per job forever. Per-node series carry `node`: a fleet is
tens of devices, not thousands.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from xronos.contract import wire
from xronos.contract.metrics_http import MetricsEndpoint

JOB_STATES = ("planning", "running", "completed", "failed", "stopped")
FINISHED_STATES = ("completed", "failed", "stopped")
KEPT_FINISHED = 20


class ControllerMetrics(MetricsEndpoint):
    def __init__(self):
        super().__init__()
        r = self.registry
        self.nodes_online = Gauge("xronos_nodes_online", "Nodes online (birth seen, heartbeats on time).", registry=r)
        self.nodes_known = Gauge("xronos_nodes_known", "Nodes the registry has seen.", registry=r)
        self.node_online = Gauge(
            "xronos_node_online", "1 while a known node is online, 0 once it is lost.", ["node"], registry=r
        )
        self.heartbeat_age = Gauge(
            "xronos_node_heartbeat_age_seconds",
            "Seconds since a node's last heartbeat (or birth) reached the controller.",
            ["node"],
            registry=r,
        )
        self.jobs = Gauge("xronos_jobs", "Jobs by state.", ["state"], registry=r)
        self.finished = Counter("xronos_jobs_finished", "Jobs that ended, by final state.", ["state"], registry=r)
        self.recoveries = Counter(
            "xronos_job_recoveries", "Times a job lost nodes and went on without them.", registry=r
        )
        self.job_state = Gauge(
            "xronos_job_state", "1 for a job's current state, 0 for the others.", ["job_id", "state"], registry=r
        )
        self.job_info = Gauge("xronos_job_info", "A job's mode (value 1).", ["job_id", "mode"], registry=r)
        self.job_step = Gauge("xronos_job_step", "The last step the job's nodes reported.", ["job_id"], registry=r)
        self.job_steps = Gauge("xronos_job_steps", "Steps the job was asked for.", ["job_id"], registry=r)
        self.job_loss = Gauge("xronos_job_loss", "Loss of the last reported step.", ["job_id"], registry=r)
        self.predicted = Gauge(
            "xronos_job_predicted_step_seconds", "The plan's predicted step time.", ["job_id"], registry=r
        )
        self.predicted_compute = Gauge(
            "xronos_node_predicted_compute_seconds",
            "The plan's predicted compute seconds per step of each node in a job.",
            ["job_id", "node"],
            registry=r,
        )
        self.measured = Gauge(
            "xronos_job_step_seconds",
            "Measured step time: the last step's while the job runs, the report's mean once it completed.",
            ["job_id"],
            registry=r,
        )
        self.idle_ratio = Gauge(
            "xronos_job_idle_ratio", "Measured mean idle ratio (0..1) of a completed job.", ["job_id"], registry=r
        )
        self.invalid = Counter(
            "xronos_invalid_messages",
            "Messages dropped (malformed, unknown node, bad command...).",
            ["topic"],
            registry=r,
        )
        self.heartbeat_lag = Histogram(
            "xronos_heartbeat_lag_seconds",
            "From a heartbeat's send time to its handling.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        for state in FINISHED_STATES:
            self.finished.labels(state)
        for topic in wire.TOPICS:
            self.invalid.labels(topic.family)
        self.job_nodes: dict[str, list[str]] = {}
        """The nodes each exported job has per-node series for."""
        self.job_modes: dict[str, str | None] = {}
        self.finished_jobs: collections.deque[str] = collections.deque()

    def dropped(self, topic: str, why: str) -> None:
        self.invalid.labels(topic).inc()

    def rejected(self) -> None:
        """A train command that could not run: it failed, but gets no per-job series (junk must not
        push the real jobs' series out of the kept window)."""
        self.finished.labels("failed").inc()

    def forget_node(self, node_id: str) -> None:
        """A node the registry forgot: its per-node series go too."""
        for gauge in (self.node_online, self.heartbeat_age):
            try:
                gauge.remove(node_id)
            except KeyError:
                pass

    def job_counts(self, states: Sequence[str]) -> None:
        for state in JOB_STATES:
            self.jobs.labels(state).set(states.count(state))

    def node(self, node_id: str, online: bool, heartbeat_age: float) -> None:
        self.node_online.labels(node_id).set(1 if online else 0)
        self.heartbeat_age.labels(node_id).set(max(0.0, heartbeat_age))

    def job(self, status: wire.JobStatus, mode: str | None = None, step_seconds: float | None = None) -> None:
        """A job's new status: state, step, loss, and the last step's time when a heartbeat carried it."""
        job_id = status.job_id
        if job_id not in self.job_nodes:
            self.job_nodes[job_id], self.job_modes[job_id] = [], mode
            if mode is not None:
                self.job_info.labels(job_id, mode).set(1)
        for state in JOB_STATES:
            self.job_state.labels(job_id, state).set(1 if status.state == state else 0)
        if status.steps is not None:
            self.job_steps.labels(job_id).set(status.steps)
        if status.step is not None:
            self.job_step.labels(job_id).set(status.step)
        if status.loss is not None:
            self.job_loss.labels(job_id).set(status.loss)
        if step_seconds is not None:
            self.measured.labels(job_id).set(step_seconds)
        if status.finished:
            self.finished.labels(status.state).inc()
            self.finished_jobs.append(job_id)
            while len(self.finished_jobs) > KEPT_FINISHED:
                self._forget(self.finished_jobs.popleft())

    def planned(
        self, job_id: str, predicted_step: float | None, nodes: list[str], predicted: list[float] | None
    ) -> None:
        if predicted_step is not None:
            self.predicted.labels(job_id).set(predicted_step)
        if predicted is not None:
            known = self.job_nodes.setdefault(job_id, [])
            known += [n for n in nodes if n not in known]
            for node_id, seconds in zip(nodes, predicted):
                self.predicted_compute.labels(job_id, node_id).set(seconds)

    def recovered(self, job_id: str) -> None:
        """A job re-planned on its survivors (a bounded counter: the job's status says which and when)."""
        self.recoveries.inc()

    def completed(self, job_id: str, mean_step_seconds: float, idle_ratio: float) -> None:
        self.measured.labels(job_id).set(mean_step_seconds)
        self.idle_ratio.labels(job_id).set(idle_ratio)

    def _forget(self, job_id: str) -> None:
        for node_id in self.job_nodes.pop(job_id, []):
            self.predicted_compute.remove(job_id, node_id)
        for state in JOB_STATES:
            self.job_state.remove(job_id, state)
        for gauge in (self.job_step, self.job_steps, self.job_loss, self.predicted, self.measured, self.idle_ratio):
            try:
                gauge.remove(job_id)
            except KeyError:
                pass
        mode = self.job_modes.pop(job_id, None)
        if mode is not None:
            self.job_info.remove(job_id, mode)
