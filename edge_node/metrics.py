"""A node's Prometheus metrics (names in DESIGN.md: base units, `_total` counters).

Each node labels its series with `node` (its id), so one Prometheus job can
scrape many nodes and Grafana can group by device. Fed from the worker's
per-step progress lines; served over HTTP on `--metrics-port`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from xronos.metrics_http import MetricsEndpoint

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class NodeMetrics(MetricsEndpoint):
    def __init__(self, node_id: str):
        super().__init__()
        r, label = self.registry, {"labelnames": ["node"]}
        self.step_seconds = Histogram("xronos_step_seconds", "Wall time of a training step.", buckets=STEP_BUCKETS, registry=r, **label)
        self.compute = Counter("xronos_compute_seconds", "Seconds computing (step time outside collectives).", registry=r, **label)
        self.comm = Counter("xronos_comm_seconds", "Seconds inside collectives (including waiting in them).", registry=r, **label)
        self.idle = Counter("xronos_idle_seconds", "Seconds waiting for the slowest device at sync points.", registry=r, **label)
        self.idle_ratio = Gauge("xronos_idle_ratio", "Idle share of the last step.", registry=r, **label)
        self.tokens = Counter("xronos_tokens", "Tokens trained on.", registry=r, **label)
        self.loss = Gauge("xronos_loss", "Loss of the last step.", registry=r, **label)
        self.kv_groups = Gauge("xronos_shard_kv_groups", "KV groups in this node's shard.", registry=r, **label)
        self.mlp_columns = Gauge("xronos_shard_mlp_columns", "MLP columns in this node's shard.", registry=r, **label)
        self.training = Gauge("xronos_training", "1 while this node trains a job.", registry=r, **label)
        self.invalid = Counter("xronos_invalid_messages", "Messages dropped for breaking the wire contract.",
                               registry=r, labelnames=["node", "topic"])
        self.node_id = node_id

    def step(self, line: dict) -> None:
        n = self.node_id
        self.step_seconds.labels(n).observe(line["step_seconds"])
        self.compute.labels(n).inc(max(0.0, line["compute_seconds"]))
        self.comm.labels(n).inc(max(0.0, line["comm_seconds"]))
        self.idle.labels(n).inc(line["idle_seconds"])
        self.idle_ratio.labels(n).set(line["idle_seconds"] / line["step_seconds"] if line["step_seconds"] > 0 else 0.0)
        self.tokens.labels(n).inc(line["tokens"])
        self.loss.labels(n).set(line["loss"])

    def shard(self, kv_groups: int, mlp_columns: int) -> None:
        self.kv_groups.labels(self.node_id).set(kv_groups)
        self.mlp_columns.labels(self.node_id).set(mlp_columns)

    def dropped(self, topic: str, why: str) -> None:
        self.invalid.labels(self.node_id, topic).inc()
