"""Weight gradients computed later: the same gradients, and run at the right collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edge_node.tp.weight_grads import RowsWeightGradLaterLinear, WeightGradQueue, weight_grads_later


def test_later_weight_grads_equal_autograd_ones():
    """Linear layers with and without bias, 3-d inputs, an empty shard, two backward passes
    accumulating: the queued products give autograd's gradients once flushed (outside any backward
    pass, as the last layer's attention products are), and none before."""
    torch.manual_seed(0)
    queue = WeightGradQueue()
    for bias, width in ((True, 5), (False, 5), (True, 0)):
        plain = nn.Linear(7, width, bias=bias)
        later = weight_grads_later(nn.Linear(7, width, bias=bias), queue)
        later.load_state_dict(plain.state_dict())
        x = torch.randn(2, 3, 7, requires_grad=True)
        x_later = x.detach().clone().requires_grad_(True)
        for _ in range(2):
            (plain(x).tanh().sum()).backward()
            (later(x_later).tanh().sum()).backward()
            if width:
                assert later.weight.grad is None or not torch.equal(later.weight.grad, plain.weight.grad)
            queue.flush()
        torch.testing.assert_close(x_later.grad, x.grad)
        torch.testing.assert_close(later.weight.grad, plain.weight.grad)
        assert not later.weight.grad.requires_grad  # a flush outside backward builds no graph
        if bias:
            torch.testing.assert_close(later.bias.grad, plain.bias.grad)


def test_a_product_waits_for_one_backward_collective():
    """Queued before collective k, run just before collective k + 1 (what places an MLP's weight
    gradients in the wait for the layer's attention backward), or at the flush."""
    queue, ran = WeightGradQueue(), []
    queue.add(lambda: ran.append("mlp-1"))
    queue.before_backward_collective()  # the MLP's all-reduce: goes out without the product
    assert ran == []
    queue.add(lambda: ran.append("mlp-0"))
    queue.before_backward_collective()  # the attention's all-reduce: the product runs first
    assert ran == ["mlp-1"]
    queue.flush()
    assert ran == ["mlp-1", "mlp-0"] and not queue.pending and not queue.held


def test_spread_products_run_one_before_each_attention_backward_collective():
    """The LM head's pieces (queued at the start of the backward) run one per attention backward
    all-reduce, in that all-reduce's wait, after what waited one collective; the rest at the flush."""
    queue, ran = WeightGradQueue(), []
    queue.add_spread([lambda k=k: ran.append(f"vocab-{k}") for k in range(3)])
    queue.before_backward_collective("vocab_rows")  # the LM head's own all-reduce
    queue.add(lambda: ran.append("mlp-1"))
    queue.before_backward_collective("mlp_columns")
    assert ran == []
    queue.before_backward_collective("kv_groups")
    assert ran == ["mlp-1", "vocab-0"]
    queue.flush()
    assert ran == ["mlp-1", "vocab-0", "vocab-1", "vocab-2"] and not queue.spread


def test_lm_head_rows_later_give_autograd_gradients():
    """Some or all rows' products later, in more pieces than rows, a tied weight that also gets an
    embedding's gradient: once flushed, autograd's gradients; before, none for the later rows."""
    torch.manual_seed(0)
    queue = WeightGradQueue()
    for later_rows, pieces in ((3, 2), (5, 8)):
        plain = nn.Linear(4, 5, bias=False)
        later = RowsWeightGradLaterLinear(4, 5, later_rows, pieces, queue)
        later.load_state_dict(plain.state_dict())
        ids = torch.tensor([[0, 4, 2]])
        for head in (plain, later):
            x = nn.functional.embedding(ids, head.weight) + torch.randn(
                1, 3, 4, generator=torch.Generator().manual_seed(1)
            )
            head(x).softmax(-1)[..., 1].sum().backward()
        assert len(queue.spread) == min(later_rows, pieces)
        assert not torch.allclose(later.weight.grad[:later_rows], plain.weight.grad[:later_rows])
        queue.flush()
        torch.testing.assert_close(later.weight.grad, plain.weight.grad)
    with pytest.raises(ValueError, match="later rows 6 of 5"):
        RowsWeightGradLaterLinear(4, 5, 6, 2, queue)
