"""From measured device profiles to a job's layout: who takes part, with which rank and shard.

One pure function for both front ends: the local launcher (`xronos run`) and
the MQTT controller call `plan_job` with the profiles in device order and hand
the answer to their workers. `pp` plans with the exact pipeline planner, `tp`
is the even split over every device, `single` wants exactly one device.
`xronos` prices the layouts the job allows (`JobOptions.layouts`) by the job's
predicted time (`xronos.planner.job_time`): uneven TP on the partitioner's best
set of devices and the even split over all, the pipeline plan, and the fastest
device alone with the plain model; it keeps the shortest.
"""

from __future__ import annotations

from functools import partial

from pydantic import BaseModel

from xronos.contract.assignment import RankAssignment
from xronos.contract.choice import Layout, LayoutCandidate, LayoutChoice
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import ExcludedDevice, HeadStart, RankResult, RunReport, build_report, mean_idle_ratio
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import device_compute, split_step_seconds, unit_bytes
from xronos.planner.job_time import choose, reshard_seconds, startup_seconds, steps_left
from xronos.planner.partitioner import fits_memory, plan_partition
from xronos.planner.pipeline_plan import PipelinePlan, plan_pipeline
from xronos.planner.planning import even_split, split_for_mode


class JobPlan(BaseModel):
    ranks: list[int | None]
    """Rank of each device (input order); None = left out."""
    reasons: list[str | None]
    """Why a device was left out (None for participants)."""
    split: ShardSplit | None = None
    stages: list[tuple[int, int]] | None = None
    micro_batches: int = 1
    profiles: list[DeviceProfile] | None = None
    """Mode xronos: the participants' profiles in rank order, for re-planning during the job."""
    predicted: list[float] | None = None
    """Predicted compute seconds per step of each rank."""
    predicted_step_seconds: float | None = None
    predicted_idle_ratio: float | None = None
    """Mode xronos: the idle ratio the partitioner predicted for its split."""
    optimal: bool = True
    """False when the partitioner's time cap cut the search short (memory binding on many devices)."""
    plain: bool = False
    """One device trains the plain Hugging Face model (mode xronos chose the fastest device alone)."""
    choice: LayoutChoice | None = None
    """Mode xronos: the layouts it priced, the chosen one first."""

    @property
    def members(self) -> list[int]:
        """Participating devices, in rank order."""
        return [d for _, d in sorted((r, d) for d, r in enumerate(self.ranks) if r is not None)]

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_assignment(self, device: int, master_addr: str, master_port: int) -> RankAssignment:
        """Device `device`'s part in the plan (its rank None: left out), with the job's rendezvous."""
        rank = self.ranks[device]
        if rank is None:
            return RankAssignment()
        return RankAssignment(
            rank=rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            split=self.split,
            stages=self.stages,
            micro_batches=self.micro_batches,
            profiles=self.profiles,
            plain=self.plain,
        )


def plan_job(
    job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile], head_start: HeadStart | None = None
) -> JobPlan:
    """The layout of `job` over devices with these profiles (all measured at the job's shapes); mode xronos
    with a `head_start` under way plans the steps it leaves (`chosen_plan`)."""
    n = len(profiles)
    if job.mode == "pp":
        plan = pipeline_plan(job, dims, profiles)
        if plan is None:
            raise XronosError("the fastest pipeline puts more layers on a device than its memory holds")
        return plan
    if job.mode == "xronos":
        return chosen_plan(job, dims, profiles, head_start)
    if job.mode == "single" and n != 1:
        raise XronosError(f"mode single trains on one device, not {n}")
    split = split_for_mode("single", dims, 1, None) if job.mode == "single" else even_split(dims, n)
    return JobPlan(
        ranks=list(range(n)),
        reasons=[None] * n,
        split=split,
        predicted=[device_compute(p, dims, *s) * job.grad_accum for p, s in zip(profiles, split.shares())],
        predicted_step_seconds=split_step_seconds(profiles, dims, split) * job.grad_accum,
    )


