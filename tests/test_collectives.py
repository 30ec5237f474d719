"""The hub all-reduce (`edge_node.tp.comm`) gives what gloo's ring gives, on every rank.

Real processes, real gloo point-to-point messages and the hub's own sockets over loopback. The
equivalence tests train through both algorithms; this one checks the hub at every position, through
gloo and through its sockets (the same bytes), both operations and odd sizes directly, and that
`auto`'s timings agree across ranks; that an all-reduce whose segment only some ranks hold a share of
sums their parts alone; that the hub keeps only its group's connections; and that a rank gone
mid-collective fails the hub's at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from controller.jobs import is_peer_error
from edge_node.tp.comm import accept_peers, all_reduce, await_listener, broadcast_bytes, open_star, time_collectives
from edge_node.tp.context import TPContext
from edge_node.worker_process import free_port

SHAPES = [(1,), (7, 5), (3, 128, 24)]


def _ranks(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out, tp = {}, TPContext()
        for hub in range(world):
            star = open_star(hub, "127.0.0.1", 30.0)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                for shape in SHAPES:
                    gen = torch.Generator().manual_seed(1000 * rank + len(shape))
                    x = torch.randn(shape, generator=gen)
                    ring = x.clone()
                    tp.hub, tp.star = None, None
                    all_reduce(ring, tp, op=op)
                    tp.hub = hub
                    through_hub = all_reduce(x.clone(), tp, op=op)
                    tp.star = star
                    through_sockets = all_reduce(x.clone(), tp, op=op)
                    out[(hub, str(op), shape)] = (ring, through_hub, through_sockets)
            if hub == world - 1:
                out["socket timings"] = time_collectives(4096, hub, star, trials=3)
                for conn in star.peers.values():
                    conn.close()  # timed over the sockets, not gloo's messages: closed, they fail
                try:
                    time_collectives(4096, hub, star, trials=1)
                    out["closed"] = None
                except OSError as err:
                    out["closed"] = type(err).__name__
            star.close()
        tp.hub, tp.star = None, None
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
            ring, through_hub, through_sockets = results[rank][key]
            assert through_hub.shape == shape
            torch.testing.assert_close(through_hub, ring, rtol=1e-6, atol=1e-6, msg=str(key))
            assert torch.equal(through_hub, results[0][key][1]), f"rank {rank} differs from rank 0: {key}"
            assert torch.equal(through_sockets, through_hub), f"rank {rank}: the hub's sockets differ: {key}"
        if "MAX" in op:
            assert torch.equal(results[0][key][0], results[0][key][1])  # a maximum has no round-off
    # `auto`'s timings: positive, the same pair on every rank (so all choose alike), not counted as comm
    assert all(results[rank]["closed"] is not None for rank in range(world))  # no rank timed gloo's messages
    for name in ("timings", "socket timings"):
        timings = {results[rank][name] for rank in range(world)}
        assert len(timings) == 1 and all(t > 0 for t in timings.pop()), name
    assert all(results[rank]["untimed"] for rank in range(world))
    assert all(results[rank]["bytes"] == [b'{"a": [1.5]}', b""] for rank in range(world))


HOLDER_SETS = [(0,), (1,), (2,), (0, 2), (1, 2)]


def _holders_ranks(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out, tp = {}, TPContext()
        stars = {hub: open_star(hub, "127.0.0.1", 30.0) for hub in (0, 2)}
        for hub, sockets in ((None, False), (0, False), (2, False), (0, True), (2, True)):
            tp.star = stars[hub] if sockets and hub is not None else None
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
                out[(hub, sockets, holders)] = (skipped, full)
        for star in stars.values():
            star.close()
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_an_all_reduce_sums_the_holders_parts_alone_to_the_bit():
    """A broadcast where one rank holds the share; through the hub (gloo's messages or its own sockets),
    the others only receive; by the ring, several holders sum as before (zeros and all). The same bytes
    as the full sum."""
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


def test_the_hub_keeps_only_its_groups_connections():
    """`accept_peers`: a connection with a wrong token, one that says nothing, the hub's own rank and a rank
    already connected are closed; the group's ranks, in any order, are kept by rank."""
    token = b"t" * 16
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()
        hellos = [
            (2).to_bytes(4, "little") + b"x" * 16,  # a stranger: wrong token
            b"",  # says nothing (the hub waits HELLO_SECONDS for it, patched short below)
            (0).to_bytes(4, "little") + token,  # the hub's own rank
            (2).to_bytes(4, "little") + token,
            (2).to_bytes(4, "little") + token,  # rank 2 again
            (1).to_bytes(4, "little") + token,
        ]
        clients = []
        for hello in hellos:
            conn = socket.create_connection(address)
            conn.sendall(hello)
            clients.append(conn)
        import edge_node.tp.comm as comm

        before, comm.HELLO_SECONDS = comm.HELLO_SECONDS, 0.5
        try:
            peers = accept_peers(server, token, hub=0, world=3, deadline=time.monotonic() + 10)
        finally:
            comm.HELLO_SECONDS = before
        assert sorted(peers) == [1, 2]
        for kept, client in ((peers[2], clients[3]), (peers[1], clients[5])):
            client.sendall(b"ok")
            assert kept.recv(2) == b"ok"
        for refused in (clients[0], clients[2], clients[4]):
            refused.settimeout(5)
            assert refused.recv(1) == b""  # closed by the hub
        for conn in [*clients, *peers.values()]:
            conn.close()


def _leaving_rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TPContext(hub=0, star=open_star(0, "127.0.0.1", 60.0))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone before the next collective, its sockets closed by the kernel
    started = time.monotonic()
    try:
        all_reduce(torch.ones(1000), tp)
        results["error"] = None
    except ConnectionError as err:
        results["error"] = str(err)
    results["seconds"] = time.monotonic() - started
    os._exit(0)  # the process group's peer is gone: no orderly teardown


def test_a_rank_gone_fails_the_hubs_all_reduce_at_once():
    """A rank that exits: the hub's next all-reduce over its sockets raises ConnectionError at once, not
    after the collective timeout (60 s here)."""
    results = mp.Manager().dict()
    context = mp.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_leaving_rank, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():
            process.kill()
    assert results["error"] and results["error"].startswith("Connection closed by peer: rank 1")
    assert is_peer_error(results["error"])  # what the controller takes for a failure echoed from a peer
    assert results["seconds"] < 10


def _unreachable_hub(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        started = time.monotonic()
        # the hub names an address no rank reaches (TEST-NET-1): the others cannot connect
        star = open_star(0, "192.0.2.1", 2.0)
        tp = TPContext(hub=0, star=star)
        x = torch.full((5,), float(rank + 1))
        results[rank] = (star is None, time.monotonic() - started, all_reduce(x, tp).tolist())
    finally:
        dist.destroy_process_group()


def test_where_the_sockets_cannot_be_opened_every_rank_goes_through_gloo():
    """A rank that cannot reach the hub: `open_star` gives None on every rank (they agree), within its
    setup time (half of the 2 s timeout here), and the hub all-reduce goes on through gloo's messages."""
    world, results = 3, mp.Manager().dict()
    mp.spawn(_unreachable_hub, args=(world, free_port(), results), nprocs=world)
    for rank in range(world):
        no_star, seconds, summed = results[rank]
        assert no_star and seconds < 10
        assert summed == [6.0] * 5
