"""Helpers for tests that run the real processes: `xronos` subcommands, waiting, training by command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def xronos_process(*args: str, user: str, password: str, url: str, log: Path) -> subprocess.Popen:
    """`xronos ARGS` as its own process, the broker and credentials in the environment (never in argv)."""
    env = {**os.environ, "XRONOS_BROKER": url, "XRONOS_USERNAME": user, "XRONOS_PASSWORD": password}
    return subprocess.Popen(
        [sys.executable, "-m", "xronos.cli", *args], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def node_process(
    node: str, root: Path, url: str, password: str, *extra: str, metrics_port: int | None = None
) -> subprocess.Popen:
    """`xronos node` for `node` (its MQTT username), working in `root/node`, heartbeats every second, logging
    to `root/node.log`; `extra` flags appended (`--speed`, ...)."""
    metrics = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    return xronos_process(
        "node",
        "--node-id",
        node,
        *metrics,
        "--workdir",
        str(root / node),
        "--heartbeat-seconds",
        "1",
        *extra,
        user=node,
        password=password,
        url=url,
        log=root / f"{node}.log",
    )


def train_by_command(
    url: str,
    password: str,
    model: Path,
    data: Path,
    output: Path,
    job_id: str,
    *extra: str,
    steps: int,
    seq_len: int,
    batch_size: int,
    log: Path,
) -> subprocess.CompletedProcess:
    """`xronos train --wait` as the operator: the job's exit code, output and log."""
    env = {**os.environ, "XRONOS_BROKER": url, "XRONOS_USERNAME": "operator", "XRONOS_PASSWORD": password}
    cmd = [
        sys.executable,
        "-m",
        "xronos.cli",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--seq-len",
        str(seq_len),
        "--batch-size",
        str(batch_size),
        "--lr",
        "1e-3",
        "--no-shuffle",
        "--job-id",
        job_id,
        "--output",
        str(output),
        "--wait",
        "--timeout",
        "300",
        "--quiet",
        *extra,
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
    log.write_text(result.stdout + result.stderr)
    return result
