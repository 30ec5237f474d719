"""A device's measured speed at a job's shapes: what the partitioner plans with.

Seconds, not FLOP estimates: every number is timed on the device itself,
under whatever CPU share it really has. Units match the split: one KV group,
one block of MLP columns and one block of vocabulary rows, each costed for
forward + backward + the AdamW update of its parameters, in one layer (the
vocabulary has no layers). Each component also has a fixed cost: the per-call
work that does not shrink with the share (kernel launches, rotary embedding,
Python), planned as paid by a device holding any of it (a rank holding none
still launches a few empty operations; not priced). A share of u units costs
fixed + u * per-unit: a device's small share costs more than its fraction of
a whole. Travels as JSON (a profile file, an MQTT message); profiles without
the fixed costs (older nodes) read as fixed cost 0, while older controllers
refuse the new fields (log, count, drop).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

from xronos.contract.splits import ModelDims


class ProfileShape(BaseModel):
    """What a profile was measured at; a cached profile is reused only for the same shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: PositiveInt
    head_dim: PositiveInt
    heads_per_group: PositiveInt
    micro_batch: PositiveInt
    seq_len: PositiveInt
    mlp_block: PositiveInt
    vocab_block: PositiveInt
    threads: PositiveInt


class DeviceProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    device: str = Field(description="Node id (or 'device-<i>' in a local run).")
    speed_hint: float | None = Field(None, description="The emulated speed, when there is one (informational).")
    shape: ProfileShape
    kv_group_seconds: NonNegativeFloat
    mlp_block_seconds: NonNegativeFloat
    vocab_block_seconds: NonNegativeFloat
    layer_fixed_seconds: NonNegativeFloat = Field(description="Replicated work per layer (norms, residuals).")
    step_fixed_seconds: NonNegativeFloat = Field(description="Replicated work per micro-step outside the layers.")
    kv_fixed_seconds: NonNegativeFloat = Field(0.0, description="Per layer, for holding any attention at all.")
    mlp_fixed_seconds: NonNegativeFloat = Field(0.0, description="Per layer, for holding any MLP columns at all.")
    vocab_fixed_seconds: NonNegativeFloat = Field(0.0, description="Per micro-step, for holding any vocabulary rows.")
    mlp_weight_grad_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Part of an MLP share's seconds (fixed + per block) spent on its "
        "weight-gradient products, which a rank can compute later (0: unmeasured).",
    )
    attention_backward_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Part of an attention share's seconds spent in its backward pass."
    )
    attention_weight_grad_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Part of an attention share's seconds (fixed + per group) spent on "
        "its weight-gradient products (0: unmeasured).",
    )
    vocab_weight_grad_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Part of a vocabulary block's seconds (the per-block cost) spent on its LM "
        "head weight-gradient product, which a rank can compute later (0: unmeasured).",
    )
    attention_forward_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Part of an attention share's seconds spent in its forward pass (0: unmeasured).",
    )
    mlp_forward_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Part of an MLP share's seconds spent in its forward pass (0: unmeasured)."
    )
    vocab_forward_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Part of a vocabulary share's seconds spent in its forward pass: embedding, LM head and "
        "the loss (0: unmeasured).",
    )
    allreduce_latency_seconds: NonNegativeFloat
    allreduce_seconds_per_mib: NonNegativeFloat = Field(description="This device's CPU cost of an all-reduce, per MiB.")
    memory_bytes: PositiveInt = Field(description="Memory the device can give to the job.")
    address: str | None = None
    profile_seconds: NonNegativeFloat = 0.0


COMPUTE_FIELDS = (
    "kv_group_seconds",
    "mlp_block_seconds",
    "vocab_block_seconds",
    "layer_fixed_seconds",
    "step_fixed_seconds",
    "kv_fixed_seconds",
    "mlp_fixed_seconds",
    "vocab_fixed_seconds",
)
"""A profile's compute seconds (not its collective cost): what scales with the device's pace."""
SEGMENT_FIELDS = {
    "kv_groups": ("kv_group_seconds", "kv_fixed_seconds"),
    "mlp_columns": ("mlp_block_seconds", "mlp_fixed_seconds"),
    "vocab_rows": ("vocab_block_seconds", "vocab_fixed_seconds", "step_fixed_seconds"),
}
"""By split dimension, the compute seconds of its segment that a share changes (a job measures each
segment apart; the layer norms, split between a layer's two segments, stay with the whole)."""


REFERENCE_CONFIG = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=1,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)
"""A node's start-up profile is measured on one SmolLM2-135M layer (a Llama config with these
sizes) at REFERENCE_BATCH x REFERENCE_SEQ tokens: a quick look at each device's speed before any job."""
REFERENCE_BATCH, REFERENCE_SEQ = 1, 64


