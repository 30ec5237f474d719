"""The two conjugate communication operators of Megatron tensor parallelism.

`copy_to_tp` is placed where a replicated activation enters a parallel block:
every rank already holds it (identity forward), but each rank's slice of the
block produces only part of its gradient (all-reduce backward).
`reduce_from_tp` is placed where a parallel block's partial outputs leave it:
they are summed (all-reduce forward) and the gradient of a sum is the same for
every rank (identity backward). `closes` names the segment whose compute the
all-reduce ends (see `edge_node.tp.comm`).
"""

from __future__ import annotations

import torch

from edge_node.tp.comm import all_reduce
from edge_node.tp.context import TPContext


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, closes):
        ctx.tp, ctx.closes = tp, closes
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.tp.weight_grads.before_backward_collective(ctx.closes)
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tp, closes=ctx.closes), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, closes):
        # A fresh buffer: the collective works in place and autograd owns `x`.
        return all_reduce(x.clone(memory_format=torch.contiguous_format), tp, closes=closes)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_tp(x: torch.Tensor, tp: TPContext, closes: str | None = None) -> torch.Tensor:
    """Identity forward, all-reduce backward (which ends the backward of segment `closes`)."""
    return _CopyToTP.apply(x, tp, closes)


def reduce_from_tp(x: torch.Tensor, tp: TPContext, closes: str | None = None) -> torch.Tensor:
    """All-reduce forward (which ends the forward of segment `closes`), identity backward."""
    return _ReduceFromTP.apply(x, tp, closes)
