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


def metrics(port: int) -> dict[str, float]:
    """The samples a process serves on `port`, by name with labels (`name{label="value"}`)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def controller_sees(port: int, nodes: int) -> bool:
    """Whether the controller serving metrics on `port` counts `nodes` nodes online."""
    try:
        return metrics(port).get("xronos_nodes_online") == nodes
    except OSError:
        return False


def uninterrupted(model: Path, data: Path, output: Path, *, steps: int, batch_size: int, seq_len: int):
    """The reference a job by command is held to: one process, the same data and the options
    `train_by_command` gives (lr 1e-3, no shuffling). Returns its RunReport."""
    from edge_node.launcher import run_local
    from xronos.contract.job import JobOptions

    job = JobOptions(
        model=str(model),
        data=str(data),
        output=str(output),
        mode="single",
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=1e-3,
        shuffle=False,
    )
    return run_local(job, 1, show_progress=False)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (its workers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return out


def cmdline(pid: int) -> str:
    """The process's command line, arguments separated by NUL ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """`pid`'s children, theirs, and so on (a launcher's workers are its worker server's children)."""
    family, i = [pid], 0
    while i < len(family):
        try:
            family += children(family[i])
        except OSError:
            pass
        i += 1
    return family[1:]


def spec_of(pid: int, name: str) -> Path | None:
    """The spec file ending in `name` that process `pid` runs (a worker names it: `python -m edge_node.worker SPEC`)."""
    return next((Path(a) for a in cmdline(pid).replace("\0", " ").split() if a.endswith(name)), None)


def worker_below(pid: int, name: str) -> int | None:
    """The worker below `pid` whose spec file ends in `name` (`spec-1.json`: device 1's)."""
    return next((p for p in descendants(pid) if spec_of(p, name) is not None), None)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants at once, as a device unplugged ends them all."""
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
