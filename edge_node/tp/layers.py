"""The sharded modules swapped into a Hugging Face model.

Column-parallel projections need no class of their own: a plain `nn.Linear`
with fewer output features, fed by `copy_to_tp` at the block's input.
Row-parallel projections sum their partial products; the vocabulary-parallel
embedding looks up only the rows it owns. Parameter names stay `weight` and
`bias`, so state-dict keys match the Hugging Face checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edge_node.tp.context import TPContext
from edge_node.tp.frozen import COMPUTE_DTYPE, frozen_linear, upcast
from edge_node.tp.mappings import reduce_from_tp
from edge_node.tp.weight_grads import linear_weight_grad_later


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b, with the bias replicated and added once.

    With `deferred`, forward returns the partial product only and `finish` sums it
    (for a rank that computes only some rows: the rows are put back in place first).
    `closes`: the segment whose forward the sum ends (see `edge_node.tp.comm`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, device=None):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.deferred = False
        self.weight_grad_later = False
        self.closes: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (
            linear_weight_grad_later(x, self.weight, None, self.tp.weight_grads)
            if self.weight_grad_later
            else frozen_linear(x, self.weight)
        )
        return y if self.deferred else self.finish(y)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(partial, self.tp, self.closes)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding for rows [start, start + num_rows); other ids contribute zeros before the sum."""

    def __init__(self, start: int, num_rows: int, dim: int, padding_idx: int | None, tp: TPContext, device=None):
        super().__init__()
        self.start, self.num_rows, self.tp = start, num_rows, tp
        self.weight = nn.Parameter(torch.empty(num_rows, dim, device=device))
        # HF's nn.Embedding(padding_idx=...) never updates the padding row: keep that, locally indexed.
        local_pad = None if padding_idx is None else padding_idx - start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < num_rows else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.num_rows == 0:
            out = self.weight.new_zeros(*input_ids.shape, self.weight.shape[1], dtype=COMPUTE_DTYPE)
        else:
            outside = (input_ids < self.start) | (input_ids >= self.start + self.num_rows)
            local_ids = (input_ids - self.start).masked_fill(outside, 0)
            rows = upcast(F.embedding(local_ids, self.weight, self.padding_idx))  # a table held lower: float32
            out = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


def share_rows(attention: nn.Module, rows: tuple[int, int], batch: int) -> None:
    """Make a Hugging Face attention module compute only micro-batch rows [r0, r1) of its KV groups.

    Hooks, so the module, its code and its parameter names stay Hugging Face's: before the
    forward, the row-indexed inputs are narrowed to the rows; after it, the partial o_proj
    output is put back among zero rows of the full batch and summed across ranks (the other
    rows come from the ranks that share this group).
    """
    r0, r1 = rows
    o_proj = attention.o_proj
    if not isinstance(o_proj, RowParallelLinear):
        raise TypeError("share_rows needs an attention whose o_proj is already row-parallel (parallelize)")
    o_proj.deferred = True

    def narrow(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x[r0:r1]
        if isinstance(x, tuple):
            return tuple(narrow(t) for t in x)
        return x

    def before(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if hidden.shape[0] != batch:
            raise RuntimeError(
                f"this split computes rows {r0}:{r1} of micro-batches of {batch}, got {hidden.shape[0]} rows"
            )
        args = tuple(narrow(a) for a in args)
        kwargs = {k: narrow(v) for k, v in kwargs.items()}
        return args, kwargs

    def after(module, args, kwargs, output):
        partial, weights = output
        placed = F.pad(partial, (0, 0, 0, 0, r0, batch - r1))
        return o_proj.finish(placed), weights

    attention.register_forward_pre_hook(before, with_kwargs=True)
    attention.register_forward_hook(after, with_kwargs=True)


class HeadlessAttention(nn.Module):
    """Attention of a rank that owns no KV group: it still joins the o_proj all-reduce.

    HF attention reshapes to (..., -1, head_dim), which is undefined for zero
    heads, so such a rank swaps the whole attention for this module. Its
    (empty) input stays connected to the graph so that the backward all-reduce
    of `copy_to_tp` runs on this rank as on every other.
    """

    def __init__(self, o_proj: RowParallelLinear):
        super().__init__()
        self.o_proj = o_proj

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        empty = hidden_states[..., :0]  # (B, T, 0), still part of the graph
        return self.o_proj(empty), None
