"""How often a job over MQTT checkpoints: what a lost node costs against what checkpoints cost.

A job resumes on the survivors of a lost node from its newest checkpoint, so it loses
the steps since; checkpoints are not free either: every node keeps the whole of each
(`edge_node.checkpoint`, `replicate`), which rank 0 assembles from the slices and
broadcasts, and every node writes to its own, slow, storage while the job waits. The
interval is chosen so that checkpointing costs about CHECKPOINT_SHARE of the training
time: the larger the model, the rarer; the longer a step, the more often (a step lost
is then worth more, and a checkpoint costs relatively less).
"""

from __future__ import annotations

import math

from xronos.contract.job import MAX_EVERY, JobOptions
from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.splits import ModelDims
from xronos.planner.cost_model import trained_count
from xronos.planner.job_plan import JobPlan

CHECKPOINT_SHARE = 0.05
"""Part of the training time checkpoints may take."""
CHECKPOINT_TENSORS = 3
"""Full float32 copies in a checkpoint: the model and AdamW's two moments."""
NETWORK_BYTES_PER_SECOND = 12.5e6
"""100 Mbit/s, the link a checkpoint's bytes are assumed to cross: Fast Ethernet or good Wi-Fi, what
edge boards have. Profiles measure a device's CPU cost of moving bytes (a loopback exchange,
`DeviceProfile.allreduce_seconds_per_mib`), not its network; the slower of the two is used."""
DISK_BYTES_PER_SECOND = 50e6
"""Sequential writes of eMMC or an SD card (class A1/U3), where an edge device keeps its checkpoints."""
CHECKPOINT_FIXED_SECONDS = 0.2
"""Per checkpoint whatever its size: opening and fsyncing a dozen files and directories, the manifest."""


def checkpoint_seconds(
    dims: ModelDims, world_size: int, profiles: list[DeviceProfile] | None = None, lora: LoraOptions | None = None
) -> float:
    """Estimated seconds of one replicated checkpoint: its bytes moved twice over the slowest link
    (gathered to rank 0, broadcast to all; not at all on one device), written to disk, and the fixed cost."""
    nbytes = trained_count(dims, lora) * 4 * CHECKPOINT_TENSORS
    per_byte = 1 / NETWORK_BYTES_PER_SECOND
    if profiles:
        per_byte = max(per_byte, max(p.allreduce_seconds_per_mib for p in profiles) / 2**20)
    network = 2 * nbytes * per_byte if world_size > 1 else 0.0
    return network + nbytes / DISK_BYTES_PER_SECOND + CHECKPOINT_FIXED_SECONDS


def checkpoint_interval(
    job: JobOptions, dims: ModelDims, plan: JobPlan, profiles: list[DeviceProfile] | None = None
) -> int:
    """Steps between checkpoints so that they take about CHECKPOINT_SHARE of the training time: one
    checkpoint's `checkpoint_seconds` over the share of `plan.predicted_step_seconds`.

    `profiles` (default: the plan's, mode xronos) give the devices' cost per byte moved. At least 1;
    it may reach `job.steps` (a short job then writes only its final model), and at most MAX_EVERY
    (what `JobOptions.checkpoint_every` admits). A plan without a predicted step (`plan_job` always
    predicts one) checkpoints once, halfway.
    """
    step = plan.predicted_step_seconds
    if step is None or step <= 0:
        return max(1, job.steps // 2)
    cost = checkpoint_seconds(dims, plan.world_size, profiles if profiles is not None else plan.profiles, job.lora)
    steps = cost / (CHECKPOINT_SHARE * step)
    return MAX_EVERY if steps >= MAX_EVERY else max(1, math.ceil(steps))
