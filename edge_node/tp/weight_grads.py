"""Weight gradients computed later, in a wait: a linear layer's backward split in two.

A linear layer's backward computes the gradient of its input (which the layers
below need now) and the gradient of its weight (which only the optimizer needs,
at the end of the step). Pipeline schedules that split the two ("zero bubble")
fill their bubbles with the second; tensor parallelism has bubbles too: a device
whose attention share is small (or empty) waits at every layer's attention
all-reduce in the backward pass for the devices that hold more.

So on a rank the plan marks, the MLP's linear layers hand their weight-gradient
product to `WEIGHT_GRADS` instead of computing it, and the queue runs it one
backward collective later: the layer's MLP all-reduce goes out without it (the
rank arrives earlier and can hold more MLP columns), and the product is computed
while the other ranks still compute their attention backward. Same products,
same sums: the gradients are those of the plain backward up to float round-off.

The other way round too: a rank whose attention share is the largest for its
speed (whole KV groups rarely divide evenly) can hand its attention's products
(q, k, v, o) to the queue; they then run in the MLP backward of the layer below,
a segment the plan balances to the column, and the attention all-reduce that
everyone waits for comes sooner. The last layer's (layer 0's) run at the flush.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradQueue:
    """Weight-gradient products waiting for the next backward collective but one."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []  # queued since the last backward collective
        self.held: list[Callable[[], None]] = []  # have let one backward collective go by

    def add(self, product: Callable[[], None]) -> None:
        self.pending.append(product)

    def before_backward_collective(self) -> None:
        """Run what has waited one collective; what came since waits for the next."""
        for product in self.held:
            product()
        self.held, self.pending = self.pending, []

    def flush(self) -> None:
        """Run everything still queued (the end of a backward pass: the optimizer needs the gradients)."""
        for product in self.held + self.pending:
            product()
        self.held, self.pending = [], []


WEIGHT_GRADS = WeightGradQueue()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _LinearWeightGradLater(torch.autograd.Function):
    """y = x W^T (+ b); the backward returns the input's gradient and queues the weight's (and bias's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight_param, bias_param = ctx.params
        grad_x = grad.matmul(weight)

        @torch.no_grad()  # run in a backward pass or after it (a flush): a gradient, never part of a graph
        def product() -> None:
            g2 = grad.flatten(0, -2)  # (rows, out); flatten, not reshape(-1, ...): a shard may be empty
            _accumulate(weight_param, g2.t().mm(x.flatten(0, -2)))
            if bias_param is not None:
                _accumulate(bias_param, g2.sum(0))

        WEIGHT_GRADS.add(product)
        return grad_x, None, None


def linear_weight_grad_later(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None) -> torch.Tensor:
    """F.linear whose weight (and bias) gradient is accumulated by `WEIGHT_GRADS`, not by autograd."""
    return _LinearWeightGradLater.apply(x, weight, bias)


class WeightGradLaterLinear(nn.Linear):
    """A column-parallel `nn.Linear` (same parameters and names) whose weight gradient comes later."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_weight_grad_later(x, self.weight, self.bias)


def weight_grads_later(linear: nn.Linear) -> WeightGradLaterLinear:
    """`linear` (its parameters, not copies) with its weight gradient coming later."""
    later = WeightGradLaterLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  device="meta")
    later.weight, later.bias = linear.weight, linear.bias
    return later
