"""`xronos demo`: the whole system on one machine, with nothing but the package installed.

It starts what a deployment runs on many machines: the embedded MQTT broker,
the controller, and three node agents (`xronos node`, one process each) whose
workers run under CPU quotas of different speeds. It makes a small Llama
model and a learnable data set, then triggers two training jobs by MQTT
command exactly as an operator would (`xronos train --wait`): the even
tensor-parallel split (`tp`) and the speed-aware one (`xronos`), and prints
both side by side. Every process it started is stopped at the end (and dies
with it if it is killed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypedDict

from controller.service import Controller, ControllerOptions
from edge_node.toy_model import make_data, make_model
from edge_node.worker_process import die_with_parent, free_port, stop_processes
from xronos.broker import EmbeddedBroker
from xronos.contract import wire
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.lora import LoraOptions
from xronos.contract.mqtt import BrokerSettings
from xronos.operator import submit
from xronos.summary import print_report, print_side_by_side


class _ModelSizes(TypedDict):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


DEMO_MODEL: _ModelSizes = dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768, vocab=2048)
SEQ_LEN, BATCH = 64, 8
DEMO_USER, DEMO_PASSWORD = "xronos-demo", "demo-only-password"


def _start_node(
    root: Path, node_id: str, speed: float, settings: BrokerSettings, metrics_port: int
) -> subprocess.Popen:
    log = (root / f"{node_id}.log").open("wb")
    cmd = [
        sys.executable,
        "-m",
        "xronos.cli",
        "node",
        "--node-id",
        node_id,
        "--speed",
        str(speed),
        "--workdir",
        str(root / "nodes" / node_id),
        "--broker",
        settings.broker,
        "--metrics-port",
        str(metrics_port),
    ]
    if settings.username is None or settings.password is None:
        raise XronosError("the demo's nodes need the broker's username and password")
    env_auth = {"XRONOS_USERNAME": settings.username, "XRONOS_PASSWORD": settings.password.get_secret_value()}
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_auth}, preexec_fn=die_with_parent
    )


def _wait_online(controller: Controller, nodes: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with controller.lock:
            if all(controller.registry.alive(n) for n in nodes):
                return
        for node_id, proc in zip(nodes, procs):
            if proc.poll() is not None:
                raise XronosError(f"node {node_id} exited with code {proc.returncode} (see its log)")
        time.sleep(0.2)
    raise XronosError(f"nodes did not come online within {timeout:g} s")


def metrics_ports(first: int, count: int) -> list[int]:
    """`count` ports from `first` on (what the shipped Prometheus configuration scrapes), each
    taken one replaced by a free one: a second demo, or a real node on this machine, must not
    stop this one."""
    ports = []
    for port in range(first, first + count):
        try:
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", port))
        except OSError:
            port = free_port()
        ports.append(port)
    return ports


def run_demo(
    workdir: str | None = None,
    steps: int = 8,
    speeds: list[float] | None = None,
    metrics_port: int = 9100,
    lora: int | None = None,
) -> int:
    """The demo's two jobs (even TP, then xronos); with `lora`, both train LoRA adapters of that rank."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    speeds = speeds or [1.0, 0.5, 0.25]
    with tempfile.TemporaryDirectory(prefix="xronos-demo-") as tmp:
        root = Path(workdir or tmp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        model = make_model(root / "model", **DEMO_MODEL)
        data = make_data(root / "data.jsonl", rows=256, seq_len=SEQ_LEN, vocab=DEMO_MODEL["vocab"])
        print(f"demo: model {model} ({DEMO_MODEL}), data {data}")
        port = free_port()
        broker = EmbeddedBroker("127.0.0.1", port, {DEMO_USER: DEMO_PASSWORD}).start()
        settings = BrokerSettings(broker=f"mqtt://127.0.0.1:{port}", username=DEMO_USER, password=DEMO_PASSWORD)
        print(
            f"demo: embedded broker on 127.0.0.1:{port} (password required), controller, "
            f"{len(speeds)} nodes at speeds {speeds}; logs in {root}"
        )
        ports = metrics_ports(metrics_port, 1 + len(speeds))
        controller = Controller(
            ControllerOptions(state_dir=root / "controller", metrics_port=ports[0]), settings
        ).start()
        node_ids = [f"node-{i}" for i in range(len(speeds))]
        procs = [
            _start_node(root, node_id, speed, settings, port)
            for node_id, speed, port in zip(node_ids, speeds, ports[1:])
        ]
        print(
            "demo: Prometheus metrics at "
            + ", ".join(
                f"{name} http://127.0.0.1:{port}/metrics" for name, port in zip(["controller", *node_ids], ports)
            )
        )
        if ports != list(range(metrics_port, metrics_port + len(ports))):
            print(
                "demo: some of the usual ports were taken; deploy/prometheus/prometheus.yml scrapes "
                f"{metrics_port}-{metrics_port + len(ports) - 1}, so point its targets at the ports above"
            )
        try:
            _wait_online(controller, node_ids, procs, timeout=120)
            reports = []
            for mode in ("tp", "xronos"):
                job = JobOptions(
                    model=str(model),
                    data=str(data),
                    output=str(root / f"out-{mode}"),
                    mode=mode,
                    steps=steps,
                    batch_size=BATCH,
                    seq_len=SEQ_LEN,
                    lr=1e-3,
                    shuffle=False,
                    lora=LoraOptions(r=lora) if lora is not None else None,
                )
                command = wire.TrainCommand(job_id=f"demo-{mode}-{int(time.time())}", job=job, nodes=node_ids)
                print(f"\ndemo: publishing xronos/cmd/train for job {command.job_id} (mode {mode})", flush=True)
                status = submit(settings, command, wait=True, timeout=600)
                assert status is not None  # with wait, submit returns the final status (or raises)
                if status.state != "completed":
                    raise XronosError(f"job {command.job_id} {status.state}: {status.reason}")
                if status.report is None:
                    raise XronosError(f"job {command.job_id} completed without a report")
                print_report(status.report)
                reports.append(status.report)
            print_side_by_side(reports)
            tp, xr = reports
            print(
                f"\nxronos step time is {xr.mean_step_seconds / tp.mean_step_seconds:.2f}x the even split's; "
                f"idle {xr.idle_ratio:.1%} vs {tp.idle_ratio:.1%}"
            )
        finally:
            stop_processes(procs, grace=15)  # the nodes publish `offline` and stop their workers
            controller.close()
            broker.stop()
    return 0
