"""A head start's arithmetic: the pace of the device that trained instead of profiling, as a profile.

Profiling every device afresh took 2-4 s, and the plan waits for the slowest
device's profile: on a 50-step job of a narrow model, that wait was as long as
everything the cluster's shorter steps saved (issue 36). With a head start the
fastest device trains alone from the first step while the others profile
(`edge_node.head_start`); the plan then needs a profile of that device, which
never ran the profiler. Its steps measured its pace on the whole model, and
the profile of the fastest other device gives the shape (what a share costs
against the whole: fixed and per-unit costs, the weight-gradient fractions);
scaled so that the whole model costs what the steps measured, it prices the
device's shares. The job's re-plan checks then calibrate each segment against
what the shards measure, as they do for every profile.
"""

from __future__ import annotations

import statistics

from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import WARMUP_STEPS
from xronos.contract.splits import ModelDims
from xronos.planner.cost_model import device_compute, dim_units
from xronos.planner.job_plan import JobPlan
from xronos.planner.partitioner import share_bytes
from xronos.planner.planning import split_for_mode
from xronos.planner.replan import recalibrate

EXCHANGE_FIELDS = ("allreduce_latency_seconds", "allreduce_seconds_per_mib")
"""A profile's exchange costs: scaled with the compute, since a CPU device moves an all-reduce's bytes on the
same cores, at the same pace, as it computes (`edge_node.profiler`)."""


def steady_compute(compute_seconds: list[float]) -> float | None:
    """The median compute seconds of a device's steps after the warm-up (None: none yet)."""
    steady = compute_seconds[WARMUP_STEPS:]
    return statistics.median(steady) if steady else None


def whole_model_seconds(profile: DeviceProfile, dims: ModelDims) -> float:
    """What `profile` predicts one micro-step of the whole model costs (every unit of every dimension)."""
    return device_compute(profile, dims, dims.num_kv_heads, dims.intermediate_size, dims.vocab_size)


def head_start_profile(
    others: list[DeviceProfile],
    dims: ModelDims,
    micro_step_seconds: float | None,
    device: str,
    speed_hint: float | None,
    memory_bytes: int,
) -> DeviceProfile:
    """A profile for `device`, which trained `micro_step_seconds` of compute per micro-step on the whole model:
    the fastest of `others` scaled to that pace, its exchange costs with it. Without a pace (a head start given
    up before a steady step), scaled by the speeds (the emulation's; the same pace where either is unknown)."""
    base = min(others, key=lambda p: whole_model_seconds(p, dims))
    if micro_step_seconds is not None:
        factor = micro_step_seconds / whole_model_seconds(base, dims)
    else:
        factor = base.speed_hint / speed_hint if base.speed_hint and speed_hint else 1.0
    scaled = recalibrate(base, factor)
    exchange = {field: getattr(base, field) * factor for field in EXCHANGE_FIELDS}
    identity = {"device": device, "speed_hint": speed_hint, "memory_bytes": memory_bytes, "address": None}
    return scaled.model_copy(update=exchange | identity | {"profile_seconds": 0.0})


def holds_whole_model(memory_bytes: int, dims: ModelDims, micro_batch: int, seq_len: int, lora=None) -> bool:
    """Whether a device with `memory_bytes` can train the whole model alone, as the partitioner prices memory."""
    return share_bytes(dims, micro_batch, seq_len, *dim_units(dims), lora) <= memory_bytes


def trained_ahead(dims: ModelDims, device: int, devices: int) -> JobPlan:
    """The plan of a job its head start's `device` trained to the end before the others' profiles were in: it
    alone, with the whole model, the others left out."""
    return JobPlan(
        ranks=[0 if d == device else None for d in range(devices)],
        reasons=[None if d == device else "the head start trained the whole job first" for d in range(devices)],
        split=split_for_mode("single", dims, 1, None),
    )
