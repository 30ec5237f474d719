"""A worker process (`python -m edge_node.worker SPEC`) and how to start, watch and stop it.

Shared by the local launcher and the node agent. The worker's stderr is teed
to a log file (and optionally the terminal), its last lines kept to explain a
failure. It dies with its parent (PR_SET_PDEATHSIG), so no process outlives
the one that started it.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from edge_node.cpu_quota import make_quota, start_under

PR_SET_PDEATHSIG = 1

HEAP_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_TOP_PAD_": str(1 << 28),
}
"""glibc malloc settings for a training worker. By default glibc serves every
block over 32 MiB (the LM head's logits, the MLP's activations) with a fresh
mmap and returns it on free, so each step page-faults and zeroes hundreds of MB
anew: kernel time charged to the device's CPU share, the same on every device
whatever its shard. Kept in a heap that is never trimmed, a step is ~15% shorter
on SmolLM2's shapes, for ~20-30% more peak RSS (benchmarks/heap_bench.py). A
value already in the environment wins; XRONOS_KEEP_HEAP=0 leaves glibc's defaults."""


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _pinned(cpus: set[int]) -> None:
    """In the child before exec: die with the parent, and run on `cpus` only."""
    die_with_parent()
    os.sched_setaffinity(0, cpus)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WorkerProcess:
    """A worker process with its stderr teed to a log file (and, for rank 0, the terminal)."""

    def __init__(
        self,
        device: int,
        spec_file: Path,
        log_file: Path,
        echo: bool,
        threads: int,
        loopback: bool = True,
        cpus: set[int] | None = None,
        module: str = "edge_node.worker",
    ):
        heap = HEAP_ENV if os.environ.get("XRONOS_KEEP_HEAP", "1") != "0" else {}
        env = {**heap, **os.environ, "OMP_NUM_THREADS": str(threads)}
        if loopback:  # gloo would otherwise pick the interface of the host name, which may not reach a peer here
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.device = device
        self.log_file = log_file
        self.rank: int | None = None  # known once the split is
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(spec_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent if cpus is None else partial(_pinned, cpus),
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._tee = threading.Thread(target=self._copy, args=(log_file, echo), daemon=True)
        self._tee.start()

    def _copy(self, log_file: Path, echo: bool) -> None:
        with log_file.open("wb") as log:
            assert self.proc.stderr is not None  # stderr=PIPE
            for line in iter(self.proc.stderr.readline, b""):
                log.write(line)
                text = line.decode(errors="replace").rstrip()
                if text:
                    self.tail.append(text.split("\r")[-1])
                if echo:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()

    def cause(self) -> str:
        self._tee.join(timeout=2)
        rc = self.proc.returncode
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        why = last_error(list(self.tail))
        who = f"worker for device {self.device}" if self.rank is None else f"worker rank {self.rank}"
        return f"{who} {how}" + (f": {why}" if why else "")


def start_worker(
    spec,
    spec_file: Path,
    log_file: Path,
    speed: float | None,
    quota_name: str,
    echo: bool = False,
    threads: int = 1,
    loopback: bool = True,
    cpus: set[int] | None = None,
    module: str = "edge_node.worker",
):
    """Start a worker for `spec` (a `edge_node.trainer.WorkerSpec`) under a CPU quota of `speed` (None: none);
    returns the worker and its quota, which the caller closes when the worker is done.

    `module` is the entry point run as `python -m MODULE SPEC`; another one (`edge_node.hf_tp`) takes a
    spec of its own, with the `device` and `quota_file` fields this function reads and sets.

    The one way `xronos run` and the node agent start workers: the quota is made first, its
    procs file goes into the spec (the worker joins it once its imports are done), and the
    process is put under it at once (the duty-cycle fallback throttles from outside).
    """
    quota = make_quota(quota_name, speed) if speed is not None else None
    try:
        joins = quota is not None and quota.procs_file is not None  # the worker pins itself as it joins
        spec = spec.model_copy(
            update={
                "quota_file": quota.procs_file if quota is not None else None,
                "cpus": sorted(cpus) if joins and cpus else None,
            }
        )
        spec_file.write_text(spec.model_dump_json())
        worker = WorkerProcess(
            spec.device,
            spec_file,
            log_file,
            echo=echo,
            threads=threads,
            loopback=loopback,
            cpus=None if joins else cpus,
            module=module,
        )
        if quota is not None:
            start_under(quota, worker.proc.pid)
    except BaseException:
        if quota is not None:
            quota.close()
        raise
    return worker, quota


EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))\b(?::(.*))?$")
"""A traceback's last line: the exception's (dotted) name, then its message."""


RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]:")
PROGRESS_BAR = re.compile(r"\|\s*\d+/\d+ \[")


def last_error(lines: list[str], limit: int = 300) -> str:
    """One line saying why a worker failed, from the last lines of its stderr.

    The exception line of the last traceback, with the lines after it (a pydantic error names
    the field and the value there; its documentation links are left out); otherwise the last
    line. The exception's module path is dropped: the name says what went wrong.
    """
    # torch.distributed prefixes a rank's traceback with "[rankN]:"; tqdm's last bar may follow it
    lines = [RANK_PREFIX.sub("", line).strip() for line in lines if line.strip()]
    lines = [line for line in lines if not PROGRESS_BAR.search(line)] or lines
    found = next(((i, m) for i in reversed(range(len(lines))) if (m := EXCEPTION_LINE.match(lines[i]))), None)
    if found is None:
        return lines[-1][:limit] if lines else ""
    at, match = found
    name, message = match.groups()
    rest = [line for line in lines[at + 1 :] if not line.startswith("For further information")]
    return " ".join([name + (f":{message}" if message else ""), *rest])[:limit]


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every process still running, then SIGKILL what has not ended after `grace` seconds."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_all(workers: list[WorkerProcess]) -> None:
    stop_processes([w.proc for w in workers])


class ProgressFile:
    """The worker's per-step progress lines (`WorkerSpec.progress_file`), read as they come.

    Only whole lines count: the worker may be half-way through writing the next one.
    """

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0

    def new_lines(self) -> list[dict]:
        if not self.path.is_file():
            return []
        lines = []
        with self.path.open() as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                lines.append(json.loads(line))
        return lines
