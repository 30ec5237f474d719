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
them and sends the result back, over the hub's own sockets (`open_star`; gloo's
messages where they could not be opened, and for a dimension the hub holds none of). The ring moves less data per rank (2(n-1)/n
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

import hmac
import logging
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from edge_node.tp.context import TPContext

log = logging.getLogger(__name__)


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
    trace: list[tuple[str | None, float, float, bool]] | None = None
    """When tracing (`XRONOS_COLLECTIVE_TRACE`, `benchmarks/collective_trace.py`): every collective's
    segment (`closes`), start and end (perf_counter: the host's monotonic clock, so the ranks of one host
    can be laid side by side, call by call), and whether this rank sent a part (see `_senders`)."""


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
    if senders is not None and len(senders) == 1 and (tp.star is None or senders[0] != tp.star.hub):
        dist.broadcast(tensor, src=senders[0])
    elif senders is not None:
        _star_all_reduce(tensor, op, tp.hub if tp.hub in senders else senders[0], senders, tp.star)
    elif tp.hub is not None and group is None:
        _star_all_reduce(tensor, op, tp.hub, tuple(range(dist.get_world_size())), tp.star)
    else:
        dist.all_reduce(tensor, op=op, group=group)
    tp.clock.last_end = time.perf_counter()
    tp.clock.seconds += tp.clock.last_end - start
    tp.clock.calls += 1
    if tp.clock.trace is not None:
        tp.clock.trace.append((closes, start, tp.clock.last_end, senders is None or dist.get_rank() in senders))
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


def time_collectives(numel: int, hub: int, star: SocketStar | None = None, trials: int = 8) -> tuple[float, float]:
    """Seconds of one all-reduce of `numel` floats by the ring and through `hub` (over `star`'s sockets
    when given), as every rank agrees.

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
                _star_all_reduce(tensor, dist.ReduceOp.SUM, hub, tuple(range(dist.get_world_size())), star)
            else:
                dist.all_reduce(tensor)
            seconds[name].append(time.perf_counter() - start)
    agreed = torch.tensor([statistics.median(seconds["ring"]), statistics.median(seconds["hub"])])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed[0].item(), agreed[1].item()


def _star_all_reduce(
    tensor: torch.Tensor, op, hub: int, senders: tuple[int, ...], star: SocketStar | None = None
) -> None:
    """All-reduce through `hub` of the parts of `senders` (ascending; all ranks, or those holding some of
    a dimension: the others' parts are the operation's identity and they only receive): the senders
    send, the hub combines in rank order and sends the result back. Every rank ends with the hub's
    bytes, so all hold the same result (as with the ring); the sum's order differs from the ring's only
    by float32 round-off. Over `star`'s sockets when it is centred on `hub`, else through gloo's
    point-to-point messages."""
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        raise ValueError(f"the hub all-reduce sums or takes the maximum, not {op}")
    if not tensor.is_contiguous():
        raise ValueError("the hub all-reduce needs a contiguous tensor")
    if star is not None and star.hub == hub:
        _socket_star_all_reduce(tensor, op, star, senders)
        return
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != hub:
        if rank in senders:
            dist.send(tensor, dst=hub)
        dist.recv(tensor, src=hub)
        return
    parts = {r: torch.empty_like(tensor) for r in senders if r != hub}
    _wait_all([dist.irecv(parts[r], src=r) for r in parts])
    _combine(tensor, op, hub, senders, parts)
    _wait_all([dist.isend(tensor, dst=r) for r in range(n) if r != hub])


class SocketStar:
    """The hub all-reduce's own connections: one plain TCP socket between the hub and each other rank.

    gloo hands every message through threads on each side (its work thread, its socket loop), and
    on a CPU under a quota each hand-over waits to be scheduled; a rank that writes and reads its own
    socket does not. A whole training step through the hub (`benchmarks/comm_bench.py`, the toy
    model's 20 all-reduces per step, the same losses to the bit) took 0.88-0.90x gloo's at speeds
    1, 0.5, 0.25 and 0.65, 0.52, 0.43, and 0.95x at three 0.58 devices. Opened collectively after the
    process group (`open_star`). The same trust as gloo's own connections (docs/security.md).
    """

    def __init__(self, hub: int, peers: dict[int, socket.socket]):
        self.hub, self.rank, self.peers = hub, dist.get_rank(), peers

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()
        self.peers = {}


STAR_SETUP_SECONDS = 30.0
"""How long opening the star may take at most (the rest of the collective timeout is the job's): every rank
has passed the rendezvous by then and connects at once; a rank that cannot must not hold the others for a
whole collective timeout before they go on through gloo."""

HELLO_SECONDS = 5.0
"""How long the hub waits for a connection's rank and token: a rank sends them as it connects, and a
connection that sends nothing must not hold the others back."""


def open_star(hub: int, host: str, timeout: float) -> SocketStar | None:
    """Collective: the hub's connections to every other rank, or None on every rank when any rank could not
    open its part (logged; the hub's messages then go through gloo).

    The hub listens on `host` (its address as the others reach it; on every interface where this host does
    not hold it) on a port of its choosing and names the address, the port and a random token over the
    group (`broadcast_bytes`); each other rank connects and sends its rank and the token, and the hub keeps
    only such connections (`accept_peers`). Every rank then agrees on whether all of it worked (a gloo
    all-reduce), so all use the star or none does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + min(timeout / 2, STAR_SETUP_SECONDS)  # within the agreement's own timeout
    server, peers, failure, named = None, {}, None, None
    if rank == hub:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                server = socket.create_server((host, 0), family=family)
            except OSError:  # an address this host does not hold (a NAT's, given as --address): every interface
                server = socket.create_server(("", 0), family=family)
            named = server.getsockname()[1].to_bytes(4, "little") + os.urandom(16) + host.encode()
        except OSError as err:
            failure, named = f"the hub could not listen: {err}", b""
    answer = broadcast_bytes(named, src=hub)
    try:
        if not answer:
            failure = failure or "the hub could not listen"
        elif server is not None:
            peers = accept_peers(server, answer[4:20], hub, world, deadline)
        else:
            port, token, address = int.from_bytes(answer[:4], "little"), answer[4:20], answer[20:].decode()
            conn = socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic()))
            peers = {hub: conn}
            conn.sendall(rank.to_bytes(4, "little") + token)
    except OSError as err:
        failure = f"{type(err).__name__}: {err}"
    finally:
        if server is not None:
            server.close()
    failed = torch.tensor([1 if failure else 0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        for conn in peers.values():
            conn.close()
        log.warning("the hub's sockets could not be opened (%s): its all-reduces go through gloo", failure or "a peer")
        return None
    for conn in peers.values():
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(timeout)  # a peer frozen mid-collective fails this one as gloo's timeout would
    return SocketStar(hub, peers)


def accept_peers(
    server: socket.socket, token: bytes, hub: int, world: int, deadline: float
) -> dict[int, socket.socket]:
    """The hub's connection from every other rank of `world`, by rank: each connects and sends its rank
    (4 bytes) and `token`; a connection that sends anything else (or nothing within HELLO_SECONDS), or a
    rank already connected, is closed and ignored. Raises TimeoutError at `deadline` (time.monotonic())."""
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < world - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                raise TimeoutError(f"{world - 1 - len(peers)} rank(s) did not connect to the hub") from None
            except OSError:
                continue  # a connection aborted before it was accepted
            conn.settimeout(max(0.01, min(HELLO_SECONDS, deadline - time.monotonic())))
            try:
                hello = _recv_exactly(conn, 4 + len(token), "a connecting rank")
            except OSError:
                hello = b""
            peer = int.from_bytes(hello[:4], "little")
            valid = len(hello) == 4 + len(token) and hmac.compare_digest(hello[4:], token)
            if not valid or peer in peers or peer == hub or not 0 <= peer < world:
                conn.close()  # not one of this group's ranks
                continue
            peers[peer] = conn
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    return peers


def _recv_exactly(conn: socket.socket, size: int, peer: str, into: memoryview | None = None) -> bytes:
    """Read exactly `size` bytes from `peer` (into `into` when given). A peer that closed its end or sent
    nothing within the socket's timeout fails it, in the words the controller recognises as a peer's
    failure echoed (`controller.jobs.PEER_ERRORS`)."""
    view = into if into is not None else memoryview(bytearray(size))
    got = 0
    while got < size:
        try:
            n = conn.recv_into(view[got:])
        except TimeoutError:
            raise TimeoutError(f"Socket Timeout: {peer} sent nothing for {conn.gettimeout():g} s") from None
        if n == 0:
            raise ConnectionError(f"Connection closed by peer: {peer}, after {got} of {size} bytes")
        got += n
    return bytes(view) if into is None else b""


def _send(conn: socket.socket, data: memoryview, peer: str) -> None:
    try:
        conn.sendall(data)
    except TimeoutError:
        raise TimeoutError(f"Socket Timeout: {peer} took nothing for {conn.gettimeout():g} s") from None


def _socket_star_all_reduce(tensor: torch.Tensor, op, star: SocketStar, senders: tuple[int, ...]) -> None:
    """`_star_all_reduce` over `star`'s sockets: the same parts combined in the same order, so the same bits;
    the result sent back in rank order."""
    data = tensor.detach().numpy().data.cast("B")
    if star.rank != star.hub:
        conn, hub = star.peers[star.hub], f"rank {star.hub} (the hub)"
        if star.rank in senders:
            _send(conn, data, hub)
        _recv_exactly(conn, len(data), hub, data)
        return
    parts = {r: torch.empty_like(tensor) for r in senders if r != star.hub}
    for r, part in parts.items():
        _recv_exactly(star.peers[r], len(data), f"rank {r}", part.numpy().data.cast("B"))
    _combine(tensor, op, star.hub, senders, parts)
    for r in sorted(star.peers):
        _send(star.peers[r], data, f"rank {r}")


def _combine(tensor: torch.Tensor, op, hub: int, senders: tuple[int, ...], parts: dict[int, torch.Tensor]) -> None:
    """The hub's sum (or maximum) of the senders' parts in rank order, into `tensor` (the hub's own part)."""
    combine = torch.Tensor.add_ if op == dist.ReduceOp.SUM else lambda t, other: torch.maximum(t, other, out=t)
    result = tensor if senders[0] == hub else parts[senders[0]]
    for r in senders[1:]:
        combine(result, tensor if r == hub else parts[r])
    if result is not tensor:
        tensor.copy_(result)


def _wait_all(requests: list) -> None:
    """Wait for point-to-point requests (torch types them Work | None: None only off the group)."""
    for request in requests:
        assert request is not None, "this rank is not in the process group"
        request.wait()


def own_address(towards: str) -> str:
    """This host's address on the route towards `towards` (no packet is sent: a UDP socket's local end once
    it is connected); `towards` itself where there is no route."""
    family = socket.AF_INET6 if ":" in towards else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((towards, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return towards


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
