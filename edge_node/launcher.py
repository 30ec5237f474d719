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

from controller.partitioner import device_compute, plan_partition, step_seconds
from controller.pipeline_plan import plan_pipeline
from controller.planning import split_for_mode
from edge_node.cpu_quota import make_quota
from edge_node.data import load_rows
from edge_node.model_io import load_config
from edge_node.profiler import available_memory_bytes
from edge_node.trainer import WorkerSpec
from xronos.errors import XronosError
from xronos.job import JobOptions
from xronos.profiles import DeviceProfile
from xronos.report import ExcludedDevice, LocalAssignment, RankResult, RunReport, build_report
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

    def __init__(self, device: int, spec_file: Path, log_file: Path, echo: bool, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self.device = device
        self.rank: int | None = None  # known once the split is
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
        who = f"worker for device {self.device}" if self.rank is None else f"worker rank {self.rank}"
        return f"{who} {how}" + (f": {last.strip()}" if last else "")


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


def _watch(workers: list[_Worker], until=None) -> None:
    """Wait for all workers (or for `until()`); on the first failure stop the rest and raise with its cause."""
    try:
        while True:
            codes = [w.proc.poll() for w in workers]
            failed = next((w for w, rc in zip(workers, codes) if rc not in (None, 0)), None)
            if failed is not None:
                _stop_all(workers)
                raise XronosError(failed.cause())
            if all(rc == 0 for rc in codes) or (until is not None and until()):
                return
            time.sleep(0.05)
    except BaseException:
        _stop_all(workers)
        raise


def _write_json(path: Path, model) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(model.model_dump_json())
    os.replace(tmp, path)


def run_local(
    job: JobOptions,
    nodes: int,
    speeds: list[float] | None = None,
    split_override: dict[str, list[int]] | None = None,
    threads: int = 1,
    show_progress: bool = True,
) -> RunReport:
    """Run `job` on `nodes` local workers (one for `single`) and return its report.

    Mode `xronos` without an explicit split profiles every worker under its quota
    first, then plans with the exact partitioner; the others split by rule.
    """
    if speeds is not None and len(speeds) != nodes:
        raise XronosError(f"--speeds lists {len(speeds)} speeds for --nodes {nodes}")
    if speeds is not None and any(s <= 0 for s in speeds):
        raise XronosError(f"speeds must be positive, got {speeds}")
    dims = ModelDims.from_config(load_config(job.model))
    rows = load_rows(job.data, job.seq_len, job.model, dims.vocab_size)
    split_override = dict(split_override or {})
    layer_counts = split_override.pop("layers", None)
    if layer_counts is not None and (job.mode != "pp" or split_override):
        raise XronosError("--split layers=... is for --mode pp alone")
    stages = None
    if layer_counts is not None:
        if len(layer_counts) != nodes or sum(layer_counts) != dims.num_layers:
            raise XronosError(f"split layers {'+'.join(map(str, layer_counts))} must give {nodes} stages "
                              f"summing to the model's {dims.num_layers} layers")
        if any(count == 0 for count in layer_counts[1:-1]):
            raise XronosError("a middle pipeline stage needs at least one layer")
        if (job.micro_batches or job.batch_size) < nodes:
            raise XronosError(f"a 1F1B pipeline of {nodes} stages needs at least {nodes} micro-batches")
        ends = [sum(layer_counts[: i + 1]) for i in range(nodes)]
        stages = [(end - count, end) for end, count in zip(ends, layer_counts)]
    profiled = (job.mode == "pp" and stages is None) or (job.mode == "xronos" and not split_override)
    split = None if profiled or job.mode == "pp" else split_for_mode(job.mode, dims, nodes, speeds, split_override)
    n_workers = 1 if job.mode == "single" else nodes
    device_speeds = (speeds or [None] * nodes)[:n_workers]

    run_dir = Path(tempfile.mkdtemp(prefix="xronos-run-"))
    run_id = uuid.uuid4().hex[:8]
    quotas, workers = [], []
    try:
        save_file({"input_ids": rows}, run_dir / "rows.safetensors")
        port = free_port()
        memory = available_memory_bytes() // n_workers
        for device in range(n_workers):
            spec = WorkerSpec(
                job=job, device=device, speed_hint=device_speeds[device], memory_bytes=memory,
                rank=None if profiled else device, split=split, stages=stages,
                micro_batches=job.micro_batches or job.batch_size,
                profile_file=str(run_dir / f"profile-{device}.json") if profiled else None,
                plan_file=str(run_dir / "plan.json") if profiled else None,
                master_port=port, rows_file=str(run_dir / "rows.safetensors"),
                result_file=str(run_dir / f"result-{device}.json"), threads=threads,
                show_progress=show_progress and device == 0,
            )
            spec_file = run_dir / f"spec-{device}.json"
            spec_file.write_text(spec.model_dump_json())
            worker = _Worker(device, spec_file, run_dir / f"device-{device}.log", echo=show_progress and device == 0, threads=threads)
            worker.rank = None if profiled else device
            workers.append(worker)
            if device_speeds[device] is not None:
                quota = make_quota(f"xronos-{run_id}-d{device}", device_speeds[device])
                quotas.append(quota)
                quota.add(worker.proc.pid)

        devices, predicted, excluded = list(range(n_workers)), None, []
        if profiled:
            profile_files = [run_dir / f"profile-{d}.json" for d in range(n_workers)]
            _watch(workers, until=lambda: all(p.is_file() for p in profile_files))
            profiles = [DeviceProfile.model_validate_json(p.read_text()) for p in profile_files]
            if job.mode == "pp":
                plan = plan_pipeline(profiles, dims, job.batch_size, job.micro_batches or job.batch_size)
                ranks = [plan.devices.index(d) if d in plan.devices else None for d in range(n_workers)]
                stages = plan.stages
                assignment = LocalAssignment(ranks=ranks, stages=stages, micro_batches=plan.micro_batches)
                predicted = [plan.stage_seconds[r] * plan.micro_batches for r in range(len(stages))]
                reasons = ["a faster pipeline leaves it out"] * n_workers
            else:
                plan = plan_partition(profiles, dims, job.batch_size // job.grad_accum, job.seq_len)
                split = plan.split
                ranks = [d.rank for d in plan.devices]
                members = sorted((d for d in range(n_workers) if ranks[d] is not None), key=lambda d: ranks[d])
                assignment = LocalAssignment(ranks=ranks, split=split, profiles=[profiles[d] for d in members])
                predicted = [plan.devices[d].compute_seconds * job.grad_accum for d in members]
                reasons = [c.reason for c in plan.devices]
            for worker, rank in zip(workers, ranks):
                worker.rank = rank
            _write_json(run_dir / "plan.json", assignment)
            devices = [d for _, d in sorted((r, d) for d, r in enumerate(ranks) if r is not None)]
            excluded = [ExcludedDevice(device=d, speed=device_speeds[d], reason=reasons[d])
                        for d in range(n_workers) if ranks[d] is None]
        _watch(workers)
        results = [RankResult.model_validate_json((run_dir / f"result-{d}.json").read_text()) for d in devices]
        report = build_report(job.mode, split, [device_speeds[d] for d in devices], results, devices, predicted,
                              stages=stages, dims=dims)
        if profiled and job.mode == "xronos":  # predictions for the split the job ended with
            members = [profiles[d] for d in devices]
            shares = list(zip(report.split.kv_groups, report.split.mlp_columns, report.split.vocab_rows))
            predicted_step = step_seconds(members, dims, shares) * job.grad_accum
            nodes = [n.model_copy(update={"predicted_compute_seconds": device_compute(p, dims, *share) * job.grad_accum})
                     for n, p, share in zip(report.nodes, members, shares)]
            report = report.model_copy(update={"predicted_step_seconds": predicted_step, "nodes": nodes, "excluded": excluded})
        elif profiled:
            report = report.model_copy(update={"predicted_step_seconds": plan.predicted_step_seconds, "excluded": excluded})
        return report
    finally:
        _stop_all(workers)
        for quota in quotas:
            quota.close()
        shutil.rmtree(run_dir, ignore_errors=True)
