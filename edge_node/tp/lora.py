"""LoRA under the uneven split: low-rank factors sharded like their base weights, the base frozen.

peft's LoRA adds  y += scaling * B(A(dropout(x)))  to a projection y = x W^T + b, with A (r, in)
and B (out, r) trained and W, b frozen. Under tensor parallelism each factor shares its base
weight's split dimension where it has one:
- column-parallel (q, k, v, gate, up: output rows split): B holds the rank's rows, A is
  replicated. The rank computes its rows' delta from the replicated input.
- row-parallel (o, down: input columns split): A holds the rank's columns, B is replicated.
  A_local x_local is a partial sum of A x and B is linear, so the rank adds B(A_local x_local)
  to its partial product and the block's one all-reduce sums both.
So LoRA adds no collective to a layer. The price is in the gradients of the replicated
factors: each rank's is only its rows' (A) or columns' (B) part of the sum. `sum_lora_grads`
adds them up once per step, before AdamW, in one all-reduce that also sums the split factors of
KV groups shared by rows (as `shared_groups` does for full fine-tuning); every rank then takes
the same update and the copies stay identical.

The modules are Xronos's own, not peft's `LoraLayer`: peft calls its `base_layer` and adds the
delta to the result, but a row-parallel base has all-reduced its result by then, and the base
weight would be renamed `base_layer.weight`, which the plan, loading and re-sharding do not know.
Here base weights keep their Hugging Face names and the factors are named as peft names them
less its prefix and adapter name (`model.layers.3.mlp.up_proj.lora_A.weight`, in an adapter file
`base_model.model.model.layers.3.mlp.up_proj.lora_A.weight`); the math is peft's, term for term.
`lora_slice` extends `param_slice` to the factors, so gathering, checkpoints and re-sharding
treat them like any other parameter.

Every rank holds every factor (a rank with no KV group gets zero-row q/k/v placeholders that are
never called, holding the replicated A), so a replicated factor's copy is on rank 0 for
gathering, and every rank steps it. With no base weight trained, there are no weight-gradient
products to defer: `apply_lora` turns the split's `*_later` layers back into plain ones.

Dropout > 0 draws its masks from each rank's own generator, on the rank's part of the input:
LoRA dropout in distribution, not peft's masks bit for bit (that would need every rank to draw
the full input's mask, in peft's order). With dropout 0, training equals peft's to round-off.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from edge_node.tp.comm import all_reduce, world_size
from edge_node.tp.context import TPContext
from edge_node.tp.frozen import compute_in_float32, frozen_linear
from edge_node.tp.layers import HeadlessAttention, RowParallelLinear
from edge_node.tp.plan import LAYER_PLAN, RowParallel, Slice, param_slice, style_of
from edge_node.tp.weight_grads import RowsWeightGradLaterLinear, WeightGradLaterLinear
from xronos.contract.lora import LoraOptions
from xronos.contract.splits import ModelDims, ShardSplit

FACTORS = ("lora_A", "lora_B")
ATTENTION_INPUTS = {"q_proj", "k_proj", "v_proj"}


class _LoraDelta(nn.Module):
    """The factors of one projection and what its output gains from them."""

    def _add_factors(self, in_features: int, out_features: int, lora: LoraOptions, device) -> None:
        # uninitialised: `init_lora` or a load fills them (and zero-row shards have nothing to draw)
        self.lora_A = nn.Linear(in_features, lora.r, bias=False, device="meta").to_empty(device=device)
        self.lora_B = nn.Linear(lora.r, out_features, bias=False, device="meta").to_empty(device=device)
        self.lora_dropout: nn.Module = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.scaling = lora.scaling
        self.merged = False
        """After `merge_lora`: the delta is in the base weight, and added no more."""

    def plus_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if self.merged else y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LoraLinear(_LoraDelta):
    """A column-parallel projection with LoRA: x W^T + b + scaling * B(A(x)); W and b are the shard's
    own (frozen), A is replicated, B holds the shard's output rows."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, base: nn.Linear, lora: LoraOptions):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self._add_factors(base.in_features, base.out_features, lora, base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plus_delta(frozen_linear(x, self.weight, self.bias), x)


