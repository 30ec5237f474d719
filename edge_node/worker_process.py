"""A worker process (`python -m edge_node.worker SPEC`) and how to start, watch and stop it.

Shared by the local launcher and the node agent. A worker is forked from a worker server
(multiprocessing's forkserver) that imported torch, transformers and the trainer once: a
worker started by exec spent ~4.5 s of CPU importing them, per job and per device (three
devices on two cores: 6-9 s before the first profile; a slow device pays it at its speed).
The forked worker names itself as the exec'd one did (`python -m MODULE SPEC`, so `ps` and
the stale-run cleanup see its spec), takes the environment of the process that started it,
writes its stderr to its log file, which is followed to the terminal when asked, its last
lines kept to explain a failure. It dies with the server (PR_SET_PDEATHSIG), and the server
with the process that started it, so no process outlives the one that started it.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import importlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from setproctitle import setproctitle

from edge_node.cpu_quota import make_quota, start_under

PR_SET_PDEATHSIG = 1
INT_MAX = (1 << 31) - 1  # mallopt's values are C ints

PRELOAD = [
    "edge_node.worker_server_guard",
    "edge_node.worker",
    "edge_node.profiler",
    "edge_node.pipeline",
    "xronos.planner.replan",
    "peft",
    "transformers.models.llama.modeling_llama",
]
"""What the worker server imports once for every worker it forks: first what makes it die with its
starter (`edge_node.worker_server_guard`), then the worker, what it imports
lazily before joining its quota (`edge_node.worker.import_before_quota`), and the modeling file
of the Llama layout (SmolLM2's, the suite's), and peft (the plain model's LoRA). Another model's
modeling file and the `hf-tp` reference are imported by the worker that needs them."""

HEAP_OPTIONS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30),  # M_MMAP_THRESHOLD
    "MALLOC_TRIM_THRESHOLD_": (-1, INT_MAX),  # M_TRIM_THRESHOLD
    "MALLOC_TOP_PAD_": (-2, 1 << 28),  # M_TOP_PAD
}
"""glibc malloc settings for a training worker, set with mallopt as it starts: the environment
variable each one stands for, its mallopt parameter and value. By default glibc serves every
block over 32 MiB (the LM head's logits, the MLP's activations) with a fresh
mmap and returns it on free, so each step page-faults and zeroes hundreds of MB
anew: kernel time charged to the device's CPU share, the same on every device
whatever its shard. Kept in a heap that is never trimmed, a step is ~15% shorter
on SmolLM2's shapes, for ~20-30% more peak RSS (benchmarks/heap_bench.py). The
environment variable, where set, gives the value; XRONOS_KEEP_HEAP=0 leaves glibc's defaults."""


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def keep_heap(env: dict[str, str]) -> None:
    """Set HEAP_OPTIONS in this process, with the values `env` gives (glibc reads its own variables only
    as a process starts, and a forked worker's process started as the worker server)."""
    if env.get("XRONOS_KEEP_HEAP", "1") == "0":
        return
    libc = ctypes.CDLL("libc.so.6")
    for name, (param, value) in HEAP_OPTIONS.items():
        given = env.get(name, "")
        libc.mallopt(param, min(int(given), INT_MAX) if given.isdigit() else value)


def worker_server() -> multiprocessing.context.ForkServerContext:
    """The context that forks workers from the worker server, started on first use with PRELOAD."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def warm_worker_server() -> None:
    """Start the worker server now, so that its imports overlap with what the caller does before
    its first worker (the launcher's checks of model and data; a node agent's start)."""
    worker_server()
    multiprocessing.forkserver.ensure_running()


def _forked_worker(module: str, argv: list[str], env: dict[str, str], log_file: str, cpus: set[int] | None) -> None:
    """A forked worker's first steps: what `python -m MODULE ARGV` under `env` would have been, then its main,
    whose return value or SystemExit is the exit code as for `sys.exit` (an exception: its traceback, 1).

    It lets go of the server's "a client is alive" pipe, which every forked process inherits: held
    by the worker, it would keep the server running after the process that started both was killed,
    and the worker with it (PR_SET_PDEATHSIG fires when the server ends)."""
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)  # first: whatever fails from here on is in the worker's log
    os.close(log)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    server: Any = multiprocessing.forkserver._forkserver  # private: the one server of this process
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent()
    gc.freeze()  # the server's objects: a full collection would touch, and so copy, every page they are on
    setproctitle(" ".join([os.path.basename(sys.executable), "-m", module, *argv]))
    os.environ.clear()
    os.environ.update(env)
    keep_heap(env)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore, which would be registered with the
    # launcher's resource tracker and reported leaked when the worker exits without teardown
    tqdm.set_lock(threading.RLock())
    sys.argv = [module, *argv]
    code: object
    try:
        code = importlib.import_module(module).main(argv)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        traceback.print_exc()
        code = 1
    from edge_node.worker import exit_now  # preloaded

    exit_now(code if isinstance(code, int) else 0 if code is None else 1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ProcessLike(Protocol):
    """What watching and stopping a process needs: a `subprocess.Popen`, or a `ForkedProcess`."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A worker forked from the worker server, with `subprocess.Popen`'s methods that the launcher,
    the node agent and `stop_processes` use (exit codes as Popen's: negative for a signal).

    Its exit code is read once from the server's socket; the lock keeps two threads (the log's
    follower and the watcher) from both reading it, where the second would see 255 (so does
    multiprocessing's own bookkeeping, which the worker is taken out of as it starts)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process
        assert process.pid is not None  # started
        self.pid: int = process.pid
        self._lock = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        multiprocessing.connection.wait([self.process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


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
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if loopback:  # gloo would otherwise pick the interface of the host name, which may not reach a peer here
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.device = device
        self.log_file = log_file
        self.rank: int | None = None  # known once the split is
        self.retired = False
        """Stopped on purpose by whoever started it (a head start given up): its exit is no failure."""
        log_file.write_bytes(b"")
        process = worker_server().Process(
            target=_forked_worker, args=(module, [str(spec_file)], env, str(log_file), cpus)
        )
        process.start()
        # Not multiprocessing's child: it would poll the worker's exit code on every later start (a
        # second reader of it sees 255) and join it at exit; the worker ends with its server instead.
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
        self.proc = ForkedProcess(process)
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._tee = threading.Thread(target=self._follow, args=(log_file, echo), daemon=True)
        self._tee.start()

    def _follow(self, log_file: Path, echo: bool) -> None:
        """Read the worker's log as it writes it, until it has ended and all it wrote is read."""
        with log_file.open("rb") as log:
            pending = b""
            while True:
                ended = self.proc.poll() is not None  # before the read: nothing it wrote is missed
                pending += log.read()
                *lines, pending = pending.split(b"\n")
                for line in [*lines, pending] if ended and pending else lines:
                    self._line(line + b"\n", echo)
                if ended:
                    return
                time.sleep(0.05)

    def _line(self, line: bytes, echo: bool) -> None:
        text = line.decode(errors="replace").rstrip()
        if text:
            self.tail.append(text.split("\r")[-1])
        if echo:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    def cause(self) -> str:
        self._tee.join(timeout=2)
        rc = self.proc.returncode
        assert rc is not None, "cause() is for a worker that ended"
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


def stop_processes(procs: Sequence[ProcessLike], grace: float = 5.0) -> None:
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
