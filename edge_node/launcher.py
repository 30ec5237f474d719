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
from edge_node.profiler import job_cached_profile, remember_profile
from edge_node.trainer import WorkerSpec
from edge_node.worker_process import ProgressFile, WorkerProcess, free_port, start_worker, stop_all, warm_worker_server
from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import HeadStart, RankResult, RunReport, build_report
from xronos.contract.splits import ModelDims
from xronos.planner.head_start import head_start_profile, holds_whole_model, steady_compute, trained_ahead
from xronos.planner.job_plan import JobPlan, excluded_devices, plan_job, planned_report, with_predictions
from xronos.planner.pipeline_plan import stages_from_layers
from xronos.planner.planning import split_for_mode


def _watch(workers: list[WorkerProcess], keep_log_in: Path, until=None, tick=None) -> None:
    """Wait for all workers (or for `until()`); on the first failure stop the rest and raise with its cause (of
    failures seen together, one killed by a signal: the others' errors follow from it).

    `tick()` runs on every look at the workers (the metrics read their progress there).

    The failed worker's log is copied to `keep_log_in` (the job's output directory): the run's
    own directory, and every log in it, is removed when the run ends.
    """
    try:
        while True:
            codes = [0 if w.retired else w.proc.poll() for w in workers]
            failures = [(rc, w) for w, rc in zip(workers, codes) if rc not in (None, 0)]
            # one killed by a signal is the cause of the others' errors (a peer gone mid-collective), not their effect
            failed = min(failures, key=lambda f: f[0] is not None and f[0] >= 0)[1] if failures else None
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


class LocalWorkers:
    """One local run's worker processes, one per emulated device: their temporary directory (the rows,
    specs, logs, results), their CPU quotas packed onto this machine's cores, and their end. `xronos run`
    and the bench's `hf-tp` reference start their workers through it; `close` stops what still runs,
    releases the quotas and removes the directory."""

    def __init__(self, rows, speeds: list[float | None], threads: int = 1, show_progress: bool = True):
        self.dir = Path(tempfile.mkdtemp(prefix="xronos-run-"))
        self.id = uuid.uuid4().hex[:8]
        self.speeds, self.threads, self.show_progress = speeds, threads, show_progress
        self.workers: list[WorkerProcess] = []
        self.quotas: list = []
        try:
            save_file({"input_ids": rows}, self.rows_file)
            quotas_of = [s for s in speeds if s is not None]
            throttled = len(quotas_of) == len(speeds)
            self.cpus = pack_cores(quotas_of, len(os.sched_getaffinity(0))) if throttled else None
        except BaseException:
            self.close()
            raise

    @property
    def rows_file(self) -> Path:
        return self.dir / "rows.safetensors"

    @property
    def head_start_file(self) -> Path:
        """Mode xronos: the head start's progress (`edge_node.head_start`)."""
        return self.dir / "head-start.json"

    def file(self, kind: str, device: int, suffix: str = "json") -> Path:
        """Device `device`'s file of `kind` (spec, result, profile, plan, progress) in the run's directory."""
        return self.dir / f"{kind}-{device}.{suffix}"

    def start(self, spec, device: int, module: str = "edge_node.worker", again: bool = False) -> WorkerProcess:
        """Start device `device`'s worker for `spec` under its quota and cores (device 0 echoes its progress);
        `again`: a second worker of the device (`restart`), with a log and a quota of its own."""
        worker, quota = start_worker(
            spec,
            self.file("spec", device),
            self.file("restarted" if again else "device", device, "log"),
            self.speeds[device],
            f"xronos-{self.id}-d{device}" + ("-again" if again else ""),
            echo=self.show_progress and device == 0,
            threads=self.threads,
            cpus=self.cpus[device] if self.cpus else None,
            module=module,
        )
        self.workers.append(worker)
        self.quotas += [quota] if quota is not None else []
        return worker

    def retire(self, device: int) -> None:
        """Stop device `device`'s worker on purpose: its exit is no failure (`WorkerProcess.retired`)."""
        stop_all([self.workers[device]])
        self.workers[device].retired = True

    def restart(self, device: int, assignment: RankAssignment) -> None:
        """Start device `device`'s worker afresh, in place of its retired one, with `assignment` (no profiling,
        no head start)."""
        spec = WorkerSpec.model_validate_json(self.file("spec", device).read_text())
        unplanned = {"profile_file": None, "plan_file": None, "head_start": False, "quota_file": None, "cpus": None}
        self.start(spec.model_copy(update={"assignment": assignment} | unplanned), device, again=True)
        self.workers[device] = self.workers.pop()

    def result(self, device: int) -> RankResult:
        return RankResult.model_validate_json(self.file("result", device).read_text())

    def close(self) -> None:
        stop_all(self.workers)
        for quota in self.quotas:
            quota.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _head_start_device(
    job: JobOptions,
    dims: ModelDims,
    profiled: bool,
    speeds: list[float | None],
    memory: list[int],
    threads: int,
    head_start: bool,
) -> int | None:
    """The device that trains alone while the others profile (`edge_node.head_start`): the fastest (the first
    of equals) that holds the whole model, in a mode xronos job over several devices that may keep one device
    alone, where some other device profiles afresh (None: no head start)."""
    if not (head_start and profiled and job.mode == "xronos" and len(speeds) > 1 and "single" in job.layouts):
        return None
    micro_batch = job.batch_size // job.grad_accum
    able = [d for d, m in enumerate(memory) if holds_whole_model(m, dims, micro_batch, job.seq_len, job.lora)]
    head = max(able, key=lambda d: (speeds[d] or 0.0, -d), default=None)
    others = [d for d in range(len(speeds)) if d != head]
    if all(job_cached_profile(job, threads, f"device-{d}", speeds[d]) for d in others):
        return None  # their profiles come at once: the plan would not wait, nor a head start pay
    return head