class LoraRowParallelLinear(RowParallelLinear, _LoraDelta):
    """A row-parallel projection with LoRA: the partial product x_local W_local^T gains
    scaling * B(A_local x_local) before the one all-reduce (`finish`); A holds the shard's input
    columns, B is replicated.

    It takes over `base`'s parameters and settings; `share_rows` may still call `base.finish`,
    which is the same sum (same context, segment and bias parameter).
    """

    def __init__(self, base: RowParallelLinear, lora: LoraOptions):
        super().__init__(base.in_features, base.out_features, base.bias is not None, base.tp, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.deferred, self.closes = base.deferred, base.closes
        self._add_factors(base.in_features, base.out_features, lora, base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.plus_delta(frozen_linear(x, self.weight), x)
        return partial if self.deferred else self.finish(partial)


def _plain_linear(module: nn.Linear) -> nn.Linear:
    """`module`'s parameters in a plain `nn.Linear` (no deferred weight-gradient product)."""
    plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    plain.weight = module.weight
    plain.register_parameter("bias", module.bias)
    return plain


def _without_weight_grads_later(model: nn.Module) -> None:
    """Plain layers where the split deferred weight-gradient products: a frozen weight has none, and
    the deferred ones would accumulate a gradient into it regardless."""
    for name, module in list(model.named_modules()):
        if isinstance(module, RowParallelLinear):
            module.weight_grad_later = False
        elif isinstance(module, WeightGradLaterLinear | RowsWeightGradLaterLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, _plain_linear(module))


def _output_requires_grad(module, args, output):
    """A forward hook for the attention of a rank with no KV group, when q, k or v carry LoRA: on the
    other ranks the attention's output then needs a gradient even where its input does not (the
    first layer), and every rank must run the same backward all-reduces."""
    attention, weights = output
    return (attention if attention.requires_grad else attention.detach().requires_grad_()), weights


def apply_lora(model, lora: LoraOptions) -> nn.Module:
    """Freeze a shard (`parallelize`d, its parameters materialised: after `empty_shard` or
    `load_shard`) and give its target projections LoRA factors shaped like its shards, not yet
    initialised (`init_lora` or `load_adapter` fills them); in place, returns the model."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("apply_lora needs the shard's parameters allocated (after to_empty or a load)")
    model.requires_grad_(False)
    _without_weight_grads_later(model)
    dims = ModelDims.from_config(model.config)
    targets = set(lora.targets)
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    for layer in model.model.layers:
        headless = isinstance(layer.self_attn, HeadlessAttention)
        for suffix, style in LAYER_PLAN.items():
            parent_path, _, attr = suffix.rpartition(".")
            if attr not in targets:
                continue
            parent = layer.get_submodule(parent_path)
            if isinstance(style, RowParallel):
                parent.add_module(attr, LoraRowParallelLinear(getattr(parent, attr), lora))
                continue
            base = getattr(parent, attr) if not (headless and parent_path == "self_attn") else None
            if base is None:  # a placeholder, never called: it holds the replicated A (its empty base in the
                # dtype of the others: a re-shard receives a KV group's slices into it)
                base = nn.Linear(dims.hidden_size, 0, bias=False, device="meta", dtype=dtype).to_empty(device=device)
                base.requires_grad_(False)
            parent.add_module(attr, LoraLinear(base, lora))
        if headless and targets & ATTENTION_INPUTS:
            layer.self_attn.register_forward_hook(_output_requires_grad)
    return compute_in_float32(model)  # a base held in bfloat16 (`LoraOptions.base_dtype`): the new plain linears


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA factors of a model `apply_lora` adapted, by name: what the optimizer steps."""
    return {name: p for name, p in model.named_parameters() if name.rpartition(".")[0].endswith(FACTORS)}


def lora_shapes(shapes: dict[str, torch.Size], lora: LoraOptions) -> dict[str, torch.Size]:
    """Every LoRA factor of the full model with its shape, in the base parameters' order (`shapes`:
    the full model's parameters, `edge_node.model_io.full_param_shapes`)."""
    out: dict[str, torch.Size] = {}
    for name, shape in shapes.items():
        module_path, _, kind = name.rpartition(".")
        if kind == "weight" and module_path.rpartition(".")[2] in lora.targets and style_of(module_path):
            out[f"{module_path}.lora_A.weight"] = torch.Size((lora.r, shape[1]))
            out[f"{module_path}.lora_B.weight"] = torch.Size((shape[0], lora.r))
    return out


def lora_slice(name: str, split: ShardSplit, rank: int, dims: ModelDims) -> Slice | None:
    """`param_slice` for models with LoRA: a factor is split where it shares its base weight's split
    dimension (a column-parallel B's rows, a row-parallel A's columns) and replicated otherwise."""
    module_path, _, _ = name.rpartition(".")
    base_path, _, factor = module_path.rpartition(".")
    if factor not in FACTORS:
        return param_slice(name, split, rank, dims)
    base = param_slice(f"{base_path}.weight", split, rank, dims)
    if base is None:
        return None
    return base if (base.dim == 0) == (factor == "lora_B") else None


def initial_factor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full initial value of factor `name`, peft's initialisation drawn from a generator of its
    own (seeded by `seed` and the name): A uniform in +-1/sqrt(in) (kaiming-uniform with a = sqrt(5),
    as nn.Linear's), B zeros. The same whatever the split (single mode fills peft's factors with it)."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    bound = shape[1] ** -0.5
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init_lora(
    model: nn.Module, shapes: dict[str, torch.Size], split: ShardSplit, rank: int, dims: ModelDims, seed: int
) -> None:
    """This rank's slices of every `initial_factor` (`shapes`: `lora_shapes`)."""
    for name, param in lora_parameters(model).items():
        full = initial_factor(name, shapes[name], seed)
        part = lora_slice(name, split, rank, dims)
        param.copy_(full if part is None else full.narrow(part.dim, part.start, part.size))


def sum_lora_grads(
    model: nn.Module, split: ShardSplit, rank: int, shapes: dict[str, torch.Size], dims: ModelDims, tp: TPContext
) -> None:
    """Sum the partial gradients of the factors several ranks hold: the replicated ones over all
    ranks, the split ones of a KV group shared by rows over its holders; one all-reduce (every rank
    must call this, after the backward passes and before the optimizer; `shapes`: `lora_shapes`).
    Afterwards every factor has a gradient, so AdamW steps all of them on every rank."""
    if world_size() == 1:
        return
    params = lora_parameters(model)
    replicated = [n for n in shapes if lora_slice(n, split, 0, dims) is None]
    groups = split.shared_kv_groups
    grouped = [n for n in shapes if groups and ".self_attn." in n and n not in replicated]
    per_group = sum(shapes[n].numel() // dims.num_kv_heads for n in grouped)
    buffer = torch.zeros(sum(shapes[n].numel() for n in replicated) + len(groups) * per_group)
    sums: list[tuple[nn.Parameter, torch.Tensor]] = []
    offset = 0
    for name in replicated:
        sums.append((params[name], buffer[offset : offset + shapes[name].numel()]))
        offset += shapes[name].numel()
    (g0, _), rows = split.attention_shares()[rank]
    if rows is not None:  # this rank's group is shared: its factors' part of the group segment
        offset += groups.index(g0) * per_group
        for name in grouped:
            sums.append((params[name], buffer[offset : offset + params[name].numel()]))
            offset += params[name].numel()
    for param, part in sums:
        if param.grad is not None:
            part.copy_(param.grad.reshape(-1))
    all_reduce(buffer, tp)
    for param, part in sums:
        param.grad = part.view_as(param)
    for param in params.values():  # the zero-row B of a placeholder: every factor steps, every rank alike
        if param.grad is None:
            param.grad = torch.zeros_like(param)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Add each projection's delta into its base weight shard (peft's merge: W += (B @ A) * scaling),
    after which the model computes the same without the factors: a column shard's rows of B @ A
    come from its rows of B, a row shard's columns from its columns of A."""
    for module in model.modules():
        if isinstance(module, _LoraDelta) and not module.merged:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            weight += (module.lora_B.weight @ module.lora_A.weight) * module.scaling
            module.merged = True
