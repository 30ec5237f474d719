"""Gradients of KV groups that ranks share by rows: summed once per step, before the update.

A rank that computes a group for some rows of each micro-batch holds the group's
weights whole, but its backward yields only its rows' part of their gradient;
the other rows' parts are on the ranks that share the group. One all-reduce per
step over all ranks (a rank with no shared group adds zeros) sums the parts, so
every holder applies the same AdamW update and the copies stay identical.
"""

from __future__ import annotations

import torch
from torch import nn

from edge_node.tp.comm import all_reduce
from edge_node.tp.context import TPContext
from edge_node.tp.plan import param_slice
from xronos.contract.splits import ModelDims, ShardSplit


def _is_group_param(name: str, split: ShardSplit, dims: ModelDims) -> bool:
    """q/k/v/o weights and q/k/v biases: the attention parameters split by KV group."""
    return ".self_attn." in name and param_slice(name, split, 0, dims) is not None


def group_numel(shapes: dict[str, torch.Size], split: ShardSplit, dims: ModelDims) -> int:
    """Elements of one KV group's attention parameters, all layers together."""
    return sum(
        shape.numel() // dims.num_kv_heads for name, shape in shapes.items() if _is_group_param(name, split, dims)
    )


def sum_shared_grads(
    model: nn.Module, split: ShardSplit, rank: int, shapes: dict[str, torch.Size], dims: ModelDims, tp: TPContext
) -> None:
    """Sum every shared group's gradients across its holders (every rank must call this)."""
    groups = split.shared_kv_groups
    if not groups:
        return
    per = group_numel(shapes, split, dims)
    buffer = torch.zeros(len(groups) * per)
    (g0, _), rows = split.attention_shares()[rank]
    params = [p for name, p in model.named_parameters() if _is_group_param(name, split, dims)] if rows else []
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        raise RuntimeError("a shared KV group's parameter has no gradient: call after the backward pass")
    held = [g for g in grads if g is not None]
    if held:
        mine = buffer[groups.index(g0) * per :][:per]
        torch.cat([g.reshape(-1) for g in held], out=mine)
    all_reduce(buffer, tp)
    offset = groups.index(g0) * per if held else 0
    for g in held:
        g.copy_(buffer[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
