"""From measured device profiles to a job's layout: who takes part, with which rank and shard.

One pure function for both front ends: the local launcher (`xronos run`) and
the MQTT controller call `plan_job` with the profiles in device order and hand
the answer to their workers. `xronos` plans with the exact partitioner, `pp`
with the exact pipeline planner, `tp` is the even split over every device,
`single` wants exactly one device.
"""

from __future__ import annotations

from pydantic import BaseModel

from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import ExcludedDevice, RankResult, RunReport, build_report
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import device_compute, split_step_seconds
from xronos.planner.partitioner import plan_partition
from xronos.planner.pipeline_plan import plan_pipeline
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
        )


def plan_job(job: JobOptions, dims: ModelDims, profiles: list[DeviceProfile]) -> JobPlan:
    """The layout of `job` over devices with these profiles (all measured at the job's shapes)."""
    n = len(profiles)
    micro_batch = job.batch_size // job.grad_accum
    if job.mode == "pp":
        plan = plan_pipeline(profiles, dims, job.batch_size, job.micro_batches or job.batch_size)
        ranks = [plan.devices.index(d) if d in plan.devices else None for d in range(n)]
        return JobPlan(
            ranks=ranks,
            reasons=[None if r is not None else "a faster pipeline leaves it out" for r in ranks],
            stages=plan.stages,
            micro_batches=plan.micro_batches,
            predicted=[s * plan.micro_batches for s in plan.stage_seconds],
            predicted_step_seconds=plan.predicted_step_seconds,
        )
    if job.mode == "xronos":
        partition = plan_partition(profiles, dims, micro_batch, job.seq_len, lora=job.lora)
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


def with_predictions(
    report: RunReport,
    job: JobOptions,
    dims: ModelDims,
    plan: JobPlan,
    profiles: list[DeviceProfile],
    speeds: list[float | None],
) -> RunReport:
    """Add the plan's predictions (for the split the job ended with) and the left-out devices to a report."""
    excluded = [
        ExcludedDevice(device=d, speed=speeds[d], reason=plan.reasons[d] or "left out")
        for d, r in enumerate(plan.ranks)
        if r is None
    ]
    update: dict = {
        "excluded": excluded,
        "predicted_step_seconds": plan.predicted_step_seconds,
        "predicted_idle_ratio": plan.predicted_idle_ratio,
        "profiles": profiles,
    }
    if report.split is not None and job.mode != "pp":
        members = [profiles[d] for d in plan.members]
        update["predicted_step_seconds"] = split_step_seconds(members, dims, report.split) * job.grad_accum
        update["nodes"] = [
            n.model_copy(update={"predicted_compute_seconds": device_compute(p, dims, *s) * job.grad_accum})
            for n, p, s in zip(report.nodes, members, report.split.shares())
        ]
    return report.model_copy(update=update)
