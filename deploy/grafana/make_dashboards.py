"""Write deploy/grafana/dashboards/xronos.json, the Grafana dashboard of a fine-tuning cluster.

    python deploy/grafana/make_dashboards.py          # rewrite the JSON
    python deploy/grafana/make_dashboards.py --check  # exit 1 if the committed JSON differs

The panels are data (PANELS below): a title, a unit and PromQL queries each;
the layout and Grafana's boilerplate come from one function. Plain dicts, no
SDK: twenty panels do not need a dependency whose API moves every release,
and the committed JSON (what Grafana loads) stays reviewable next to this.
`tests/test_monitoring.py` evaluates every query against a real Prometheus
scraping real jobs, and checks that the JSON is this script's output.

Queries use `$node` and `$job` (multi-value variables, "All" = `.*`) and
`$__rate_interval`. Metric names: README, "Metrics".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "xronos.json"
DATASOURCE = {"type": "prometheus", "uid": "xronos-prometheus"}
NODE, JOB = 'node=~"$node"', 'job_id=~"$job"'
RATE = "[$__rate_interval]"


def per_step(counter: str, by: str = "node") -> str:
    """Seconds of `counter` per training step, per `by`."""
    return (
        f"sum by ({by}) (rate({counter}{{{NODE}, {JOB}}}{RATE}))"
        f" / sum by ({by}) (rate(xronos_step_seconds_count{{{NODE}, {JOB}}}{RATE}))"
    )


def share_of_step(counter: str) -> str:
    """`counter`'s share (0..1) of each device's step time."""
    return (
        f"sum by (node) (rate({counter}{{{NODE}, {JOB}}}{RATE}))"
        f" / sum by (node) (rate(xronos_step_seconds_sum{{{NODE}, {JOB}}}{RATE}))"
    )


def quantile(q: float) -> str:
    return f"histogram_quantile({q}, sum by (job_id, le) (rate(xronos_step_seconds_bucket{{{NODE}, {JOB}}}{RATE})))"


# (row title, [(panel title, kind, unit, width, [(legend, expr)], options)])
PANELS = [
    (
        "Job",
        [
            (
                "Job state",
                "stat",
                "none",
                6,
                [("{{job_id}}: {{state}}", f"max by (job_id, state) (xronos_job_state{{{JOB}}}) == 1")],
                {"textMode": "name"},
            ),
            (
                "Step",
                "stat",
                "none",
                6,
                [
                    ("{{job_id}} step", f"max by (job_id) (xronos_job_step{{{JOB}}})"),
                    ("{{job_id}} of", f"max by (job_id) (xronos_job_steps{{{JOB}}})"),
                ],
                {},
            ),
            (
                "Loss",
                "timeseries",
                "none",
                12,
                [
                    ("{{job_id}}", f"max by (job_id) (xronos_job_loss{{{JOB}}})"),
                    ("{{node}}", f"xronos_loss{{{NODE}, {JOB}}}"),
                ],
                {},
            ),
            (
                "Step seconds: measured (p50, p95) beside the plan's prediction",
                "timeseries",
                "s",
                16,
                [
                    ("{{job_id}} p50", quantile(0.5)),
                    ("{{job_id}} p95", quantile(0.95)),
                    ("{{job_id}} last step", f"max by (job_id) (xronos_job_step_seconds{{{JOB}}})"),
                    ("{{job_id}} predicted", f"max by (job_id) (xronos_job_predicted_step_seconds{{{JOB}}})"),
                ],
                {},
            ),
            (
                "Jobs by state",
                "stat",
                "none",
                8,
                [("{{state}}", "sum by (state) (xronos_jobs)")],
                {"textMode": "value_and_name"},
            ),
        ],
    ),
    (
        "Devices",
        [
            (
                "Step of $node: compute, communication, idle (seconds per step)",
                "timeseries",
                "s",
                8,
                [
                    ("compute", per_step("xronos_compute_seconds_total")),
                    (
                        "communication",
                        f"({per_step('xronos_comm_seconds_total')}) - ({per_step('xronos_idle_seconds_total')})",
                    ),
                    ("idle", per_step("xronos_idle_seconds_total")),
                    ("predicted compute", f"max by (node) (xronos_node_predicted_compute_seconds{{{NODE}, {JOB}}})"),
                ],
                {"stack": True, "repeat": "node"},
            ),
            (
                "Idle ratio per device",
                "timeseries",
                "percentunit",
                12,
                [("{{node}}", share_of_step("xronos_idle_seconds_total"))],
                {},
            ),
            (
                "Computation stall ratio (pp jobs)",
                "timeseries",
                "percentunit",
                12,
                [("{{node}}", share_of_step("xronos_stall_seconds_total"))],
                {},
            ),
            (
                "Tokens per second",
                "timeseries",
                "suffix: tokens/s",
                12,
                [
                    ("{{node}}", f"sum by (node) (rate(xronos_tokens_total{{{NODE}, {JOB}}}{RATE}))"),
                    # every device of a job works on the same tokens: the cluster's rate is each job's once
                    ("cluster", f"sum(max by (job_id) (rate(xronos_tokens_total{{{NODE}, {JOB}}}{RATE})))"),
                ],
                {},
            ),
            (
                "Memory per device",
                "timeseries",
                "bytes",
                12,
                [
                    ("{{node}} worker", f"max by (node) (xronos_worker_resident_memory_bytes{{{NODE}}})"),
                    ("{{node}} available", f"max by (node) (xronos_memory_available_bytes{{{NODE}}})"),
                    ("{{instance}} agent", 'process_resident_memory_bytes{job="xronos-nodes"}'),
                ],
                {},
            ),
        ],
    ),
    (
        "Shards",
        [
            (
                "KV groups",
                "bargauge",
                "none",
                5,
                [("{{node}}", f"max by (node) (xronos_shard_kv_groups{{{NODE}, {JOB}}})")],
                {},
            ),
            (
                "MLP columns",
                "bargauge",
                "none",
                5,
                [("{{node}}", f"max by (node) (xronos_shard_mlp_columns{{{NODE}, {JOB}}})")],
                {},
            ),
            (
                "Vocabulary rows",
                "bargauge",
                "none",
                5,
                [("{{node}}", f"max by (node) (xronos_shard_vocab_rows{{{NODE}, {JOB}}})")],
                {},
            ),
            (
                "Layers",
                "bargauge",
                "none",
                4,
                [("{{node}}", f"max by (node) (xronos_shard_layers{{{NODE}, {JOB}}})")],
                {},
            ),
            (
                "Parameter bytes",
                "bargauge",
                "bytes",
                5,
                [("{{node}}", f"max by (node) (xronos_shard_parameter_bytes{{{NODE}, {JOB}}})")],
                {},
            ),
        ],
    ),
    (
        "Control plane",
        [
            (
                "Node liveness",
                "timeseries",
                "bool_on_off",
                8,
                [
                    ("{{node}} online", f"max by (node) (xronos_node_online{{{NODE}}})"),
                    ("{{instance}} scraped", 'up{job=~"xronos-.*"}'),
                ],
                {},
            ),
            (
                "Heartbeat lag",
                "timeseries",
                "s",
                8,
                [
                    ("{{node}} since last heartbeat", f"max by (node) (xronos_node_heartbeat_age_seconds{{{NODE}}})"),
                    (
                        "send to handling p95",
                        f"histogram_quantile(0.95, sum by (le) (rate(xronos_heartbeat_lag_seconds_bucket{RATE})))",
                    ),
                ],
                {},
            ),
            (
                "Invalid messages by topic",
                "timeseries",
                "suffix: messages",
                8,
                [("{{topic}}", f"sum by (topic) (increase(xronos_invalid_messages_total{RATE}))")],
                {},
            ),
        ],
    ),
]


def _panel(pid: int, title: str, kind: str, unit: str, targets: list, grid: dict, options: dict) -> dict:
    custom = {}
    if kind == "timeseries":
        custom = {
            "drawStyle": "line",
            "fillOpacity": 30 if options.get("stack") else 10,
            "lineWidth": 1,
            "showPoints": "never",
            "stacking": {"mode": "normal" if options.get("stack") else "none", "group": "A"},
        }
    panel = {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries"
        else {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            **({"textMode": options["textMode"]} if "textMode" in options else {}),
            **({"orientation": "horizontal"} if kind == "bargauge" else {}),
        },
    }
    if "repeat" in options:
        panel.update(repeat=options["repeat"], repeatDirection="h", maxPerRow=4)
    return panel


def _variable(name: str, label: str, metric: str, label_name: str) -> dict:
    query = f"label_values({metric}, {label_name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row in PANELS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for title, kind, unit, width, targets, options in row:
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(_panel(pid, title, kind, unit, targets, {"h": 8, "w": width, "x": x, "y": y}, options))
            pid, x = pid + 1, x + width
        y += 8
    return {
        "uid": "xronos-cluster",
        "title": "Xronos: fine-tuning across edge devices",
        "description": "Which device is the straggler, how each step splits into compute, communication and idle, "
        "whether the plan's prediction holds, and the control plane's health.",
        "tags": ["xronos"],
        "timezone": "browser",
        "editable": False,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "graphTooltip": 1,
        "templating": {
            "list": [
                _variable("node", "Node", "xronos_training", "node"),
                _variable("job", "Job", "xronos_job_state", "job_id"),
            ]
        },
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is not this script's output: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
