"""The tensor-parallel process group, its rendezvous, and the time spent in its collectives.

Every collective of the engine goes through `all_reduce` here so that the
time a rank spends communicating (which includes waiting for slower peers)
is measured in one place; compute time is the step's wall time minus it.
A collective that closes a layer's attention or MLP segment, or the
vocabulary's, says so (`closes`, the split dimension), and the compute since
the previous collective is added to that segment: the job itself measures
each rank's pace per component, which the re-plan calibrates the profiles
with.

The whole TP group's all-reduces run either as gloo's ring or through a hub
(`TPContext.hub`): every other rank sends its tensor to the hub, which combines
them and sends the result back. The ring moves less data per rank (2(n-1)/n
of the tensor; the hub's link carries 2(n-1) tensors), but it takes 2(n-1)
dependent steps, and on CPUs under quotas every step waits for the most
recently throttled peer to be scheduled again; the hub takes two. Which one is
faster depends on the devices and the network between them, so a job with
`collective: auto` times both at its activation size on its own ranks before
the first step (`time_collectives`) and keeps the faster.

A rank that owns none of a split dimension (no KV group, no MLP column, no
vocabulary row) adds only zeros to the all-reduces that close that dimension's
segments, so it does not send them (`TPContext.holders`): where one rank holds all of
it (a layout such as kv 3/0/0), the all-reduce is that rank's broadcast; through
the hub, the ranks without a share only receive. The sum is the same to the
bit (x + 0 = x), the bytes moved fewer: in isolation, 1.2 ms instead of 4.0 ms
for one SmolLM2 activation among devices of speeds 1, 0.5 and 0.25
(`benchmarks/collective_bench.py`).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from edge_node.tp.context import TPContext


@dataclass
class CommClock:
    """Seconds spent inside collectives since the shard was built, and compute seconds by segment."""

    seconds: float = 0.0
    calls: int = 0
    last_end: float | None = None
    """When the last collective returned (perf_counter)."""
    segments: dict[str, float] = field(default_factory=dict)
    """Compute seconds before the collectives that close each kind of segment (by split dimension: every
    layer's attention and MLP, the vocabulary's final norm, LM head and loss; not the embedding or AdamW)."""


def _senders(op, group, closes: str | None, tp: TPContext) -> tuple[int, ...] | None:
    """The ranks whose parts this all-reduce must sum, when not all of them: None for all."""
    senders = tp.holders.get(closes) if closes is not None and group is None and op == dist.ReduceOp.SUM else None
    if not senders or len(senders) == dist.get_world_size():
        return None
    if len(senders) > 1 and tp.hub is None:
        return None  # the ring, zeros and all: a star through one of them is not always faster
    return senders


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(
    tensor: torch.Tensor, tp: TPContext, op=dist.ReduceOp.SUM, group=None, closes: str | None = None
) -> torch.Tensor:
    """In-place all-reduce, timed on `tp.clock`; a no-op without a process group of size > 1.

    `closes`: the segment this collective ends (its compute since the last collective counts to it)."""
    if world_size(group) == 1:
        return tensor
    start = time.perf_counter()
    if closes is not None and tp.clock.last_end is not None:
        tp.clock.segments[closes] = tp.clock.segments.get(closes, 0.0) + start - tp.clock.last_end
    senders = _senders(op, group, closes, tp)
    if senders is not None and len(senders) == 1:
        dist.broadcast(tensor, src=senders[0])
    elif senders is not None:
        _star_all_reduce(tensor, op, tp.hub if tp.hub in senders else senders[0], senders)
    elif tp.hub is not None and group is None:
        _hub_all_reduce(tensor, op, tp.hub)
    else:
        dist.all_reduce(tensor, op=op, group=group)
    tp.clock.last_end = time.perf_counter()
    tp.clock.seconds += tp.clock.last_end - start
    tp.clock.calls += 1
    return tensor


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank `src`'s `data` on every rank (the others pass None): its length, then its bytes, as tensors.

    Not `broadcast_object_list`, which unpickles what a peer sends (a compromised rank would run
    code on every other): what arrives here is only bytes, which the caller parses as JSON against
    a model."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if dist.get_rank() == src and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=src)
    return buffer.numpy().tobytes()


def time_collectives(numel: int, hub: int, trials: int = 8) -> tuple[float, float]:
    """Seconds of one all-reduce of `numel` floats by the ring and through `hub`, as every rank agrees.

    The two are timed alternately (so both see the same load), each rank takes its median, and
    the ranks take the maximum (what the slowest participant makes everyone wait): every rank
    gets the same pair, so every rank makes the same choice. Not counted in tp.clock.
    """
    tensor = torch.zeros(numel)
    seconds: dict[str, list[float]] = {"ring": [], "hub": []}
    dist.barrier()
    for _ in range(trials):
        for name in seconds:
            start = time.perf_counter()
            if name == "hub":
                _hub_all_reduce(tensor, dist.ReduceOp.SUM, hub)
            else:
                dist.all_reduce(tensor)
            seconds[name].append(time.perf_counter() - start)
    agreed = torch.tensor([statistics.median(seconds["ring"]), statistics.median(seconds["hub"])])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed[0].item(), agreed[1].item()


def _hub_all_reduce(tensor: torch.Tensor, op, hub: int) -> None:
    """All-reduce through `hub`: the others send, the hub combines in rank order and sends the result back.

    Every rank ends with the hub's bytes, so all hold the same result (as with the ring);
    the sum's order differs from the ring's only by float32 round-off.
    """
    _star_all_reduce(tensor, op, hub, tuple(range(dist.get_world_size())))


def _star_all_reduce(tensor: torch.Tensor, op, hub: int, senders: tuple[int, ...]) -> None:
    """The hub all-reduce of the parts of `senders` (the hub among them, ascending): the other ranks
    only receive, their parts being the operation's identity."""
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        raise ValueError(f"the hub all-reduce sums or takes the maximum, not {op}")
    if not tensor.is_contiguous():
        raise ValueError("the hub all-reduce needs a contiguous tensor")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != hub:
        if rank in senders:
            dist.send(tensor, dst=hub)
        dist.recv(tensor, src=hub)
        return
    parts = {r: torch.empty_like(tensor) for r in senders if r != hub}
    _wait_all([dist.irecv(parts[r], src=r) for r in parts])
    combine = torch.Tensor.add_ if op == dist.ReduceOp.SUM else lambda t, other: torch.maximum(t, other, out=t)
    result = tensor if senders[0] == hub else parts[senders[0]]
    for r in senders[1:]:
        combine(result, tensor if r == hub else parts[r])
    if result is not tensor:
        tensor.copy_(result)
    _wait_all([dist.isend(tensor, dst=r) for r in range(n) if r != hub])


def _wait_all(requests: list) -> None:
    """Wait for point-to-point requests (torch types them Work | None: None only off the group)."""
    for request in requests:
        assert request is not None, "this rank is not in the process group"
        request.wait()


AWAIT_LISTENER_SECONDS = 10.0
"""How long a rank waits for rank 0's store to listen before it calls the rendezvous anyway (`await_listener`):
rank 0 is normally moments away; one later than this leaves the rank to torch's retries, as before."""


def await_listener(host: str, port: int, seconds: float) -> None:
    """Return once something listens at `host`:`port` (rank 0's rendezvous store), or after `seconds`.

    A rank that reaches the store before rank 0 has opened it is retried by torch's client after a
    back-off: with every rank handed its plan at the same moment (forked workers, no imports left
    to stagger them), that cost 0.3-0.6 s of each job's start. A connection tried every 10 ms
    costs nothing. After `seconds` the rendezvous goes on as before (torch's retries, its timeout,
    its error)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)
