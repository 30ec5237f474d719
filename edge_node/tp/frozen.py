"""Frozen base matrices held in bfloat16, computed with in float32 (LoRA's `base_dtype`).

Under LoRA the base is only read, so its matrices (projections, embedding, LM head) may be held in
bfloat16 at half the bytes. The computation stays float32: each matrix is upcast as it is used (an
exact conversion), so activations, the LoRA factors, their gradients and AdamW moments are float32,
and the only change from a float32 base is the rounding of the weights, the same in every mode
(a shard's slices and single mode's whole matrices round element by element alike).

Not autocast: CPU autocast computes in the low precision (bfloat16 activations, matmuls rounded to
8 bits of mantissa), where upcasting keeps float32's. The upcast is per matmul, not per model: a
linear whose weight is held lower (`frozen_linear`) saves the held weight for its input's gradient,
not the float32 copy, which is freed after its product; autograd would otherwise keep a float32
copy of every matrix until the backward, as much memory as a float32 base.

Vectors (norms, biases) stay float32: they are a few KB, and a norm's weight is a multiplier every
activation passes through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

COMPUTE_DTYPE = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _UpcastLinear(torch.autograd.Function):
    """x W^T + b with W frozen and held in a lower precision: computed with W upcast, saving W as held."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise RuntimeError("a weight held in a lower precision is frozen: it has no gradient")
        (weight,) = ctx.saved_tensors
        return grad.matmul(weight.to(grad.dtype)), None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or with a weight held in a lower precision than `x` the same product computed in `x`'s."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return _UpcastLinear.apply(x, weight, bias)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """`t` in the compute dtype (itself when already: a float32 model's tensors pass through)."""
    return t.to(COMPUTE_DTYPE)


class UpcastLinear(nn.Linear):
    """An `nn.Linear` whose frozen weight is held lower: `frozen_linear` (`hold_matrices` converts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


class UpcastEmbedding(nn.Embedding):
    """An `nn.Embedding` whose frozen table is held lower: the rows looked up, then upcast (exact)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return upcast(super().forward(input_ids))


def held_dtype(shape: torch.Size, base_dtype: torch.dtype) -> torch.dtype:
    """What `hold_matrices(model, base_dtype)` holds a base parameter of this shape in."""
    return base_dtype if len(shape) >= 2 else COMPUTE_DTYPE


def is_factor(name: str) -> bool:
    """A LoRA factor's parameter (Xronos's `...lora_A.weight` or peft's `...lora_A.default.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def hold_matrices(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Hold every base matrix of `model` (every parameter of 2 or more dimensions but the LoRA factors)
    in `dtype`, in place (tied parameters stay one), and make the plain linears and embeddings holding
    one compute in float32 (`UpcastLinear`, `UpcastEmbedding`; Xronos's sharded modules do by
    themselves). On a meta model it only changes what `to_empty` will allocate; with float32, a model
    held lower is float32 again (exactly its held values). Returns the model."""
    for name, param in model.named_parameters():  # each tied parameter once
        if param.dim() >= 2 and not is_factor(name) and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return compute_in_float32(model)


def compute_in_float32(model: nn.Module) -> nn.Module:
    """Make each plain linear and embedding of `model` whose weight is held lower than float32 an
    `UpcastLinear` or `UpcastEmbedding` (the same module, parameters and hooks); returns the model."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype == COMPUTE_DTYPE:
            continue
        if type(module) is nn.Linear:
            module.__class__ = UpcastLinear
        elif type(module) is nn.Embedding:
            module.__class__ = UpcastEmbedding
    return model