class Segment(NamedTuple):
    """One segment's cost for one device: floor (paid by every participant) + [units > 0] fixed + units * per_unit."""

    floor: float
    fixed: float
    per_unit: float

    def seconds(self, units: float) -> float:
        return self.floor + (self.fixed if units > 0 else 0.0) + units * self.per_unit


def unit_costs(p: DeviceProfile) -> tuple[Segment, Segment, Segment]:
    """(attention per layer, MLP per layer, vocabulary per step) in units of KV groups, MLP blocks
    and vocabulary blocks. The replicated norms of a layer are split between its two segments;
    the step's own replicated work (the final norm) is the vocabulary segment's floor."""
    return (
        Segment(p.layer_fixed_seconds / 2, p.kv_fixed_seconds, p.kv_group_seconds),
        Segment(p.layer_fixed_seconds / 2, p.mlp_fixed_seconds, p.mlp_block_seconds),
        Segment(p.step_fixed_seconds, p.vocab_fixed_seconds, p.vocab_block_seconds),
    )


def forward_fractions(p: DeviceProfile) -> tuple[float, float, float]:
    """(attention, MLP, vocabulary): the part of each segment's seconds before its forward all-reduce.

    A segment's two all-reduces split it: every participant waits for the slowest forward, then for
    the slowest backward, so a split is priced by both (`xronos.planner.cost_model.step_seconds`).
    Unmeasured (a profile from before these fields), half of what the weight-gradient products
    leave: a forward product costs what its input-gradient product does."""
    measured = (p.attention_forward_fraction, p.mlp_forward_fraction, p.vocab_forward_fraction)
    later = (p.attention_weight_grad_fraction, p.mlp_weight_grad_fraction, p.vocab_weight_grad_fraction)
    return tuple(f if f > 0 else (1 - w) / 2 for f, w in zip(measured, later))  # type: ignore[return-value]


def weight_grad_costs(p: DeviceProfile) -> tuple[Segment, Segment]:
    """(MLP per layer, vocabulary per step): the weight-gradient products of a share, in MLP and
    vocabulary blocks, as a Segment with no floor (a rank holding none computes none)."""
    mlp, f = unit_costs(p)[1], p.mlp_weight_grad_fraction
    return Segment(0.0, f * mlp.fixed, f * mlp.per_unit), Segment(
        0.0, 0.0, p.vocab_weight_grad_fraction * p.vocab_block_seconds
    )


def weight_grad_seconds(p: DeviceProfile, blocks: float) -> float:
    """Per layer, the weight-gradient products of `blocks` MLP column blocks: what a rank whose
    weight gradients come later (`edge_node.tp.weight_grads`) moves out of its MLP segment."""
    return weight_grad_costs(p)[0].seconds(blocks)


def vocab_weight_grad_seconds(p: DeviceProfile, blocks: float) -> float:
    """Per micro-step, the LM head weight-gradient products of `blocks` vocabulary blocks: what a rank
    moves out of its vocabulary segment by computing them later (`edge_node.tp.weight_grads`). A product
    scales with its rows alone, so it is priced per block: the fixed work of the head and loss stays."""
    return weight_grad_costs(p)[1].seconds(blocks)


def attention_kept(p: DeviceProfile) -> Segment:
    """The attention segment of a rank whose attention weight gradients come later: what stays."""
    attention, keep = unit_costs(p)[0], 1 - p.attention_weight_grad_fraction
    return Segment(attention.floor, keep * attention.fixed, keep * attention.per_unit)


def attention_weight_grad_seconds(p: DeviceProfile, groups: float) -> float:
    """Per layer, the weight-gradient products of `groups` KV groups' attention (q, k, v, o): what a
    rank whose attention weight gradients come later moves into the MLP segment of the layer below."""
    return unit_costs(p)[0].seconds(groups) - attention_kept(p).seconds(groups)


def attention_backward_seconds(p: DeviceProfile, groups: float) -> float:
    """Per layer, the backward pass of `groups` KV groups' attention (and its norm): the span between
    a layer's two backward all-reduces, in which weight gradients computed later are hidden."""
    return p.attention_backward_fraction * unit_costs(p)[0].seconds(groups)


def layer_seconds(p: DeviceProfile, dims: ModelDims) -> float:
    """One whole decoder layer (all KV groups, all MLP blocks), one profiled micro-batch."""
    attention, mlp, _ = unit_costs(p)
    return attention.seconds(dims.num_kv_heads) + mlp.seconds(dims.intermediate_size / dims.mlp_block)


def head_seconds(p: DeviceProfile, dims: ModelDims) -> float:
    """Embedding, final norm, LM head and loss (the whole vocabulary), one profiled micro-batch."""
    return unit_costs(p)[2].seconds(dims.vocab_size / dims.vocab_block)


def reference_layer_seconds(p: DeviceProfile) -> float:
    """Seconds of one whole reference layer (all KV groups and MLP columns) by a start-up profile."""
    return layer_seconds(p, ModelDims.from_config(SimpleNamespace(**REFERENCE_CONFIG)))
