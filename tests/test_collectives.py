"""The hub all-reduce (`edge_node.tp.comm`) gives what gloo's ring gives, on every rank.

Real processes, real gloo point-to-point messages over loopback. The equivalence tests
train through both algorithms; this one checks the hub at every position, both
operations and odd sizes directly, and that `auto`'s timings agree across ranks; and
that an all-reduce whose segment only some ranks hold a share of sums their parts alone.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from edge_node.tp.comm import all_reduce, await_listener, broadcast_bytes, time_collectives
from edge_node.tp.context import TPContext
from edge_node.worker_process import free_port

SHAPES = [(1,), (7, 5), (3, 128, 24)]


def _ranks(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out, tp = {}, TPContext()
        for hub in range(world):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                for shape in SHAPES:
                    gen = torch.Generator().manual_seed(1000 * rank + len(shape))
                    x = torch.randn(shape, generator=gen)
                    ring = x.clone()
                    tp.hub = None
                    all_reduce(ring, tp, op=op)
                    tp.hub = hub
                    through_hub = all_reduce(x.clone(), tp, op=op)
                    out[(hub, str(op), shape)] = (ring, through_hub)
        tp.hub = None
        calls = tp.clock.calls
        out["timings"] = time_collectives(4096, hub=world - 1, trials=3)
        out["untimed"] = tp.clock.calls == calls
        # rank 0's bytes reach every rank as bytes (no pickle), empty ones too
        out["bytes"] = [broadcast_bytes(payload if rank == 0 else None) for payload in (b'{"a": [1.5]}', b"")]
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
    assert all(results[rank]["bytes"] == [b'{"a": [1.5]}', b""] for rank in range(world))


HOLDER_SETS = [(0,), (1,), (2,), (0, 2), (1, 2)]


def _holders_ranks(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out, tp = {}, TPContext()
        for hub in (None, 0, 2):
            for holders in HOLDER_SETS:
                x = torch.randn(3, 128, 24, generator=torch.Generator().manual_seed(rank))
                tp.hub, tp.holders = hub, {"mlp_columns": holders}
                # A rank without a share adds zeros; where it is left out (the hub, or one holder's
                # broadcast; the ring keeps its zeros) it gets garbage instead, to see it is.
                left_out = hub is not None or len(holders) == 1
                skipped = all_reduce(
                    x.clone() if rank in holders else torch.full_like(x, 1e6 if left_out else 0.0),
                    tp,
                    closes="mlp_columns",
                )
                tp.holders = {}
                full = all_reduce(x.clone() if rank in holders else torch.zeros_like(x), tp, closes="mlp_columns")
                out[(hub, holders)] = (skipped, full)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_an_all_reduce_sums_the_holders_parts_alone_to_the_bit():
    """A broadcast where one rank holds the share; through the hub, the others only receive;
    by the ring, several holders sum as before (zeros and all). The same bytes as the full sum."""
    world, results = 3, mp.Manager().dict()
    mp.spawn(_holders_ranks, args=(world, free_port(), results), nprocs=world)
    for key in results[0]:
        for rank in range(world):
            skipped, full = results[rank][key]
            assert skipped.abs().max() < 1e3, f"a rank without a share was summed: {key}"
            assert torch.equal(skipped, full), f"rank {rank}: {key}"
            assert torch.equal(skipped, results[0][key][0]), f"rank {rank} differs from rank 0: {key}"


def test_a_rank_waits_for_rank_0s_store_to_listen_and_gives_up_after_its_time():
    """`await_listener` returns once rank 0's port answers (the listener saw the connection), and returns,
    not raises, when nothing listens within its time: the rendezvous then reports it as before."""
    port = free_port()
    accepted: list[bool] = []

    def listen_later():
        time.sleep(0.3)
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
            server.settimeout(20)
            conn, _ = server.accept()
            accepted.append(True)
            conn.close()

    listener = threading.Thread(target=listen_later)
    listener.start()
    await_listener("127.0.0.1", port, 20)
    listener.join(20)
    assert accepted == [True]
    started = time.monotonic()
    await_listener("127.0.0.1", free_port(), 0.3)
    assert 0.3 <= time.monotonic() - started < 10
