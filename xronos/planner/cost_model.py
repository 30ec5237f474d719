"""The cost model: a device's predicted seconds and bytes for a share of each sharded dimension.

Pure arithmetic on measured profiles (`xronos.contract.profiles`): the per-segment costs, the
collectives' share of each device's step, the weight-gradient products a rank may move later, and the
memory a share needs. The solvers (`layouts`, `partitioner`) and the re-plan (`replan`) price splits
with it; docs/architecture.md derives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import (
    DeviceProfile,
    attention_backward_seconds,
    attention_weight_grad_seconds,
    forward_fractions,
    unit_costs,
    vocab_weight_grad_seconds,
    weight_grad_seconds,
)
from xronos.contract.splits import ModelDims, ShardSplit

BYTES_PER_PARAM = 16
"""float32 parameter + gradient + two AdamW moments."""
FROZEN_BYTES_PER_PARAM = 4
"""A LoRA job's base weights: the float32 parameter alone (no gradient, no AdamW state); its factors
cost BYTES_PER_PARAM."""
FROZEN_BF16_BYTES_PER_PARAM = 2
"""A LoRA job's base matrices held in bfloat16 (`LoraOptions.base_dtype`); its norms stay float32."""
RUNTIME_BYTES = 400 * 2**20
"""Python, torch and transformers loaded: what a worker uses before any tensor."""


# -- the pure cost model -----------------------------------------------------------


def allreduces_per_step(dims: ModelDims) -> int:
    """Per micro-batch, of an activation's size: 2 forward + 2 backward per layer, the embedding's sum, the
    final norm's gradient (the cross-entropy's two more are a value per token: LOSS_ALLREDUCES)."""
    return 4 * dims.num_layers + 2


LOSS_ALLREDUCES = 2
"""The vocabulary-parallel cross-entropy's all-reduces per micro-batch (the rows' maxima, then their sums
and target logits): a few values per token, so latency alone; on a throttled device that latency is
most of an all-reduce's cost."""


def payload_mib(dims: ModelDims, micro_batch: int, seq_len: int) -> float:
    return micro_batch * seq_len * dims.hidden_size * 4 / 2**20


def collective_seconds(p: DeviceProfile, dims: ModelDims) -> float:
    """This device's cost for one step's all-reduces (what every participant waits for)."""
    mib = payload_mib(dims, p.shape.micro_batch, p.shape.seq_len)
    activations = allreduces_per_step(dims) * (p.allreduce_latency_seconds + mib * p.allreduce_seconds_per_mib)
    return activations + LOSS_ALLREDUCES * p.allreduce_latency_seconds


def group_mib(dims: ModelDims) -> float:
    """One KV group's attention weights (q, k, v, o), all layers: what a shared group's gradient all-reduce moves."""
    return dims.num_layers * 2 * (dims.heads_per_group + 1) * dims.head_dim * dims.hidden_size * 4 / 2**20


def shared_grad_seconds(p: DeviceProfile, dims: ModelDims, groups: int) -> float:
    """This device's cost for summing the gradients of `groups` row-shared KV groups (once per step).

    Costed as that many MiB of activation all-reduces, so that it orders devices exactly
    as `collective_seconds` does (the participant sets worth trying stay the closed ones).
    """
    mib = payload_mib(dims, p.shape.micro_batch, p.shape.seq_len)
    return groups * group_mib(dims) / mib * collective_seconds(p, dims) / allreduces_per_step(dims)


def segments(p: DeviceProfile, dims: ModelDims, kv_groups: float, mlp_columns: float, vocab_rows: float):
    """This device's (attention, MLP, vocabulary) segment seconds for a share."""
    attn, mlp, vocab = unit_costs(p)
    return (
        attn.seconds(kv_groups),
        mlp.seconds(mlp_columns / dims.mlp_block),
        vocab.seconds(vocab_rows / dims.vocab_block),
    )


def later_products(
    p: DeviceProfile, dims: ModelDims, share: tuple[float, float, float], mlp_later: bool, attention_later: bool
) -> tuple[float, float]:
    """Per layer, for a device holding `share`: the seconds of MLP weight-gradient products it moves into
    its attention's backward span, and of attention products it defers to the MLP segment below."""
    return (
        weight_grad_seconds(p, share[1] / dims.mlp_block) if mlp_later else 0.0,
        attention_weight_grad_seconds(p, share[0]) if attention_later else 0.0,
    )


