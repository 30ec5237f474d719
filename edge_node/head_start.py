"""A head start: the fastest device trains alone from the job's first step while the others profile.

A mode xronos job plans from every device's profile, and profiling afresh took
2-4 s on the emulated devices, the slowest last: the plan came 9-11 s after
`xronos run` started, where mode `single` had trained its first step at ~6 s
(issue 36, docs/benchmarks.md). So the local launcher gives its fastest device
(by speed) a head start (`edge_node.launcher`): that worker skips its own
profiling and trains the whole model through the TP engine on one rank, which
times its compute per step, and it rewrites the `HeadStart` file after every
step. The launcher plans once the others' profiles are in, with a profile made
from those steps (`xronos.planner.head_start`), for the steps left. When the
plan arrives, the device finishes the step under way, writes a checkpoint of
where it stands (the parameters and their AdamW moments) in the run's own
directory and names it in the file; every member of the plan resumes from it, as a job resumed on another set
of devices does (issue 30), so the job's numbers equal single-process
training's. A plan that keeps the device alone writes no plan to it: it trains
on to the end, as does a job shorter than the others' profiling.

A device whose profile is cached (a day, per shape) profiles as usual: its
profile comes at once, and the plan with it.
"""

from __future__ import annotations

import time
from pathlib import Path

from edge_node.model_io import load_config
from edge_node.timeline import Timeline
from edge_node.trainer import Trainer, WorkerSpec
from edge_node.worker_process import free_port
from xronos.contract.assignment import RankAssignment
from xronos.contract.files import write_atomically
from xronos.contract.report import HeadStart
from xronos.contract.splits import ModelDims
from xronos.planner.planning import split_for_mode

PACE_STEPS = 10
"""The steps whose compute the progress file keeps: the warm-up and eight steady ones price the device; a head
start the plan keeps alone goes on writing its progress every step, and the file stays this small."""


def starts_ahead(spec: WorkerSpec) -> bool:
    """Whether this worker takes the head start: the launcher offered it, and its profile is not cached."""
    if not spec.head_start or spec.head_start_file is None or spec.plan_file is None:
        return False
    from edge_node.profiler import job_cached_profile

    return job_cached_profile(spec.job, spec.threads, spec.name or f"device-{spec.device}", spec.speed_hint) is None


def handed_over(spec: WorkerSpec) -> str | None:
    """The checkpoint a head start handed the job over through (None: none did), for a member of the plan."""
    if spec.head_start_file is None or not Path(spec.head_start_file).is_file():
        return None
    return HeadStart.model_validate_json(Path(spec.head_start_file).read_text()).checkpoint


def head_start(spec: WorkerSpec, timeline: Timeline) -> WorkerSpec | None:
    """Train alone until the plan arrives, then hand over through a checkpoint; returns this device's part in
    the plan, to resume from that checkpoint (None: it trained the job to the end, its result written, or
    the plan leaves it out)."""
    handoff = _train_until_plan(spec, timeline)  # its model and moments freed before the plan's trainer loads
    if handoff is None:
        return None
    assignment = RankAssignment.model_validate_json(Path(str(spec.plan_file)).read_text())
    if assignment.rank is None:
        return None
    return spec.model_copy(update={"assignment": assignment, "resume_from": str(handoff)})


def _train_until_plan(spec: WorkerSpec, timeline: Timeline) -> Path | None:
    """The head start's training: the whole model on one rank of the TP engine, its progress written after
    every step; the checkpoint written when the plan arrived (None: the job ended first, its result written)."""
    assert spec.head_start_file is not None and spec.plan_file is not None
    dims = ModelDims.from_config(load_config(spec.job.model))
    alone = RankAssignment(
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        split=split_for_mode("single", dims, 1, None),
    )
    progress, plan = Path(spec.head_start_file), Path(spec.plan_file)
    write_atomically(progress, HeadStart(device=spec.device, steps=0, compute_seconds=[]).model_dump_json())
    trainer = Trainer(spec.model_copy(update={"assignment": alone}), timeline)

    def state(**update) -> HeadStart:
        timed = zip(trainer.step_seconds[:PACE_STEPS], trainer.comm_seconds[:PACE_STEPS])
        compute = [wall - comm for wall, comm in timed]
        return HeadStart(device=spec.device, steps=len(trainer.step_seconds), compute_seconds=compute, **update)

    def plan_arrived() -> bool:
        write_atomically(progress, state().model_dump_json())
        if not plan.is_file():
            return False
        timeline.mark("plan_received")
        return True

    try:
        if trainer.train(stop=plan_arrived):
            Path(spec.result_file).write_text(trainer.result().model_dump_json())
            write_atomically(progress, state(finished=True).model_dump_json())
            return None
        started = time.perf_counter()
        handoff = progress.parent / f"handoff-{trainer.steps_done:08d}"  # the run's own: not the output's to prune
        trainer.save_checkpoint(trainer.steps_done, handoff)
        seconds = time.perf_counter() - started
        timeline.mark("handoff", seconds)
        write_atomically(progress, state(checkpoint=str(handoff), handoff_seconds=seconds).model_dump_json())
        return handoff
    finally:
        trainer.close()
