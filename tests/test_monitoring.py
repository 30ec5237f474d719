"""Monitoring, really run: the shipped Prometheus configuration, alert rules and Grafana
dashboard against a real Prometheus (Debian's package) scraping a real controller and
three real nodes through `tp`, `xronos` and `pp` jobs over Mosquitto.

Every PromQL expression of every dashboard must return data; every metric the README
lists must exist with its type; counters never go down; under the even split the fast
device waits for the slow one (its idle seconds exceed the slow device's).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from live_cluster import node_process, train_by_command, wait_for, xronos_process
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_node.toy_model import make_data, make_model
from edge_node.worker_process import free_port, stop_processes
from xronos.mosquitto import Mosquitto

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
NODES = {"fast": 1.0, "mid": 0.5, "slow": 0.25}
USERS = {"controller": "ctl-pw", "operator": "op-pw", **{n: f"{n}-pw" for n in NODES}}
STEPS, SEQ_LEN, BATCH = 10, 64, 8
MODEL = dict(hidden=256, layers=2, heads=8, kv_heads=4, intermediate=1024, vocab=320, tie=True)
"""Big enough that the work between two all-reduces (about 10 ms on a full core) far exceeds a 0.25
quota's 1 ms per 4 ms period: smaller pieces fit in one period's quota and a slow device is not slower."""
GRAFANA_VARIABLES = {"$node": ".*", "$job": ".*", "$__rate_interval": "5s"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (apt-get install --no-install-recommends prometheus; .ci/run does)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=PROMETHEUS_DIR, timeout=120)


def test_shipped_prometheus_config_and_alert_rules_pass_promtool():
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "alerts_test.yml"),
    ):
        result = _promtool(*args)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_every_alert_has_a_firing_and_a_quiet_case_in_the_promtool_tests():
    alerts = {
        r["alert"]
        for g in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    cases = [
        case
        for test in yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    assert alerts == {"XronosNodeDown", "XronosStraggler", "XronosPlanOff", "XronosInvalidMessages", "XronosJobFailed"}
    for alert in alerts:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert} is never tested firing"
        assert any(not c["exp_alerts"] for c in mine), f"{alert} is never tested quiet"


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA_DIR / "dashboards").glob("*.json"))}


def panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield from [panel, *panel.get("panels", [])]


def test_dashboards_are_the_generators_output_with_a_unit_on_every_panel_and_the_provisioned_datasource():
    result = subprocess.run(
        [sys.executable, str(GRAFANA_DIR / "make_dashboards.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    datasource = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "xronos.yml").read_text())[
        "datasources"
    ][0]
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "xronos.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert dashboards(), "no dashboard under deploy/grafana/dashboards"
    for name, dashboard in dashboards().items():
        assert {v["name"] for v in dashboard["templating"]["list"]} >= {"node", "job"}, name
        for panel in panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{name}: panel {panel['title']!r} has no unit"
            assert panel["datasource"]["uid"] == datasource["uid"], f"{name}: panel {panel['title']!r}"
            assert panel["targets"], f"{name}: panel {panel['title']!r} has no query"


# -- a live cluster, scraped ---------------------------------------------------------------
class Scraper(threading.Thread):
    """Reads every endpoint twice a second with prometheus_client's parser, keeping each read."""

    def __init__(self, endpoints: dict[str, int]):
        super().__init__(daemon=True)
        self.endpoints, self.reads = endpoints, {name: [] for name in endpoints}
        self.types: dict[str, dict[str, str]] = {name: {} for name in endpoints}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            for name, port in self.endpoints.items():
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                except OSError:
                    continue
                samples = {}
                for family in text_string_to_metric_families(text):
                    self.types[name][family.name] = family.type
                    for s in family.samples:
                        samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                self.reads[name].append(samples)

    def last(self, name: str) -> dict:
        return self.reads[name][-1]