def device_compute(p: DeviceProfile, dims: ModelDims, kv_groups: float, mlp_columns: float, vocab_rows: float) -> float:
    """Predicted compute seconds of one micro-step for a device holding this share."""
    attn, mlp, vocab = segments(p, dims, kv_groups, mlp_columns, vocab_rows)
    return dims.num_layers * (attn + mlp) + vocab


def vocab_later_seconds(p: DeviceProfile, dims: ModelDims, rows: int) -> float:
    """Per micro-step, the LM head weight-gradient products of `rows` vocabulary rows computed later."""
    return vocab_weight_grad_seconds(p, rows / dims.vocab_block) if rows else 0.0


def step_seconds(
    profiles: list[DeviceProfile],
    dims: ModelDims,
    shares: Sequence[tuple[float, float, float]],
    shared_groups: int = 0,
    later: list[bool] | None = None,
    attention_later: list[bool] | None = None,
    vocab_later: list[int] | None = None,
) -> float:
    """Predicted step of participants `profiles` holding `shares` (kv groups, MLP columns, vocabulary rows),
    with `shared_groups` KV groups shared by rows, the ranks flagged in `later` computing their
    MLP's weight gradients in the attention backward's span (what does not fit lengthens it),
    those flagged in `attention_later` their attention's in the MLP segment (of the layer below), and
    `vocab_later` rows of each rank's vocabulary computing theirs in the attention backward's spans,
    a layer's worth in each.

    Each segment costs its slowest forward plus its slowest backward: its two all-reduces make every
    participant wait at each. (The slowest sum is the same when every device's forward takes the same
    part of each segment and no product moves; moves shorten or lengthen a backward alone.)"""
    segs = [segments(p, dims, *share) for p, share in zip(profiles, shares)]
    fwds = [[f * s for f, s in zip(forward_fractions(p), seg)] for p, seg in zip(profiles, segs)]
    moved, deferred = zip(
        *(
            later_products(p, dims, share, bool(later and later[i]), bool(attention_later and attention_later[i]))
            for i, (p, share) in enumerate(zip(profiles, shares))
        )
    )
    spread = [vocab_later_seconds(p, dims, vocab_later[i] if vocab_later else 0) for i, p in enumerate(profiles)]
    backs = [attention_backward_seconds(p, share[0]) - d for p, share, d in zip(profiles, shares, deferred)]
    overflow = max(b + w + x / dims.num_layers for b, w, x in zip(backs, moved, spread)) - max(backs)
    coll = max(collective_seconds(p, dims) for p in profiles) if len(profiles) > 1 else 0.0
    coll += max(shared_grad_seconds(p, dims, shared_groups) for p in profiles)
    attention = max(f[0] for f in fwds) + max(s[0] - f[0] - d for s, f, d in zip(segs, fwds, deferred)) + overflow
    mlp = max(f[1] for f in fwds) + max(s[1] - f[1] - w + d for s, f, w, d in zip(segs, fwds, moved, deferred))
    vocab = max(f[2] for f in fwds) + max(s[2] - f[2] - x for s, f, x in zip(segs, fwds, spread))
    return dims.num_layers * (attention + mlp) + vocab + coll


def split_step_seconds(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit) -> float:
    """Predicted step of participants `profiles` (rank order) holding `split`."""
    return step_seconds(
        profiles,
        dims,
        split.shares(),
        len(split.shared_kv_groups),
        split.weight_grads_later,
        split.attention_weight_grads_later,
        split.vocab_rows_later,
    )


def lora_factor_params(dims: ModelDims, lora: LoraOptions) -> tuple[int, int, int]:
    """A LoRA job's factor elements (replicated on every rank, per KV group, per MLP block), all layers:
    a column-parallel projection's A and a row-parallel one's B are replicated, the other factor split
    with its base weight (`edge_node.tp.lora`)."""
    h, hd, hpg, r = dims.hidden_size, dims.head_dim, dims.heads_per_group, lora.r
    targets = set(lora.targets)
    rows = {"q_proj": hpg * hd, "k_proj": hd, "v_proj": hd, "o_proj": hpg * hd}
    per_group = sum(n * r for t, n in rows.items() if t in targets)
    per_block = sum(dims.mlp_block * r for t in ("gate_proj", "up_proj", "down_proj") if t in targets)
    return dims.num_layers * len(targets) * r * h, dims.num_layers * per_group, dims.num_layers * per_block


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


def frozen_bytes_per_param(lora: LoraOptions) -> int:
    """A LoRA job's frozen base matrices: float32, or bfloat16 with `base_dtype` (norms stay float32)."""
    return FROZEN_BF16_BYTES_PER_PARAM if lora.base_dtype == "bfloat16" else FROZEN_BYTES_PER_PARAM


