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
from xronos.planner.cost_model import lora_factor_params
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


def parameter_count(dims: ModelDims) -> int:
    """Parameters of a Llama-family model of these sizes (biases, which some families add, are
    negligible and not counted)."""
    h = dims.hidden_size
    attention = h * dims.head_dim * 2 * (dims.num_heads + dims.num_kv_heads)  # q and o; k and v
    layer = attention + 3 * h * dims.intermediate_size + 2 * h  # + gate, up, down; two norms
    embeddings = (1 if dims.tie_word_embeddings else 2) * dims.vocab_size * h
    return dims.num_layers * layer + embeddings + h  # + the final norm


def trained_count(dims: ModelDims, lora: LoraOptions | None = None) -> int:
    """Parameters a checkpoint holds: the whole model's, or with LoRA only the adapter's factors (the
    frozen base is the `--model` every node has)."""
    if lora is None:
        return parameter_count(dims)
    replicated, per_group, per_block = lora_factor_params(dims, lora)
    return replicated + per_group * dims.num_kv_heads + per_block * (dims.intermediate_size // dims.mlp_block)


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
