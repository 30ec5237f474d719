"""`xronos run`: a whole job on this machine, one worker process per emulated device.

The launcher validates everything a user can get wrong before any worker
starts (model, data, split), prepares the rows once, starts the workers
under their CPU quotas, and watches them: if one dies, the others are
stopped and the error names the rank and its cause. Workers die with the
launcher (PR_SET_PDEATHSIG), so no process outlives a run.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from safetensors.torch import save_file

from controller.planning import split_for_mode
from edge_node.cpu_quota import make_quota
from edge_node.data import load_rows
from edge_node.model_io import load_config
from edge_node.trainer import WorkerSpec
from xronos.errors import XronosError
from xronos.job import JobOptions
from xronos.report import RankResult, RunReport, build_report
from xronos.splits import ModelDims

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    """A worker process with its stderr teed to a log file (and, for rank 0, the terminal)."""

    def __init__(self, rank: int, spec_file: Path, log_file: Path, echo: bool, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_node.worker", str(spec_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=_die_with_parent,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._tee = threading.Thread(target=self._copy, args=(log_file, echo), daemon=True)
        self._tee.start()

    def _copy(self, log_file: Path, echo: bool) -> None:
        with log_file.open("wb") as log:
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
        last = next((line for line in reversed(self.tail) if line.strip()), "")
        return f"worker rank {self.rank} {how}" + (f": {last.strip()}" if last else "")


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + 5
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def _watch(workers: list[_Worker]) -> None:
    """Wait for all workers; on the first failure stop the rest and raise with its cause."""
    try:
        while True:
            codes = [w.proc.poll() for w in workers]
            failed = next((w for w, rc in zip(workers, codes) if rc not in (None, 0)), None)
            if failed is not None:
                _stop_all(workers)
                raise XronosError(failed.cause())
            if all(rc == 0 for rc in codes):
                return
            time.sleep(0.05)
    except BaseException:
        _stop_all(workers)
        raise


def run_local(
    job: JobOptions,
    nodes: int,
    speeds: list[float] | None = None,
    split_override: dict[str, list[int]] | None = None,
    threads: int = 1,
    show_progress: bool = True,
) -> RunReport:
    """Run `job` on `nodes` local workers (one for `single`) and return its report."""
    if speeds is not None and len(speeds) != nodes:
        raise XronosError(f"--speeds lists {len(speeds)} speeds for --nodes {nodes}")
    if speeds is not None and any(s <= 0 for s in speeds):
        raise XronosError(f"speeds must be positive, got {speeds}")
    dims = ModelDims.from_config(load_config(job.model))
    rows = load_rows(job.data, job.seq_len, job.model, dims.vocab_size)
    split = split_for_mode(job.mode, dims, nodes, speeds, split_override)
    world = split.world_size
    node_speeds = (speeds or [None] * nodes)[:world]

    run_dir = Path(tempfile.mkdtemp(prefix="xronos-run-"))
    run_id = uuid.uuid4().hex[:8]
    quotas, workers = [], []
    try:
        save_file({"input_ids": rows}, run_dir / "rows.safetensors")
        port = free_port()
        for rank in range(world):
            spec = WorkerSpec(
                job=job,
                rank=rank,
                split=split,
                master_port=port,
                rows_file=str(run_dir / "rows.safetensors"),
                result_file=str(run_dir / f"result-{rank}.json"),
                threads=threads,
                show_progress=show_progress and rank == 0,
            )
            spec_file = run_dir / f"spec-{rank}.json"
            spec_file.write_text(spec.model_dump_json())
            worker = _Worker(rank, spec_file, run_dir / f"rank-{rank}.log", echo=show_progress and rank == 0, threads=threads)
            workers.append(worker)
            if node_speeds[rank] is not None:
                quota = make_quota(f"xronos-{run_id}-r{rank}", node_speeds[rank])
                quotas.append(quota)
                quota.add(worker.proc.pid)
        _watch(workers)
        results = [RankResult.model_validate_json((run_dir / f"result-{r}.json").read_text()) for r in range(world)]
        return build_report(job.mode, split, node_speeds, results)
    finally:
        _stop_all(workers)
        for quota in quotas:
            quota.close()
        shutil.rmtree(run_dir, ignore_errors=True)