def unit_bytes(
    dims: ModelDims, micro_batch: int, seq_len: int, lora: LoraOptions | None = None
) -> tuple[float, float, float, float]:
    """(fixed, per KV group, per MLP block, per vocabulary block) bytes: parameters with their
    gradients and AdamW moments, plus the activations autograd keeps for the backward. With `lora`,
    the base parameters alone (FROZEN_BYTES_PER_PARAM) and the factors with their gradients and
    moments (BYTES_PER_PARAM); the activations are priced as for full fine-tuning (the backward still
    runs through every layer), which slightly over-counts (inputs kept only for weight gradients).
    A base held in bfloat16 costs FROZEN_BF16_BYTES_PER_PARAM for its matrices (the norms stay float32;
    the float32 copy of the one matrix being multiplied is transient, within the over-count)."""
    h, hd, hpg, layers = dims.hidden_size, dims.head_dim, dims.heads_per_group, dims.num_layers
    tokens = micro_batch * seq_len
    norms = (2 * layers + 1) * h
    norm_bytes = BYTES_PER_PARAM if lora is None else FROZEN_BYTES_PER_PARAM
    per_param = BYTES_PER_PARAM if lora is None else frozen_bytes_per_param(lora)
    replicated, per_group, per_block = lora_factor_params(dims, lora) if lora is not None else (0, 0, 0)
    fixed = RUNTIME_BYTES + norm_bytes * norms + BYTES_PER_PARAM * replicated + 4 * tokens * h * (6 * layers + 4)
    kv_params = layers * (2 * hpg * hd * h + 2 * hd * h)
    kv_acts = layers * 4 * (tokens * (hpg + 2) * hd * 3 + micro_batch * hpg * seq_len * seq_len)
    mlp_params = layers * 3 * h * dims.mlp_block
    mlp_acts = layers * 4 * tokens * dims.mlp_block * 4
    tied = 1 if dims.tie_word_embeddings else 2
    vocab_params = tied * h * dims.vocab_block
    vocab_acts = 4 * tokens * dims.vocab_block * 3
    return (
        fixed,
        per_param * kv_params + BYTES_PER_PARAM * per_group + kv_acts,
        per_param * mlp_params + BYTES_PER_PARAM * per_block + mlp_acts,
        per_param * vocab_params + vocab_acts,
    )


def dim_units(dims: ModelDims) -> tuple[int, int, int]:
    return dims.num_kv_heads, dims.intermediate_size // dims.mlp_block, dims.vocab_size // dims.vocab_block


class Later(NamedTuple):
    """Per participant: whether its MLP's, and whether its attention's, weight gradients come later, and
    how many of its vocabulary blocks' do (None: none)."""

    mlp: list[bool]
    attention: list[bool]
    vocab: list[int] | None = None

    def select(self, members: list[int]) -> Later:
        return Later(
            [self.mlp[i] for i in members],
            [self.attention[i] for i in members],
            [self.vocab[i] for i in members] if self.vocab else None,
        )


def to_split(dims: ModelDims, g: list, m: list[int], v: list[int], later: Later | None = None) -> ShardSplit:
    """Blocks to sizes; a tail that is not a whole block goes to the device with the most blocks.
    `g`: attention shares (see `Share`), or plain KV group counts; `later`: per rank, whether its
    MLP's and its attention's weight gradients come later (None: no rank's)."""
    g = [share if isinstance(share, tuple) else (share, None) for share in g]
    mlp = [b * dims.mlp_block for b in m]
    vocab = [b * dims.vocab_block for b in v]
    mlp[max(range(len(m)), key=lambda i: (m[i], -i))] += dims.intermediate_size - sum(mlp)
    vocab[max(range(len(v)), key=lambda i: (v[i], -i))] += dims.vocab_size - sum(vocab)
    rows = [r for _, r in g] if any(r is not None for _, r in g) else None
    vocab_later = (
        [min(b * dims.vocab_block, rows_i) for b, rows_i in zip(later.vocab, vocab)]
        if later and later.vocab and any(later.vocab)
        else None
    )
    return ShardSplit(
        kv_groups=[k for k, _ in g],
        kv_rows=rows,
        mlp_columns=mlp,
        vocab_rows=vocab,
        weight_grads_later=list(later.mlp) if later and any(later.mlp) else None,
        attention_weight_grads_later=list(later.attention) if later and any(later.attention) else None,
        vocab_rows_later=vocab_later,
    ).check(dims)


# -- the solver ----------------------------------------------------------------------
