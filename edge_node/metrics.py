"""A node's Prometheus metrics (docs/monitoring.md: base units, `_total` counters).

Every series carries `node` (the device's id), so one Prometheus job can scrape
many nodes and Grafana can group by device; what a job's steps measure also
carries `job_id` (not `job`: Prometheus gives every scraped series a `job`
label of its own, the scrape job's name). Fed from the worker's per-step
progress lines; served over HTTP on `--metrics-port`. A node keeps the series
of its last KEPT_JOBS jobs: Prometheus holds the history, and a long-lived agent
must not grow one series set per job forever.
"""

from __future__ import annotations

import collections

from prometheus_client import Counter, Gauge, Histogram

from edge_node.memory import available_memory_bytes, resident_bytes
from xronos.contract.metrics_http import MetricsEndpoint

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
KEPT_JOBS = 5

SHARD_GAUGES = {
    # progress-line key: (metric name, help)
    "kv_groups": (
        "xronos_shard_kv_groups",
        "KV groups' worth of attention in this node's shard (a row share counts as its fraction).",
    ),
    "mlp_columns": ("xronos_shard_mlp_columns", "MLP intermediate columns in this node's shard."),
    "vocab_rows": ("xronos_shard_vocab_rows", "Vocabulary rows of the LM head in this node's shard."),
    "layers": (
        "xronos_shard_layers",
        "Decoder layers this node's shard spans (a pipeline stage's own; all of them under TP).",
    ),
    "param_bytes": ("xronos_shard_parameter_bytes", "Bytes of the parameters this node holds."),
}


class NodeMetrics(MetricsEndpoint):
    def __init__(self, node_id: str, subscribed: tuple[str, ...] = ()):
        super().__init__()
        r, per_job = self.registry, ["node", "job_id"]
        self.node_id = node_id
        self.step_seconds = Histogram(
            "xronos_step_seconds", "Wall time of a training step.", buckets=STEP_BUCKETS, registry=r, labelnames=per_job
        )
        self.compute = Counter(
            "xronos_compute_seconds",
            "Seconds computing (step time outside collectives).",
            registry=r,
            labelnames=per_job,
        )
        self.comm = Counter(
            "xronos_comm_seconds",
            "Seconds inside collectives (including waiting in them).",
            registry=r,
            labelnames=per_job,
        )
        self.idle = Counter(
            "xronos_idle_seconds",
            "Seconds waiting for the slowest device at sync points.",
            registry=r,
            labelnames=per_job,
        )
        self.stall = Counter(
            "xronos_stall_seconds",
            "pp jobs: seconds a stage's compute waited for a neighbour "
            "stage's activations or gradients (the computation stall).",
            registry=r,
            labelnames=per_job,
        )
        self.idle_ratio = Gauge(
            "xronos_idle_ratio", "Idle share of the last step (0..1).", registry=r, labelnames=per_job
        )
        self.tokens = Counter("xronos_tokens", "Tokens this node's shard trained on.", registry=r, labelnames=per_job)
        self.loss = Gauge("xronos_loss", "Loss of the last step.", registry=r, labelnames=per_job)
        self.steps = Gauge("xronos_step", "The last step this node finished.", registry=r, labelnames=per_job)
        self.shard = {
            key: Gauge(name, doc, registry=r, labelnames=per_job) for key, (name, doc) in SHARD_GAUGES.items()
        }
        self.training = Gauge("xronos_training", "1 while this node trains a job.", registry=r, labelnames=["node"])
        self.worker_memory = Gauge(
            "xronos_worker_resident_memory_bytes",
            "Resident memory of the node's worker process (profiling or training; 0 when none).",
            registry=r,
            labelnames=["node"],
        )
        self.available_memory = Gauge(
            "xronos_memory_available_bytes", "Memory the device has available.", registry=r, labelnames=["node"]
        )
        self.invalid = Counter(
            "xronos_invalid_messages",
            "Messages dropped for breaking the wire contract.",
            registry=r,
            labelnames=["node", "topic"],
        )
        self.training.labels(node_id).set(0)
        self.memory(None)
        for family in subscribed:
            self.invalid.labels(node_id, family)
        self.jobs: collections.OrderedDict[str, None] = collections.OrderedDict()

    def step(self, job_id: str, line: dict) -> None:
        """One progress line of the worker (`Trainer._log_progress`)."""
        labels = (self.node_id, job_id)
        self._keep(job_id)
        self.step_seconds.labels(*labels).observe(line["step_seconds"])
        self.compute.labels(*labels).inc(max(0.0, line["compute_seconds"]))
        self.comm.labels(*labels).inc(max(0.0, line["comm_seconds"]))
        self.idle.labels(*labels).inc(max(0.0, line["idle_seconds"]))
        if "stall_seconds" in line:
            self.stall.labels(*labels).inc(max(0.0, line["stall_seconds"]))
        self.idle_ratio.labels(*labels).set(
            line["idle_seconds"] / line["step_seconds"] if line["step_seconds"] > 0 else 0.0
        )
        self.tokens.labels(*labels).inc(line["tokens"])
        self.loss.labels(*labels).set(line["loss"])
        self.steps.labels(*labels).set(line["step"])
        for key, gauge in self.shard.items():
            if key in line:
                gauge.labels(*labels).set(line[key])

    def _keep(self, job_id: str) -> None:
        """Start a job's series (counters at zero) and forget those of the oldest beyond KEPT_JOBS."""
        if job_id in self.jobs:
            return
        self.jobs[job_id] = None
        for counter in (self.compute, self.comm, self.idle, self.tokens):
            counter.labels(self.node_id, job_id)
        while len(self.jobs) > KEPT_JOBS:
            old, _ = self.jobs.popitem(last=False)
            for metric in (
                self.step_seconds,
                self.compute,
                self.comm,
                self.idle,
                self.stall,
                self.idle_ratio,
                self.tokens,
                self.loss,
                self.steps,
                *self.shard.values(),
            ):
                try:
                    metric.remove(self.node_id, old)
                except KeyError:
                    pass

    def memory(self, worker_pid: int | None) -> None:
        """The worker's resident memory (the agent's own is `process_resident_memory_bytes`) and the device's free."""
        self.worker_memory.labels(self.node_id).set(resident_bytes(worker_pid) if worker_pid else 0)
        self.available_memory.labels(self.node_id).set(available_memory_bytes())

    def dropped(self, topic: str, why: str) -> None:
        self.invalid.labels(self.node_id, topic).inc()