def _head_state(path: Path) -> HeadStart | None:
    """The head start's progress as its device last wrote it (None: not yet)."""
    return HeadStart.model_validate_json(path.read_text()) if path.is_file() else None


def _plannable(profile_files: list[Path], head: int | None, head_file: Path) -> bool:
    """Whether the plan can be made: every profile is in but that of a head start's device, which has begun (it
    wrote its progress file), or the head start has trained the whole job."""
    state = _head_state(head_file) if head is not None and not profile_files[head].is_file() else None
    if state is not None and state.finished:
        return True
    others = all(p.is_file() for d, p in enumerate(profile_files) if d != head)
    return others and (head is None or profile_files[head].is_file() or state is not None)


def _handed_over(head_file: Path) -> bool:
    """Whether the head start's device has handed its model over (or trained the job to its end)."""
    state = _head_state(head_file)
    return state is not None and (state.checkpoint is not None or state.finished)


def _plan_profiled(
    job: JobOptions, dims: ModelDims, local: LocalWorkers, head: int | None, port: int, memory: list[int], tick
) -> tuple[JobPlan, list[DeviceProfile], HeadStart | None]:
    """Plan a profiled job once its profiles are in, and write each worker its part. With a head start under
    way, its device is priced by its steady steps, and it hands its model over before the others read it (or
    goes on, told nothing, when the plan keeps it alone); without a steady step by then it is given up and its
    device started afresh; one that trained the whole job leaves the others out. Returns the plan, the
    profiles (device order) and the head start's last state (None: none)."""
    workers, output = local.workers, Path(job.output)
    profile_files = [local.file("profile", d) for d in range(len(workers))]
    head_file = local.head_start_file
    _watch(workers, output, until=partial(_plannable, profile_files, head, head_file), tick=tick)
    state = _head_state(head_file) if head is not None and not profile_files[head].is_file() else None
    profiles = [DeviceProfile.model_validate_json(p.read_text()) for p in profile_files if p.is_file()]
    if state is None or head is None:
        return _hand_out(plan_job(job, dims, profiles), local, port, None), profiles, None
    pace = steady_compute(state.compute_seconds)
    if pace is None and not state.finished:  # its steps are too long for the head start to pay
        local.retire(head)
        state = _head_state(head_file) or state  # as it was when stopped: it may have just finished
    if state.finished:  # the whole job, before any plan: the others, maybe still profiling, are not needed
        for device in range(len(workers)):
            if device != head:
                local.retire(device)
        return _hand_out(trained_ahead(dims, head, len(workers)), local, port, head), profiles, state
    own = head_start_profile(
        profiles, dims, pace / job.grad_accum if pace else None, f"device-{head}", local.speeds[head], memory[head]
    )
    profiles.insert(head, own)
    if pace is None:  # given up: the device starts afresh with its part, as every member does
        plan = plan_job(job, dims, profiles)
        if plan.ranks[head] is not None:
            local.restart(head, plan.rank_assignment(head, "127.0.0.1", port))
        state = state.model_copy(update={"given_up": True})
        write_atomically(head_file, state.model_dump_json())
        return _hand_out(plan, local, port, head), profiles, state
    remember_profile(own, job.lora)  # its steps' pace: the next job of these shapes plans with it at once
    plan = plan_job(job, dims, profiles, state)
    if plan.members != [head]:  # it checkpoints before the others are told where to read it
        write_atomically(local.file("plan", head), plan.rank_assignment(head, "127.0.0.1", port).model_dump_json())
        _watch(workers, output, until=partial(_handed_over, head_file), tick=tick)
        state = _head_state(head_file) or state
        if state.finished:  # it trained the last step meanwhile: the others go
            plan = trained_ahead(dims, head, len(workers))
    return _hand_out(plan, local, port, head), profiles, state


