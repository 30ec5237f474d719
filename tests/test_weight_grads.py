"""Weight gradients computed later: the same gradients, and run at the right collective."""

from __future__ import annotations

import torch
from torch import nn

from edge_node.tp.weight_grads import WEIGHT_GRADS, WeightGradQueue, weight_grads_later


def test_later_weight_grads_equal_autograd_ones():
    """Linear layers with and without bias, 3-d inputs, an empty shard, two backward passes
    accumulating: the queued products give autograd's gradients once flushed (outside any backward
    pass, as the last layer's attention products are), and none before."""
    torch.manual_seed(0)
    for bias, width in ((True, 5), (False, 5), (True, 0)):
        plain = nn.Linear(7, width, bias=bias)
        later = weight_grads_later(nn.Linear(7, width, bias=bias))
        later.load_state_dict(plain.state_dict())
        x = torch.randn(2, 3, 7, requires_grad=True)
        x_later = x.detach().clone().requires_grad_(True)
        for _ in range(2):
            (plain(x).tanh().sum()).backward()
            (later(x_later).tanh().sum()).backward()
            if width:
                assert later.weight.grad is None or not torch.equal(later.weight.grad, plain.weight.grad)
            WEIGHT_GRADS.flush()
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
