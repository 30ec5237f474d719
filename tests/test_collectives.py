"""The hub all-reduce (`edge_node.tp.comm`) gives what gloo's ring gives, on every rank.

Real processes, real gloo point-to-point messages over loopback. The equivalence tests
train through both algorithms; this one checks the hub at every position, both
operations and odd sizes directly, and that `auto`'s timings agree across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from edge_node.tp.comm import CLOCK, all_reduce, time_collectives, use_hub
from edge_node.worker_process import free_port

SHAPES = [(1,), (7, 5), (3, 128, 24)]


def _ranks(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {}
        for hub in range(world):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                for shape in SHAPES:
                    gen = torch.Generator().manual_seed(1000 * rank + len(shape))
                    x = torch.randn(shape, generator=gen)
                    ring = x.clone()
                    use_hub(None)
                    all_reduce(ring, op=op)
                    use_hub(hub)
                    through_hub = all_reduce(x.clone(), op=op)
                    out[(hub, str(op), shape)] = (ring, through_hub)
        use_hub(None)
        calls = CLOCK.calls
        out["timings"] = time_collectives(4096, hub=world - 1, trials=3)
        out["untimed"] = CLOCK.calls == calls
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_hub_all_reduce_equals_ring_on_every_rank(world):
    results = mp.Manager().dict()
    mp.spawn(_ranks, args=(world, free_port(), results), nprocs=world)
    keys = [k for k in results[0] if isinstance(k, tuple)]
    assert len(keys) == world * 2 * len(SHAPES)
    for key in keys:
        hub_rank, op, shape = key
        for rank in range(world):
            ring, through_hub = results[rank][key]
            assert through_hub.shape == shape
            torch.testing.assert_close(through_hub, ring, rtol=1e-6, atol=1e-6, msg=str(key))
            assert torch.equal(through_hub, results[0][key][1]), f"rank {rank} differs from rank 0: {key}"
        if "MAX" in op:
            assert torch.equal(results[0][key][0], results[0][key][1])  # a maximum has no round-off
    # `auto`'s timings: positive, the same pair on every rank (so all choose alike), not counted as comm
    timings = {results[rank]["timings"] for rank in range(world)}
    assert len(timings) == 1 and all(t > 0 for t in timings.pop())
    assert all(results[rank]["untimed"] for rank in range(world))