def _hand_out(plan: JobPlan, local: LocalWorkers, port: int, head: int | None) -> JobPlan:
    """Write every worker its part of `plan` (but the head start's device, told already or not at all) and
    note each worker's rank; returns the plan."""
    for device, worker in enumerate(local.workers):
        if device != head:
            write_atomically(
                local.file("plan", device), plan.rank_assignment(device, "127.0.0.1", port).model_dump_json()
            )
        worker.rank = plan.ranks[device]
    return plan


def _cached_predictions(
    report: RunReport, job: JobOptions, dims: ModelDims, speeds: list[float | None], threads: int
) -> RunReport:
    """A fixed split's report (modes single and tp, or a `--split`) with the step its devices' cached profiles
    predict for it, where each device has one: such a mode does not profile (that would slow it), but a device
    that planned a job of these shapes before has its pace cached, as the last job's checks measured it."""
    cached = [job_cached_profile(job, threads, f"device-{d}", speed) for d, speed in enumerate(speeds)]
    profiles = [p for p in cached if p is not None]
    if report.split is None or len(profiles) != len(speeds):
        return report
    plan = JobPlan(ranks=list(range(len(speeds))), reasons=[None] * len(speeds), split=report.split)
    return with_predictions(report, job, dims, plan, profiles, speeds)


def run_local(
    job: JobOptions,
    nodes: int,
    speeds: list[float] | None = None,
    split_override: dict[str, list[int]] | None = None,
    threads: int = 1,
    show_progress: bool = True,
    metrics_port: int | None = None,
    memory_caps: list[float] | None = None,
    head_start: bool = True,
) -> RunReport:
    """Run `job` on `nodes` local workers (one for `single`) and return its report.

    Mode `xronos` without an explicit split profiles every worker under its quota
    first, then plans with the exact partitioner; the others split by rule. Its fastest device
    trains alone meanwhile (`head_start`, `edge_node.head_start`), and the plan takes over from it.
    With `metrics_port`, device d serves its node metrics (node `device-d`) on
    `metrics_port + d` while the run lasts, as a node agent would. `memory_caps` (GiB per device)
    is the memory each device's profile reports to the planner (default: the free memory, shared).
    """
    started = time.perf_counter()
    warm_worker_server()  # started already by `xronos run`; here for the bench and other callers
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

    shared = available_memory_bytes() // n_workers
    memory = [int(c * 2**30) for c in memory_caps] if memory_caps is not None else [shared] * n_workers
    head = _head_start_device(job, dims, profiled, device_speeds, memory, threads, head_start)
    local = LocalWorkers(rows, device_speeds, threads, show_progress)
    workers, feeds = local.workers, []
    try:
        if metrics_port is not None:
            for d in range(n_workers):
                progress = local.file("progress", d, "jsonl")
                feeds.append(_MetricsFeed(f"device-{d}", f"run-{local.id}", progress, metrics_port + d))
        port = free_port()
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
                profile_file=str(local.file("profile", device)) if profiled else None,
                plan_file=str(local.file("plan", device)) if profiled else None,
                head_start=device == head,
                head_start_file=str(local.head_start_file) if head is not None else None,
                rows_file=str(local.rows_file),
                resume_from=str(resume_from) if resume_from is not None else None,
                result_file=str(local.file("result", device)),
                threads=threads,
                show_progress=show_progress and device == 0,
                progress_file=str(local.file("progress", device, "jsonl")) if metrics_port is not None else None,
            )
            local.start(spec, device).rank = None if profiled else device

        tick = partial(_read_feeds, feeds, workers) if feeds else None
        devices, predicted, plan, state = list(range(n_workers)), None, None, None
        if profiled:
            plan, profiles, state = _plan_profiled(job, dims, local, head, port, memory, tick)
            split, stages, predicted, devices = plan.split, plan.stages, plan.predicted, plan.members
        _watch(workers, Path(job.output), tick=tick)
        if tick is not None:
            tick()
        results = [local.result(d) for d in devices]
        if plan is not None and not (state is not None and state.finished):
            report = planned_report(job, dims, plan, profiles, device_speeds, results)
        else:
            report = build_report(
                job.mode,
                split,
                [device_speeds[d] for d in devices],
                results,
                devices,
                predicted,
                stages=stages,
                dims=dims,
            )
            if plan is None:
                report = _cached_predictions(report, job, dims, device_speeds, threads)
        if state is not None:  # as its device last wrote it
            report = report.model_copy(update={"head_start": _head_state(local.head_start_file)})
        if plan is not None and state is not None and state.finished:  # it trained the job: the others were left out
            report = report.model_copy(update={"excluded": excluded_devices(plan, device_speeds)})
        return report.model_copy(update={"job_seconds": time.perf_counter() - started})
    finally:
        local.close()
        for feed in feeds:
            feed.metrics.close()
