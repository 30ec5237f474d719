"""The tensor-parallel process group and the time spent in its collectives.

Every collective of the engine goes through `all_reduce` here so that the
time a rank spends communicating (which includes waiting for slower peers)
is measured in one place; compute time is the step's wall time minus it.
A collective that closes a layer's attention or MLP segment, or the
vocabulary's, says so (`closes`, the split dimension), and the compute since
the previous collective is added to that segment: the job itself measures
each rank's pace per component, which the re-plan calibrates the profiles
with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommClock:
    """Seconds spent inside collectives since the process started, and compute seconds by segment."""

    seconds: float = 0.0
    calls: int = 0
    last_end: float | None = None
    """When the last collective returned (perf_counter)."""
    segments: dict[str, float] = field(default_factory=dict)
    """Compute seconds before the collectives that close each kind of segment (by split dimension: every
    layer's attention and MLP, the vocabulary's final norm, LM head and loss; not the embedding or AdamW)."""


CLOCK = CommClock()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, closes: str | None = None) -> torch.Tensor:
    """In-place all-reduce, timed; a no-op without a process group of size > 1.

    `closes`: the segment this collective ends (its compute since the last collective counts to it)."""
    if world_size(group) == 1:
        return tensor
    start = time.perf_counter()
    if closes is not None and CLOCK.last_end is not None:
        CLOCK.segments[closes] = CLOCK.segments.get(closes, 0.0) + start - CLOCK.last_end
    dist.all_reduce(tensor, op=op, group=group)
    CLOCK.last_end = time.perf_counter()
    CLOCK.seconds += CLOCK.last_end - start
    CLOCK.calls += 1
    return tensor
