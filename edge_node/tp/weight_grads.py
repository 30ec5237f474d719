"""Weight gradients computed later, in a wait: a linear layer's backward split in two.

A linear layer's backward computes the gradient of its input (which the layers
below need now) and the gradient of its weight (which only the optimizer needs,
at the end of the step). Pipeline schedules that split the two ("zero bubble")
fill their bubbles with the second; tensor parallelism has bubbles too: a device
whose attention share is small (or empty) waits at every layer's attention
all-reduce in the backward pass for the devices that hold more.

So on a rank the plan marks, the MLP's linear layers hand their weight-gradient
product to the shard's `WeightGradQueue` (`TPContext.weight_grads`) instead of computing it, and the queue runs it one
backward collective later: the layer's MLP all-reduce goes out without it (the
rank arrives earlier and can hold more MLP columns), and the product is computed
while the other ranks still compute their attention backward. Same products,
same sums: the gradients are those of the plain backward up to float round-off.

The other way round too: a rank whose attention share is the largest for its
speed (whole KV groups rarely divide evenly) can hand its attention's products
(q, k, v, o) to the queue; they then run in the MLP backward of the layer below,
a segment the plan balances to the column, and the attention all-reduce that
everyone waits for comes sooner. The last layer's (layer 0's) run at the flush.

And the LM head's: its weight-gradient product (the vocabulary rows' share of the
step's largest matrix product) is needed no sooner than the MLP's, but it comes
at the start of the backward pass, in the vocabulary segment. A rank that waits
through the layers' attention backward can take some of its rows' products out
of that segment (`ShardSplit.vocab_rows_later`): they are cut into one piece per
layer (`WeightGradQueue.spread`), and each layer's attention backward all-reduce
runs one piece first, so the rank holds more vocabulary rows in the same time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SPREAD_BEFORE = "kv_groups"
"""The backward collectives that each run one spread piece first: the attention's, which a rank
with less attention than the slowest waits in."""


class WeightGradQueue:
    """Weight-gradient products waiting for the next backward collective but one, and products
    spread one per attention backward collective."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []  # queued since the last backward collective
        self.held: list[Callable[[], None]] = []  # have let one backward collective go by
        self.spread: list[Callable[[], None]] = []  # one runs before each attention backward collective

    def add(self, product: Callable[[], None]) -> None:
        self.pending.append(product)

    def add_spread(self, products: list[Callable[[], None]]) -> None:
        self.spread.extend(products)

    def before_backward_collective(self, closes: str | None = None) -> None:
        """Run what has waited one collective (what came since waits for the next), and before an
        attention backward collective (`closes`: the segment it ends) the next spread piece."""
        for product in self.held:
            product()
        self.held, self.pending = self.pending, []
        if closes == SPREAD_BEFORE and self.spread:
            self.spread.pop(0)()

    def flush(self) -> None:
        """Run everything still queued (the end of a backward pass: the optimizer needs the gradients)."""
        for product in self.held + self.pending + self.spread:
            product()
        self.held, self.pending, self.spread = [], [], []


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _LinearWeightGradLater(torch.autograd.Function):
    """y = x W^T (+ b); the backward returns the input's gradient and queues the weight's (and bias's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.params, ctx.queue = (weight, bias), queue
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

        ctx.queue.add(product)
        return grad_x, None, None, None


def linear_weight_grad_later(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, queue: WeightGradQueue
) -> torch.Tensor:
    """F.linear whose weight (and bias) gradient is accumulated by `queue`, not by autograd."""
    return _LinearWeightGradLater.apply(x, weight, bias, queue)


class WeightGradLaterLinear(nn.Linear):
    """A column-parallel `nn.Linear` (same parameters and names) whose weight gradient comes later, in `queue`."""

    def __init__(self, in_features: int, out_features: int, queue: WeightGradQueue, bias: bool = True, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.queue = queue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_weight_grad_later(x, self.weight, self.bias, self.queue)


def weight_grads_later(linear: nn.Linear, queue: WeightGradQueue) -> WeightGradLaterLinear:
    """`linear` (its parameters, not copies) with its weight gradient coming later, in `queue`."""
    later = WeightGradLaterLinear(
        linear.in_features, linear.out_features, queue, bias=linear.bias is not None, device="meta"
    )
    later.weight, later.bias = linear.weight, linear.bias
    return later


def _accumulate_rows(param: nn.Parameter, start: int, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """param.grad[start:start + rows] += grad_out^T x, in place (rows: grad_out's columns)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad[start : start + grad_out.shape[1]].addmm_(grad_out.t(), x)


class _LinearRowsWeightGradLater(torch.autograd.Function):
    """y = x W^T; the backward returns the input's gradient, accumulates the weight gradient of rows
    `later_rows`.. itself and spreads that of rows ..`later_rows` over `pieces` products."""

    @staticmethod
    def forward(ctx, x, weight, later_rows, pieces, queue):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.later_rows, ctx.pieces, ctx.queue = weight, later_rows, pieces, queue
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param, later = ctx.param, ctx.later_rows
        grad_x = grad.matmul(weight)
        g2, x2 = grad.flatten(0, -2), x.flatten(0, -2)
        if later < weight.shape[0]:
            _accumulate_rows(param, later, g2[:, later:], x2)
        g2 = g2[:, :later].contiguous()  # the pieces keep only their rows' gradient, not all the logits'

        def piece(start: int, stop: int) -> Callable[[], None]:
            @torch.no_grad()
            def product() -> None:
                _accumulate_rows(param, start, g2[:, start:stop], x2)

            return product

        bounds = [round(later * k / ctx.pieces) for k in range(ctx.pieces + 1)]
        ctx.queue.add_spread([piece(a, b) for a, b in zip(bounds, bounds[1:]) if b > a])
        return grad_x, None, None, None, None


class RowsWeightGradLaterLinear(nn.Linear):
    """A bias-free `nn.Linear` (the vocabulary-parallel LM head) whose first `later_rows` output rows'
    weight gradients are spread over `pieces` attention backward collectives (`WeightGradQueue.spread` of `queue`)."""

    def __init__(
        self, in_features: int, out_features: int, later_rows: int, pieces: int, queue: WeightGradQueue, device=None
    ):
        super().__init__(in_features, out_features, bias=False, device=device)
        if not 0 < later_rows <= out_features or pieces < 1:
            raise ValueError(f"later rows {later_rows} of {out_features}, in {pieces} pieces")
        self.later_rows, self.pieces, self.queue = later_rows, pieces, queue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearRowsWeightGradLater.apply(x, self.weight, self.later_rows, self.pieces, self.queue)
