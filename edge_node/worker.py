"""Entry point of one worker process: `python -m edge_node.worker SPEC.json`.

Started by the local launcher (`xronos run`); the spec file says which rank
this is and what to train. Writes its measurements to the spec's result file.
A user error exits 2 with one line on stderr; anything else is a traceback
(the launcher shows its last line and stops the other workers).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from edge_node.cpu_quota import join_quota
from edge_node.head_start import handed_over, head_start, starts_ahead
from edge_node.model_io import load_config, model_class
from edge_node.timeline import Timeline
from edge_node.trainer import Trainer, WorkerSpec
from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically


def xronos_layouts(spec: WorkerSpec) -> tuple[str, ...]:
    """The layouts this worker's job may be given: mode xronos chooses among its `layouts` after profiling."""
    return spec.job.layouts if spec.job.mode == "xronos" and spec.assignment is None else ()


def import_before_quota(spec: WorkerSpec) -> None:
    """Import, still unthrottled, every module this worker will run. Lazy imports (the model's
    modeling file with transformers' masking utilities, the profiler, scipy for the re-plan) take
    ~2.5 s of CPU, ~8 s under a 0.3 quota: start-up a real device pays once, not per step."""
    model_class(load_config(spec.job.model))
    modules = ["edge_node.profiler"]
    modules += ["edge_node.pipeline"] if spec.job.mode == "pp" or "pp" in xronos_layouts(spec) else []
    modules += ["xronos.planner.replan"] if spec.job.mode == "xronos" else []
    plain = spec.job.mode == "single" or "single" in xronos_layouts(spec)
    modules += ["peft"] if spec.job.lora is not None and plain else []  # the plain model's LoRA
    for module in modules:
        importlib.import_module(module)


def profile_and_wait(spec: WorkerSpec, timeline: Timeline) -> WorkerSpec | None:
    """Profile this device, hand the profile to the launcher, and wait for the plan."""
    from edge_node.profiler import profile_device

    torch.set_num_threads(spec.threads)
    job = spec.job
    profile = profile_device(
        load_config(job.model),
        job.batch_size // job.grad_accum,
        job.seq_len,
        spec.threads,
        device=spec.name or f"device-{spec.device}",
        speed_hint=spec.speed_hint,
        memory_bytes=spec.memory_bytes,
        lora=job.lora,
    )
    if spec.profile_file is None:
        raise XronosError("a worker without an assignment needs a profile_file to hand its profile to")
    write_atomically(spec.profile_file, profile.model_dump_json())
    timeline.mark("profiled")
    if spec.plan_file is None:  # profiling was all that was asked
        return None
    plan = Path(spec.plan_file)
    while not plan.is_file():
        time.sleep(0.05)
    assignment = RankAssignment.model_validate_json(plan.read_text())
    timeline.mark("plan_received")
    if assignment.rank is None:
        return None
    return spec.model_copy(update={"assignment": assignment, "resume_from": handed_over(spec) or spec.resume_from})


def main(argv: list[str]) -> int:
    timeline = Timeline()
    spec = WorkerSpec.model_validate_json(Path(argv[0]).read_text())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if spec.quota_file is not None:  # from here on, this device runs at its speed
            import_before_quota(spec)
            join_quota(spec.quota_file, spec.cpus)
        timeline.mark("imports")
        if spec.assignment is None:
            planned = head_start(spec, timeline) if starts_ahead(spec) else profile_and_wait(spec, timeline)
            if planned is None:  # the plan leaves this device out (or its head start trained the whole job)
                return 0
            spec = planned
        assert spec.assignment is not None
        trainer: Trainer
        if spec.assignment.stages is not None:
            from edge_node.pipeline import PipelineTrainer

            trainer = PipelineTrainer(spec, timeline)
        else:
            trainer = Trainer(spec, timeline)
        trainer.train()
        Path(spec.result_file).write_text(trainer.result().model_dump_json())
        trainer.close()
    except XronosError as err:
        rank = spec.assignment.rank if spec.assignment is not None else None
        print(f"xronos: error: rank {rank}: {err}", file=sys.stderr)
        return 2
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown. The worker's outputs are written and closed by
    then; freeing torch's and transformers' modules is CPU work that, under a device's quota, kept the
    launcher (and the job's end) waiting 1-5 s after the model was saved (0.25 and 0.5 speeds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