def start_prometheus(root: Path, controller_port: int, node_ports: dict[str, int]) -> tuple[subprocess.Popen, str]:
    """Prometheus with the shipped configuration, its targets pointed at this test's ports.

    The controller keeps its static target; the nodes come through the shipped file_sd
    glob (`targets/*.json`, relative to the config), as `xronos deploy` lists them.
    """
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed (apt-get install --no-install-recommends prometheus; .ci/run does)")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["xronos-controller"]["static_configs"][0]["targets"] = [f"127.0.0.1:{controller_port}"]
    jobs["xronos-nodes"]["static_configs"] = []
    jobs["xronos-nodes"]["file_sd_configs"][0]["refresh_interval"] = "1s"
    (root / "targets").mkdir()
    (root / "targets" / "nodes.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{p}" for p in node_ports.values()], "labels": {"role": "node"}}])
    )
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(root / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, (root / "prometheus.log").read_text()[-2000:]
        try:
            return urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    wait_for(ready, 30, "Prometheus to be ready")
    return proc, url


def prom(url: str, path: str, **params) -> dict:
    query = urllib.parse.urlencode(params, doseq=True)
    answer = json.loads(urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=30).read())
    assert answer["status"] == "success", answer
    return answer["data"]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """Mosquitto, a controller, nodes fast/mid/slow (speeds 1, 0.5, 0.25), Prometheus and a scraper,
    through a `tp`, an `xronos` and a `pp` job triggered by `xronos train --wait`."""
    root = tmp_path_factory.mktemp("monitored")
    model = make_model(root / "model", **MODEL, seed=1)
    data = make_data(root / "rows.jsonl", rows=STEPS * BATCH, seq_len=SEQ_LEN + 4, vocab=MODEL["vocab"], seed=3)
    with Mosquitto(users=USERS) as broker:
        ports = {"controller": free_port(), **{n: free_port() for n in NODES}}
        procs = [
            xronos_process(
                "controller",
                "--metrics-port",
                str(ports["controller"]),
                user="controller",
                password=USERS["controller"],
                url=broker.url,
                log=root / "controller.log",
            )
        ]
        for node, speed in NODES.items():
            procs.append(
                node_process(node, root, broker.url, USERS[node], "--speed", str(speed), metrics_port=ports[node])
            )
        scraper = Scraper(ports)
        prometheus = None
        try:
            prometheus, url = start_prometheus(root, ports["controller"], {n: ports[n] for n in NODES})
            scraper.start()

            def all_online():
                return scraper.reads["controller"] and scraper.last("controller").get(("xronos_nodes_online", ())) == 3

            wait_for(all_online, 120, "the controller to see the three nodes online", poll=0.5)
            start = time.time()
            jobs = {}
            for mode in ("tp", "xronos", "pp"):
                jobs[mode] = f"mon-{mode}"
                result = train_by_command(
                    broker.url,
                    USERS["operator"],
                    model,
                    data,
                    root / f"out-{mode}",
                    jobs[mode],
                    "--mode",
                    mode,
                    *(("--layouts", "tp") if mode == "xronos" else ()),  # every node's panels, not one device's
                    "--nodes",
                    ",".join(NODES),
                    steps=STEPS,
                    seq_len=SEQ_LEN,
                    batch_size=BATCH,
                    log=root / f"train-{mode}.log",
                )
                assert result.returncode == 0, result.stdout + result.stderr
            time.sleep(3)  # the last steps scraped and the rules evaluated once more
            yield dict(url=url, start=start, end=time.time(), scraper=scraper, jobs=jobs, root=root)
        finally:
            scraper.stopping.set()
            stop_processes(procs + ([prometheus] if prometheus else []), grace=15)


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, Grafana's variables replaced by match-all values."""
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
            out.append((panel["title"], expr))
    return out


def test_every_dashboard_query_returns_data_from_prometheus_scraping_live_jobs(monitored):
    missing = []
    for name, dashboard in dashboards().items():
        for title, expr in expressions(dashboard):
            data = prom(
                monitored["url"], "query_range", query=expr, start=monitored["start"], end=monitored["end"], step=1
            )
            if not data["result"]:
                missing.append(f"{name}: {title}: {expr}")
        for variable in dashboard["templating"]["list"]:
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"]).groups()
            values = prom(monitored["url"], "label/" + label + "/values", **{"match[]": metric})
            if not values:
                missing.append(f"{name}: variable {variable['name']}: no {label} on {metric}")
    assert not missing, "queries that returned no data:\n" + "\n".join(missing)
    jobs = prom(monitored["url"], "label/job_id/values", **{"match[]": "xronos_job_state"})
    assert set(monitored["jobs"].values()) <= set(jobs)


