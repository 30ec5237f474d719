"""The two conjugate communication operators of Megatron tensor parallelism.

`copy_to_tp` is placed where a replicated activation enters a parallel block:
every rank already holds it (identity forward), but each rank's slice of the
block produces only part of its gradient (all-reduce backward).
`reduce_from_tp` is placed where a parallel block's partial outputs leave it:
they are summed (all-reduce forward) and the gradient of a sum is the same for
every rank (identity backward).
"""

from __future__ import annotations

import torch

from edge_node.tp.comm import all_reduce
from edge_node.tp.weight_grads import WEIGHT_GRADS


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        WEIGHT_GRADS.before_backward_collective()
        return all_reduce(grad.clone(memory_format=torch.contiguous_format))


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # A fresh buffer: the collective works in place and autograd owns `x`.
        return all_reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Identity forward, all-reduce backward."""
    return _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    """All-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x)
