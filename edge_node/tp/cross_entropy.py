"""Cross-entropy over vocabulary-sharded logits, never gathering the full logits.

Each rank holds logits for its vocabulary rows [start, stop). The softmax
needs only three global quantities per token: the max (for stability), the
sum of exponentials, and the target's logit (owned by exactly one rank).
The last two travel in one all-reduce. Same math as
`torch.nn.functional.cross_entropy` on the full logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from edge_node.tp.comm import all_reduce
from edge_node.tp.context import TPContext


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, tp: TPContext) -> torch.Tensor:
        # logits: (N, V_local) float32, target: (N,) global vocabulary ids
        n, v_local = logits.shape
        if v_local:
            local_max = logits.max(dim=-1).values
        else:
            local_max = logits.new_full((n,), float("-inf"))
        global_max = all_reduce(local_max.clone(), tp, op=dist.ReduceOp.MAX, closes="vocab_rows")
        shifted = logits - global_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + v_local)
        local_target = (target - start).masked_fill(outside, 0)
        rows = torch.arange(n)
        if v_local:
            target_logit = shifted[rows, local_target].masked_fill(outside, 0.0)
        else:
            target_logit = logits.new_zeros(n)
        exp = shifted.exp()
        sums = all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), tp, closes="vocab_rows")  # (2, N)
        sum_exp, target_logit = sums[0], sums[1]

        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        if grad.shape[1]:
            rows = torch.arange(grad.shape[0])
            grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, tp: TPContext) -> torch.Tensor:
    """Per-token loss (N,) from local logits (N, V_local) of vocabulary rows starting at `start`."""
    return _VocabParallelCrossEntropy.apply(logits.float(), target, start, tp)


def causal_lm_loss(
    local_logits: torch.Tensor, input_ids: torch.Tensor, vocab_start: int, tp: TPContext
) -> torch.Tensor:
    """Mean next-token loss with labels = input_ids, as Hugging Face computes it."""
    # (B, T, V_local) -> predictions for positions 0..T-2, targets 1..T-1
    target = input_ids[:, 1:].reshape(-1)
    logits = local_logits[:, :-1, :].reshape(target.numel(), local_logits.shape[-1])
    return vocab_parallel_cross_entropy(logits, target, vocab_start, tp).mean()
