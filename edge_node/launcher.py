"""`xronos run`: a whole job on this machine, one worker process per emulated device.

The launcher validates everything a user can get wrong before any worker
starts (model, data, split), prepares the rows once, starts the workers
under their CPU quotas, and watches them: if one dies, the others are
stopped and the error names the rank and its cause. Workers die with the
launcher (PR_SET_PDEATHSIG), so no process outlives a run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

from safetensors.torch import save_file

from edge_node.cpu_quota import pack_cores
from edge_node.memory import available_memory_bytes
from edge_node.metrics import NodeMetrics
from edge_node.preflight import job_inputs
from edge_node.trainer import WorkerSpec
from edge_node.worker_process import ProgressFile, WorkerProcess, free_port, start_worker, stop_all
from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import RankResult, RunReport, build_report
from xronos.planner.job_plan import plan_job, planned_report
from xronos.planner.pipeline_plan import stages_from_layers
from xronos.planner.planning import split_for_mode


def _watch(workers: list[WorkerProcess], keep_log_in: Path, until=None, tick=None) -> None:
    """Wait for all workers (or for `until()`); on the first failure stop the rest and raise with its cause.

    `tick()` runs on every look at the workers (the metrics read their progress there).

    The failed worker's log is copied to `keep_log_in` (the job's output directory): the run's
    own directory, and every log in it, is removed when the run ends.
    """
    try:
        while True:
            codes = [w.proc.poll() for w in workers]
            failed = next((w for w, rc in zip(workers, codes) if rc not in (None, 0)), None)
            if failed is not None:
                stop_all(workers)
                cause = failed.cause()
                with contextlib.suppress(OSError):
                    keep_log_in.mkdir(parents=True, exist_ok=True)
                    kept = shutil.copy(failed.log_file, keep_log_in / failed.log_file.name)
                    cause += f" (its log: {kept})"
                raise XronosError(cause)
            if tick is not None:
                tick()
            if all(rc == 0 for rc in codes) or (until is not None and until()):
                return
            time.sleep(0.05)
    except BaseException:
        stop_all(workers)
        raise


class _MetricsFeed:
    """One device's node metrics, fed from its worker's progress lines and served on `port`."""

    def __init__(self, node: str, job_id: str, progress: Path, port: int):
        self.metrics, self.job_id, self.progress = NodeMetrics(node), job_id, ProgressFile(progress)
        try:
            self.metrics.serve(port)
        except OSError as err:
            raise XronosError(f"cannot serve {node}'s metrics on port {port}: {err.strerror or err}") from None
        print(f"metrics of {node} ({job_id}): http://127.0.0.1:{self.metrics.port}/metrics", flush=True)

    def read(self, worker_pid: int) -> None:
        self.metrics.memory(worker_pid)
        for line in self.progress.new_lines():
            self.metrics.step(self.job_id, line)


def _read_feeds(feeds: list[_MetricsFeed], workers: list[WorkerProcess]) -> None:
    """Each device's metrics from its worker's progress so far."""
    for feed, worker in zip(feeds, workers):
        feed.read(worker.proc.pid)


def run_local(
    job: JobOptions,
    nodes: int,
    speeds: list[float] | None = None,
    split_override: dict[str, list[int]] | None = None,
    threads: int = 1,
    show_progress: bool = True,
    metrics_port: int | None = None,
    memory_caps: list[float] | None = None,
) -> RunReport:
    """Run `job` on `nodes` local workers (one for `single`) and return its report.

    Mode `xronos` without an explicit split profiles every worker under its quota
    first, then plans with the exact partitioner; the others split by rule.
    With `metrics_port`, device d serves its node metrics (node `device-d`) on
    `metrics_port + d` while the run lasts, as a node agent would. `memory_caps` (GiB per device)
    is the memory each device's profile reports to the planner (default: the free memory, shared).
    """
    if speeds is not None and len(speeds) != nodes:
        raise XronosError(f"--speeds lists {len(speeds)} speeds for --nodes {nodes}")
    if speeds is not None and any(s <= 0 for s in speeds):
        raise XronosError(f"speeds must be positive, got {speeds}")
    if memory_caps is not None and len(memory_caps) != nodes:
        raise XronosError(f"--memory lists {len(memory_caps)} caps for --nodes {nodes}")
    dims, rows, resume_from = job_inputs(job)  # every mistake in the model, data or --resume, before a worker starts
    split_override = dict(split_override or {})
    layer_counts = split_override.pop("layers", None)
    if layer_counts is not None and (job.mode != "pp" or split_override):
        raise XronosError("--split layers=... is for --mode pp alone")
    stages = None
    if layer_counts is not None:
        stages = stages_from_layers(layer_counts, nodes, dims.num_layers, job.micro_batches or job.batch_size)
    profiled = (job.mode == "pp" and stages is None) or (job.mode == "xronos" and not split_override)
    split = None if profiled or job.mode == "pp" else split_for_mode(job.mode, dims, nodes, speeds, split_override)
    n_workers = 1 if job.mode == "single" else nodes
    device_speeds: list[float | None] = [None] * n_workers
    if speeds is not None:
        device_speeds = list(speeds[:n_workers])

    run_dir = Path(tempfile.mkdtemp(prefix="xronos-run-"))
    run_id = uuid.uuid4().hex[:8]
    quotas, workers, feeds = [], [], []
    try:
        save_file({"input_ids": rows}, run_dir / "rows.safetensors")
        if metrics_port is not None:
            for d in range(n_workers):
                feeds.append(
                    _MetricsFeed(f"device-{d}", f"run-{run_id}", run_dir / f"progress-{d}.jsonl", metrics_port + d)
                )
        port = free_port()
        shared = available_memory_bytes() // n_workers
        memory = [int(c * 2**30) for c in memory_caps] if memory_caps is not None else [shared] * n_workers
        quotas_of = [s for s in device_speeds if s is not None]
        throttled = len(quotas_of) == n_workers
        cpus = pack_cores(quotas_of, len(os.sched_getaffinity(0))) if throttled else None
        for device in range(n_workers):
            spec = WorkerSpec(
                job=job,
                device=device,
                speed_hint=device_speeds[device],
                memory_bytes=memory[device],
                assignment=None
                if profiled
                else RankAssignment(
                    rank=device,
                    world_size=n_workers,
                    master_addr="127.0.0.1",
                    master_port=port,
                    split=split,
                    stages=stages,
                    micro_batches=job.micro_batches or job.batch_size,
                ),
                profile_file=str(run_dir / f"profile-{device}.json") if profiled else None,
                plan_file=str(run_dir / f"plan-{device}.json") if profiled else None,
                rows_file=str(run_dir / "rows.safetensors"),
                resume_from=str(resume_from) if resume_from is not None else None,
                result_file=str(run_dir / f"result-{device}.json"),
                threads=threads,
                show_progress=show_progress and device == 0,
                progress_file=str(run_dir / f"progress-{device}.jsonl") if metrics_port is not None else None,
            )
            worker, quota = start_worker(
                spec,
                run_dir / f"spec-{device}.json",
                run_dir / f"device-{device}.log",
                device_speeds[device],
                f"xronos-{run_id}-d{device}",
                echo=show_progress and device == 0,
                threads=threads,
                cpus=cpus[device] if cpus else None,
            )
            worker.rank = None if profiled else device
            workers.append(worker)
            quotas += [quota] if quota is not None else []

        tick = partial(_read_feeds, feeds, workers) if feeds else None
        devices, predicted, plan = list(range(n_workers)), None, None
        if profiled:
            profile_files = [run_dir / f"profile-{d}.json" for d in range(n_workers)]
            _watch(workers, Path(job.output), until=lambda: all(p.is_file() for p in profile_files), tick=tick)
            profiles = [DeviceProfile.model_validate_json(p.read_text()) for p in profile_files]
            plan = plan_job(job, dims, profiles)
            split, stages, predicted, devices = plan.split, plan.stages, plan.predicted, plan.members
            for device, (worker, rank) in enumerate(zip(workers, plan.ranks)):
                worker.rank = rank
                assignment = plan.rank_assignment(device, "127.0.0.1", port)
                write_atomically(run_dir / f"plan-{device}.json", assignment.model_dump_json())
        _watch(workers, Path(job.output), tick=tick)
        if tick is not None:
            tick()
        results = [RankResult.model_validate_json((run_dir / f"result-{d}.json").read_text()) for d in devices]
        if plan is not None:
            return planned_report(job, dims, plan, profiles, device_speeds, results)
        return build_report(
            job.mode, split, [device_speeds[d] for d in devices], results, devices, predicted, stages=stages, dims=dims
        )
    finally:
        stop_all(workers)
        for feed in feeds:
            feed.metrics.close()
        for quota in quotas:
            quota.close()
        shutil.rmtree(run_dir, ignore_errors=True)
