"""A job's predicted time, not its step alone: what a layout costs before its steps pay.

Spreading a job over devices shortens its steps but costs once: the ranks meet
(the rendezvous), time the two all-reduce algorithms (`collective: auto`), warm
up, and mode xronos's first checks may re-shard. One device alone pays only its
warm-up. Over a short job, or beside devices too slow to take much, that one-off
cost is more than the steps save, and the fastest device alone is the faster
job. Mode xronos prices every layout it may use (`JobOptions.layouts`) with
these costs for the steps the job has left and keeps the shortest
(`xronos.planner.job_plan`). Profiling is not counted: it is spent before any
layout is chosen, and a device's profile is cached for the next job of the same
shapes (`edge_node.profiler`).
"""

from __future__ import annotations

from xronos.contract.choice import Layout, LayoutCandidate, LayoutChoice
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.splits import ModelDims
from xronos.planner.cost_model import (
    allreduces_per_step,
    collective_seconds,
    frozen_bytes_per_param,
    parameter_count,
    trained_count,
)

RENDEZVOUS_SECONDS = 1.0
"""A spread job's ranks meeting over TCP (`init_process_group`) and their first barrier."""
COLLECTIVE_TRIALS = 18
"""All-reduces `collective: auto` times before the first step: both algorithms, a warm-up and 8 trials each
(`edge_node.tp.comm.time_collectives`)."""
FIRST_STEP_EXTRA = 1.5
"""Steps' worth the first two steps cost over steady ones, in any layout: the first allocates (AdamW's
moments too), the second still runs about 1.5x a steady one (`xronos.contract.report.WARMUP_STEPS`)."""
RESHARD_BYTES_PER_PARAM = 12
"""A re-shard moves the trained parameters with their two AdamW moments, float32."""
ONE_DEVICE_MARGIN = 0.05
"""A layout over several devices must be predicted this much shorter than the fastest device alone to be
chosen: within it, the prediction's error (10% is the cost model's target) could make the spread job the
slower one, and one device has no peer to wait for or to lose."""


def reshard_seconds(members: list[DeviceProfile], dims: ModelDims, job: JobOptions) -> float:
    """One re-shard: each rank receives about its share of the trained parameters and their moments (with
    LoRA also of the frozen base weights, which move with their split), at the slowest member's measured
    exchange rate."""
    moved = trained_count(dims, job.lora) * RESHARD_BYTES_PER_PARAM
    if job.lora is not None:
        moved += parameter_count(dims) * frozen_bytes_per_param(job.lora)
    mib = moved / len(members) / 2**20
    return mib * max(p.allreduce_seconds_per_mib for p in members)


def startup_seconds(
    layout: Layout, members: list[DeviceProfile], dims: ModelDims, job: JobOptions, step: float, reshards: int
) -> float:
    """The one-off seconds of `layout` on `members` (rank order) for a job whose steps take `step`:
    the first step's warm-up; with several devices the rendezvous; for tensor parallelism the
    collective's timing (`collective: auto`) and `reshards` expected re-shards."""
    seconds = FIRST_STEP_EXTRA * step
    if len(members) == 1:
        return seconds
    seconds += RENDEZVOUS_SECONDS
    if layout == "tp":
        if job.collective == "auto":
            per_call = max(collective_seconds(p, dims) for p in members) / allreduces_per_step(dims)
            seconds += COLLECTIVE_TRIALS * per_call
        seconds += reshards * reshard_seconds(members, dims, job)
    return seconds


def steps_left(job: JobOptions) -> int:
    """The steps the job still trains: all of them, or those after the checkpoint it resumes from."""
    return job.steps - (job.resume_step or 0) if job.resume else job.steps


EVEN_MARGIN = 0.03
"""Uneven TP must be predicted this much shorter than the even split over the same devices to be chosen: the
re-plan's own threshold (`xronos.planner.replan.MIN_REPLAN_GAIN`). Below it the gain is within the
prediction's error, and with equal devices an uneven split measured 4-9% slower than the even one (issue 36,
docs/benchmarks.md)."""


def _simpler(best: LayoutCandidate, ranked: list[LayoutCandidate]) -> tuple[LayoutCandidate, str | None]:
    """The simplest candidate within its margin of `best`: the fastest device alone (ONE_DEVICE_MARGIN),
    else even TP on the same devices (EVEN_MARGIN); `best` itself when none is; and why."""
    alone = [c for c in ranked if len(c.devices) == 1]
    if len(best.devices) > 1 and alone and alone[0].job_seconds <= best.job_seconds * (1 + ONE_DEVICE_MARGIN):
        gain = 1 - best.job_seconds / alone[0].job_seconds
        return alone[0], (
            f"{best.describe()} was predicted {gain:.1%} shorter, within the {ONE_DEVICE_MARGIN:.0%} margin a spread "
            "job must beat one device by"
        )
    even = [c for c in ranked if c.layout == "tp" and c.note == "even" and c.devices == best.devices]
    if (
        best.layout == "tp"
        and best.note != "even"
        and even
        and even[0].job_seconds <= best.job_seconds * (1 + EVEN_MARGIN)
    ):
        gain = 1 - best.job_seconds / even[0].job_seconds
        return even[0], (
            f"{best.describe()} was predicted {gain:.1%} shorter, within the {EVEN_MARGIN:.0%} margin an uneven "
            "split must beat the even one by"
        )
    return best, None


def choose(candidates: list[LayoutCandidate]) -> LayoutChoice:
    """The shortest job (on a tie, the fewest devices, the plain model on one), or a simpler one within its
    margin of it (`_simpler`, saying why); the others after it, shortest first."""
    if not candidates:
        raise ValueError("no layout to choose from")
    # on a tie, fewer devices, and on one device the plain model (no engine around it)
    ranked = sorted(candidates, key=lambda c: (c.job_seconds, len(c.devices), c.layout != "single"))
    best, reason = _simpler(ranked[0], ranked)
    return LayoutChoice(candidates=[best] + [c for c in ranked if c is not best], reason=reason)