def test_alert_rules_evaluate_cleanly_against_the_live_metrics(monitored):
    groups = prom(monitored["url"], "rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} >= {"XronosNodeDown", "XronosStraggler", "XronosPlanOff", "XronosJobFailed"}
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"


def readme_metrics() -> dict[str, str]:
    """The documented metric table (docs/monitoring.md, which the README links): name -> type
    (counter, gauge, histogram)."""
    text = (REPO / "docs" / "monitoring.md").read_text()
    rows = re.findall(r"^\| `(xronos_\w+|process_\w+)` \| (counter|gauge|histogram) \|", text, flags=re.M)
    assert len(rows) >= 20, "the metric table of docs/monitoring.md is missing or short"
    return dict(rows)


def family_name(name: str, kind: str) -> str:
    """The family name prometheus_client's parser gives a metric as PromQL spells it."""
    return name.removesuffix("_total") if kind == "counter" else name


def test_every_readme_metric_is_served_with_its_type_and_counters_never_decrease(monitored):
    scraper = monitored["scraper"]
    served = {}
    for endpoint in scraper.endpoints:
        served.update(scraper.types[endpoint])
    for name, kind in readme_metrics().items():
        family = family_name(name, kind)
        assert family in served, f"{name} (README) is not served by the controller or the nodes"
        assert served[family] == kind, f"{name}: README says {kind}, served as {served[family]}"
    cumulative = re.compile(r".*(_total|_count|_sum|_bucket)$")
    for endpoint, reads in scraper.reads.items():
        assert len(reads) > 20, f"{endpoint}: only {len(reads)} scrapes"
        for before, after in zip(reads, reads[1:]):
            for key, value in before.items():
                if cumulative.match(key[0]) and not key[0].startswith("process_") and key in after:
                    assert after[key] >= value, f"{endpoint}: {key} went down from {value} to {after[key]}"


def test_under_the_even_split_the_fast_device_idles_more_than_the_slow_one(monitored):
    scraper, job = monitored["scraper"], monitored["jobs"]["tp"]
    idle = {n: scraper.last(n)[("xronos_idle_seconds_total", (("job_id", job), ("node", n)))] for n in NODES}
    assert idle["fast"] > idle["slow"], idle
    steps = {n: scraper.last(n)[("xronos_step_seconds_count", (("job_id", job), ("node", n)))] for n in NODES}
    assert set(steps.values()) == {float(STEPS)}, steps
    stall = [key for n in NODES for key in scraper.last(n) if key[0] == "xronos_stall_seconds_total"]
    assert stall and all(dict(key[1])["job_id"] == monitored["jobs"]["pp"] for key in stall), stall


def _free_port_pair() -> int:
    """A port P with P + 1 free too (`xronos run --metrics-port P` serves device d on P + d): a port that
    free_port alone picks can have its neighbour taken by another test's process."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def test_xronos_run_serves_each_devices_metrics_while_it_runs(model_dir, data_file, tmp_path):
    port = _free_port_pair()
    cmd = [
        sys.executable,
        "-m",
        "xronos.cli",
        "run",
        "--model",
        str(model_dir("gqa_tied")),
        "--data",
        str(data_file),
        "--nodes",
        "2",
        "--mode",
        "tp",
        "--steps",
        "40",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--no-shuffle",
        "--output",
        str(tmp_path / "out"),
        "--quiet",
        "--metrics-port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def device_1_stepped():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=1).read().decode()
            except OSError:
                return None
            counts = [
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "xronos_step_seconds_count" and s.labels["node"] == "device-1"
            ]
            return counts and counts[0] >= 1

        wait_for(device_1_stepped, 120, "device-1's metrics to count a step", poll=0.05)
        out, _ = proc.communicate(timeout=300)
    finally:
        stop_processes([proc])
    assert proc.returncode == 0, out
    assert re.search(rf"metrics of device-0 \(run-\w+\): http://127\.0\.0\.1:{port}/metrics", out), out
    assert "metrics of device-1" in out and f":{port + 1}/metrics" in out


def test_the_controller_keeps_the_series_of_the_last_finished_jobs_and_counts_every_end():
    from controller.metrics import KEPT_FINISHED, ControllerMetrics
    from xronos.contract import wire

    metrics = ControllerMetrics()
    jobs = [f"job-{i}" for i in range(KEPT_FINISHED + 5)]
    for i, job_id in enumerate(jobs):
        running = wire.JobStatus(job_id=job_id, state="running", steps=4, step=2, loss=1.5)
        metrics.job(running, "xronos", step_seconds=0.5)
        metrics.planned(job_id, 0.4, ["a", "b"], [0.3, 0.2])
        metrics.planned(job_id, 0.4, ["a", "b"], [0.3, 0.2])  # a second plan of the same job
        metrics.job(running.model_copy(update={"state": "failed" if i % 5 == 0 else "completed"}), "xronos")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    exported = {s.labels["job_id"] for s in families["xronos_job_state"].samples}
    assert exported == set(jobs[-KEPT_FINISHED:])
    assert {s.labels["job_id"] for s in families["xronos_node_predicted_compute_seconds"].samples} == exported
    finished = {
        s.labels["state"]: s.value
        for s in families["xronos_jobs_finished"].samples
        if s.name == "xronos_jobs_finished_total"
    }
    assert finished == {"completed": 20.0, "failed": 5.0, "stopped": 0.0}
