"""The controller's Prometheus metrics (DESIGN.md): nodes online, jobs by state,
predicted vs measured step time, invalid messages, and how late it handles heartbeats."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from xronos.metrics_http import MetricsEndpoint

JOB_STATES = ("planning", "running", "completed", "failed", "stopped")


class ControllerMetrics(MetricsEndpoint):
    def __init__(self):
        super().__init__()
        r = self.registry
        self.nodes_online = Gauge("xronos_nodes_online", "Nodes online (birth seen, heartbeats on time).", registry=r)
        self.nodes_known = Gauge("xronos_nodes_known", "Nodes the registry has seen.", registry=r)
        self.jobs = Gauge("xronos_jobs", "Jobs by state.", ["state"], registry=r)
        self.predicted = Gauge("xronos_job_predicted_step_seconds", "The plan's predicted step time.", ["job"], registry=r)
        self.measured = Gauge("xronos_job_step_seconds", "Measured mean step time of a completed job.", ["job"], registry=r)
        self.idle_ratio = Gauge("xronos_job_idle_ratio", "Measured mean idle ratio of a completed job.", ["job"], registry=r)
        self.invalid = Counter("xronos_invalid_messages", "Messages dropped (malformed, unknown node, bad command...).",
                               ["topic"], registry=r)
        self.heartbeat_lag = Histogram("xronos_heartbeat_lag_seconds", "From a heartbeat's send time to its handling.",
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                       registry=r)

    def dropped(self, topic: str, why: str) -> None:
        self.invalid.labels(topic).inc()

    def job_counts(self, states: list[str]) -> None:
        for state in JOB_STATES:
            self.jobs.labels(state).set(states.count(state))
