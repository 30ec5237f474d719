"""Re-shard in memory: every rank keeps what it already holds and receives only what moves.

A re-plan changes a split by a few column blocks, vocabulary rows or a KV group;
through a checkpoint, every rank's whole model and AdamW moments went to disk
and back (2.4-5 s per re-shard on the benches, two or three steps, which made
every re-plan gain under ~3% not worth taking in a 32-step job). Here each
rank computes, from the old and the new split alone (`tp.plan` gives every
rank's slice of every parameter), which parts of each tensor it sends to whom
and receives from whom, and the overlap of its old and new slices never
leaves it. A slice that several ranks hold alike (a KV group shared by rows)
is sent by the lowest of them. Replicated tensors (the norms) stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from edge_node.checkpoint import SliceOf, sharded_slice
from edge_node.tp.plan import Slice


class Move(NamedTuple):
    """Elements [start, stop) of a tensor's sliced dimension (full coordinates) go from `src` to `dst`."""

    src: int
    dst: int
    start: int
    stop: int


def sources(old: list[Slice]) -> list[tuple[int, int]]:
    """Per rank, the part of its old slice it is the source of: all of it but what a lower rank
    also holds (slices are intervals in rank order; shared KV groups overlap their neighbours')."""
    out, covered = [], 0
    for part in old:
        start = max(part.start, covered) if part.size else part.start
        out.append((start, max(start, part.stop)))
        if part.size:
            covered = max(covered, part.stop)
    return out


def moves(old: list[Slice], new: list[Slice]) -> list[Move]:
    """Every (source, destination) overlap of the old slices' sources and the new slices, rank order."""
    out, held = [], sources(old)
    for dst, want in enumerate(new):
        for src, (lo, hi) in enumerate(held):
            start, stop = max(lo, want.start), min(hi, want.stop)
            if start < stop:
                out.append(Move(src, dst, start, stop))
    return out


def reshard_tensors(
    tensors: dict[str, list[torch.Tensor]],
    shapes: dict[str, torch.Size],
    old_slice_of: SliceOf,
    new_slice_of: SliceOf,
    rank: int,
    world: int,
    dtype_of: Callable[[torch.Size], torch.dtype] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Collective: each named group of same-sliced tensors (a parameter and its moments), as this rank
    holds them under the old split, becomes this rank's part of them under the new one.

    One round of point-to-point messages per name, in `shapes`' order on every rank; the tensors of a
    group travel under their own tags. Every sliced name comes back, also where this rank's new part
    is empty (the new model may have no such parameter: the caller takes what its model has).
    `dtype_of`: the dtype a tensor of that shape is held in, for what a rank without it receives
    (float32 without; a frozen LoRA base may hold its matrices in bfloat16).
    """
    out, group = {}, len(next(iter(tensors.values())))
    for name, shape in shapes.items():
        if old_slice_of(name, 0) is None:  # replicated: every rank holds the whole of it already
            if name in tensors:
                out[name] = [t.detach() for t in tensors[name]]
            continue
        old = [sharded_slice(old_slice_of, name, r) for r in range(world)]
        new = [sharded_slice(new_slice_of, name, r) for r in range(world)]
        mine, held, dim = new[rank], old[rank], old[rank].dim
        if name in tensors:
            local = tensors[name]
        elif held.size == 0:  # a module built without it (no KV group: no q, k or v at all)
            local = [torch.empty(0, dtype=dtype_of(shape) if dtype_of else torch.float32)] * group
        else:
            raise ValueError(f"this rank holds part of {name!r} under the old split but was not given it")
        width = list(shape)
        width[dim] = mine.size
        result = [torch.empty(width, dtype=t.dtype) for t in local]
        requests, sent, received = [], [], []
        for move in moves(old, new):
            if rank not in (move.src, move.dst):
                continue
            n = move.stop - move.start
            for tag, (t, r) in enumerate(zip(local, result)):
                target = r.narrow(dim, move.start - mine.start, n) if move.dst == rank else None
                if move.src == rank:
                    piece = t.detach().narrow(dim, move.start - held.start, n)
                    if target is not None:
                        target.copy_(piece)
                        continue
                    sent.append(piece.contiguous())  # kept alive until its send completes
                    requests.append(dist.isend(sent[-1], dst=move.dst, tag=tag))
                else:
                    assert target is not None  # this rank is the move's destination
                    buffer = (
                        target
                        if target.is_contiguous()
                        else torch.empty_like(target, memory_format=torch.contiguous_format)
                    )
                    received.append((target, buffer))
                    requests.append(dist.irecv(buffer, src=move.src, tag=tag))
        for request in requests:
            assert request is not None  # None only for a rank outside the group: the default group holds every rank
            request.wait()
        for target, buffer in received:
            if buffer is not target:
                target.copy_(buffer)
        out[name] = result
    return out