def stages_fit(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile], plan: PipelinePlan) -> bool:
    """Whether every stage's device holds its layers (the embedding on the first, the LM head on the last),
    priced as the TP memory model prices the same parameters and activations (`unit_bytes`)."""
    fixed, kv, mlp, vocab = unit_bytes(dims, job.batch_size // (job.micro_batches or job.batch_size), job.seq_len)
    per_layer = (kv * dims.num_kv_heads + mlp * (dims.intermediate_size // dims.mlp_block)) / dims.num_layers
    vocab_bytes = vocab * (dims.vocab_size // dims.vocab_block)
    last = len(plan.stages) - 1
    return all(
        fixed + (hi - lo) * per_layer + vocab_bytes * ((k == 0) + (k == last)) / 2 <= profiles[d].memory_bytes
        for k, (d, (lo, hi)) in enumerate(zip(plan.devices, plan.stages))
    )


def pipeline_plan(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile]) -> JobPlan | None:
    """The exact pipeline plan: the fastest stages over device subsets and orders (None: a stage's device
    cannot hold its layers; the pipeline planner prices time alone)."""
    plan = plan_pipeline(profiles, dims, job.batch_size, job.micro_batches or job.batch_size)
    if not stages_fit(job, dims, profiles, plan):
        return None
    ranks = [plan.devices.index(d) if d in plan.devices else None for d in range(len(profiles))]
    return JobPlan(
        ranks=ranks,
        reasons=[None if r is not None else "a faster pipeline leaves it out" for r in ranks],
        stages=plan.stages,
        micro_batches=plan.micro_batches,
        predicted=[s * plan.micro_batches for s in plan.stage_seconds],
        predicted_step_seconds=plan.predicted_step_seconds,
    )


def partition_plan(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile]) -> JobPlan:
    """Uneven TP: the partitioner's minimum-step split over its best set of devices."""
    partition = plan_partition(profiles, dims, job.batch_size // job.grad_accum, job.seq_len, lora=job.lora)
    ranks = [d.rank for d in partition.devices]
    members = [d for _, d in sorted((r, d) for d, r in enumerate(ranks) if r is not None)]
    return JobPlan(
        ranks=ranks,
        reasons=[c.reason for c in partition.devices],
        split=partition.split,
        profiles=[profiles[d] for d in members],
        predicted=[partition.devices[d].compute_seconds * job.grad_accum for d in members],
        predicted_step_seconds=partition.predicted_step_seconds * job.grad_accum,
        optimal=partition.optimal,
        predicted_idle_ratio=partition.predicted_idle_ratio,
    )


def _fits(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile], split: ShardSplit) -> bool:
    """Whether every device (rank order) holds its share of `split` in its memory."""
    shares = [(kv, mlp // dims.mlp_block, vocab // dims.vocab_block) for kv, mlp, vocab in split.shares()]
    return fits_memory(
        profiles,
        dims,
        job.batch_size // job.grad_accum,
        job.seq_len,
        list(range(len(profiles))),
        [(kv, None) for kv, _, _ in shares],
        [m for _, m, _ in shares],
        [v for _, _, v in shares],
        job.lora,
    )


def even_plan(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile]) -> JobPlan | None:
    """Even TP over every device (None when a device cannot hold its share)."""
    split = even_split(dims, len(profiles))
    if not _fits(job, dims, profiles, split):
        return None
    n = len(profiles)
    compute = [device_compute(p, dims, *s) for p, s in zip(profiles, split.shares())]
    step = split_step_seconds(profiles, dims, split)
    return JobPlan(
        ranks=list(range(n)),
        reasons=[None] * n,
        split=split,
        profiles=profiles,
        predicted=[c * job.grad_accum for c in compute],
        predicted_step_seconds=step * job.grad_accum,
        predicted_idle_ratio=mean_idle_ratio(compute, step),
    )


def alone_plan(
    job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile], only: int | None = None
) -> JobPlan | None:
    """The fastest device that holds the whole model (or device `only`, if it does), alone with the plain
    model (None: none holds it)."""
    split = split_for_mode("single", dims, 1, None)
    whole = split.shares()[0]
    fitting = [d for d, p in enumerate(profiles) if _fits(job, dims, [p], split) and (only is None or d == only)]
    if not fitting:
        return None
    device = min(fitting, key=lambda d: device_compute(profiles[d], dims, *whole))
    step = device_compute(profiles[device], dims, *whole) * job.grad_accum
    return JobPlan(
        ranks=[0 if d == device else None for d in range(len(profiles))],
        reasons=[None if d == device else "the fastest device alone is the shorter job" for d in range(len(profiles))],
        split=split,
        predicted=[step],
        predicted_step_seconds=step,
        plain=True,
    )


def chosen_plan(
    job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile], head_start: HeadStart | None = None
) -> JobPlan:
    """Mode xronos: each layout `job.layouts` allows, priced by the job's predicted time; the shortest.

    A LoRA job does not pipeline (`JobOptions`); a layout that cannot place the model is not a candidate.
    With a `head_start` under way, the steps it has trained are done (and the one under way nearly so), its
    device alone goes on with nothing to start, and every other layout first takes its model over. No other
    device alone is a candidate then: it would gain at most its pace over the head start's, priced by a
    profile against a measurement (the profiles of a tiny model put an equal device 19% faster).
    """
    done = head_start.steps + 1 if head_start is not None else 0
    options: list[tuple[LayoutCandidate, JobPlan]] = []
    errors: list[str] = []

    def add(layout: Layout, build, note: str | None = None, reshards: int = 0) -> None:
        try:
            plan = build(job, dims, profiles)
        except XronosError as err:
            errors.append(str(err))
            return
        if plan is None or (layout != "single" and len(plan.members) == 1 and "single" in job.layouts):
            return  # on one device, the plain model is the same job with less around it
        members = [profiles[d] for d in plan.members]
        step = plan.predicted_step_seconds or 0.0
        startup = startup_seconds(layout, members, dims, job, step, reshards)
        if head_start is not None:
            goes_on = layout == "single" and plan.members == [head_start.device]
            # the handoff writes the trained state to a checkpoint and each member reads its share back:
            # priced as a re-shard moves the same state
            startup = 0.0 if goes_on else startup + reshard_seconds(members, dims, job)
        candidate = LayoutCandidate(
            layout=layout,
            devices=[p.device for p in members],
            note=note,
            step_seconds=step,
            startup_seconds=startup,
            steps=max(1, steps_left(job) - done),
        )
        options.append((candidate, plan))

    if "tp" in job.layouts:  # either split is checked against the measured pace, and may re-shard once
        add("tp", partition_plan, "uneven", reshards=1 if job.replan_after else 0)
        if len(profiles) > 1:
            add("tp", even_plan, "even", reshards=1 if job.replan_after else 0)
    if "pp" in job.layouts and job.lora is None:
        add("pp", pipeline_plan)
    if "single" in job.layouts:  # a head start's device alone, or none: its pace is measured, the others' profiled
        add("single", partial(alone_plan, only=head_start.device if head_start is not None else None))
    if not options:
        raise XronosError(errors[0] if errors else "no device, nor any group of devices, can hold this model")
    choice = choose([c for c, _ in options])
    plan = next(p for c, p in options if c is choice.chosen)
    shorter = f"{choice.chosen.describe()} is the shorter job"
    reasons = [None if rank is not None else why or shorter for rank, why in zip(plan.ranks, plan.reasons)]
    return plan.model_copy(update={"choice": choice, "reasons": reasons})


def planned_report(
    job: JobOptions,
    dims: ModelDims,
    plan: JobPlan,
    profiles: list[DeviceProfile],
    speeds: list[float | None],
    results: list[RankResult],
) -> RunReport:
    """The report of a job that ran `plan` (both front ends: `xronos run` and the controller): what the
    ranks measured (`results`, rank order), with what the plan predicted and who it left out.
    `profiles` and `speeds` are per device, in the order the plan was made."""
    report = build_report(
        job.mode,
        plan.split,
        [speeds[d] for d in plan.members],
        results,
        plan.members,
        plan.predicted,
        stages=plan.stages,
        dims=dims,
    )
    return with_predictions(report, job, dims, plan, profiles, speeds)


def excluded_devices(plan: JobPlan, speeds: list[float | None]) -> list[ExcludedDevice]:
    """The devices `plan` leaves out, with its reasons (`speeds` per device)."""
    return [
        ExcludedDevice(device=d, speed=speeds[d], reason=plan.reasons[d] or "left out")
        for d, r in enumerate(plan.ranks)
        if r is None
    ]


def with_predictions(
    report: RunReport,
    job: JobOptions,
    dims: ModelDims,
    plan: JobPlan,
    profiles: list[DeviceProfile],
    speeds: list[float | None],
) -> RunReport:
    """Add the plan's predictions (for the split the job ended with) and the left-out devices to a report."""
    update: dict = {
        "excluded": excluded_devices(plan, speeds),
        "predicted_step_seconds": plan.predicted_step_seconds,
        "predicted_idle_ratio": plan.predicted_idle_ratio,
        "profiles": profiles,
        "layout_choice": plan.choice,
    }
    if report.split is not None and plan.stages is None:
        members = [profiles[d] for d in plan.members]
        update["predicted_step_seconds"] = split_step_seconds(members, dims, report.split) * job.grad_accum
        update["nodes"] = [
            n.model_copy(update={"predicted_compute_seconds": device_compute(p, dims, *s) * job.grad_accum})
            for n, p, s in zip(report.nodes, members, report.split.shares())
        ]
    return report.model_copy(update=update)
